"""Explicit programs of sites whose mask arrives at run time: one fixed plan, the mask as data.

A packed-sequence model brings a new document mask every batch. The graph Inductor compiles for such a
site is fixed by shapes, mesh and options alone, so its plan is too: ``planner.exchange.owner_computes_plan``,
a ``TilePlan`` in which every rank computes the rows of its own chunks against every chunk and each chunk's
K/V may go to every other rank. The executor traces that plan exactly as it traces a static site's
(``explicit/program.py``: the same ``TracedIO``, stage ops, tile sets, merge and delta), written with ONE chunk
per rank (its tokens), so the graph does not grow with the chunks per rank; the ops work in the site's fine
chunks (``PerMaskProgram.fine``). The mask enters the graph in its first node and every later node reads it by
the plan id it returns::

    token, plan = cp_mask_plan(token, [mask tensors], site)       # milliseconds; cached per mask content
    q_l = index_select(pad(q), 2, cp_mask_index(plan, site))      # dispatch: the mask's owners (global view)
    h = cp_start(token, [this rank's K, V], site, 0, plan)       # per peer, only the fine chunks it needs
    o, lse = cp_tiles_fwd([q_l], [own K], [own V], site, t, plan)   # own keys, while messages fly
    token, *kv_in = cp_wait(h, h, site, 0, plan)                 # each peer's K/V; zeros where nothing came
    o', lse' = cp_tiles_fwd([q_l], kv_in..., site, t', plan)     # received keys (empty fine cells skipped)
    ... one LSE merge, cp_gather(..., plan) ...

The plan id selects the call's ``MaskRun``: its ``ExchangePlan`` (owners, which fine messages carry data), the
global chunk of every fine chunk, and the mask's ``TileGeometry`` (block kinds, element masks), so a tile
computes each fine row of its rows against the global chunks its columns stand for. A new mask: no recompile,
no new guard, the same graph. Only planning and the dispatch index are this path's own ops
(``passes/ops/per_mask.py``).

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

import dataclasses
import functools
import math
import time
import weakref
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import torch
from torch import Tensor

from ultraattn.cache import LRU
from ultraattn.masks.convert import pattern_from_kinds
from ultraattn.masks.read import ElementMask
from ultraattn.passes.explicit.program import ExplicitProgram, TileRow, TileSet, TracedIO, stage_of
from ultraattn.passes.records import PlanEvent
from ultraattn.passes.site import (
    MAX_PENDING,
    SiteState,
    call_block_kinds,
    check_same_inputs,
    dense_mask_mod,
    flex_mask_mod,
    flex_tables,
)
from ultraattn.passes.state import side_table
from ultraattn.planner.baselines import striped_owner
from ultraattn.planner.exchange import ExchangePlan, owner_computes_plan, pattern_weights, plan_exchange
from ultraattn.planner.plan import AttnShape, Mesh, Transfer, padded_chunk
from ultraattn.runtime.api import DTYPE_NAMES
from ultraattn.runtime.comm import GroupRef, resolve_group
from ultraattn.runtime.executor import Executor, message_pieces
from ultraattn.runtime.plan_cache import content_digest
from ultraattn.runtime.sequence import SequenceShards
from ultraattn.runtime.tiles import TileGeometry, group_kind_grid, row_backward, row_forward
from ultraattn.runtime.transport import transport_for

ops = torch.ops.ultraattn

CHUNKS_PER_RANK = 4
"""Chunks each rank owns in a global-view site (per-batch owners balance over them)."""
RUNTIME_MASK_STRIPES = 8
"""Head-tail stripes of a sequence-sharded graph whose first site's mask arrives at run time: 16 chunks per rank
(fewer where chunks would be smaller than a block); see the [Note] above."""
OWNERS_PER_BATCH = True
"""Global-view sites choose owners per mask (see the [Note] in the module docstring)."""


@dataclass(eq=False)
class MaskRun:
    """One mask's data for the fixed plan on one rank (module docstring)."""

    plan: ExchangePlan
    rank: int
    chunks: tuple[int, ...]
    """The global chunk of every virtual chunk (``ExchangePlan.global_chunks``)."""
    live: frozenset
    """(tensor, virtual chunk, src, dst) of the messages that carry data (``ExchangePlan.live``)."""
    nonempty: np.ndarray
    """bool [P, P] over global chunks: the (q chunk, kv chunk) cells the mask does not leave empty."""
    geo: TileGeometry
    """The mask's block kinds and element masks on the global (padded) grid: what every tile reads."""
    index: Tensor
    """int64 [local_len]: the global (padded) position of each local token (the dispatch)."""
    seq: SequenceShards
    """The plan's token layout on this rank's group (the gathers)."""
    bound: dict = field(default_factory=dict, repr=False)
    """ids of a call's mask tensors -> (weakrefs to them, their versions, weakref to this run bound to them)."""

    def bound_to(self, tensors: list[Tensor], make_mod) -> MaskRun:
        """This run with its tiles reading the mask through ``make_mod()``: the mask_mod over this call's tensors (a
        boolean mask's elements, a BlockMask's buffers) where they live. A run-time mask's run is keyed by its block
        table, so one run serves every mask with the same blocks, and each call's tiles read the call's own
        elements; the element masks are cached per mask, shared by the sites that read it in a step. Held weakly:
        a bound run lives while a call in flight holds its plan id."""
        key = tuple(id(t) for t in tensors)
        hit = self.bound.get(key)
        if hit is not None and all(r() is t and v == t._version for r, v, t in zip(hit[0], hit[1], tensors)) and \
                (run := hit[2]()) is not None:
            return run
        geo = dataclasses.replace(self.geo, element=ElementMask(make_mod()), mask_cache={}, cache_bytes=0)
        run = dataclasses.replace(self, geo=geo, bound={})
        self.bound = {k: v for k, v in self.bound.items() if v[2]() is not None}
        self.bound[key] = ([weakref.ref(t) for t in tensors], [t._version for t in tensors], weakref.ref(run))
        return run

    def cells(self, q_virtual: int, kv_supers: tuple[int, ...], per: int) -> tuple[int, list[tuple[int, int, int]]]:
        """(global q chunk, [(position in ``kv_supers``, chunk inside it, global kv chunk)] of the non-empty cells) of
        the fine row ``q_virtual`` against the traced chunks ``kv_supers`` (``per`` fine chunks each): a tile skips
        the chunks this mask needs nothing of (they were never sent)."""
        i = self.chunks[q_virtual]
        return i, [(n, b, j) for n, s in enumerate(kv_supers) for b in range(per)
                   if self.nonempty[i, j := self.chunks[s * per + b]]]


