"""A rewritten attention site: its static description, its run-time state, and how its mask becomes a plan.

* ``SiteSpec`` (frozen, built at compile time): shapes, mask kind, the flex ``mask_mod``
  submodule, scale, backend options. The graph refers to a site by ``spec.key`` (a string
  baked into the graph); the mask's *content* (BlockMask tensors, mask_mod buffers such as
  document ids, a boolean ``attn_mask``) arrives as op inputs at run time.
* ``SiteState`` (mutable, one per site in the side table): the plan cache, the forward state
  waiting for its backward, call counts, the explicit program, and the observer that shows
  plan events.
* ``runner_for``: the plan (world > 1) or block lists (world 1) for one call's mask content,
  cached on that content, so a new batch's document mask is planned again without recompiling.
"""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from ultraattn.cache import LRU
from ultraattn.kernels import BlockLists, make_block_lists
from ultraattn.kernels.block_lists import dense_block_kinds, dense_block_lists, mod_bits
from ultraattn.masks.convert import block_table_kinds, pattern_from_mask_mod, to_block_pattern
from ultraattn.masks.pattern import FULL, PARTIAL
from ultraattn.masks.read import MASK_DEPENDS, ElementMask
from ultraattn.passes.fx_util import module_digest
from ultraattn.passes.records import NullObserver, Observer, PlanEvent, SiteForm, SiteStats
from ultraattn.planner.api import PlanResult, choose_planner, method_summaries, plan
from ultraattn.planner.plan import AttnShape, Mesh
from ultraattn.runtime.api import AttentionPlan, plan_attention
from ultraattn.runtime.comm import ranks_differing
from ultraattn.runtime.plan_cache import PlanCache, TensorMemo, content_digest
from ultraattn.runtime.tiles import ScoreMod

if TYPE_CHECKING:
    from ultraattn.passes.options import BackendOptions
    from ultraattn.planner.plan import TokenSharding

MAX_PENDING = 8
"""Forwards of one site that may await their backward (gradient accumulation, checkpointing); read when a
graph is compiled."""

Runner = AttentionPlan | BlockLists
"""What a site runs: a plan across ranks, or (world size 1) the block-sparse kernels' block lists."""


STATIC_MASKS = ("causal", "full")
"""Masks without run-time content: a site with one is planned at compile time."""

@dataclass(frozen=True, slots=True, kw_only=True)
class FlexMaskInfo:
    """The static part of a site's BlockMask (its tensors and mask_mod buffers are run-time inputs)."""

    q_len: int
    kv_len: int
    q_block: int
    kv_block: int
    has_full: bool
    """Whether the BlockMask has full_kv_num_blocks/full_kv_indices (they follow kv_num_blocks/kv_indices)."""
    mask_mod: fx.GraphModule


@dataclass(frozen=True, slots=True, kw_only=True)
class SiteSpec:
    key: str
    """Process-unique (baked into the graph's op calls)."""
    name: str
    """``sdpa#i`` / ``flex#i``."""
    graph: int
    """Index of the Dynamo graph the site is in."""
    op: str
    mask: str
    """full | causal | bool_mask | block_mask."""
    q_shape: tuple
    kv_shape: tuple
    dtype: torch.dtype
    scale: float
    options: BackendOptions
    flex: FlexMaskInfo | None = None
    score: ScoreMod | None = None
    """A flex site's score_mod (None: the identity); its buffers follow the mask's tensors in the op's inputs."""
    identity: str = ""
    """A digest of everything that defines what the site computes (``site_identity``); its key digests it."""

    def split_inputs(self, tensors: Sequence[Tensor]) -> tuple[list[Tensor], list[Tensor]]:
        """(the mask's content, the score_mod's buffers) of the op's ``mask_tensors``."""
        n = len(self.score.grads) if self.score is not None else 0
        tensors = list(tensors)
        return tensors[:len(tensors) - n], tensors[len(tensors) - n:]

    @property
    def score_wanted(self) -> list[int]:
        """Which score_mod buffers get a gradient (positions among the buffers)."""
        return self.score.wanted if self.score is not None else []

    @property
    def sync_key(self) -> str:
        """Identical on every rank (graph index and site name), for store exchanges."""
        return f"g{self.graph}-{self.name}"

    @property
    def static_mask(self) -> bool:
        """The mask has no run-time content (causal or none): its plan is known at compile time."""
        return self.mask in STATIC_MASKS


