"""Planner entry points: build plans, evaluate them, compare with the baselines.

    result = plan(pattern, shape, mesh, backward=True)      # -> PlanResult
    result.plan            # the chosen TilePlan ("ultraattn")
    result.evaluations     # method -> Evaluation (ours and every baseline)

Every plan, ours and the baselines', is replayed by one simulator and one cost model.
The planner's answer is the best of its hierarchical ILP plan and the baseline-
structured plans (the issue's rule: when a baseline's plan is better, find that plan or
better); ``meta["structure"]`` says which won.
"""

from __future__ import annotations

import dataclasses
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Literal

import torch

from ..cache import gc_paused
from ..masks.pattern import BlockPattern
from .baselines import BASELINES, NotApplicable, baseline_of
from .build import BATCHES, group_kernels, make_plan, route_transfers
from .cost import DEFAULT_COST, CostModel, block_flops
from .fast import FastPlanner
from .ilp import SolveInfo, have_pulp, require_pulp
from .launches import timed_kernels
from .plan import AttnShape, Mesh, TilePlan, TokenSharding, padded_chunk
from .program import replay_executed, run_order, with_order
from .schedule import Schedule, Workload, build_graph, simulate, workload
from .schedule_ilp import refine_schedule
from .tiling import PlannerOptions, TilingResult, tile

#: the balance tolerance of the refinement pass (``PlannerOptions.refine_over``)
REFINED_TOL = 0.02
#: the optional passes after the first plan (timed launches, the refinement) start only while planning has used less
#: than this many ``PlannerOptions.time_budget``s: on 32x8 at 2M tokens they took 47 s and 56 s on top of a 20 s plan
OPTIONAL_BUDGETS = 2.0


def check_layout(layout: TokenSharding, pattern: BlockPattern, shape: AttnShape, mesh: Mesh) -> None:
    """A given token layout must fit the mesh, cover the sequence and cut it on block boundaries."""
    if not isinstance(layout, TokenSharding):
        raise TypeError(f"`layout` must be a TokenSharding, got {type(layout).__name__}")
    if layout.world != mesh.world:
        raise ValueError(f"the layout spreads tokens over {layout.world} ranks but the mesh has {mesh.world}")
    if layout.padded_len < shape.seq_len:
        raise ValueError(f"the layout covers {layout.padded_len} tokens, fewer than seq_len={shape.seq_len}")
    if layout.chunk_size % pattern.q_block or layout.chunk_size % pattern.kv_block:
        raise ValueError(f"the layout's chunk size {layout.chunk_size} is not a multiple of the mask's blocks "
                         f"({pattern.q_block}, {pattern.kv_block}); use mask blocks that divide it")


@dataclass(slots=True)
class Evaluation:
    """A plan replayed by the simulator, with the per-rank facts reports need."""

    plan: TilePlan
    fwd: Schedule
    bwd: Schedule | None
    rank_rows: list[dict]
    fwd_ms: float
    bwd_ms: float | None
    max_rank_bytes: int
    max_rank_inter_node_bytes: int
    compute_imbalance: float

    def summary(self) -> dict:
        return {"fwd_ms": self.fwd_ms, "bwd_ms": self.bwd_ms, "max_rank_bytes": self.max_rank_bytes,
                "max_rank_inter_node_bytes": self.max_rank_inter_node_bytes,
                "compute_imbalance": self.compute_imbalance}

    def total_ms(self) -> float:
        """Forward + backward; the forward alone where the backward was not replayed (``evaluate(backward=False)``):
        what the planner minimises either way."""
        return self.fwd_ms + (self.bwd_ms or 0.0)


def rank_bytes(plan: TilePlan, phases=("fwd", "bwd")) -> dict[int, dict[str, int]]:
    """Bytes each rank sends and receives, split intra/inter node (exact, from the transfers)."""
    out = {r: {"intra_in": 0, "intra_out": 0, "inter_in": 0, "inter_out": 0} for r in range(plan.world)}
    for t in plan.transfers:
        if t.phase not in phases:
            continue
        kind = "intra" if plan.mesh.same_node(t.src, t.dst) else "inter"
        out[t.src][f"{kind}_out"] += t.nbytes
        out[t.dst][f"{kind}_in"] += t.nbytes
    return out


