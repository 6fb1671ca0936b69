"""Public runtime API: plan an attention (moving shards and running it: ``runtime/tokens.py``).

    plan = ultraattn.plan_attention(mask, seqlen=S, num_heads=H, head_dim=D)   # collective
    q_local = ultraattn.dispatch(q, plan)                 # global -> this rank's tokens
    out_local, lse_local = ultraattn.dist_attention(q_local, k_local, v_local, plan)
    out = ultraattn.undispatch(out_local, plan)           # this rank's tokens -> global

Two planners (``planner=``): the ILP planner (masks known up front: "causal", "full", a
mask_mod) runs on the plan's rank 0 and its plan is broadcast, since its ILPs have wall-clock
limits; on first use every rank's mask, shapes, mesh and plan hashes are compared and a
difference is an error that names it. The fast planner (run-time masks: a BlockMask, a
BlockPattern) is deterministic, so every rank plans for itself in milliseconds, with no
broadcast; ``debug=True`` adds the hash comparison. ``plan_ahead(block_mask)`` plans a mask on a
worker thread before the step needs it (``runtime/online.py``).
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from ..masks.cells import BlockCells
from ..masks.pattern import BlockPattern
from ..masks.read import MaskRead, read_mask
from ..planner.api import baseline_plan, choose_planner
from ..planner.api import plan as run_planner
from ..planner.baselines import BASELINES, METHODS, REGISTRY, HeadsIndivisible, NotApplicable
from ..planner.cost import DEFAULT_COST, CostModel
from ..planner.fast import FastPlanner, planner_key
from ..planner.plan import AttnShape, Mesh, TilePlan, TokenSharding
from ..planner.profile import CostProfile, cost_model_of
from ..planner.program import ordered
from ..planner.robust import DEFAULT_BAND, Band
from ..planner.tiling import PlannerOptions
from .comm import GroupRef, resolve_group, store_exchange
from .costs import band_of, resolve_source
from .executor import Executor
from .online import ONLINE
from .sequence import SequenceShards
from .tiles import ScoreMod, TileGeometry, group_kind_grid
from .transport import transport_for

DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
Planner = Literal["auto", "fast", "ilp"]
PLANNERS = ("auto", "fast", "ilp")


@dataclass(eq=False)
class AttentionPlan:
    """A plan bound to this rank and its process group (what dispatch/dist_attention/undispatch take)."""

    tile_plan: TilePlan
    mask: MaskRead
    """The mask as read once (``masks/read.py``): its block structure (a dense ``BlockPattern``, or the ``BlockCells``
    the fast planner read, made dense when first needed: ``pattern``) and the element test of its PARTIAL blocks."""
    rank: int
    """This process's rank in the plan (position in the mesh, row-major)."""
    global_ranks: tuple[int, ...]
    """Global rank of each plan rank."""
    group_ref: GroupRef
    """The process group used for communication, held weakly (``group``; None at world size 1)."""
    dtype: torch.dtype
    timeout: float
    planning_seconds: float
    """Wall-clock seconds ``plan_attention`` spent making (or fetching) the plan on this rank."""
    planner_result: object = None
    """The ILP planner's ``PlanResult`` (on plan rank 0 only; None elsewhere, for baselines and fast plans)."""
    planner: str = "ilp"
    """Which planner made the plan: "fast", "ilp", or "baseline" (``method`` other than "ultraattn")."""
    planned_ahead: bool = False
    """The fast plan was made ahead of the call, on the worker thread (``plan_ahead``)."""
    verify: bool = True
    """Compare every rank's mask, shapes, mesh and plan hashes on first use (``check_consistent``)."""
    score_mod: ScoreMod | None = None
    """A FlexAttention score_mod every tile applies (``tiles.ScoreMod``); None: plain scores."""
    _executor: Executor | None = field(default=None, repr=False)
    _checked: bool = field(default=False, repr=False)
    _seq: SequenceShards | None = field(default=None, repr=False)

    @property
    def group(self):
        """Process group used for communication (None at world size 1); an error once it was destroyed."""
        return self.group_ref.get()

    @property
    def pattern(self) -> BlockPattern:
        """The mask's dense ``BlockPattern`` (made from the cells on first use for a fast plan)."""
        return self.mask.pattern

    @property
    def world(self) -> int:
        return self.tile_plan.world

    @property
    def shape(self) -> AttnShape:
        return self.tile_plan.shape

    @property
    def seq_len(self) -> int:
        return self.tile_plan.shape.seq_len

    @property
    def padded_len(self) -> int:
        return self.tile_plan.num_chunks * self.tile_plan.chunk_size

    @property
    def local_len(self) -> int:
        return self.tile_plan.chunks_per_rank * self.tile_plan.chunk_size

    @property
    def layout(self) -> TokenSharding:
        """Which rank holds which tokens (``dispatch``/``undispatch`` follow it)."""
        return self.tile_plan.layout

    @property
    def seq(self) -> SequenceShards:
        """The layout bound to this rank and group: shards and gathers along any dimension."""
        if self._seq is None:
            self._seq = SequenceShards(self.layout, rank=self.rank, global_ranks=self.global_ranks,
                                       group_ref=self.group_ref, timeout=self.timeout)
        return self._seq

    @property
    def executor(self) -> Executor:
        if self._executor is None:
            self._executor = _make_executor(self)
        return self._executor

    @property
    def comm_log(self) -> dict:
        """Messages of the last forward ('fwd') and backward ('bwd') on this rank (``CommLog`` per phase)."""
        return self.executor.log

    def local_token_index(self, rank: int | None = None) -> Tensor:
        """Global (padded) token positions held by ``rank`` (default: this rank), in local order."""
        tp = self.tile_plan
        r = self.rank if rank is None else rank
        c = tp.chunk_size
        return torch.cat([torch.arange(i * c, (i + 1) * c) for i in tp.local_chunks(r)])

    def predicted_bytes(self, phase: str) -> dict[str, int]:
        """Bytes this rank sends and receives in ``phase`` according to the plan."""
        sent = sum(t.nbytes for t in self.tile_plan.transfers if t.phase == phase and t.src == self.rank)
        recv = sum(t.nbytes for t in self.tile_plan.transfers if t.phase == phase and t.dst == self.rank)
        return {"sent": sent, "recv": recv}

    def __repr__(self) -> str:
        return (f"AttentionPlan(rank={self.rank}/{self.world}, method={self.tile_plan.method!r}, "
                f"planner={self.planner!r}, mask={self.mask.blocks.name!r}, seq_len={self.seq_len}, "
                f"local_len={self.local_len})")