def _message(t: Transfer) -> tuple[str, int, int, int]:
    return (t.tensor, t.chunk, t.src, t.dst)


ops = torch.ops.ultraattn


class PerMaskTracedIO(TracedIO):
    """The traced IO of a per-mask program: a step's ready tiles become ONE node (``cp_tiles_fwd`` / ``cp_tiles_bwd``):
    the graph holds a node per step of the schedule, not per row (its rows cover every chunk, most of them empty
    under any one mask)."""

    def tiles_fwd(self, items, scale, score=()):
        tid, ks, vs = self._tile_set(items, scale)
        outs = ops.cp_tiles_fwd([q for _g, _i, _js, q, _kvs in items], ks, vs, list(score), self.prog.key, tid,
                                *self.data)
        return [(outs[2 * n], outs[2 * n + 1]) for n in range(len(items))]

    def tiles_bwd(self, items, scale, score=()):
        tid, ks, vs = self._tile_set(items, scale)
        rows = [it[3:7] for it in items]
        outs = ops.cp_tiles_bwd(*([r[n] for r in rows] for n in range(4)), ks, vs, list(score), self.prog.key, tid,
                                *self.data)
        n, m_cols = len(items), len(self.prog.tiles[tid].cols)
        dkvs = {u: (outs[n + m], outs[n + m_cols + m]) for m, u in enumerate(self.prog.tiles[tid].cols)}
        return outs[:n], dkvs, list(outs[n + 2 * m_cols:])

    def _tile_set(self, items: list, scale: float) -> tuple[int, list[Tensor], list[Tensor]]:
        """A tile set's id in the table, and the K and V of its columns (each once)."""
        cols, ks, vs = {}, [], []
        for g, _i, js, *_, kvs in items:
            for j, (k, v) in zip(js, kvs, strict=True):
                if (j, g) not in cols:
                    cols[(j, g)] = len(ks)
                    ks.append(k)
                    vs.append(v)
        tid = len(self.prog.tiles)
        self.prog.tiles.append(TileSet(tuple(TileRow(g, i, tuple(js), scale) for g, i, js, *_ in items), tuple(cols)))
        return tid, ks, vs


