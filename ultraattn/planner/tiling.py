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
    consider_baselines: bool = True
    """Also evaluate the baseline-structured plans and keep the best (never worse than them)."""
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.balance_tol < 1:
            raise ValueError(f"balance_tol must lie in [0, 1), got {self.balance_tol}")
        if self.chunks_per_rank < 1:
            raise ValueError(f"chunks_per_rank must be >= 1, got {self.chunks_per_rank}")
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
    n_nodes, n_dev, k = mesh.nodes, mesh.devices, opts.chunks_per_rank
    p = weight_PP.shape[0]
    assert p == mesh.world * k
    if fixed_owner is not None and len(fixed_owner) != p:
        raise ValueError(f"fixed_owner lists {len(fixed_owner)} chunks, the grid has {p}")
    deadline = time.perf_counter() + opts.time_budget
    nonempty = weight_PP > 0
    total = float(weight_PP.sum())
    units = unit_costs(shape, chunk, backward)
    infos: list[SolveInfo] = []
    # ---------------------------------------------------------------- node level
    # [Note] two granularities: coarse items (the node's chunks_per_rank chunks, small enough for
    # the ILP) cannot see structure finer than a node's share (strided groups interleave blocks);
    # fine items (up to MAX_NODE_ITEMS) can, but only the heuristic handles their size. Both are
    # scored on the fine grid and the better is kept.
    if n_nodes > 1:
        inv = 1.0 / (cost.inter_bw_GBps * 1e9) / n_dev  # per node: D NICs share the traffic
        cap = (1 + opts.balance_tol / 2) * total / n_nodes

        def node_level(group: int, name: str, fixed: list[int] | None = None) -> Level:
            pc = p // group
            w_c = weight_PP.reshape(pc, group, pc, group).sum(dim=(1, 3))
            cells = [(i, j) for i in range(pc) for j in range(pc) if w_c[i, j] > 0]
            return Level(bins=n_nodes, items=pc, counted=[True] * pc, per_bin=pc // n_nodes, cells=cells,
                         weight=[float(w_c[c]) for c in cells], cap=cap,
                         **{key: v * group * inv for key, v in units.items()}, name=name, fixed=fixed)

    if n_nodes > 1 and fixed_owner is not None:
        # the layout fixes each fine chunk's node; only where cells are computed is chosen
        if progress:
            progress("node level (fixed layout)")
        lv_best = node_level(1, "node level (fixed layout)", fixed=[r // n_dev for r in fixed_owner])
        sol, info = _solve_level(lv_best, opts, deadline=deadline, instances_left=1 + n_nodes)
        infos.append(info)
        group = 1
        node_own_item = sol.own
        node_at = {c: b for c, b in zip(lv_best.cells, sol.at)}
    elif n_nodes > 1:
        fine_group = next(g for g in range(1, n_dev + 1) if n_dev % g == 0 and p // g <= MAX_NODE_ITEMS)
        if progress:
            progress("node level")
        coarse = node_level(n_dev, "node level")
        sol_c, info = _solve_level(coarse, opts, deadline=deadline, instances_left=2 + n_nodes)
        infos.append(info)
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
            at_map = {c: b for c, b in zip(lv_g.cells, sol.at)}
            at = [at_map[(i // r, j // r)] for i, j in ref.cells]
            scored.append((evaluate_level(ref, own, at).key(), g, sol, lv_g))
        _, group, sol, lv_best = min(scored, key=lambda t: t[0])
        if group != n_dev:
            info.note = (info.note + "; " if info.note else "") + (
                f"the fine-item heuristic ({p // group} items) beat the coarse level: adopted")
            info.used = False
        node_own_item = sol.own
        node_at = {c: b for c, b in zip(lv_best.cells, sol.at)}
    else:
        group = n_dev
        node_own_item = [0] * (p // group)
        node_at = None
    node_of_fine = [node_own_item[i // group] for i in range(p)]
    fine_node_at = torch.full((p, p), -1, dtype=torch.int64)
    nz = nonempty.nonzero().tolist()
    for i, j in nz:
        fine_node_at[i, j] = node_at[(i // group, j // group)] if node_at else 0
    # ---------------------------------------------------------------- device level
    owner = [-1] * p
    assign = torch.full((p, p), -1, dtype=torch.int32)
    landing: dict[tuple[int, int], int] = {}
    intra = 1.0 / (cost.intra_bw_GBps * 1e9)
    inter = 1.0 / (cost.inter_bw_GBps * 1e9)
    cache: dict = {}
    hits = 0
    dev_infos: list[SolveInfo] = []
    for n in range(n_nodes):
        own_fine = [i for i in range(p) if node_of_fine[i] == n]
        my_cells = [(i, j) for i, j in nz if fine_node_at[i, j] == n]
        # remote needs of this node's own chunks, and this node's needs of remote chunks
        used_rows = {i for i, _ in my_cells}
        used_cols = {j for _, j in my_cells}
        foreign = sorted((used_rows | used_cols) - set(own_fine))
        items = own_fine + foreign
        idx = {c: m for m, c in enumerate(items)}
        ext_in = [0.0] * len(items)
        ext_out = [0.0] * len(items)
        for c in foreign:
            m = idx[c]
            if c in used_rows:
                ext_in[m] += units["RI"] * inter
                ext_out[m] += units["RO"] * inter
            if c in used_cols:
                ext_in[m] += units["CI"] * inter
                ext_out[m] += units["CO"] * inter
        if n_nodes > 1:
            for c in own_fine:
                m = idx[c]
                row_nodes = set(fine_node_at[c][nonempty[c]].tolist()) - {n}
                col_nodes = set(fine_node_at[:, c][nonempty[:, c]].tolist()) - {n}
                ext_out[m] += (len(row_nodes) * units["RI"] + len(col_nodes) * units["CI"]) * inter
                ext_in[m] += (len(row_nodes) * units["RO"] + len(col_nodes) * units["CO"]) * inter
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
                       per_bin=k, cells=cells, weight=weights, cap=(1 + opts.balance_tol) * total / mesh.world,
                       **{kk: v * intra for kk, v in units.items()}, extra_in=ext_in, extra_out=ext_out,
                       name=f"device level (node {n})", fixed=fixed)
            if progress:
                progress(f"device level, node {n}")
            sol, info = _solve_level(lv, opts, deadline=deadline, instances_left=n_nodes - n)
            dev_infos.append(info)
            cache[key] = sol
        for c, m in idx.items():
            r = n * n_dev + sol.own[m]
            if c in own_fine:
                owner[c] = r
            else:
                landing[(c, n)] = r
        for (i, j), b in zip(my_cells, sol.at):
            assign[i, j] = n * n_dev + b
    infos.extend(dev_infos)
    return TilingResult(owner=owner, assign_PP=assign, landing=landing, infos=infos, cache_hits=hits)