# ----------------------------------------------------------------------------- process group / mesh
def _resolve_planner(planner: str, mask, method: str) -> str:
    """auto: the fast planner for masks whose content arrives at run time (a BlockMask, BlockCells or a
    BlockPattern: new every batch for packed documents), the ILP planner for masks known up front ("causal",
    "full", a mask_mod: planned once, worth seconds)."""
    if planner not in PLANNERS:
        raise ValueError(f"`planner` must be one of {', '.join(map(repr, PLANNERS))}, got {planner!r}")
    if method != "ultraattn":
        return "baseline"
    if planner == "ilp" and isinstance(mask, BlockCells):
        raise ValueError("planner='ilp' needs a BlockMask, BlockPattern, mask_mod or string mask, got BlockCells; "
                         "pass the BlockMask or use planner='fast'")
    return choose_planner(planner, known_up_front=not isinstance(mask, (BlockMask, BlockCells, BlockPattern)))


# ----------------------------------------------------------------------------- planning
def plan_attention(
    mask,
    *,
    seqlen: int,
    num_heads: int,
    head_dim: int,
    num_kv_heads: int | None = None,
    batch: int = 1,
    mesh=None,
    group=None,
    dtype: torch.dtype = torch.bfloat16,
    block_size: int = 128,
    mask_mod: Callable | None = None,
    method: str = "ultraattn",
    options: PlannerOptions | None = None,
    cost: CostModel | CostProfile | str | os.PathLike = DEFAULT_COST,
    timeout: float = 300.0,
    layout: TokenSharding | None = None,
    planner: Planner = "auto",
    debug: bool = False,
    score_mod: Callable | ScoreMod | None = None,
) -> AttentionPlan:
    """Plan one attention for the ranks of ``mesh`` / ``group`` (every rank calls it; with the ILP planner it is a
    collective: rank 0 plans and broadcasts).

    Args:
        mask: a FlexAttention ``BlockMask``, a mask_mod, ``"causal"``/``"full"``, a ``BlockPattern`` or
            ``BlockCells``.
        seqlen, num_heads, head_dim, num_kv_heads, batch, dtype: the attention's shapes; GQA when
            ``num_kv_heads`` divides ``num_heads``.
        mesh: a 1-D DeviceMesh (one node) or 2-D (nodes x devices); None: the group as one node.
        group: process group (default: the world); None and no initialised torch.distributed: one process.
        block_size: pattern block size for a mask_mod or a string mask (a BlockMask keeps its own).
        mask_mod: element mask for a ``BlockPattern`` with PARTIAL blocks.
        method: "ultraattn" (planned) or a baseline executed by the same runtime (``planner.baselines.BASELINES``:
            "ring", "zigzag", "allgather", "ulysses", "usp").
        options: planner settings.
        cost: the cost model: a ``CostModel``, a ``CostProfile`` (``ultraattn.calibrate``), a profile's path, or
            ``"auto"``: this machine's calibrated profile, cached under the user's cache directory and measured
            first (a collective, about a minute) when there is none (``runtime/calibrate.py``). A path or
            ``"auto"`` is resolved once per process and configuration (``"auto"`` by ``ultraattn.plan_attention``,
            ``runtime/entry.py``, which hands this function the profile).
        timeout: seconds any rank waits for a peer before failing with the peer's name.
        layout: a given ``TokenSharding`` (which rank holds which token chunks): the plan keeps it and
            chooses only where tiles run and what moves. A sequence-sharded model passes its
            activations' layout, so attention needs no re-distribution. A baseline ``method`` has a
            layout of its own: it must be the same.
        planner: "fast" (``planner.fast``: deterministic, milliseconds, every rank plans for itself), "ilp"
            (hierarchical ILPs: seconds, rank 0 plans and broadcasts) or "auto": fast for a BlockMask, BlockCells
            or BlockPattern (content known at run time), ILP for "causal", "full" and mask_mods.
        debug: also compare every rank's fast plan (hashes of mask, shapes, mesh and plan, through the store) on
            first use; a rank that differs is named. ILP and baseline plans are always compared.
        score_mod: a FlexAttention score_mod ``fn(score, b, h, q_idx, kv_idx)`` every tile applies with global
            indices (or a ``runtime.tiles.ScoreMod`` with buffers, as the compiler backend passes them). Tiles with
            a score_mod run in plain torch on every device (``tiles.ScoreMod``'s note).

    Returns:
        The ``AttentionPlan``; ``planner``, ``planning_seconds`` and ``planned_ahead`` say how it was made
        (``tile_plan.meta``: the structure chosen, and for fast plans ``planning_ms`` and every candidate's price).
    """
    for nm, val in (("seqlen", seqlen), ("num_heads", num_heads), ("head_dim", head_dim), ("batch", batch),
                    ("block_size", block_size)):
        if not isinstance(val, int) or isinstance(val, bool) or val < 1:
            raise ValueError(f"`{nm}` must be a positive int, got {val!r}")
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"`dtype` must be one of torch.bfloat16, torch.float16, torch.float32, got {dtype}")
    if method not in METHODS:
        raise ValueError(f"`method` must be one of {', '.join(METHODS)}, got {method!r}")
    if not timeout > 0:
        raise ValueError(f"`timeout` must be positive seconds, got {timeout!r}")
    if not isinstance(debug, bool):
        raise TypeError(f"`debug` must be True or False, got {debug!r}")
    if score_mod is not None and not isinstance(score_mod, ScoreMod):
        if not callable(score_mod):
            raise TypeError(f"ultraattn: `score_mod` must be a FlexAttention score_mod (a callable) or None, got "
                            f"{score_mod!r}")
        score_mod = ScoreMod(fn=score_mod)
    which = _resolve_planner(planner, mask, method)
    shape = AttnShape(seq_len=seqlen, num_heads=num_heads, head_dim=head_dim, num_kv_heads=num_kv_heads,
                      batch=batch, dtype=DTYPE_NAMES[dtype])
    pmesh, ranks, comm_group, me = resolve_group(mesh, group)
    _check_method(method, shape, pmesh)  # on every rank, before any communication
    cost, band = _cost_model(cost)
    t0 = time.perf_counter()
    # the one read of the mask: its blocks for the planner, its element test for the tiles (masks/read.py)
    read = read_mask(mask, q_len=seqlen, batch=batch, num_heads=num_heads, block_size=block_size, mask_mod=mask_mod,
                     sparse=which == "fast", read_cells=ONLINE.cells)
    if read.blocks.num_batch_patterns not in (1, batch):
        raise ValueError(f"the mask has {read.blocks.num_batch_patterns} batch entries but batch={batch}")
    if which == "fast":
        ap = _plan_fast(read, shape=shape, pmesh=pmesh, ranks=ranks, comm_group=comm_group, me=me, dtype=dtype,
                        options=options or PlannerOptions(), cost=cost, timeout=timeout, layout=layout, debug=debug,
                        band=band, t0=t0)
    else:
        ap = _plan_ilp(read, which=which, shape=shape, pmesh=pmesh, ranks=ranks, comm_group=comm_group, me=me,
                       dtype=dtype, method=method, options=options, cost=cost, timeout=timeout, layout=layout, t0=t0)
    ap.score_mod = score_mod   # (the plan does not depend on it: only the tiles apply it)
    return ap


