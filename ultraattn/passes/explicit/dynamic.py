"""Explicit programs of sites whose mask arrives at run time: a fixed skeleton, the plan as data.

A packed-sequence model brings a new document mask every batch. The graph Inductor compiles for such a
site is fixed by shapes, mesh and options alone; the mask becomes a plan (``planner.exchange``) inside
the graph, in its first node, and every later node reads that plan by its id::

    token, plan = cp_dyn_plan(token, [mask tensors], site)       # milliseconds; cached per mask content
    q_l = index_select(pad(q), 2, cp_dyn_index(plan, site))      # dispatch (global view only)
    h = cp_start(token, [k_l, v_l], site, KV_STAGE, plan)        # stage: the K/V chunks each rank needs
    o0, l0 = cp_dyn_tile_fwd(q_l, k_l, v_l, plan, site, 0)       # own keys, while messages fly
    token, k_in, v_in = cp_wait(h, site, KV_STAGE, plan)
    o1, l1 = cp_dyn_tile_fwd(q_l, k_in, v_in, plan, site, 1)     # received keys
    out, lse = merge_partial(...), cp_gather(..., plan)           # global view: gather

and the backward: remote tile, ``cp_start(..., DKV_STAGE, plan)`` (partials home), own tile while they fly,
``cp_wait``, sums. A new mask: no recompile, no new guard, the same graph. The stage, gather and stash ops are a
static program's (``passes/ops/program.py``) with the plan as data; only planning, the dispatch index and the
tiles (one block-sparse kernel over this rank's rows per part) are this path's own ops.

[Note] Owners: fixed per graph or chosen per batch? Owner computes (only K/V move), so the owners ARE the
balance. ``benchmarks/exchange_owners.py`` plans document masks (the example's packing and a pretraining-like
long-tail packing; 32K and 128K tokens; 4 and 8 ranks) both ways and models each rank's time with the H100
cost model (not a GPU measurement), as the slowest rank's step over a perfectly balanced one (median of 24
masks per setting): per-batch owners (the balancer, 4 chunks per rank) 1.02-1.17x; fixed head-tail, two
contiguous ranges per rank, 1.31-1.89x; fixed head-tail STRIPES (the zigzag dealt again every 2 x ranks chunks)
1.14-1.56x with 4 chunks per rank and 1.04-1.21x with 16 (1.34x for short documents at 32K on 8 ranks, where
the finer chunks' messages no longer hide behind the little compute). So:

* global view (the site dispatches and gathers itself): per-batch owners (``OWNERS_PER_BATCH``), free here:
  the dispatch is an index_select whose index is plan data;
* a sequence-sharded graph lays its tokens out once for every activation, so its owners are fixed: there the
  layout is fine stripes (``RUNTIME_MASK_STRIPES`` per rank and direction, ``passes/backend.choose_layout``)
  rather than one mask's plan, which says nothing about the next mask's.

On the CPU test machine the end-to-end benchmark (``dynamic_masks.py --attention-only``) could not separate
them (four ranks share two cores: idle time goes to the others, only total work counts).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import Tensor

from ultraattn.cache import LRU
from ultraattn.kernels.block_lists import layout_from_pattern
from ultraattn.kernels.reference import softmax_delta
from ultraattn.masks.convert import to_block_pattern
from ultraattn.passes.ops.program import new_token
from ultraattn.passes.records import PlanEvent
from ultraattn.passes.site import MAX_PENDING, SiteState, check_same_inputs, mask_from_content
from ultraattn.passes.state import side_table
from ultraattn.planner.baselines import striped_owner
from ultraattn.planner.exchange import pattern_weights, plan_exchange
from ultraattn.planner.plan import Mesh, padded_chunk
from ultraattn.runtime.comm import GroupRef, resolve_group
from ultraattn.runtime.exchange import (
    ExchangeRun,
    make_run,
    post_dkv,
    post_kv,
    rank_rows,
    wait_dkv,
    wait_kv,
)
from ultraattn.runtime.plan_cache import content_digest
from ultraattn.runtime.sequence import SequenceShards
from ultraattn.runtime.tiles import merge_partial
from ultraattn.runtime.transport import Transport, transport_for

ops = torch.ops.ultraattn

CHUNKS_PER_RANK = 4
"""Chunks each rank owns in a global-view site (per-batch owners balance over them)."""
RUNTIME_MASK_STRIPES = 8
"""Head-tail stripes of a sequence-sharded graph whose first site's mask arrives at run time: 16 chunks per rank
(fewer where chunks would be smaller than a block); see the [Note] above."""
OWNERS_PER_BATCH = True
"""Global-view sites choose owners per mask (see the [Note] in the module docstring)."""


KV_STAGE, DKV_STAGE = 0, 1
"""A dynamic program's two stages: the forward's K/V exchange and the backward's dK/dV return."""


