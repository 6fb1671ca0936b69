"""Hierarchical context tiling: node level, then device level, then kernel level.

1. Node level (skipped for one node): the sequence is cut into
   ``nodes * chunks_per_rank`` coarse chunks; nodes own
   ``chunks_per_rank`` each and the coarse cells are split among nodes, minimising the
   largest per-node inter-node traffic (the expensive kind) under compute balance
   (half the tolerance, so the device level keeps the other half).
2. Device level, per node: the node's coarse chunks are cut into
   ``devices * chunks_per_rank`` fine chunks (``chunks_per_rank`` per device); the
   node's fine cells are split among its devices, minimising NVLink traffic plus the
   inter-node traffic each device's NIC carries (data from other nodes lands on one
   device and is relayed: see ``build.route_transfers``). Balance against the GLOBAL
   mean, so the overall imbalance stays within the tolerance. Nodes whose sub-problem
   is identical up to relabelling are solved once (symmetry).
3. Kernel level: ``build.group_kernels`` (stages by remote inputs), then the schedule.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .cost import CostModel
from .ilp import SolveInfo
from .partition import Level, Solution, heuristic, solve_ilp
from .partition import evaluate as evaluate_level
from .plan import AttnShape, Mesh

MAX_NODE_ITEMS = 64


@dataclass(frozen=True, slots=True, kw_only=True)
class PlannerOptions:
    """Planner settings (all overridable from the CLI and the compile backend)."""

    balance_tol: float = 0.05
    """Allowed compute imbalance: max rank load <= (1 + tol) x mean."""
    chunks_per_rank: int = 2
    """Token chunks per rank (more = finer balance and bigger ILPs)."""
    ilp_time_limit: float = 4.0
    """Seconds per partition ILP (CBC); the heuristic incumbent is kept on a time-out."""
    ilp_max_nodes: int = 400
    """Branch-and-bound node limit per ILP: keeps CBC deterministic across ranks."""
    ilp_max_binaries: int = 2000
    """Larger partition ILPs are skipped (the heuristic stands; the report says so). Measured here:
    CBC spends 18-22 s in the root node of a 4,900-binary device-level instance whatever its
    time limit, so the limit alone cannot bound planning time."""
    time_budget: float = 10.0
    """Wall-clock seconds for all partition work; per-instance limits shrink to fit it."""
    heuristic_seconds: float = 1.0
    """Local-search budget per level instance."""
    schedule_ilp: bool = True
    """Refine the critical rank's order with the scheduling ILP."""
    schedule_time_limit: float = 2.0
    refine_over: float | None = 1.10
    """A plan modeled above this multiple of the compute bound (``api.compute_bound_ms``) is planned once more on
    chunks half as long with the tolerance at most 0.02, the faster kept (None: never)."""
    consider_baselines: bool = True
    """Also evaluate the baseline-structured plans and keep the best (never worse than them)."""
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.balance_tol < 1:
            raise ValueError(f"balance_tol must lie in [0, 1), got {self.balance_tol}")
        if self.chunks_per_rank < 1:
            raise ValueError(f"chunks_per_rank must be >= 1, got {self.chunks_per_rank}")
        if self.refine_over is not None and self.refine_over < 1:
            raise ValueError(f"refine_over must be None or >= 1, got {self.refine_over}")
        if self.ilp_time_limit <= 0 or self.schedule_time_limit <= 0:
            raise ValueError("ilp_time_limit and schedule_time_limit must be positive")


@dataclass(slots=True)
class TilingResult:
    owner: list[int]
    assign_PP: torch.Tensor
    landing: dict[tuple[int, int], int]
    infos: list[SolveInfo] = field(default_factory=list)
    cache_hits: int = 0


def unit_costs(shape: AttnShape, chunk: int, backward: bool) -> dict[str, float]:
    """Bytes per chunk unit for the four traffic kinds of ``partition.Level``."""
    ub = lambda t: float(shape.unit_bytes(t, chunk))  # noqa: E731
    return {
        "RI": ub("q") + (ub("qdo") if backward else 0.0),
        "RO": ub("o") + (ub("dq") if backward else 0.0),
        "CI": ub("kv") * (2.0 if backward else 1.0),
        "CO": ub("dkv") if backward else 0.0,
    }


def _solve_level(lv: Level, opts: PlannerOptions, *, deadline: float, instances_left: int
                 ) -> tuple[Solution, SolveInfo]:
    share = max(0.0, deadline - time.perf_counter()) / max(1, instances_left)
    inc = heuristic(lv, seconds=min(opts.heuristic_seconds, 0.3 * share), seed=opts.seed)
    limit = min(opts.ilp_time_limit, 0.7 * share)
    if limit < 0.5:
        return inc, SolveInfo(name=lv.name, status="Skipped", objective=inc.V,
                              note=f"time_budget={opts.time_budget}s spent: heuristic kept")
    return solve_ilp(lv, inc, time_limit=limit, max_nodes=opts.ilp_max_nodes, max_binaries=opts.ilp_max_binaries)