def _cost_model(cost) -> tuple[CostModel, Band]:
    """``cost`` as a ``CostModel``, and the band the fast planner chooses robustly over (a profile's fit errors, else
    the default: ``runtime.costs.band_of``); a path is read once per process (``ONLINE.cost_model``). ``"auto"``
    arrives resolved (``runtime/entry.py``); here it is an error that says where it is resolved."""
    if isinstance(cost, str | os.PathLike) and cost != "auto":
        path = os.path.abspath(os.fspath(cost))
        stamp = os.stat(path).st_mtime_ns if os.path.exists(path) else None
        src = ONLINE.cost_model(("path", path, stamp), lambda: resolve_source(path))
    else:
        src = resolve_source(cost)   # a model or a profile; "auto" or anything else raises, naming `cost`
    return cost_model_of(src), band_of(src)


def _check_method(method: str, shape: AttnShape, pmesh: Mesh) -> None:
    """Refuse a baseline that cannot run this configuration, on every rank alike and before any rank communicates
    (else rank 0 alone would find out while planning and the others would learn it from its broadcast)."""
    if method not in REGISTRY:
        return
    try:
        REGISTRY[method].check(pmesh, shape)
    except HeadsIndivisible:
        w = pmesh.world
        which = " and ".join(f"{nm}={n}" for nm, n in (("num_heads", shape.num_heads),
                                                        ("num_kv_heads", shape.kv_heads)) if n % w)
        raise ValueError(
            f"method={method!r} gives each of the {w} ranks an equal share of the heads, but the world size {w} "
            f"does not divide {which}; use a process group (or mesh) whose size divides num_heads and "
            f"num_kv_heads, or method='usp' (Ulysses inside a node, a ring across) or 'ultraattn' (any head count)"
        ) from None
    except NotApplicable as exc:
        raise ValueError(f"method={method!r} cannot run this configuration: {exc}; use method='ultraattn' "
                         f"(it plans for any configuration)") from None