@dataclass(eq=False)
class SiteState:
    """What one site accumulates at run time (owned by the side table, under ``spec.key``)."""

    spec: SiteSpec
    next_id: Callable[[], int]
    """The side table's id counter (tickets of forward state)."""
    observer: Observer = field(default_factory=NullObserver)
    """Shows this site's plan events (installed by the backend's caller)."""
    layout: TokenSharding | None = None
    """The graph's token layout when the sequence-sharding pass runs the site on local tokens: every plan
    of the site keeps it (None: the planner chooses)."""
    device: torch.device | None = None
    """The graph's device (set when the site is planned at compile time)."""
    plans: PlanCache = field(default_factory=PlanCache)
    stash: LRU = field(default_factory=lambda: LRU(MAX_PENDING))
    """ticket -> forward state its backward needs (bounded: a forward whose backward never runs is dropped)."""
    program: object = None
    """The site's explicit per-rank program (``passes.explicit.program.ExplicitProgram``), when expanded."""
    form: SiteForm | None = None
    """What the site runs as (``passes.forms.form_for``, decided once when its graph is rewritten), and why."""
    form_why: str = ""
    calls: int = 0
    memo: TensorMemo = field(default_factory=TensorMemo)
    """What was read off this step's mask tensors (digests, block tables), shared by the sites of the side table
    (``SideTable.tensor_memo``): every layer gets the same mask tensor and reads it once."""

    def put_state(self, value) -> int:
        """Keep ``value`` for the backward; returns its ticket."""
        ticket = self.next_id()
        self.stash.put(ticket, value)
        return ticket

    def take_state(self, ticket: int):
        value = self.stash.pop(ticket)
        if value is None:
            raise RuntimeError(
                f"ultraattn site {self.spec.name}: the backward's forward state is gone (more than {MAX_PENDING} "
                f"forwards of this attention ran before its backward, or backward ran twice); raise "
                f"ultraattn.passes.site.MAX_PENDING before compiling, or call backward sooner")
        return value

    def stats(self) -> SiteStats:
        return SiteStats(graph=self.spec.graph, site=self.spec.name, calls=self.calls, plans=self.plans.plans,
                         cache_hits=self.plans.hits, planning_seconds=self.plans.seconds)


def site_identity(spec: SiteSpec) -> str:
    """A digest of everything that defines what a site computes, and nothing that names where it sits: the op,
    the mask's kind, the shapes, dtype and scale, the options, a BlockMask's static part with its mask_mod's graph
    and constants, and the score_mod's graph and constants with which of its buffers want a gradient
    (``fx_util.module_digest``). Two sites that compute different things never share it (their keys, and the
    caches keyed by it, stay apart); two that compute the same thing may (the layers of a model, a recompile)."""
    flex, score = spec.flex, spec.score
    parts = (spec.op, spec.mask, tuple(spec.q_shape), tuple(spec.kv_shape), str(spec.dtype), repr(spec.scale),
             re.sub(r"0x[0-9a-fA-F]+", "0x", repr(spec.options)),
             None if flex is None else (flex.q_len, flex.kv_len, flex.q_block, flex.kv_block, flex.has_full,
                                        module_digest(flex.mask_mod)),
             None if score is None else (module_digest(score.fn), score.grads))
    return hashlib.sha1(repr(parts).encode()).hexdigest()[:16]