def tile(weight_PP: torch.Tensor, *, mesh: Mesh, shape: AttnShape, chunk: int, cost: CostModel,
         opts: PlannerOptions, backward: bool, progress=None, fixed_owner: list[int] | None = None) -> TilingResult:
    """Ownership of fine chunks and the rank computing each fine cell (module docstring).

    ``fixed_owner`` (a given token layout, one rank per fine chunk): ownership is not chosen, only
    where each cell is computed and where foreign data lands; the levels keep their objectives.
    """
    p = weight_PP.shape[0]
    assert p == mesh.world * opts.chunks_per_rank
    if fixed_owner is not None and len(fixed_owner) != p:
        raise ValueError(f"fixed_owner lists {len(fixed_owner)} chunks, the grid has {p}")
    deadline = time.perf_counter() + opts.time_budget
    units = unit_costs(shape, chunk, backward)
    if mesh.nodes > 1:
        group, node_own_item, node_at, infos = _node_level(weight_PP, mesh=mesh, cost=cost, opts=opts, units=units,
                                                           deadline=deadline, progress=progress,
                                                           fixed_owner=fixed_owner)
    else:
        group, node_own_item, node_at, infos = mesh.devices, [0] * (p // mesh.devices), None, []
    node_of_fine = [node_own_item[i // group] for i in range(p)]
    fine_node_at = torch.full((p, p), -1, dtype=torch.int64)
    for i, j in (weight_PP > 0).nonzero().tolist():
        fine_node_at[i, j] = node_at[(i // group, j // group)] if node_at else 0
    res = _device_level(weight_PP, node_of_fine, fine_node_at, mesh=mesh, cost=cost, opts=opts, units=units,
                        deadline=deadline, progress=progress, fixed_owner=fixed_owner)
    res.infos[:0] = infos
    return res


def _node_level(weight_PP: torch.Tensor, *, mesh: Mesh, cost: CostModel, opts: PlannerOptions, units: dict,
                deadline: float, progress, fixed_owner: list[int] | None
                ) -> tuple[int, list[int], dict[tuple[int, int], int], list[SolveInfo]]:
    """(fine chunks per node-level item, the node owning each item, the node computing each item cell, infos).

    [Note] two granularities: coarse items (the node's chunks_per_rank chunks, small enough for
    the ILP) cannot see structure finer than a node's share (strided groups interleave blocks);
    fine items (up to MAX_NODE_ITEMS) can, but only the heuristic handles their size. Both are
    scored on the fine grid and the better is kept.
    """
    n_nodes, n_dev, p = mesh.nodes, mesh.devices, weight_PP.shape[0]
    inv = 1.0 / (cost.inter_bw_GBps * 1e9) / n_dev  # per node: D NICs share the traffic
    cap = (1 + opts.balance_tol / 2) * float(weight_PP.sum()) / n_nodes

    def node_level(group: int, name: str, fixed: list[int] | None = None) -> Level:
        pc = p // group
        w_c = weight_PP.reshape(pc, group, pc, group).sum(dim=(1, 3))
        cells = [(i, j) for i in range(pc) for j in range(pc) if w_c[i, j] > 0]
        return Level(bins=n_nodes, items=pc, counted=[True] * pc, per_bin=pc // n_nodes, cells=cells,
                     weight=[float(w_c[c]) for c in cells], cap=cap,
                     **{key: v * group * inv for key, v in units.items()}, name=name, fixed=fixed)

    if fixed_owner is not None:
        # the layout fixes each fine chunk's node; only where cells are computed is chosen
        if progress:
            progress("node level (fixed layout)")
        lv = node_level(1, "node level (fixed layout)", fixed=[r // n_dev for r in fixed_owner])
        sol, info = _solve_level(lv, opts, deadline=deadline, instances_left=1 + n_nodes)
        return 1, sol.own, dict(zip(lv.cells, sol.at)), [info]
    # the finest grouping with at most MAX_NODE_ITEMS items; none (a refined grid on many nodes: 32x8 at 4 chunks
    # per rank is 1024 chunks) leaves the coarse level alone
    fine_group = next((g for g in range(1, n_dev + 1) if n_dev % g == 0 and p // g <= MAX_NODE_ITEMS), n_dev)
    if progress:
        progress("node level")
    coarse = node_level(n_dev, "node level")
    sol_c, info = _solve_level(coarse, opts, deadline=deadline, instances_left=2 + n_nodes)
    candidates = [(n_dev, coarse, sol_c)]
    if fine_group < n_dev:
        fine = node_level(fine_group, f"node level (fine, {p // fine_group} items)")
        share = max(0.0, deadline - time.perf_counter()) / (1 + n_nodes)
        sol_f = heuristic(fine, seconds=min(opts.heuristic_seconds, share), seed=opts.seed)
        candidates.append((fine_group, fine, sol_f))
    # score every candidate on the finest node-level grid
    g0, ref, _ = candidates[-1]
    scored = []
    for g, lv_g, sol in candidates:
        r = g // g0
        own = [sol.own[i // r] for i in range(ref.items)]
        at_map = dict(zip(lv_g.cells, sol.at))
        at = [at_map[(i // r, j // r)] for i, j in ref.cells]
        scored.append((evaluate_level(ref, own, at).key(), g, sol, lv_g))
    _, group, sol, lv_best = min(scored, key=lambda t: t[0])
    if group != n_dev:
        info.note = (info.note + "; " if info.note else "") + (
            f"the fine-item heuristic ({p // group} items) beat the coarse level: adopted")
        info.used = False
    return group, sol.own, dict(zip(lv_best.cells, sol.at)), [info]


def _device_level(weight_PP: torch.Tensor, node_of_fine: list[int], fine_node_at: torch.Tensor, *, mesh: Mesh,
                  cost: CostModel, opts: PlannerOptions, units: dict, deadline: float, progress,
                  fixed_owner: list[int] | None) -> TilingResult:
    """Inside each node: which device owns each of its chunks, computes each of its cells, and where foreign
    chunks land. Nodes with identical instances share one solution (``cache_hits``)."""
    n_nodes, n_dev, p = mesh.nodes, mesh.devices, weight_PP.shape[0]
    nonempty = weight_PP > 0
    nz = nonempty.nonzero().tolist()
    total = float(weight_PP.sum())
    owner = [-1] * p
    assign = torch.full((p, p), -1, dtype=torch.int32)
    landing: dict[tuple[int, int], int] = {}
    intra = 1.0 / (cost.intra_bw_GBps * 1e9)
    inter = 1.0 / (cost.inter_bw_GBps * 1e9)
    cache: dict = {}
    hits = 0
    infos: list[SolveInfo] = []
    for n in range(n_nodes):
        own_fine = [i for i in range(p) if node_of_fine[i] == n]
        my_cells = [(i, j) for i, j in nz if fine_node_at[i, j] == n]
        foreign = sorted(({i for i, _ in my_cells} | {j for _, j in my_cells}) - set(own_fine))
        items = own_fine + foreign
        idx = {c: m for m, c in enumerate(items)}
        ext_in, ext_out = _external(n, own_fine, foreign, my_cells, idx, fine_node_at, nonempty, units,
                                    inter, n_nodes > 1)
        cells = [(idx[i], idx[j]) for i, j in my_cells]
        weights = [float(weight_PP[i, j]) for i, j in my_cells]
        fixed = None if fixed_owner is None else [fixed_owner[c] - n * n_dev for c in own_fine] + [-1] * len(foreign)
        key = (len(own_fine), tuple(cells), tuple(round(w, 6) for w in weights),
               tuple(round(v * 1e9, 6) for v in ext_in), tuple(round(v * 1e9, 6) for v in ext_out),
               None if fixed is None else tuple(fixed))
        if key in cache:
            sol = cache[key]
            hits += 1
        else:
            lv = Level(bins=n_dev, items=len(items), counted=[True] * len(own_fine) + [False] * len(foreign),
                       per_bin=opts.chunks_per_rank, cells=cells, weight=weights,
                       cap=(1 + opts.balance_tol) * total / mesh.world,
                       **{kk: v * intra for kk, v in units.items()}, extra_in=ext_in, extra_out=ext_out,
                       name=f"device level (node {n})", fixed=fixed)
            if progress:
                progress(f"device level, node {n}")
            sol, info = _solve_level(lv, opts, deadline=deadline, instances_left=n_nodes - n)
            infos.append(info)
            cache[key] = sol
        for c, m in idx.items():
            if c in own_fine:
                owner[c] = n * n_dev + sol.own[m]
            else:
                landing[(c, n)] = n * n_dev + sol.own[m]
        for (i, j), b in zip(my_cells, sol.at):
            assign[i, j] = n * n_dev + b
    return TilingResult(owner=owner, assign_PP=assign, landing=landing, infos=infos, cache_hits=hits)


def _external(n: int, own_fine: list[int], foreign: list[int], my_cells: list[tuple[int, int]], idx: dict[int, int],
              fine_node_at: torch.Tensor, nonempty: torch.Tensor, units: dict, inter: float, multi_node: bool
              ) -> tuple[list[float], list[float]]:
    """Seconds of node-crossing traffic each item of node ``n``'s device level brings in and sends out: foreign
    chunks its cells need, and (with several nodes) its own chunks other nodes' cells need."""
    used_rows = {i for i, _ in my_cells}
    used_cols = {j for _, j in my_cells}
    ext_in = [0.0] * len(idx)
    ext_out = [0.0] * len(idx)
    for c in foreign:
        m = idx[c]
        if c in used_rows:
            ext_in[m] += units["RI"] * inter
            ext_out[m] += units["RO"] * inter
        if c in used_cols:
            ext_in[m] += units["CI"] * inter
            ext_out[m] += units["CO"] * inter
    if multi_node:
        for c in own_fine:
            m = idx[c]
            row_nodes = set(fine_node_at[c][nonempty[c]].tolist()) - {n}
            col_nodes = set(fine_node_at[:, c][nonempty[:, c]].tolist()) - {n}
            ext_out[m] += (len(row_nodes) * units["RI"] + len(col_nodes) * units["CI"]) * inter
            ext_in[m] += (len(row_nodes) * units["RO"] + len(col_nodes) * units["CO"]) * inter
    return ext_in, ext_out