def _plan_ilp(read: MaskRead, *, which: str, shape: AttnShape, pmesh: Mesh, ranks, comm_group, me: int,
              dtype: torch.dtype, method: str, options: PlannerOptions | None, cost: CostModel, timeout: float,
              layout: TokenSharding | None, t0: float) -> AttentionPlan:
    """Rank 0 plans with the ILP planner (or builds the baseline ``method``) and broadcasts the plan."""
    pattern = read.pattern
    result = None
    tile_plan = None
    error = None
    if me == 0:
        try:
            if method == "ultraattn":
                result = run_planner(pattern, shape, pmesh, cost=cost, options=options or PlannerOptions(),
                                     baselines=BASELINES, layout=layout)
                tile_plan = result.plan
            else:
                tile_plan = ordered(baseline_plan(method, pattern, shape, pmesh), pattern, cost)
                if layout is not None and tile_plan.layout != layout:
                    raise ValueError(f"method={method!r} holds tokens as {tile_plan.layout.to_string()}, not in the "
                                     f"given layout {layout.to_string()}; use method='ultraattn' (it plans in any "
                                     f"layout) or the layout of the {method} plan")
        except Exception as exc:  # noqa: BLE001 - re-raised on every rank below, so none waits forever
            error = exc
    if comm_group is not None and pmesh.world > 1:
        # plan on rank 0, broadcast: ranks agree even though the ILPs have wall-clock limits
        box = [(tile_plan, None if error is None else (type(error).__name__, str(error)))]
        dist.broadcast_object_list(box, src=ranks[0], group=comm_group)
        tile_plan, err = box[0]
        if err is not None and error is None:
            error = RuntimeError(f"planning failed on rank 0: {err[0]}: {err[1]}")
    if error is not None:
        raise error
    seconds = time.perf_counter() - t0
    if which == "ilp":
        tile_plan.meta.setdefault("planner", "ilp")
    ap = AttentionPlan(tile_plan=tile_plan, mask=read, rank=me, global_ranks=ranks,
                       group_ref=GroupRef(comm_group if pmesh.world > 1 else None), dtype=dtype, timeout=timeout,
                       planning_seconds=seconds, planner_result=result, planner=which)
    _check_chunking(ap)
    return ap