# ----------------------------------------------------------------------------- mask content -> mask
def dense_mask_mod(mask: Tensor) -> Callable:
    """A boolean mask ``[Q, K]`` / ``[B|1, H|1, Q, K]`` as a mask_mod that reads it where it lives: indices on another
    device go to the mask's, the answer comes back on theirs (nothing is copied whole; a tile on the mask's device
    moves nothing)."""
    m = mask.detach()
    m = m if m.dtype == torch.bool else m.to(torch.bool)
    while m.dim() < 4:
        m = m.unsqueeze(0)
    bm, hm, dev = m.shape[0], m.shape[1], m.device

    def on(x):
        return x.to(dev) if isinstance(x, Tensor) else x

    def dense_mask(b, h, q_idx, kv_idx):
        out = m[on(b if bm > 1 else b * 0), on(h if hm > 1 else h * 0), on(q_idx), on(kv_idx)]
        return out.to(q_idx.device) if isinstance(q_idx, Tensor) else out

    setattr(dense_mask, MASK_DEPENDS, (bm > 1, hm > 1))
    return dense_mask


def _bool_mask(spec: SiteSpec, tensors: Sequence[Tensor], batch: int, heads: int):
    """(pattern with exact pair counts, mask_mod) of a boolean mask: what a plan made once (at compile time, for a
    sequence-sharded graph's layout, ``explain``) reads. A run-time mask's plan per step reads its block table
    instead (``explicit/per_mask.py``)."""
    dense_mask = dense_mask_mod(tensors[0])
    bm, hm = getattr(dense_mask, MASK_DEPENDS)
    pat = pattern_from_mask_mod(dense_mask, spec.q_shape[2], spec.kv_shape[2], block_size=spec.options.block_size,
                                batch=batch if bm else 1, num_heads=heads if hm else 1)
    return pat, dense_mask


def flex_mask_mod(info: FlexMaskInfo, buffers: Sequence[Tensor]) -> Callable:
    """A flex site's mask_mod over this call's buffers (document ids, ...), evaluated where its indices are: on the
    buffers' device (the block lists' bit tiles on the GPU read them there), or, for indices elsewhere (the CPU
    tiles' element masks), on a copy of the buffers made there once per mask (8 bytes per token, shared by the
    sites that read the mask in a step; the answers never cross devices)."""
    copies = {None: [t.detach() for t in buffers]}
    gm = info.mask_mod

    def mask_mod(b, h, q_idx, kv_idx):
        dev = q_idx.device if isinstance(q_idx, Tensor) else None
        bufs = copies.get(dev)
        if bufs is None:
            bufs = copies[dev] = [t.to(dev) for t in copies[None]]
        return gm(b, h, q_idx, kv_idx, *bufs)

    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(phs) >= 4:  # its graph reads b / h, or not
        setattr(mask_mod, MASK_DEPENDS, (bool(phs[0].users), bool(phs[1].users)))
    return mask_mod


def flex_tables(info: FlexMaskInfo, tensors: Sequence[Tensor]) -> tuple[list[Tensor], list[Tensor]]:
    """(the BlockMask's index lists: kv_num_blocks, kv_indices[, full_kv_num_blocks, full_kv_indices]; the mask_mod's
    buffers) of a flex site's mask tensors."""
    n = 4 if info.has_full else 2
    return list(tensors[:n]), list(tensors[n:])


def _block_mask(info: FlexMaskInfo, tensors: Sequence[Tensor]):
    (kvn, kvi, *full), buffers = flex_tables(info, tensors)
    fkn, fki = full if full else (None, None)
    mask_mod = flex_mask_mod(info, buffers)

    # [Note] A BlockMask without its transposed (q-side) tensors: BlockMask's constructors compute them with
    # vmap, which is unavailable below the autograd dispatch key where custom ops run; only the kv side is
    # read by ultraattn.
    bmask = object.__new__(BlockMask)
    for name, val in (("seq_lengths", (info.q_len, info.kv_len)), ("kv_num_blocks", kvn.cpu()),
                      ("kv_indices", kvi.cpu()), ("full_kv_num_blocks", None if fkn is None else fkn.cpu()),
                      ("full_kv_indices", None if fki is None else fki.cpu()),
                      ("BLOCK_SIZE", (info.q_block, info.kv_block)), ("mask_mod", mask_mod)):
        object.__setattr__(bmask, name, val)
    return bmask, mask_mod