def evaluate(plan: TilePlan, pattern: BlockPattern, *, cost: CostModel = DEFAULT_COST, backward: bool = True,
             fwd_priority=None, executed: bool = False) -> Evaluation:
    """The plan replayed by the simulator (``schedule``); ``executed``: as the executor runs it, each rank's program
    (``program.executed_graph``) in the plan's run order, or in the order of this replay where the plan has none
    (the order ``plan_attention`` gives it)."""
    work = workload(pattern, plan.shape, num_chunks=plan.num_chunks, head_groups=plan.num_head_groups,
                    chunk=plan.chunk_size)

    def replay(phase: str, priority=None) -> Schedule:
        graph = build_graph(plan, work, cost, phase)
        order = plan.order.get(phase) if executed else None
        if order is None:   # (the plain replay: the result, or where the plan has no order, the order)
            sched = simulate(graph, priority)
            if not executed:
                return sched
            order = run_order(sched)
        return replay_executed(plan, graph, order, cost)

    with gc_paused():   # (as ``FastPlanner.plan``: the replays' many small objects set off collections of the heap)
        fwd = replay("fwd", fwd_priority)
        bwd = replay("bwd") if backward else None
    g_f = fwd.graph
    phases = ("fwd", "bwd") if backward else ("fwd",)
    rb = rank_bytes(plan, phases)
    comp = defaultdict(float)  # modeled kernel seconds
    for t in g_f.tasks:
        if t.kind == "attn":
            comp[t.rank] += t.duration
    total = sum(comp.values()) or 1.0
    imbalance = work_imbalance(plan, work, cost)
    kernels = defaultdict(int)
    for k in plan.kernels:
        kernels[k.rank] += 1
    rows = []
    for r in range(plan.world):
        b = rb[r]
        rows.append({"rank": r, "node": plan.mesh.node_of(r), "compute_share": comp[r] / total,
                     "compute_ms": comp[r] * 1e3, "intra_in_bytes": b["intra_in"], "intra_out_bytes": b["intra_out"],
                     "inter_in_bytes": b["inter_in"], "inter_out_bytes": b["inter_out"], "kernels": kernels[r]})
    per_rank = [max(b["intra_in"] + b["inter_in"], b["intra_out"] + b["inter_out"]) for b in rb.values()]
    per_rank_inter = [max(b["inter_in"], b["inter_out"]) for b in rb.values()]
    return Evaluation(plan=plan, fwd=fwd, bwd=bwd, rank_rows=rows, fwd_ms=fwd.makespan * 1e3,
                      bwd_ms=bwd.makespan * 1e3 if bwd else None, max_rank_bytes=max(per_rank),
                      max_rank_inter_node_bytes=max(per_rank_inter),
                      compute_imbalance=imbalance)


def work_imbalance(plan: TilePlan, work: Workload, cost: CostModel) -> float:
    """Max over mean of per-rank work (FLOPs, PARTIAL blocks at their overhead): the quantity the
    planner balances. Modeled seconds would also carry launch overheads and small-tile efficiency."""
    blocks = work.cell_blocks(cost)
    per_rank = torch.zeros(plan.world, dtype=torch.float64)
    per_rank.index_add_(0, plan.assign_GPP.clamp(min=0).flatten().long(),
                        torch.where(plan.assign_GPP >= 0, blocks, 0.0).flatten())
    mean = float(per_rank.mean())
    return float(per_rank.max()) / mean if mean > 0 else 1.0


def lower_bound_ms(plan: TilePlan, pattern: BlockPattern, *, cost: CostModel = DEFAULT_COST,
                   backward: bool = True) -> float:
    """A makespan no schedule of ``plan`` can beat: per rank and phase, the busiest of its compute
    stream and its four link streams (bytes / bandwidth), summed over phases. Cheap: no simulation."""
    work = workload(pattern, plan.shape, num_chunks=plan.num_chunks, head_groups=plan.num_head_groups,
                    chunk=plan.chunk_size)
    total = 0.0
    for phase in (("fwd", "bwd") if backward else ("fwd",)):
        busy = defaultdict(float)
        for k in plan.kernels:
            busy[(k.rank, "compute")] += work.kernel_seconds(k.head_group, k.cells, cost, phase)
        for t in plan.transfers_for(phase):
            inter = not plan.mesh.same_node(t.src, t.dst)
            d = cost.message_seconds(t.nbytes, inter_node=inter)
            link = "inter" if inter else "intra"
            busy[(t.src, "send_" + link)] += d
            busy[(t.dst, "recv_" + link)] += d
        total += max(busy.values(), default=0.0)
    return total * 1e3