def _plan_fast(read: MaskRead, *, shape: AttnShape, pmesh: Mesh, ranks, comm_group, me: int, dtype: torch.dtype,
               options: PlannerOptions, cost: CostModel, timeout: float, layout: TokenSharding | None, debug: bool,
               band: Band = DEFAULT_BAND, t0: float) -> AttentionPlan:
    """Every rank plans for itself with the fast planner (no broadcast: the plan is a pure function)."""
    cells = read.cells
    key = planner_key(shape, pmesh, cost, layout, options.balance_tol, True, BASELINES, band)
    fp = ONLINE.planner(key, lambda: FastPlanner(shape=shape, mesh=pmesh, cost=cost, layout=layout,
                                                 balance_tol=options.balance_tol, band=band))
    tile_plan, ahead = ONLINE.plan(fp, cells)
    ap = AttentionPlan(tile_plan=tile_plan, mask=read, rank=me, global_ranks=ranks,
                       group_ref=GroupRef(comm_group if pmesh.world > 1 else None), dtype=dtype, timeout=timeout,
                       planning_seconds=time.perf_counter() - t0, planner="fast", planned_ahead=ahead,
                       verify=debug)
    _check_chunking(ap)
    return ap


def _check_chunking(ap: AttentionPlan) -> None:
    tp, pat = ap.tile_plan, ap.mask.blocks
    if tp.chunk_size % pat.q_block or tp.chunk_size % pat.kv_block:
        raise ValueError(
            f"chunk size {tp.chunk_size} must be a multiple of the mask's blocks ({pat.q_block}, {pat.kv_block}); "
            f"use equal Q and KV block sizes"
        )