def mask_from_content(spec: SiteSpec, tensors: Sequence[Tensor], batch: int, heads: int):
    """(mask, mask_mod) for ``plan_attention`` / ``make_block_lists`` from the site's spec and one call's mask
    tensors."""
    if spec.static_mask:
        return spec.mask, None
    if spec.mask == "bool_mask":
        return _bool_mask(spec, tensors, batch, heads)
    assert spec.flex is not None, spec
    return _block_mask(spec.flex, tensors)


# ----------------------------------------------------------------------------- planning
def make_runner(spec: SiteSpec, layout: TokenSharding | None, q_shape: tuple, kv_shape: tuple, dtype: torch.dtype,
                device, tensors: Sequence[Tensor]) -> Runner:
    """Plan the site for this mask content (a collective across the site's ranks), or build its block lists."""
    B, H, S, D = q_shape
    mask, mask_mod = mask_from_content(spec, tensors, B, H)
    opts = spec.options
    if opts.world_size == 1:
        return make_block_lists(mask, q_len=S, kv_len=kv_shape[2], batch=B, num_heads=H, mask_mod=mask_mod,
                                block_size=opts.block_size, device=device)
    return plan_attention(mask, seqlen=S, num_heads=H, head_dim=D, num_kv_heads=kv_shape[1], batch=B, mesh=opts.mesh,
                          dtype=dtype, block_size=opts.block_size, mask_mod=mask_mod, method=opts.method,
                          options=opts.planner_options(), cost=opts.cost, timeout=opts.timeout,
                          layout=layout, planner=opts.planner, debug=opts.debug, score_mod=spec.score)


def plan_offline(spec: SiteSpec, tensors: Sequence[Tensor], *, nodes: int, devices: int
                 ) -> PlanResult | BlockLists:
    """Plan the site for ``nodes x devices`` ranks with the pure planner (no process group: ``ultraattn.explain``),
    or build its block lists for one rank."""
    B, H, S, D = spec.q_shape
    mask, mask_mod = mask_from_content(spec, tensors, B, H)
    if nodes * devices == 1:
        return make_block_lists(mask, q_len=S, kv_len=spec.kv_shape[2], batch=B, num_heads=H, mask_mod=mask_mod,
                                block_size=spec.options.block_size)
    pattern = to_block_pattern(mask, q_len=S, kv_len=S, block_size=spec.options.block_size, batch=B, num_heads=H)
    shape = AttnShape(seq_len=S, num_heads=H, head_dim=D, num_kv_heads=spec.kv_shape[1], batch=B)
    return plan(pattern, shape, Mesh(nodes=nodes, devices=devices), cost=spec.options.cost_model(),
                options=spec.options.planner_options(), planner=offline_planner(spec))


def offline_planner(spec: SiteSpec) -> str:
    """The planner ``options["planner"]`` picks for this site: "auto" is the ILP planner for a mask known at
    compile time and the fast planner for one met at run time (what ``plan_attention`` picks on a rank)."""
    return choose_planner(spec.options.planner, known_up_front=spec.static_mask)


def _plan_key(state: SiteState, q_shape, kv_shape, dtype, device, tensors: Sequence[Tensor]) -> str:
    """The plan cache's key: each mask tensor's content digest (read once per tensor object, ``TensorMemo``) with
    the mask kind, shapes, dtype, device and token layout."""
    spec = state.spec
    digests = [state.memo.get(t, "bytes", lambda t=t: content_digest([t])) for t in tensors]
    return content_digest([], (digests, spec.mask, tuple(q_shape), tuple(kv_shape), str(dtype), str(device),
                               repr(state.layout)))