def compute_bound_ms(pattern: BlockPattern, shape: AttnShape, mesh: Mesh, *, cost: CostModel = DEFAULT_COST,
                     backward: bool = True) -> float:
    """The compute bound: every cost-weighted block (PARTIAL at its overhead) at the kernel rate, every non-empty
    query block row launched once, spread evenly over the mesh with nothing moved. No plan's modeled time is below
    it: a kernel's time is ``launches x launch + flops / rate x (1 + half / L)`` with ``L`` its keys per row, so its
    efficiency term is at least ``half`` x its query block rows' worth of work (each row in it counts once, PARTIAL
    blocks only add), and every non-empty row is in some kernel. A plan's time over it is what imbalance,
    communication not hidden, split rows and launches cost."""
    work = workload(pattern, shape, num_chunks=1)
    blocks = float(work.cell_blocks(cost).sum())
    per_group = pattern.heads_per_group(shape.num_heads)
    batch = shape.batch if pattern.num_batch_patterns == 1 else 1
    live = (pattern.kind_BGQK != 0).any(-1).sum(-1).to(torch.float64)   # [B, G] non-empty block rows
    rows = float((live * torch.tensor(per_group, dtype=torch.float64)).sum()) * batch
    if blocks == 0:
        return 0.0
    flops = blocks * block_flops(pattern.q_block, pattern.kv_block, shape.head_dim, 1, 1)
    phases = ("fwd", "bwd") if backward else ("fwd",)
    sec = sum(cost.kernel_seconds(flops=flops, kv_tokens_per_row=blocks * pattern.kv_block / rows, phase=ph)
              - cost.launch_us * 1e-6 for ph in phases)
    return sec * 1e3 / mesh.world / cost.alone_speedup


def baseline_plan(name: str, pattern: BlockPattern, shape: AttnShape, mesh: Mesh, *, backward: bool = True) -> TilePlan:
    """One baseline's plan (``baselines.REGISTRY``); raises ``NotApplicable`` with the reason when it cannot run."""
    base = baseline_of(name)
    p, _g = base.grid(mesh, shape)
    return base.tile_plan(pattern, mesh=mesh, shape=shape, chunk=padded_chunk(shape.seq_len, p, pattern.q_block),
                          backward=backward)


@dataclass(slots=True)
class PlanResult:
    plan: TilePlan
    evaluations: dict[str, Evaluation]
    not_applicable: dict[str, str]
    solver: dict
    seconds: float
    pattern: BlockPattern
    notes: list[str] = field(default_factory=list)
    compute_bound_ms: float | None = None
    """The compute bound of the planned phases (``compute_bound_ms``): what the plan's modeled time is held to."""

    @property
    def ours(self) -> Evaluation:
        return self.evaluations["ultraattn"]

    def best_baseline(self, backward: bool = True) -> tuple[str, Evaluation] | None:
        base = {k: v for k, v in self.evaluations.items() if k != "ultraattn"}
        if not base:
            return None
        key = (lambda e: e.total_ms()) if backward else (lambda e: e.fwd_ms)
        name = min(base, key=lambda k: key(base[k]))
        return name, base[name]


def choose_planner(requested: str, *, known_up_front: bool) -> Literal["ilp", "fast"]:
    """The planner that runs for ``requested`` ('auto', 'ilp', 'fast'): auto is the ILP planner for a
    mask known up front (planned once, worth seconds) and the fast one for a mask met at run time, or
    wherever PuLP is not installed. 'ilp' without PuLP is an error that says how to get it."""
    if requested == "auto":
        return "ilp" if known_up_front and have_pulp() else "fast"
    if requested == "ilp":
        require_pulp("planner='ilp'")
    return requested