def _make_executor(ap: AttentionPlan) -> Executor:
    tp = ap.tile_plan
    s = tp.shape
    pb_q = ap.padded_len // ap.pattern.q_block
    pb_k = ap.padded_len // ap.pattern.kv_block
    g_count = tp.num_head_groups
    hq = s.num_heads // g_count
    kinds = [group_kind_grid(ap.pattern, range(g * hq, (g + 1) * hq), pb_q, pb_k) for g in range(g_count)]
    geo = TileGeometry(seq_len=s.seq_len, chunk=tp.chunk_size, q_block=ap.pattern.q_block,
                       kv_block=ap.pattern.kv_block, batch=s.batch, num_heads=s.num_heads, num_kv_heads=s.kv_heads,
                       head_groups=g_count, head_dim=s.head_dim, kind_gQK=kinds, element=ap.mask.element,
                       pattern=ap.pattern, score_mod=ap.score_mod)
    transport = (transport_for(rank=ap.rank, global_ranks=ap.global_ranks, group_ref=ap.group_ref,
                               timeout=ap.timeout) if ap.world > 1 else None)
    return Executor(tp, ap.rank, geo, transport, ap.dtype)


# ----------------------------------------------------------------------------- consistency check
_CHECK_FIELDS = ("mask pattern", "shape and dtype", "mesh and ranks", "plan")


def _digests(ap: AttentionPlan) -> Tensor:
    s = ap.shape
    parts = [
        ap.mask.blocks.content_hash(),
        repr((s.seq_len, s.num_heads, s.head_dim, s.kv_heads, s.batch, s.dtype)),
        repr((ap.tile_plan.mesh.nodes, ap.tile_plan.mesh.devices, ap.global_ranks)),
        ap.tile_plan.content_hash(),
    ]
    raw = b"".join(hashlib.sha256(p.encode()).digest()[:8] for p in parts)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def check_consistent(ap: AttentionPlan) -> None:
    """All ranks must hold the same mask, shapes, mesh and plan; raises naming the ranks and fields that differ,
    or the ranks that never arrive (through the process group's store, with the plan's timeout). A fast plan
    made without ``debug`` is not compared (every rank made it alone from the same inputs)."""
    if ap._checked or not ap.verify:
        return
    if ap.world > 1:
        if not dist.is_initialized():
            raise RuntimeError(f"the plan is for {ap.world} ranks but torch.distributed is not initialised")
        _CHECK_COUNT[ap.global_ranks] = n = _CHECK_COUNT.get(ap.global_ranks, 0) + 1
        key = f"ultraattn/check/{'-'.join(map(str, ap.global_ranks))}/{n}"
        values = store_exchange(key, bytes(_digests(ap).tolist()), rank=ap.rank, world=ap.world, timeout=ap.timeout)
        width = 8
        ref = values[0]
        problems = []
        for p in range(1, ap.world):
            diff = [f for n_, f in enumerate(_CHECK_FIELDS)
                    if ref[n_ * width:(n_ + 1) * width] != values[p][n_ * width:(n_ + 1) * width]]
            if diff:
                problems.append(f"rank {p} differs from rank 0 in: {', '.join(diff)}")
        if problems:
            raise ValueError(f"rank {ap.rank}: ranks planned different attentions: " + "; ".join(problems) +
                             " (every rank must call plan_attention with the same mask and shapes)")
    ap._checked = True


_CHECK_COUNT: dict[tuple[int, ...], int] = {}
"""Consistency checks so far per rank set (every rank checks its plans in the same order). Deliberately not process
state that ``ultraattn.reset()`` clears (``cache.process_state``): it numbers the keys the check writes in the process
group's store, which outlive any reset, so counting again from 0 would read another check's values."""