@dataclass(eq=False)
class DynamicProgram:
    """A run-time-mask site's static geometry and its plans (``SiteState.program``)."""

    dynamic: ClassVar[bool] = True

    state: SiteState
    device: torch.device
    mesh: Mesh
    transport: Transport
    """This rank's messages (its rank, the group's ranks, the group)."""
    chunk: int
    num_chunks: int
    owner: tuple[int, ...] | None
    """Fixed owners (a sequence-sharded graph's layout), or None: chosen per mask."""
    runs: LRU = field(default_factory=lambda: side_table().exchange_runs)
    """(configuration, mask digest) -> ExchangeRun, shared by the sites of the process: a mask seen again, or by
    another site of the same configuration (the next layer), is not planned again."""
    live: LRU = field(default_factory=lambda: LRU(2 * MAX_PENDING + 4))
    """plan id -> ExchangeRun, for the ops of calls in flight."""
    handles: dict = field(default_factory=dict)
    last: ExchangeRun | None = None
    """The run of the latest call (tests and reports read its plan and message log)."""

    # ------------------------------------------------------------------ static geometry (fake kernels)
    @property
    def key(self) -> str:
        return self.state.spec.key

    @property
    def world(self) -> int:
        return self.mesh.world

    @property
    def rank(self) -> int:
        return self.transport.rank

    @property
    def seq_len(self) -> int:
        return self.state.spec.q_shape[2]

    @property
    def local_len(self) -> int:
        return self.num_chunks // self.world * self.chunk

    @property
    def padded_len(self) -> int:
        return self.num_chunks * self.chunk

    @property
    def dtype(self) -> torch.dtype:
        return self.state.spec.dtype

    @property
    def local_kv_shape(self) -> tuple[int, ...]:
        B, Hk, _, D = self.state.spec.kv_shape
        return (B, Hk, self.local_len, D)

    @property
    def buffer_shape(self) -> tuple[int, ...]:
        """The receive buffer: every other rank's chunks (the honest bound: all-gather CP's footprint)."""
        B, Hk, _, D = self.state.spec.kv_shape
        return (B, Hk, (self.world - 1) * self.local_len, D)

    # ------------------------------------------------------------------ plans
    def plan(self, mask_tensors: list[Tensor]) -> int:
        """Plan (or reuse the plan of) this call's mask; returns the plan id the graph's nodes carry."""
        state, spec = self.state, self.state.spec
        state.calls += 1
        if spec.options.debug:
            check_same_inputs(state, list(mask_tensors))
        mask_code = spec.flex.mask_mod.code if spec.flex is not None else ""
        key = content_digest(mask_tensors, (spec.mask, mask_code, spec.q_shape, spec.kv_shape, str(spec.dtype),
                                            spec.options.block_size, self.chunk, self.num_chunks, self.owner,
                                            self.rank, str(self.device), self.mesh))
        run = self.runs.get(key)
        if run is None:
            t0 = time.perf_counter()
            run = self._make(mask_tensors)
            seconds = time.perf_counter() - t0
            object.__setattr__(run.plan, "seconds", seconds)
            self.runs.put(key, run)
            state.plans.plans += 1
            state.plans.seconds += seconds
            side_table().bump("exchange_plan_us", round(seconds * 1e6))  # planning inside the step (examples)
            state.observer.plan_made(self._event(run, seconds))
        else:
            state.plans.hits += 1
        self.last = run
        return self.keep(run)

    def keep(self, run: ExchangeRun) -> int:
        pid = self.state.next_id()
        self.live.put(pid, run)
        return pid

    def run_of(self, plan: Tensor | int) -> ExchangeRun:
        run = self.live.get(int(plan))
        if run is None:
            raise RuntimeError(f"ultraattn site {self.state.spec.name}: plan {int(plan)} is no longer held (more than "
                               f"{self.live.capacity} calls in flight)")
        return run

    def _make(self, mask_tensors: list[Tensor]) -> ExchangeRun:
        """Kinds of the whole mask (no mask_mod evaluation for a BlockMask) -> chunk weights -> the plan (the same
        on every rank) -> the element masks of this rank's rows only: each rank evaluates 1/world of the mask."""
        spec = self.state.spec
        B, H, S, D = spec.q_shape
        Hk = spec.kv_shape[1]
        mask, mask_mod = mask_from_content(spec, mask_tensors, B, H)
        pattern = to_block_pattern(mask, q_len=S, kv_len=spec.kv_shape[2], block_size=spec.options.block_size,
                                   batch=B, num_heads=H, count=False)
        if self.chunk % pattern.q_block or self.chunk % pattern.kv_block:
            raise RuntimeError(f"ultraattn site {spec.name}: chunks of {self.chunk} tokens are not whole mask blocks "
                               f"({pattern.q_block} x {pattern.kv_block})")
        cost = spec.options.cost_model()
        weights = pattern_weights(pattern, batch=B, num_heads=H, chunk=self.chunk, num_chunks=self.num_chunks,
                                  partial_overhead=cost.partial_block_overhead)
        elt = torch.empty((), dtype=spec.dtype).element_size()
        plan = plan_exchange(weights, mesh=self.mesh, chunk=self.chunk, owner=self.owner,
                             kv_chunk_bytes=2 * B * Hk * self.chunk * D * elt,
                             dkv_chunk_bytes=2 * B * Hk * self.chunk * D * 4)
        rows = layout_from_pattern(pattern, mask_mod, batch=B, num_heads=H,
                                   q_blocks=rank_rows(plan, self.rank, pattern.q_block, pattern.grid[0]))
        seq = SequenceShards(plan.layout, rank=self.rank, global_ranks=tuple(self.transport.global_ranks),
                             group_ref=self.transport.group_ref, timeout=spec.options.timeout)
        return make_run(rows, plan, rank=self.rank, device=self.device, transport=self.transport, seq=seq)

    def _event(self, run: ExchangeRun, seconds: float) -> PlanEvent:
        spec, plan = self.state.spec, run.plan
        return PlanEvent(site=spec.name, graph=spec.graph, rank=self.rank, world=self.world, seconds=seconds,
                         hash=plan.content_hash()[:16], structure=plan.summary(), method="exchange",
                         planner="exchange", call=self.state.calls,
                         stages={"fwd": [plan.stage_bytes("fwd")], "bwd": [plan.stage_bytes("bwd")],
                                 "imbalance": plan.imbalance(), "ownership": plan.ownership})

    # ------------------------------------------------------------------ what the ops do
    # The stage ops (``cp_start``, ``cp_wait``, ``cp_gather``, ``cp_stash``, ``cp_unstash``) are a static
    # program's, with this call's plan as data (``plan``): stage ``KV_STAGE`` is the forward exchange (the K/V
    # chunks each rank needs), ``DKV_STAGE`` the backward's (the dK/dV partials of received chunks, home).
    def start(self, stage: int, pieces: list[Tensor], plan: Tensor) -> int:
        a, b = pieces
        hid = self.state.next_id()
        self.handles[hid] = (post_kv if stage == KV_STAGE else post_dkv)(self.run_of(plan), a, b)
        return hid

    def _heads(self) -> tuple[int, int, int]:
        B, Hk, _, D = self.state.spec.kv_shape
        return B, Hk, D

    def wait(self, hid: int, stage: int, plan: Tensor) -> list[Tensor]:
        """KV_STAGE: [K buffer, V buffer], other ranks' chunks by slot; DKV_STAGE: [dK, dV] fp32 on this rank's
        tokens, the partials other ranks sent, summed."""
        run, handle = self.run_of(plan), self.handles.pop(hid)
        if stage == KV_STAGE:
            return list(wait_kv(run, handle, self._heads(), self.dtype, self.device))
        return list(wait_dkv(run, handle, self._heads(), self.device))

    def received(self, stage: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
        if stage == KV_STAGE:
            return [(self.buffer_shape, self.dtype)] * 2
        return [(self.local_kv_shape, torch.float32)] * 2

    def gather(self, x: Tensor, plan: Tensor) -> Tensor:
        return self.run_of(plan).seq.gather(x, 2, self.seq_len)

    def stash(self, tensors: list[Tensor], plan: Tensor) -> int:
        return self.state.put_state((self.run_of(plan), tensors))

    def unstash(self, ticket: int) -> list[Tensor]:
        """[plan id, K buffer, V buffer] of the forward that stashed them."""
        run, tensors = self.state.take_state(ticket)
        return [torch.tensor(self.keep(run), dtype=torch.int64), *tensors]

    def stashed(self) -> list[tuple[tuple[int, ...], torch.dtype, torch.device]]:
        cpu = torch.device("cpu")
        return [((), torch.int64, cpu)] + [(self.buffer_shape, self.dtype, self.device)] * 2

    def tile_fwd(self, q, k, v, plan, part: int) -> tuple[Tensor, Tensor]:
        run = self.run_of(plan)
        lay = run.local if part == 0 else run.remote
        o, lse = ops.bsa_fwd(q, k, v, *lay.bwd_tensors(), lay.q_block, lay.kv_block, self.state.spec.scale, True)
        return o.contiguous(), lse.contiguous()

    def tile_bwd(self, q, k, v, do, lse, delta, dlse, plan, part: int):
        run = self.run_of(plan)
        lay = run.local if part == 0 else run.remote
        grads = ops.bsa_bwd(q, k, v, do, lse, delta, dlse, *lay.bwd_tensors(), lay.q_block, lay.kv_block,
                            self.state.spec.scale, True)
        return tuple(g.contiguous() for g in grads)


def dynamic_program(state: SiteState, device: torch.device) -> DynamicProgram:
    """The site's program: its chunking (the graph's layout, or ``CHUNKS_PER_RANK`` per rank) and its ranks."""
    spec, opts = state.spec, state.spec.options
    mesh, ranks, group, me = resolve_group(opts.mesh, None)
    if state.layout is not None:
        chunk, num, owner = state.layout.chunk_size, state.layout.num_chunks, state.layout.owner
    else:
        block = max(spec.flex.q_block, spec.flex.kv_block) if spec.flex is not None else opts.block_size
        # CHUNKS_PER_RANK chunks each, fewer where chunks would be smaller than a block (less padding)
        per = max(1, min(CHUNKS_PER_RANK, -(-spec.q_shape[2] // (mesh.world * block))))
        owner = None
        if not OWNERS_PER_BATCH:  # head-tail stripes (an even number of chunks each)
            per += per % 2
            owner = tuple(striped_owner(mesh.world, per // 2))
        num = per * mesh.world
        chunk = padded_chunk(spec.q_shape[2], num, block)
    transport = transport_for(rank=me, global_ranks=ranks, group_ref=GroupRef(group), timeout=opts.timeout)
    return DynamicProgram(state=state, device=device, mesh=mesh, transport=transport, chunk=chunk, num_chunks=num,
                          owner=owner)


# ----------------------------------------------------------------------------- the traced programs
def _dispatch(x: Tensor, index: Tensor, padded: int) -> Tensor:
    pad = padded - x.shape[2]
    if pad:
        x = torch.nn.functional.pad(x, [0, 0] * (x.dim() - 3) + [0, pad])
    return x.index_select(2, index)


def dynamic_forward(prog: DynamicProgram, local: bool):
    """fn(q, k, v, *mask tensors) -> (out, lse fp32, ticket) (``local``: q, k, v, out, lse on this rank's tokens)."""

    def fn(q, k, v, *mask):
        key = prog.key
        token, plan = ops.cp_dyn_plan(new_token(), list(mask), key)
        if local:
            ql, kl, vl = q, k, v
        else:
            index = ops.cp_dyn_index(plan, key)
            ql, kl, vl = (_dispatch(x, index, prog.padded_len) for x in (q, k, v))
        handle = ops.cp_start(token, [kl, vl], key, KV_STAGE, plan)
        o0, l0 = ops.cp_dyn_tile_fwd(ql, kl, vl, plan, key, 0)
        token, k_in, v_in = ops.cp_wait(handle, key, KV_STAGE, plan)
        o1, l1 = ops.cp_dyn_tile_fwd(ql, k_in, v_in, plan, key, 1)
        out, lse = merge_partial((o0, l0), (o1, l1))
        out = out.to(q.dtype)
        if not local:
            token, out = ops.cp_gather(token, out, key, plan)
            token, lse = ops.cp_gather(token, lse, key, plan)
        ticket = ops.cp_stash(token, [k_in, v_in], key, plan)
        return out, lse, ticket

    return fn


def dynamic_backward(prog: DynamicProgram, local: bool):
    """fn(q, k, v, out, lse, dout, dlse, ticket) -> (dq, dk, dv)."""

    def fn(q, k, v, out, lse, dout, dlse, ticket):
        key = prog.key
        plan, k_in, v_in = ops.cp_unstash(ticket, key)
        xs = (q, k, v, out, lse, dout.to(out.dtype), dlse.float())
        if not local:
            index = ops.cp_dyn_index(plan, key)
            xs = tuple(_dispatch(x, index, prog.padded_len) for x in xs)
        ql, kl, vl, ol, ll, dol, dll = xs
        delta = softmax_delta(ol, dol)
        dq1, dk_in, dv_in = ops.cp_dyn_tile_bwd(ql, k_in, v_in, dol, ll, delta, dll, plan, key, 1)
        handle = ops.cp_start(new_token(), [dk_in, dv_in], key, DKV_STAGE, plan)
        dq0, dk0, dv0 = ops.cp_dyn_tile_bwd(ql, kl, vl, dol, ll, delta, dll, plan, key, 0)
        token, dk_home, dv_home = ops.cp_wait(handle, key, DKV_STAGE, plan)
        grads = (dq0 + dq1, dk0 + dk_home, dv0 + dv_home)
        if not local:
            gathered = []
            for g in grads:
                token, g = ops.cp_gather(token, g, key, plan)
                gathered.append(g)
            grads = tuple(gathered)
        return tuple(g.to(x.dtype) for g, x in zip(grads, (q, k, v)))

    return fn