def plan(pattern: BlockPattern, shape: AttnShape, mesh: Mesh, *, cost: CostModel = DEFAULT_COST,
         options: PlannerOptions = PlannerOptions(), backward: bool = True, baselines=BASELINES,
         progress=None, layout: TokenSharding | None = None, planner: Literal["ilp", "fast"] = "ilp") -> PlanResult:
    """Plan one attention on ``mesh`` and compare it with the baselines (module docstring).

    ``layout``: a given token layout (the sequence-sharding pass keeps every attention of a
    graph in one): ownership is fixed, the levels choose where cells are computed and where
    foreign data lands; a baseline-structured plan is adopted only if it has the same layout.

    ``planner``: "ilp" (this module's hierarchical ILPs) or "fast" (``planner.fast``: no ILP, no
    simulation in the decision; the comparison with the baselines is simulated afterwards).
    ``solver["planner"]`` says which ran.
    """
    if layout is not None:
        check_layout(layout, pattern, shape, mesh)
    if planner not in ("ilp", "fast"):
        raise ValueError(f"`planner` must be 'ilp' or 'fast', got {planner!r}")
    if planner == "fast":
        return _plan_fast(pattern, shape, mesh, cost=cost, options=options, backward=backward, baselines=baselines,
                          layout=layout)
    require_pulp("planner='ilp'")
    t0 = time.perf_counter()
    if layout is not None:
        options = dataclasses.replace(options, chunks_per_rank=layout.chunks_per_rank)
    ev_ours, tiling = _tiled_plan(pattern, shape, mesh, cost=cost, options=options, backward=backward,
                                  progress=progress, layout=layout)
    sched_info = SolveInfo(name="schedule", status="Skipped", note="disabled")
    if options.schedule_ilp:
        if progress:
            progress("schedule ILP")
        ev_ours, sched_info = refine_schedule(ev_ours, time_limit=options.schedule_time_limit)
    key = Evaluation.total_ms
    # candidates: a baseline-structured plan is simulated during planning only when its lower
    # bound beats our plan; the rest are simulated afterwards, for the comparison alone
    if progress:
        progress("baseline candidates")
    chosen = ev_ours
    notes = []
    evals: dict[str, Evaluation] = {}
    na: dict[str, str] = {}
    deferred: dict[str, TilePlan] = {}
    for name in baselines:
        try:
            bp = baseline_plan(name, pattern, shape, mesh, backward=backward)
        except NotApplicable as exc:
            na[name] = str(exc)
            continue
        balanced = work_imbalance(bp, workload(pattern, shape, num_chunks=bp.num_chunks, chunk=bp.chunk_size,
                                               head_groups=bp.num_head_groups), cost) <= 1 + options.balance_tol + 1e-9
        same_layout = layout is None or bp.layout == layout
        if (options.consider_baselines and balanced and same_layout
                and lower_bound_ms(bp, pattern, cost=cost, backward=backward) < key(chosen)):
            ev = evaluate(bp, pattern, cost=cost, backward=backward)
            evals[name] = ev
            if key(ev) < key(chosen) * (1 - 1e-9) and ev.compute_imbalance <= 1 + options.balance_tol + 1e-9:
                chosen = ev
        else:
            deferred[name] = bp
    if chosen is not ev_ours:
        notes.append(f"the {chosen.plan.method}-structured plan models faster than the tiled plan "
                     f"({key(chosen):.3f} ms vs {key(ev_ours):.3f} ms): adopted")
        chosen = evaluate(as_ours(chosen.plan), pattern, cost=cost, backward=backward)
    if progress:
        progress("kernel batches")
    bound = compute_bound_ms(pattern, shape, mesh, cost=cost, backward=backward)
    deadline = t0 + OPTIONAL_BUDGETS * options.time_budget
    chosen, launch_notes = _launches(chosen, pattern, cost=cost, backward=backward,
                                     timed_over=options.refine_over and options.refine_over * bound, deadline=deadline)
    notes.extend(launch_notes)
    finer_fits = mesh.world * 2 * options.chunks_per_rank * pattern.q_block <= pattern.q_len
    late = time.perf_counter() > deadline
    if late and options.refine_over and key(chosen) > options.refine_over * bound:
        notes.append(f"no refinement: planning used {time.perf_counter() - t0:.1f} s, over {OPTIONAL_BUDGETS:g}x "
                     f"the time budget ({options.time_budget:g} s)")
    if (options.refine_over and layout is None and finer_fits and not late
            and key(chosen) > options.refine_over * bound):
        # [Note] refinement: far from the compute bound, the tolerance itself (the ILPs spend it on traffic) and the
        # chunk size are what is left; plan once more on chunks half as long with a tighter tolerance, in a quarter
        # of the time budget, and keep the faster (global+local at 8x8, 512K: 1.38x -> 1.10x)
        finer = dataclasses.replace(options, chunks_per_rank=2 * options.chunks_per_rank,
                                    balance_tol=min(options.balance_tol, REFINED_TOL),
                                    time_budget=options.time_budget / 4,
                                    ilp_time_limit=min(options.ilp_time_limit, 1.0),
                                    heuristic_seconds=options.heuristic_seconds / 4, schedule_ilp=False,
                                    ilp_max_binaries=options.ilp_max_binaries // 4)
        if progress:
            progress(f"refining ({key(chosen) / bound:.2f}x the compute bound)")
        ev2, _ = _tiled_plan(pattern, shape, mesh, cost=cost, options=finer, backward=backward, progress=progress,
                             layout=None)
        ev2, _ = _launches(ev2, pattern, cost=cost, backward=backward, timed_over=options.refine_over * bound,
                           deadline=deadline)
        if key(ev2) < key(chosen) * (1 - 1e-9) and ev2.compute_imbalance <= 1 + options.balance_tol + 1e-9:
            notes.append(f"refined on {finer.chunks_per_rank} chunks per rank, tolerance {finer.balance_tol}: "
                         f"{key(ev2):.3f} ms, {key(ev2) / bound:.3f}x the compute bound (was {key(chosen):.3f} ms)")
            chosen = ev2
    planning_seconds = time.perf_counter() - t0
    if progress and deferred:
        progress("simulating baselines for the comparison")
    for name, bp in deferred.items():
        evals[name] = evaluate(bp, pattern, cost=cost, backward=backward)
    evals = {name: evals[name] for name in baselines if name in evals}
    chosen = _no_slower_than_a_baseline(chosen, evals, pattern, cost=cost, backward=backward, layout=layout,
                                        notes=notes)
    evals = {"ultraattn": chosen, **evals}
    total = time.perf_counter() - t0
    solver = {
        "planner": "ilp",
        "seconds": planning_seconds,
        "comparison_seconds": total - planning_seconds,
        "levels": [i.to_dict() for i in tiling.infos],
        "schedule": sched_info.to_dict(),
        "symmetry_cache_hits": tiling.cache_hits,
    }
    phases = {"fwd": chosen.fwd, **({"bwd": chosen.bwd} if chosen.bwd is not None else {})}
    return PlanResult(plan=with_order(chosen.plan, phases), evaluations=evals, not_applicable=na, solver=solver,
                      seconds=planning_seconds, pattern=pattern, notes=notes, compute_bound_ms=bound)


def _no_slower_than_a_baseline(chosen: Evaluation, evals: dict[str, Evaluation], pattern: BlockPattern, *,
                               cost: CostModel, backward: bool, layout: TokenSharding | None,
                               notes: list[str]) -> Evaluation:
    """The ILP planner never hands back a plan its own model prices above a baseline it priced: where the fastest
    baseline (in the given layout, if any) models faster than ``chosen``, that baseline's plan is ours, and a note
    says so. (Planning adopts a baseline early only when it is balanced within the tolerance; the comparison prices
    all of them, and an unbalanced ring can still be faster on a short, narrow mask.)"""
    key = Evaluation.total_ms
    fits = {n: e for n, e in evals.items() if layout is None or e.plan.layout == layout}
    if not fits:
        return chosen
    name = min(fits, key=lambda n: key(fits[n]))
    if key(fits[name]) >= key(chosen) * (1 - 1e-9):
        return chosen
    notes.append(f"the {name} baseline models faster than the planned plan ({key(fits[name]):.3f} ms vs "
                 f"{key(chosen):.3f} ms): its plan is returned")
    return evaluate(as_ours(fits[name].plan), pattern, cost=cost, backward=backward)


def _tiled_plan(pattern: BlockPattern, shape: AttnShape, mesh: Mesh, *, cost: CostModel, options: PlannerOptions,
                backward: bool, progress, layout: TokenSharding | None) -> tuple[Evaluation, TilingResult]:
    """The hierarchical tiling's plan (``tiling.tile``) at ``options.chunks_per_rank`` chunks per rank, refined
    while it misses the balance tolerance; its evaluation and the tiling that made it."""
    w = mesh.world
    # [Note] refinement: when whole cells cannot be balanced within the tolerance, cut finer
    # (UltraAttn refines its table to ParD x ParD); stop at the pattern's own resolution.
    ev_ours = None
    tiling = None
    k = options.chunks_per_rank
    while True:
        p = w * k
        chunk = padded_chunk(shape.seq_len, p, pattern.q_block) if layout is None else layout.chunk_size
        weight = workload(pattern, shape, num_chunks=p, chunk=chunk).cell_blocks(cost)[0]
        opts_k = dataclasses.replace(options, chunks_per_rank=k)
        til = tile(weight, mesh=mesh, shape=shape, chunk=chunk, cost=cost, opts=opts_k, backward=backward,
                   progress=progress, fixed_owner=None if layout is None else list(layout.owner))
        # routed as the tiling decided: each crossing lands where its ILP put it, sent from the owner (``_rerouted``
        # tries the crossings spread over the NICs once the launches are set)
        cand = make_plan(method="ultraattn", owner=til.owner, assign_GPP=til.assign_PP[None], mesh=mesh,
                         shape=shape, chunk=chunk, backward=backward, landing=til.landing, spread=False,
                         meta={"structure": "tiled", "chunks_per_rank": k, "routing": "direct"})
        ev = evaluate(cand, pattern, cost=cost, backward=backward)
        if ev_ours is None or (ev_ours.compute_imbalance > 1 + options.balance_tol
                               and ev.compute_imbalance < ev_ours.compute_imbalance):
            ev_ours, tiling = ev, til
        finer_fits = (layout is None and 2 * k <= 4 * options.chunks_per_rank
                      and w * 2 * k * pattern.q_block <= pattern.q_len * 2)
        if ev_ours.compute_imbalance <= 1 + options.balance_tol + 1e-9 or not finer_fits:
            break
        k *= 2
    return ev_ours, tiling


def _launches(ev: Evaluation, pattern: BlockPattern, *, cost: CostModel, backward: bool,
              timed_over: float | None, deadline: float = float("inf")) -> tuple[Evaluation, list[str]]:
    """Kernel-level tiling of a chosen plan: fixed batches (``_batched``), then, while the plan still models above
    ``timed_over`` ms (the refinement threshold), launches timed by its replay (``_timed``, no variant started after
    ``deadline``, a ``perf_counter`` time), then the other routing (``_rerouted``); notes of what won."""
    ev, note = _batched(ev, pattern, cost=cost, backward=backward)
    notes = [note] if note else []
    key = Evaluation.total_ms
    if timed_over and key(ev) > timed_over:
        ev, note = _timed(ev, pattern, cost=cost, backward=backward, deadline=deadline)
        if note:
            notes.append(note)
    ev, note = _rerouted(ev, pattern, cost=cost, backward=backward)
    if note:
        notes.append(note)
    return ev, notes


def _rerouted(ev: Evaluation, pattern: BlockPattern, *, cost: CostModel, backward: bool) -> tuple[Evaluation, str]:
    """A tiled plan on several nodes with its crossings spread over the NICs (``build.NodeLinks``), same launches,
    kept when its replay is faster. Neither routing wins everywhere at 8x8, 512K (spread: document masks 9.4 -> 8.6
    ms in ``benchmarks/replan.py``; the tiling's own: global+local 1.10x against 1.15x the compute bound), and the
    launches are tuned to one routing's arrivals, so the comparison comes last: one replay."""
    tp = ev.plan
    if tp.mesh.nodes == 1 or tp.meta.get("routing") != "direct":
        return ev, ""
    alt = dataclasses.replace(tp, meta={**tp.meta, "routing": "spread"}, transfers=tuple(route_transfers(
        owner=list(tp.owner), assign_GPP=tp.assign_GPP, mesh=tp.mesh, shape=tp.shape, chunk=tp.chunk_size,
        backward=backward)))
    ev2 = evaluate(alt, pattern, cost=cost, backward=backward)
    if Evaluation.total_ms(ev2) < Evaluation.total_ms(ev) * (1 - 1e-9):
        return ev2, (f"crossings spread over the NICs: {Evaluation.total_ms(ev):.3f} -> "
                     f"{Evaluation.total_ms(ev2):.3f} ms")
    return ev, ""


#: the timed launches' variants (``_timed``): at most this many cells to a launch, and how long a launch may wait
#: for one more cell, in units of the plan's mean seconds per cell; each regrouped from ``TIMED_ROUNDS`` replays
TIMED_CAPS = (2, 4)
TIMED_SLACKS = (0.0, 0.5)
TIMED_ROUNDS = 2


def _timed(ev: Evaluation, pattern: BlockPattern, *, cost: CostModel, backward: bool,
           deadline: float = float("inf")) -> tuple[Evaluation, str]:
    """The plan's cells regrouped into launches by when their inputs arrived in its replay (``launches``), for each
    cap and slack of ``TIMED_CAPS`` x ``TIMED_SLACKS``, each phase's replay, ``TIMED_ROUNDS`` times (each round from
    the previous round's replay: arrivals move with the grouping); the fastest replay kept when it beats ``ev``. No
    round starts after ``deadline``. (Star at 8x8, 512K: 1.12x -> 1.08x the compute bound; streaming 1.14x -> 1.09x.)"""
    plan_ = ev.plan
    key = Evaluation.total_ms
    work = workload(pattern, plan_.shape, num_chunks=plan_.num_chunks, head_groups=plan_.num_head_groups,
                    chunk=plan_.chunk_size)
    best, best_how = ev, ""
    for phase in ("fwd", "bwd") if backward else ("fwd",):
        seconds = work.kernels_seconds([(k.head_group, k.cells) for k in plan_.kernels], cost, phase)
        per_cell = float(seconds.sum()) / max(1, sum(len(k.cells) for k in plan_.kernels))
        for cap in TIMED_CAPS:
            for slack in TIMED_SLACKS:
                cur = ev
                for _ in range(TIMED_ROUNDS):
                    if time.perf_counter() > deadline:
                        break
                    kernels = timed_kernels(cur.plan, cur.fwd if phase == "fwd" else cur.bwd, work, cost, phase,
                                            cap=cap, slack=slack * per_cell)
                    cur = evaluate(dataclasses.replace(plan_, kernels=kernels,
                                                       meta={**plan_.meta, "kernel_launches": f"timed {cap}"}),
                                   pattern, cost=cost, backward=backward)
                    if key(cur) < key(best) * (1 - 1e-9):
                        best, best_how = cur, (f"at most {cap} cells, waiting up to {slack:g} cells' time, from the "
                                               f"{phase} replay")
    if best is ev:
        return ev, ""
    return best, (f"launches timed by the replay ({best_how}): {key(best):.3f} ms, was {key(ev):.3f} ms")


def _batched(ev: Evaluation, pattern: BlockPattern, *, cost: CostModel, backward: bool) -> tuple[Evaluation, str]:
    """The plan with its remote cells in per-row launches (``build``'s module docstring) of each batch size of
    ``build.BATCHES`` above 1, replayed; the fastest kept when it beats the plan as grouped before, with a note.
    (Replayed, not priced: the closed-form price bounds a grouping's stalls less tightly the longer its launches,
    so it always prefers the longest; the replay finds 4 best on strided masks, 8 on causal ones.)"""
    plan_ = ev.plan
    key = Evaluation.total_ms
    best, best_b = ev, 1
    for b in BATCHES[1:]:
        kernels = tuple(group_kernels(owner=list(plan_.owner), assign_GPP=plan_.assign_GPP, batch=b,
                                      devices=plan_.mesh.devices))
        cand = evaluate(dataclasses.replace(plan_, kernels=kernels, meta={**plan_.meta, "kernel_batch": b}), pattern,
                        cost=cost, backward=backward)
        if key(cand) < key(best) * (1 - 1e-9):
            best, best_b = cand, b
    if best is ev:
        return ev, ""
    return best, (f"remote cells launched {best_b} to a row ({key(best):.3f} ms, as grouped before {key(ev):.3f} ms):"
                  f" longer launches, fewer of them")


def as_ours(src: TilePlan) -> TilePlan:
    """A baseline's plan adopted as the planner's: same tiles and transfers, ``structure`` names its origin."""
    return TilePlan(method="ultraattn", mesh=src.mesh, shape=src.shape, chunk_size=src.chunk_size,
                    num_chunks=src.num_chunks, owner=src.owner, num_head_groups=src.num_head_groups,
                    assign_GPP=src.assign_GPP, kernels=src.kernels, transfers=src.transfers,
                    meta={**src.meta, "structure": src.method})


def _plan_fast(pattern: BlockPattern, shape: AttnShape, mesh: Mesh, *, cost: CostModel, options: PlannerOptions,
               backward: bool, baselines, layout: TokenSharding | None) -> PlanResult:
    """``plan`` with the fast planner: its plan, then every baseline simulated for the comparison."""
    t0 = time.perf_counter()
    fp = FastPlanner(shape=shape, mesh=mesh, cost=cost, layout=layout, balance_tol=options.balance_tol,
                     backward=backward, baselines=tuple(baselines))
    tile_plan = fp.plan(pattern)
    planning_seconds = time.perf_counter() - t0
    evals = {"ultraattn": evaluate(tile_plan, pattern, cost=cost, backward=backward)}
    na: dict[str, str] = {}
    for name in baselines:
        try:
            evals[name] = evaluate(baseline_plan(name, pattern, shape, mesh, backward=backward), pattern, cost=cost,
                                   backward=backward)
        except NotApplicable as exc:
            na[name] = str(exc)
    meta = tile_plan.meta
    priced = ", ".join(f"{k} {v:.3f}" for k, v in sorted(meta["candidates"].items(), key=lambda kv: kv[0])
                       if v is not None)
    notes = [f"fast planner: {meta['structure']} (closed-form price {meta['estimate_ms']:.3f} ms); candidates priced "
             f"(ms): {priced}"]
    if meta.get("regrets"):
        band = meta["band"]
        notes.append(f"robust choice: worst-case regret {meta['regret']:.3f} over the cost-model band (rates and "
                     f"bandwidths x{band['rate']:g} either way, latencies x{band['latency']:g}); finalists: "
                     + ", ".join(f"{k} {v:.3f}" for k, v in sorted(meta["regrets"].items())))
    skipped = SolveInfo(name="schedule", status="Skipped", note="fast planner: no ILP").to_dict()
    solver = {"planner": "fast", "seconds": planning_seconds,
              "comparison_seconds": time.perf_counter() - t0 - planning_seconds, "levels": [],
              "schedule": skipped, "symmetry_cache_hits": 0}
    return PlanResult(plan=tile_plan, evaluations=evals, not_applicable=na, solver=solver, seconds=planning_seconds,
                      pattern=pattern, notes=notes,
                      compute_bound_ms=compute_bound_ms(pattern, shape, mesh, cost=cost, backward=backward))


def overall_ilp_status(result: PlanResult) -> tuple[str, float | None]:
    """One status and the worst gap over the partition ILPs that ran (for the JSON summary); "NotRun" for the
    fast planner."""
    if result.solver.get("planner") == "fast":
        return "NotRun", None
    infos = result.solver["levels"]
    ran = [i for i in infos if i["status"] not in ("Skipped",)]
    if not ran:
        return ("Skipped" if infos else "NotNeeded"), None
    order = ["Error", "NoSolution", "Infeasible", "Stopped", "Optimal"]
    worst = min((i["status"] for i in ran), key=lambda s: order.index(s) if s in order else 0)
    gaps = [i["gap"] for i in ran if i["gap"] is not None]
    return worst, (max(gaps) if gaps else None)


def method_summaries(result: PlanResult) -> dict[str, dict]:
    """Modeled figures of ultraattn and every baseline, json-able (``Evaluation.summary`` per method; a
    baseline that does not apply has None figures and a ``note`` saying why)."""
    methods = {name: ev.summary() for name, ev in result.evaluations.items()}
    for name, why in result.not_applicable.items():
        methods[name] = {"fwd_ms": None, "bwd_ms": None, "max_rank_bytes": None, "max_rank_inter_node_bytes": None,
                         "compute_imbalance": None, "note": why}
    return methods