def call_block_kinds(state: SiteState, tensors: Sequence[Tensor]) -> Tensor:
    """A run-time mask as its block table (int8 EMPTY / PARTIAL / FULL, on the host), what planning and block lists read
    instead of the mask: a boolean mask's from the graph's ``ultraattn::mask_block_kinds`` node (computed once per
    mask and step for every site after it) or reduced here on the mask's device (``dense_block_kinds``); a
    BlockMask's from its index lists, on their device (``block_table_kinds``). Once per mask object (``TensorMemo``:
    the layers of a step share it)."""
    spec, memo = state.spec, state.memo
    if spec.mask == "bool_mask":
        if len(tensors) > 1:
            return tensors[1]
        mask, block = tensors[0], spec.options.block_size
        return memo.get(mask, ("kinds", block), lambda: dense_block_kinds(mask, block, block).cpu())
    info = spec.flex
    (kvn, kvi, *full), _ = flex_tables(info, tensors)
    nq, nk = -(-info.q_len // info.q_block), -(-info.kv_len // info.kv_block)
    return memo.get(kvi, ("kinds", nq, nk), lambda: block_table_kinds(kvn, kvi, *(full or (None, None)), nq,
                                                                       nk).cpu())


def _dense_runner(state: SiteState, q_shape, kv_shape, device, tensors: Sequence[Tensor]) -> BlockLists:
    """World size 1, a boolean mask: its block table (``call_block_kinds``), the block lists of that table cached, and
    this mask's bit tiles packed on its device. The mask's S x S elements never reach the host."""
    block = state.spec.options.block_size
    mask = tensors[0]
    kinds = call_block_kinds(state, tensors)
    key = state.memo.get(kinds, ("dense block lists", tuple(q_shape), tuple(kv_shape), str(device), block),
                         lambda: content_digest([kinds], ("dense", tuple(q_shape), tuple(kv_shape), str(device),
                                                          block)))
    dense = state.plans.lookup(key)
    if dense is None:
        t0 = time.perf_counter()
        dense = dense_block_lists(kinds, q_len=q_shape[2], kv_len=kv_shape[2], batch=q_shape[0], num_heads=q_shape[1],
                                  q_block=block, kv_block=block, device=device)
        seconds = time.perf_counter() - t0
        state.plans.store(key, dense, seconds)
        state.observer.plan_made(plan_event(state, dense.lists, seconds))
    return dense.bits_of(mask)


def _flex_runner(state: SiteState, q_shape, kv_shape, device, tensors: Sequence[Tensor]) -> BlockLists:
    """World size 1, a BlockMask that arrives at run time: its block table (``call_block_kinds``), the block lists
    of that table cached, and this call's bit tiles evaluated from the mask_mod over the call's buffers on their device
    (``mod_bits``). The BlockMask's int32 lists and per-token buffers never reach the host; a mask with the blocks
    of one seen before builds nothing."""
    info = state.spec.flex
    (_, kvi, *_), buffers = flex_tables(info, tensors)
    B, H = q_shape[0], q_shape[1]
    element = ElementMask(flex_mask_mod(info, buffers))
    dep_b, dep_h = element.depends
    table = call_block_kinds(state, tensors)
    bm = B if dep_b or table.shape[0] > 1 else 1
    hm = H if dep_h or table.shape[1] > 1 else 1

    def lists_key() -> tuple[Tensor, str]:  # (once per table object and shape: the sites of a step share it)
        kinds = table.expand(bm, hm, *table.shape[2:]).clone()
        if info.kv_len % info.kv_block:  # a FULL tail block would be read past the keys: its bits bound it
            tail = kinds[..., -1]
            tail[tail == FULL] = PARTIAL
        return kinds, content_digest([kinds], ("flex", tuple(q_shape), tuple(kv_shape), str(device), info.q_block,
                                               info.kv_block))

    kinds, key = state.memo.get(table, ("flex block lists", tuple(q_shape), tuple(kv_shape), str(device), bm, hm),
                                lists_key)
    dense = state.plans.lookup(key)
    if dense is None:
        t0 = time.perf_counter()
        dense = dense_block_lists(kinds, q_len=q_shape[2], kv_len=kv_shape[2], batch=B, num_heads=H,
                                  q_block=info.q_block, kv_block=info.kv_block, device=device)
        seconds = time.perf_counter() - t0
        state.plans.store(key, dense, seconds)
        state.observer.plan_made(plan_event(state, dense.lists, seconds))
    anchor = buffers[0] if buffers else kvi
    return state.memo.get(anchor, ("bits", key), lambda: mod_bits(dense, element, hm))


def plan_event(state: SiteState, runner: Runner, seconds: float) -> PlanEvent:
    """What ``runner_for`` made for the site's call number ``state.calls``, in ``seconds`` on the step's path."""
    spec = state.spec
    if isinstance(runner, AttentionPlan):
        res = runner.planner_result
        return PlanEvent(site=spec.name, graph=spec.graph, rank=runner.rank, world=runner.world, seconds=seconds,
                         hash=runner.tile_plan.content_hash()[:16],
                         structure=str(runner.tile_plan.meta.get("structure")),
                         method=runner.tile_plan.method, comparison=method_summaries(res) if res is not None else None,
                         result=res, planner=runner.planner, ahead=runner.planned_ahead, call=state.calls,
                         regret=runner.tile_plan.meta.get("regret"))
    return PlanEvent(site=spec.name, graph=spec.graph, rank=0, world=1, seconds=seconds, hash="kernels",
                     structure=repr(runner), planner="kernels", call=state.calls)


def runner_for(state: SiteState, q_shape: tuple, kv_shape: tuple, dtype: torch.dtype, device,
               tensors: Sequence[Tensor]) -> Runner:
    """The cached runner for this call's mask content, else a new one (planned, reported, cached)."""
    spec = state.spec
    if spec.options.world_size == 1 and spec.mask == "bool_mask":
        return _dense_runner(state, q_shape, kv_shape, device, tensors)
    if spec.options.world_size == 1 and spec.mask == "block_mask" and not spec.static_mask:
        return _flex_runner(state, q_shape, kv_shape, device, tensors)
    key = _plan_key(state, q_shape, kv_shape, dtype, device, tensors)
    hit = state.plans.lookup(key)
    if hit is not None:
        return hit
    t0 = time.perf_counter()
    runner = make_runner(state.spec, state.layout, q_shape, kv_shape, dtype, device, tensors)
    seconds = time.perf_counter() - t0
    state.plans.store(key, runner, seconds)
    state.observer.plan_made(plan_event(state, runner, seconds))
    return runner


def global_shapes(spec: SiteSpec) -> tuple[tuple, tuple]:
    return tuple(spec.q_shape), tuple(spec.kv_shape)


def seed_plan(state: SiteState, dtype: torch.dtype, device, tensors: Sequence[Tensor]) -> AttentionPlan:
    """Plan the site now (a collective), letting the planner choose the token layout, and make that layout the
    site's: a sequence-sharded graph takes its layout from its first attention. The plan stays cached under it."""
    state.layout = None
    q_shape, kv_shape = global_shapes(state.spec)
    plan = runner_for(state, q_shape, kv_shape, dtype, device, tensors)
    assert isinstance(plan, AttentionPlan), plan
    state.layout = plan.layout
    state.plans.alias(_plan_key(state, q_shape, kv_shape, dtype, device, tensors), plan)
    return plan


def check_same_inputs(state: SiteState, tensors: Sequence[Tensor]) -> None:
    """The ``debug`` option: every rank of the group must call this site with the same tensors (a fingerprint
    through the process group's store); ranks that differ from rank 0 are named."""
    spec = state.spec
    call = state.calls
    bad = ranks_differing(f"ultraattn/debug/{spec.sync_key}/{call}", tensors, rank=dist.get_rank(),
                          world=dist.get_world_size(), timeout=spec.options.timeout)
    if bad:
        raise RuntimeError(
            f"ultraattn site {spec.name} (call {call}): rank(s) {bad} got different q/k/v or mask than rank 0. "
            f"Every rank of a context-parallel group must run the same batch: give all of them the same data "
            f"(same seed, no DistributedSampler across the CP group)")