_PER_MASK_WORDS = {
    "cp_mask_plan": "plan this call's mask (run-time data: bytes per step in the planning table)",
    "cp_mask_index": "this rank's token positions under the plan",
    ("cp_start", "fwd"): "stage: post the K/V chunks each rank needs (of {n} possible messages)",
    ("cp_wait", "fwd"): "stage received: other ranks' K/V chunks (zeros for those the mask needs none of)",
    ("cp_start", "bwd"): "stage: post the dK/dV partials of received chunks to their owners (of {n} possible)",
    ("cp_wait", "bwd"): "stage received: partials for this rank's chunks, summed",
    "cp_gather": "all-gather to the global view (the plan's owners)",
    "cp_stash": "keep the plan and the received K/V for the backward",
    "cp_unstash": "the forward's plan and received K/V",
}


@dataclass(eq=False)
class PerMaskProgram(ExplicitProgram):
    """A run-time-mask site's program: the fixed plan's executor, and one ``MaskRun`` per mask seen."""

    counts_calls_on_post: ClassVar[bool] = False

    mesh: Mesh = None
    chunk: int = 0
    num_chunks: int = 0
    owner: tuple[int, ...] | None = None
    """Fixed owners (a sequence-sharded graph's layout), or None: chosen per mask."""
    template: Executor = None
    """The executor the graph traces: ``owner_computes_plan`` with ONE chunk per rank, the rank's tokens (so the graph
    does not grow with the chunks per rank); its IO posts the fine plan's messages (``fine``)."""
    fine: Executor = None
    """The executor of ``owner_computes_plan`` in the site's chunks (``chunk``, ``num_chunks``): the messages, byte
    table and log the ops really use; a traced K/V or dK/dV message stands for its ``per_rank`` fine ones."""
    runs: LRU = field(default_factory=lambda: side_table().exchange_runs)
    """(site identity, configuration, mask digest) -> MaskRun, shared by the sites of the process: a mask seen
    again, or by another site of the same identity (the next layer), is not planned again."""
    live_runs: LRU = field(default_factory=lambda: LRU(2 * MAX_PENDING + 4))
    """plan id -> MaskRun, for the ops of calls in flight."""
    last: MaskRun | None = None
    """The run of the latest call (tests and reports read its plan)."""

    # ------------------------------------------------------------------ static geometry
    @property
    def executor(self) -> Executor:
        return self.template

    @property
    def world(self) -> int:
        return self.mesh.world

    @property
    def rank(self) -> int:
        return self.template.rank

    @property
    def seq_len(self) -> int:
        return self.state.spec.q_shape[2]

    @property
    def padded_len(self) -> int:
        return self.num_chunks * self.chunk

    @property
    def local_len(self) -> int:
        return self.num_chunks // self.world * self.chunk

    @property
    def per_rank(self) -> int:
        """Fine chunks per traced chunk (per rank)."""
        return self.num_chunks // self.world

    @functools.cached_property
    def fine_steps(self) -> dict[tuple[str, int, int, int], tuple[int, Transfer]]:
        """(tensor, fine chunk, src, dst) -> (index, transfer) of the fine plan's messages."""
        return {_message(t): (idx, t) for idx, t in enumerate(self.fine.plan.transfers)}

    # ------------------------------------------------------------------ plans
    def plan(self, mask_tensors: list[Tensor]) -> int:
        """Plan (or reuse the plan of) this call's mask; returns the plan id the graph's nodes carry."""
        state, spec = self.state, self.state.spec
        state.calls += 1
        if spec.options.debug:
            check_same_inputs(state, list(mask_tensors))
        # The run holds the site's mask_mod and score_mod (its TileGeometry), so it is shared only between sites of
        # one identity (``site_identity``: the layers of a model), never between sites that compute differently.
        # planned from the mask's block table: its elements (and a BlockMask's int32 lists and per-token buffers)
        # never reach the host; the run serves every mask with these blocks (``MaskRun.bound_to``)
        kinds = call_block_kinds(state, mask_tensors)
        digest = state.memo.get(kinds, "bytes", lambda: content_digest([kinds]))
        key = content_digest([], (digest, spec.identity, self.chunk, self.num_chunks, self.owner, self.rank,
                                  str(self.device), self.mesh))
        run = self.runs.get(key)
        if run is None:
            t0 = time.perf_counter()
            run = self._make(kinds)
            seconds = time.perf_counter() - t0
            object.__setattr__(run.plan, "seconds", seconds)
            self.runs.put(key, run)
            state.plans.plans += 1
            state.plans.seconds += seconds
            side_table().bump("exchange_plan_us", round(seconds * 1e6))  # planning inside the step (examples)
            state.observer.plan_made(self._event(run, seconds))
        else:
            state.plans.hits += 1
        if spec.mask == "bool_mask":
            run = run.bound_to(mask_tensors[:1], lambda: dense_mask_mod(mask_tensors[0]))
        else:
            _, buffers = flex_tables(spec.flex, mask_tensors)
            run = run.bound_to(buffers, lambda: flex_mask_mod(spec.flex, buffers))
        self.last = run
        return self.keep(run)

    def keep(self, run: MaskRun) -> int:
        pid = self.state.next_id()
        self.live_runs.put(pid, run)
        return pid

    def run_of(self, plan: Tensor | int) -> MaskRun:
        run = self.live_runs.get(int(plan))
        if run is None:
            raise RuntimeError(f"ultraattn site {self.state.spec.name}: plan {int(plan)} is no longer held (more than "
                               f"{self.live_runs.capacity} calls in flight)")
        return run

    def _make(self, kinds: Tensor) -> MaskRun:
        """The mask's block table -> chunk weights -> the plan (the same on every rank) -> the tile geometry of
        these blocks (its element masks: each call's own, ``MaskRun.bound_to``)."""
        spec = self.state.spec
        B, H, S, D = spec.q_shape
        qb, kb = (spec.flex.q_block, spec.flex.kv_block) if spec.mask == "block_mask" else \
            (spec.options.block_size,) * 2
        pattern = pattern_from_kinds(kinds, q_len=S, kv_len=spec.kv_shape[2], q_block=qb, kv_block=kb)
        if self.chunk % pattern.q_block or self.chunk % pattern.kv_block:
            raise RuntimeError(f"ultraattn site {spec.name}: chunks of {self.chunk} tokens are not whole mask blocks "
                               f"({pattern.q_block} x {pattern.kv_block})")
        cost = spec.options.cost_model()
        weights = pattern_weights(pattern, batch=B, num_heads=H, chunk=self.chunk, num_chunks=self.num_chunks,
                                  partial_overhead=cost.partial_block_overhead)
        tp = self.fine.plan
        plan = plan_exchange(weights, mesh=self.mesh, chunk=self.chunk, owner=self.owner,
                             kv_chunk_bytes=tp.shape.unit_bytes("kv", self.chunk),
                             dkv_chunk_bytes=tp.shape.unit_bytes("dkv", self.chunk))
        padded = self.padded_len
        geo = TileGeometry(seq_len=S, chunk=self.chunk, q_block=pattern.q_block, kv_block=pattern.kv_block, batch=B,
                           num_heads=H, num_kv_heads=spec.kv_shape[1], head_groups=1, head_dim=D,
                           kind_gQK=[group_kind_grid(pattern, range(H), padded // pattern.q_block,
                                                     padded // pattern.kv_block)], element=None, pattern=pattern,
                           score_mod=spec.score)
        pos = torch.arange(self.chunk)
        index = torch.cat([c * self.chunk + pos for c in plan.layout.local_chunks(self.rank)])
        tr = self.template.transport
        seq = SequenceShards(plan.layout, rank=self.rank, global_ranks=tuple(tr.global_ranks), group_ref=tr.group_ref,
                             timeout=spec.options.timeout)
        return MaskRun(plan=plan, rank=self.rank, chunks=plan.global_chunks(), live=plan.live(),
                       nonempty=weights > 0, geo=geo, index=index.to(self.device), seq=seq)

    def _event(self, run: MaskRun, seconds: float) -> PlanEvent:
        spec, plan = self.state.spec, run.plan
        return PlanEvent(site=spec.name, graph=spec.graph, rank=self.rank, world=self.world, seconds=seconds,
                         hash=plan.content_hash()[:16], structure=plan.summary(), method="exchange",
                         planner="exchange", call=self.state.calls,
                         stages={"fwd": [plan.stage_bytes("fwd")], "bwd": [plan.stage_bytes("bwd")],
                                 "imbalance": plan.imbalance(), "ownership": plan.ownership})

    # ------------------------------------------------------------------ what the ops do with the plan as data
    def posts(self, sends: list, recvs: list, plan: Tensor | None) -> tuple[list, list]:
        """The fine messages of one traced stage that carry data under this call's mask: a traced chunk's K/V (or
        dK/dV) message becomes the messages of the fine chunks it holds that the peer needs, each its slice."""
        live, per, c = self.run_of(plan).live, self.per_rank, self.chunk
        out_s = [(*self.fine_steps[key], [p[:, :, b * c:(b + 1) * c] for p in pieces])
                 for _tag, t, pieces in sends for b in range(per)
                 if (key := (t.tensor, t.chunk * per + b, t.src, t.dst)) in live]
        out_r = [self.fine_steps[key] for _tag, t in recvs for b in range(per)
                 if (key := (t.tensor, t.chunk * per + b, t.src, t.dst)) in live]
        return out_s, out_r

    def wait(self, hid: int, stage: int, plan: Tensor | None = None) -> list[Tensor]:
        """The traced stage's received tensors, each assembled from its fine messages (zeros for the fine chunks
        this call's mask does not send)."""
        got = {(t.tensor, t.chunk, t.src): pieces for t, pieces in self.executor.io.wait(self.handles.pop(hid))}
        fine, per = self.fine, self.per_rank
        out = []
        for _tag, t in self.stages[stage].recvs:
            parts = [got.get((t.tensor, t.chunk * per + b, t.src)) for b in range(per)]
            for n, (shape, dt) in enumerate(message_pieces(t.tensor, fine.geo, fine.dtype)):
                out.append(torch.cat([torch.zeros(shape, dtype=dt, device=self.device) if ps is None else ps[n]
                                      for ps in parts], dim=2))
        return out

    def dispatcher(self, plan):
        """This rank's tokens of a global tensor: an index_select whose index is the call's plan data."""
        index = ops.cp_mask_index(plan, self.key)
        padded = self.padded_len

        def shard(x: Tensor) -> Tensor:
            pad = padded - x.shape[2]
            if pad:
                x = torch.nn.functional.pad(x, [0, 0] * (x.dim() - 3) + [0, pad])
            return x.index_select(2, index)

        return shard

    def gather(self, x: Tensor, plan: Tensor | None = None) -> Tensor:
        return self.run_of(plan).seq.gather(x, 2, self.seq_len)

    def stash(self, tensors: list[Tensor], plan: Tensor | None = None) -> int:
        return self.state.put_state((self.run_of(plan), tensors))

    def unstash(self, ticket: int) -> list[Tensor]:
        """[plan id, the stashed tensors] of the forward that stashed them."""
        run, tensors = self.state.take_state(ticket)
        return [torch.tensor(self.keep(run), dtype=torch.int64), *tensors]

    def stashed(self) -> list[tuple[tuple[int, ...], torch.dtype, torch.device]]:
        return [((), torch.int64, torch.device("cpu"))] + super().stashed()

    def _fine_rows(self, run: MaskRun, row, col: dict[int, int], ks: list[Tensor], vs: list[Tensor]):
        """Each fine row of the traced ``row``: (its tokens in the row, global q chunk, [(column, fine chunk inside
        it)] and the global kv chunks of its non-empty cells, their K/V slices). ``col``: traced kv chunk -> column."""
        per, c = self.per_rank, self.chunk
        for a in range(per):
            i, cells = run.cells(row.q_chunk * per + a, row.kv_chunks, per)
            at = [(col[row.kv_chunks[n]], b) for n, b, _j in cells]
            yield (slice(a * c, (a + 1) * c), i, at, [j for *_, j in cells],
                   [(ks[m][:, :, b * c:(b + 1) * c], vs[m][:, :, b * c:(b + 1) * c]) for m, b in at])

    def tiles_fwd(self, tile: int, qs: list[Tensor], ks: list[Tensor], vs: list[Tensor], score: list[Tensor] = (),
                  plan: Tensor | None = None) -> list[tuple[Tensor, Tensor]]:
        """(o, lse) fp32 of every row of tile set ``tile``: each fine row of a traced row against the global chunks
        its columns stand for, skipping the chunks this mask leaves empty there (they were never sent)."""
        run, ts = self.run_of(plan), self.tiles[tile]
        col = {u[0]: m for m, u in enumerate(ts.cols)}
        out = []
        for row, q in zip(ts.rows, qs, strict=True):
            os_, lses = [], []
            for sl, i, _at, cols, kvs in self._fine_rows(run, row, col, ks, vs):
                qa = q[:, :, sl]
                if not cols:  # nothing of this row in these chunks under this mask
                    os_.append(torch.zeros(qa.shape, dtype=torch.float32, device=q.device))
                    lses.append(torch.full(qa.shape[:-1], -math.inf, dtype=torch.float32, device=q.device))
                    continue
                o, lse = row_forward(run.geo, 0, i, cols, qa, kvs, row.scale, score)
                os_.append(o)
                lses.append(lse)
            out.append((torch.cat(os_, dim=2), torch.cat(lses, dim=2)))
        return out

    def tiles_bwd(self, tile: int, qs, dos, lses, deltas, ks, vs, score: list[Tensor] = (), plan: Tensor | None = None):
        """([dq per row], [dk per column], [dv per column], [score_mod buffer gradients]) fp32 of tile set ``tile``,
        a column's (and a buffer's) summed over rows."""
        run, ts, c = self.run_of(plan), self.tiles[tile], self.chunk
        col = {u[0]: m for m, u in enumerate(ts.cols)}
        dks = [torch.zeros(k.shape, dtype=torch.float32, device=k.device) for k in ks]
        dvs = [torch.zeros(v.shape, dtype=torch.float32, device=v.device) for v in vs]
        dscore = [torch.zeros(score[n].shape, dtype=torch.float32, device=score[n].device)
                  for n in self.state.spec.score_wanted]
        dqs = []
        for row, q, do, lse, delta in zip(ts.rows, qs, dos, lses, deltas, strict=True):
            parts = []
            for sl, i, at, cols, kvs in self._fine_rows(run, row, col, ks, vs):
                if not cols:
                    parts.append(torch.zeros(q[:, :, sl].shape, dtype=torch.float32, device=q.device))
                    continue
                dq, per_col, dbufs = row_backward(run.geo, 0, i, cols, q[:, :, sl], do[:, :, sl], lse[:, :, sl],
                                                  delta[:, :, sl], kvs, row.scale, score)
                parts.append(dq)
                for acc, gb in zip(dscore, dbufs, strict=True):
                    acc += gb
                for (m, b), (dk, dv) in zip(at, per_col, strict=True):
                    dks[m][:, :, b * c:(b + 1) * c] += dk
                    dvs[m][:, :, b * c:(b + 1) * c] += dv
            dqs.append(torch.cat(parts, dim=2))
        return dqs, dks, dvs, dscore


    # ------------------------------------------------------------------ what the traced programs ask of the form
    def traced_io(self) -> TracedIO:
        return PerMaskTracedIO(self)

    def begin_forward(self, io: TracedIO, q: Tensor, k: Tensor, v: Tensor, mask: list[Tensor], local: bool) -> None:
        """Plan the call's mask first (its plan id is every later op's ``plan`` argument)."""
        io.token, io.plan = ops.cp_mask_plan(io.token, mask, self.key)

    def resume_backward(self, io: TracedIO, flat: list[Tensor]) -> list[Tensor]:
        """The forward's plan id comes first in its stash."""
        io.plan = flat[0]
        return flat[1:]

    def describe(self, n, op: str) -> tuple[str, int]:
        """Which messages move (and their bytes) is the mask's, per step: the nodes say what they can move."""
        if op in ("cp_start", "cp_wait"):
            st = self.stages[stage_of(n)]
            if not st.sends and not st.recvs:
                return "(none)", 0
            return _PER_MASK_WORDS[(op, st.phase)].format(n=len(st.sends) + len(st.recvs)), 0
        if op in ("cp_tiles_fwd", "cp_tiles_bwd"):
            ts = self.tiles[stage_of(n)]
            return (f"{len(ts.rows)} q chunks × {len(ts.cols)} kv chunks (virtual: the mask's owners say which, "
                    f"its blocks which cells)"), 0
        return _PER_MASK_WORDS.get(op, ""), 0


def per_mask_program(state: SiteState, device: torch.device) -> PerMaskProgram:
    """The site's program: its chunking (the graph's layout, or ``CHUNKS_PER_RANK`` per rank), its ranks and the
    executor of its fixed plan."""
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
    B, H, S, D = spec.q_shape
    if spec.dtype not in DTYPE_NAMES:
        raise TypeError(f"ultraattn site {spec.name}: dtype {spec.dtype} is not supported across ranks; use one of "
                        f"{sorted(str(d) for d in DTYPE_NAMES)}")
    shape = AttnShape(seq_len=S, num_heads=H, head_dim=D, num_kv_heads=spec.kv_shape[1], batch=B,
                      dtype=DTYPE_NAMES[spec.dtype])
    per = num // mesh.world
    transport = transport_for(rank=me, global_ranks=ranks, group_ref=GroupRef(group), timeout=opts.timeout)

    def executor(size: int, n: int) -> Executor:
        # the fixed plan's geometry: message shapes only (every tile reads its call's MaskRun.geo)
        geo = TileGeometry(seq_len=S, chunk=size, q_block=size, kv_block=size, batch=B, num_heads=H,
                           num_kv_heads=spec.kv_shape[1], head_groups=1, head_dim=D, kind_gQK=[], element=None,
                           score_mod=spec.score)
        return Executor(owner_computes_plan(mesh=mesh, shape=shape, chunk=size, chunks_per_rank=n), me, geo,
                        transport, spec.dtype)

    # traced: one chunk per rank (the graph does not grow with the chunks); moved: the fine plan's messages
    template, fine = executor(chunk * per, 1), executor(chunk, per)
    fine.log = template.log
    template.io = fine.io
    return PerMaskProgram(state=state, runner=None, mesh=mesh, chunk=chunk, num_chunks=num, owner=owner,
                          template=template, fine=fine)
