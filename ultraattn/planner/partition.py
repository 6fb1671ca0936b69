"""One level of hierarchical context tiling: who owns which chunk, who computes which cell.

A ``Level`` has ``bins`` (nodes at the node level, devices at the device level), items
(token chunks) and non-empty cells (row item, column item, compute weight). It picks
jointly

* ``own[i]``: the bin owning item i. "Counted" items are the bin's own token shard:
  exactly ``per_bin`` each, so every rank keeps the same token count (static shapes).
  "Free" items (data arriving from other nodes) land on any bin.
* ``at[c]``: the bin computing cell c,

to minimise the largest per-bin traffic V (bytes weighted by their link's cost, the
UltraAttn objective) under compute balance ``load_b <= cap`` (cap = (1 + tol) x mean,
no per-case slack). UltraAttn fixed ownership to contiguous chunks; choosing it jointly
is what lets strided patterns keep whole groups on one node.

Traffic of bin b (per phase summed; the caller folds fwd+bwd into the unit costs):
    consumer of a foreign row i:    in += RI (Q [, Q+dO]),  out += RO (partial O [, dQ])
    consumer of a foreign column j: in += CI (K/V [x2]),    out += CO ([dK/dV])
    owner of i per foreign consumer: out += RI, in += RO (and CI/CO for columns)
    owner of item i:                 in += extra_in[i], out += extra_out[i]

Two solvers, same objective:
* ``heuristic``: ownership candidates (contiguous, head-tail, striped, affinity
  clustering), row-owner placement + greedy rebalancing, then chunk-swap local search;
* ``solve_ilp``: the exact MILP (linearised as below), warm-started from the heuristic,
  with a time and node limit. Symmetry breaking: bins are ordered by their first
  counted item, so ``own[i, b] = 0`` for i < b.
    x[c,b] binary, y[i,b] binary, a/ac row/column presence, f = max(0, a - y) foreign,
    u[i,b] >= F_i - bins (1 - y[i,b])  (F_i = foreign consumers of i) linearises owner load.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

from .ilp import SolveInfo, require_pulp, solve


@dataclass(slots=True, kw_only=True)
class Level:
    bins: int
    items: int
    counted: list[bool]
    per_bin: int
    cells: list[tuple[int, int]]
    weight: list[float]
    cap: float
    RI: float
    RO: float
    CI: float
    CO: float
    extra_in: list[float] = field(default_factory=list)
    extra_out: list[float] = field(default_factory=list)
    name: str = "level"
    fixed: list[int] | None = None
    """A given token layout: ``fixed[i]`` is the bin that must own counted item i (None: choose)."""

    def __post_init__(self) -> None:
        if not self.extra_in:
            self.extra_in = [0.0] * self.items
        if not self.extra_out:
            self.extra_out = [0.0] * self.items
        n_counted = sum(self.counted)
        if n_counted != self.bins * self.per_bin:
            raise ValueError(f"{self.name}: {n_counted} counted items cannot give {self.bins} bins {self.per_bin} each")
        if self.fixed is not None:
            got = [0] * self.bins
            for i in range(self.items):
                if self.counted[i]:
                    if not 0 <= self.fixed[i] < self.bins:
                        raise ValueError(f"{self.name}: fixed owner of item {i} must be a bin, got {self.fixed[i]}")
                    got[self.fixed[i]] += 1
            if any(g != self.per_bin for g in got):
                raise ValueError(f"{self.name}: the fixed layout gives bins {got} items, not {self.per_bin} each")


@dataclass(slots=True, kw_only=True)
class Solution:
    own: list[int]
    at: list[int]
    V: float = 0.0
    total: float = 0.0
    load: list[float] = field(default_factory=list)
    source: str = "heuristic"

    def key(self) -> tuple[float, float]:
        return (round(self.V, 9), round(self.total, 6))


def evaluate(lv: Level, own: list[int], at: list[int]) -> Solution:
    nb = lv.bins
    tin = [0.0] * nb
    tout = [0.0] * nb
    load = [0.0] * nb
    rows: set = set()
    cols: set = set()
    for (i, j), b, w in zip(lv.cells, at, lv.weight):
        load[b] += w
        rows.add((i, b))
        cols.add((j, b))
    for pairs, come, back in ((rows, lv.RI, lv.RO), (cols, lv.CI, lv.CO)):
        for i, b in pairs:  # bin b computes a cell of item i, which bin o owns: it comes in, results go back
            o = own[i]
            if o != b:
                tin[b] += come
                tout[b] += back
                tout[o] += come
                tin[o] += back
    for i, b in enumerate(own):
        tin[b] += lv.extra_in[i]
        tout[b] += lv.extra_out[i]
    v = max(max(a, c) for a, c in zip(tin, tout))
    return Solution(own=list(own), at=list(at), V=v, total=sum(tin) + sum(tout), load=load)


# ---------------------------------------------------------------------------------- heuristic
def _ownership_candidates(lv: Level, rng: random.Random) -> list[list[int]]:
    counted = [i for i in range(lv.items) if lv.counted[i]]
    free = [i for i in range(lv.items) if not lv.counted[i]]
    nb, k = lv.bins, lv.per_bin
    if lv.fixed is not None:  # a given layout: ownership of counted items is not ours to choose
        own = [lv.fixed[i] if lv.counted[i] else n % nb for n, i in enumerate(range(lv.items))]
        return [own]
    orders = []
    orders.append([b for b in range(nb) for _ in range(k)])  # contiguous
    if k % 2 == 0:  # head-tail (zigzag)
        half = [b for b in range(nb) for _ in range(k // 2)]
        orders.append(half + half[::-1])
    orders.append([n % nb for n in range(nb * k)])  # striped
    orders.append(_affinity_order(lv, counted))
    cands = []
    for order in orders:
        own = [-1] * lv.items
        for i, b in zip(counted, order):
            own[i] = b
        cands.append(own)
    # free items land on the bin that computes most with them (decided after placement); start round-robin
    for own in cands:
        for n, i in enumerate(free):
            own[i] = n % nb
    return cands


def _affinity_order(lv: Level, counted: list[int]) -> list[int]:
    """Greedy clustering: grow bins one at a time with the item most connected to the bin."""
    idx = {i: n for n, i in enumerate(counted)}
    aff = [[0.0] * len(counted) for _ in counted]
    for (i, j), w in zip(lv.cells, lv.weight):
        if i in idx and j in idx and i != j:
            aff[idx[i]][idx[j]] += w
            aff[idx[j]][idx[i]] += w
    left = set(range(len(counted)))
    order = [-1] * len(counted)
    for b in range(lv.bins):
        seed = min(left)
        members = [seed]
        left.discard(seed)
        while len(members) < lv.per_bin:
            best = max(sorted(left), key=lambda n: sum(aff[n][m] for m in members))
            members.append(best)
            left.discard(best)
        for m in members:
            order[m] = b
    return order


def _place(lv: Level, own: list[int]) -> list[int]:
    """Cells to their row owner, then move cells off overloaded bins at least extra traffic."""
    nb = lv.bins
    at = [own[i] for i, _ in lv.cells]
    load = [0.0] * nb
    rowc: dict = {}
    colc: dict = {}
    for (i, j), b, w in zip(lv.cells, at, lv.weight):
        load[b] += w
        rowc[(i, b)] = rowc.get((i, b), 0) + 1
        colc[(j, b)] = colc.get((j, b), 0) + 1

    # traffic a cell adds or saves by moving: its row's (or column's) inputs and partials, when it was the only
    # cell of that row (column) on the bin it leaves, or is the first on the bin it joins
    row_cost = 2 * (lv.RI + lv.RO)
    col_cost = 2 * (lv.CI + lv.CO)

    by_bin: dict[int, set] = {b: set() for b in range(nb)}
    for c, b in enumerate(at):
        by_bin[b].add(c)
    # the bins computing in each row / column (kept with rowc / colc: a move changes one row's and one column's)
    row_bins: dict[int, set] = {}
    col_bins: dict[int, set] = {}
    for (i, b), n in rowc.items():
        if n:
            row_bins.setdefault(i, set()).add(b)
    for (j, b), n in colc.items():
        if n:
            col_bins.setdefault(j, set()).add(b)
    for _ in range(4 * len(lv.cells) + 10):
        b = max(range(nb), key=lambda x: (load[x], -x))
        if load[b] <= lv.cap + 1e-9:
            break
        best = None
        excess = load[b] - lv.cap
        for c in sorted(by_bin[b]):
            w = lv.weight[c]
            i, j = lv.cells[c]
            rb, cb = row_bins[i], col_bins[j]
            targets = {own[i], own[j]} | rb | cb
            if len(targets) < 3:
                targets |= set(range(nb))
            # ``delta(c, t)`` inlined (the hot loop): leaving b is the same for every target
            leave = 0.0
            if rowc[(i, b)] == 1 and own[i] != b:
                leave -= row_cost
            if colc[(j, b)] == 1 and own[j] != b:
                leave -= col_cost
            for t in sorted(targets):
                if t == b or load[t] + w > lv.cap + 1e-9:
                    continue
                d = leave
                if t not in rb and own[i] != t:
                    d += row_cost
                if t not in cb and own[j] != t:
                    d += col_cost
                score = (d / max(w, 1e-12) if w < excess else d, -w, c, t)
                if best is None or score < best[0]:
                    best = (score, c, t)
        if best is None:
            break
        _, c, t = best
        i, j = lv.cells[c]
        w = lv.weight[c]
        rowc[(i, b)] -= 1
        colc[(j, b)] -= 1
        rowc[(i, t)] = rowc.get((i, t), 0) + 1
        colc[(j, t)] = colc.get((j, t), 0) + 1
        if not rowc[(i, b)]:
            row_bins[i].discard(b)
        if not colc[(j, b)]:
            col_bins[j].discard(b)
        row_bins[i].add(t)
        col_bins[j].add(t)
        load[b] -= w
        load[t] += w
        by_bin[b].discard(c)
        by_bin[t].add(c)
        at[c] = t
    return at


def _land_free(lv: Level, own: list[int], at: list[int]) -> list[int]:
    """Free items land on the bin using them most, spreading extra load greedily."""
    own = list(own)
    use: dict[int, dict[int, float]] = {}
    for (i, j), b in zip(lv.cells, at):
        for it in (i, j):
            if not lv.counted[it]:
                use.setdefault(it, {})
                use[it][b] = use[it].get(b, 0.0) + 1.0
    extra = [0.0] * lv.bins
    for it in range(lv.items):
        if lv.counted[it]:
            extra[own[it]] += lv.extra_in[it] + lv.extra_out[it]
    free = sorted((it for it in range(lv.items) if not lv.counted[it]),
                  key=lambda it: -(lv.extra_in[it] + lv.extra_out[it]))
    for it in free:
        users = use.get(it)
        cands = sorted(users) if users else list(range(lv.bins))
        b = min(cands, key=lambda x: (extra[x], -(users or {}).get(x, 0.0), x))
        own[it] = b
        extra[b] += lv.extra_in[it] + lv.extra_out[it]
    return own


def _better(a: Solution, b: Solution | None, cap: float) -> bool:
    if b is None:
        return True
    fa, fb = max(a.load) <= cap + 1e-9, max(b.load) <= cap + 1e-9
    if fa != fb:
        return fa
    if not fa:
        return max(a.load) < max(b.load)
    return a.key() < b.key()


def heuristic(lv: Level, *, seconds: float = 2.0, seed: int = 0) -> Solution:
    """Best of several ownerships, each placed greedily, then chunk-swap local search."""
    rng = random.Random(seed)
    t_end = time.perf_counter() + seconds
    best: Solution | None = None
    for own in _ownership_candidates(lv, rng):
        at = _place(lv, own)
        own = _land_free(lv, own, at)
        s = evaluate(lv, own, at)
        if _better(s, best, lv.cap):
            best = s
    assert best is not None
    counted = [i for i in range(lv.items) if lv.counted[i]]
    iters = 0
    while time.perf_counter() < t_end and iters < 400 and lv.bins > 1 and lv.fixed is None:
        iters += 1
        i, j = rng.sample(counted, 2)
        if best.own[i] == best.own[j]:
            continue
        own = list(best.own)
        own[i], own[j] = own[j], own[i]
        at = _place(lv, own)
        own = _land_free(lv, own, at)
        s = evaluate(lv, own, at)
        if _better(s, best, lv.cap):
            best = s
    best.source = "heuristic"
    return best


# ---------------------------------------------------------------------------------- ILP
def solve_ilp(lv: Level, incumbent: Solution, *, time_limit: float, max_nodes: int = 2000,
              max_binaries: int = 6000) -> tuple[Solution, SolveInfo]:
    """The exact MILP of the module docstring, warm-started; returns the better of ILP and incumbent."""
    pulp = require_pulp()
    nb = lv.bins
    n_bin = len(lv.cells) * nb + lv.items * nb
    if nb == 1:
        return incumbent, SolveInfo(name=lv.name, status="Optimal", objective=incumbent.V, bound=incumbent.V,
                                    gap=0.0, note="one bin: nothing to choose")
    if n_bin > max_binaries:
        return incumbent, SolveInfo(name=lv.name, status="Skipped", objective=incumbent.V, variables=n_bin,
                                    note=f"{n_bin} binaries > max_binaries={max_binaries}: heuristic kept")
    prob = pulp.LpProblem(lv.name.replace(" ", "_"), pulp.LpMinimize)
    B = range(nb)
    x = {(c, b): pulp.LpVariable(f"x_{c}_{b}", cat="Binary") for c in range(len(lv.cells)) for b in B}
    y = _owner_vars(lv, B)
    V = pulp.LpVariable("V", lowBound=0)
    rows_of: dict[int, list[int]] = {}
    cols_of: dict[int, list[int]] = {}
    for c, (i, j) in enumerate(lv.cells):
        rows_of.setdefault(i, []).append(c)
        cols_of.setdefault(j, []).append(c)
    _assignment_constraints(prob, lv, x, y, B)
    f, u = _crossing_vars(prob, rows_of, x, y, B, "")
    fc, uc = _crossing_vars(prob, cols_of, x, y, B, "c")
    total_in = []
    for b in B:
        tin = (pulp.lpSum(lv.RI * f[(i, b)] + lv.RO * u[(i, b)] for i in rows_of)
               + pulp.lpSum(lv.CI * fc[(j, b)] + lv.CO * uc[(j, b)] for j in cols_of)
               + pulp.lpSum(lv.extra_in[i] * y[(i, b)] for i in range(lv.items)))
        tout = (pulp.lpSum(lv.RO * f[(i, b)] + lv.RI * u[(i, b)] for i in rows_of)
                + pulp.lpSum(lv.CO * fc[(j, b)] + lv.CI * uc[(j, b)] for j in cols_of)
                + pulp.lpSum(lv.extra_out[i] * y[(i, b)] for i in range(lv.items)))
        prob += tin <= V
        prob += tout <= V
        total_in.append(tin)
    # secondary objective: least total traffic among min-max solutions (tiny weight)
    eps = 1e-3 / max(1, nb)
    prob += V + eps * pulp.lpSum(total_in)
    _warm_start(lv, incumbent, x, y, B)
    info = solve(prob, name=lv.name, time_limit=time_limit, max_nodes=max_nodes)
    if info.status not in ("Optimal", "Stopped"):
        return incumbent, info
    own = [next(b for b in B if _val(y[(i, b)]) > 0.5) for i in range(lv.items)]
    at = [next(b for b in B if _val(x[(c, b)]) > 0.5) for c in range(len(lv.cells))]
    sol = evaluate(lv, own, at)
    sol.source = "ilp"
    info.objective = sol.V
    if max(sol.load) <= lv.cap + 1e-6 and sol.key() <= incumbent.key():
        info.used = True
        return sol, info
    info.note = (info.note + "; " if info.note else "") + "incumbent kept (ILP answer not better)"
    return incumbent, info


def _owner_vars(lv: Level, B: range) -> dict:
    """y[(item, bin)]: 1 if the bin owns the item; constants for a given layout, and 0 where symmetry breaking
    rules it out (bin b's first counted item is at least its b-th counted item)."""
    pulp = require_pulp()
    first_counted = {}
    rank = 0
    for i in range(lv.items):
        if lv.counted[i]:
            first_counted[i] = rank
            rank += 1
    y = {}
    for i in range(lv.items):
        for b in B:
            if lv.counted[i] and lv.fixed is not None:  # a given layout: constants
                y[(i, b)] = int(lv.fixed[i] == b)
            elif lv.counted[i] and first_counted[i] < b:
                y[(i, b)] = 0
            else:
                y[(i, b)] = pulp.LpVariable(f"y_{i}_{b}", cat="Binary")
    return y


def _assignment_constraints(prob, lv: Level, x: dict, y: dict, B: range) -> None:
    """Every cell computed once, every item owned once, equal counted items per bin, compute within the cap."""
    pulp = require_pulp()
    for c in range(len(lv.cells)):
        prob += pulp.lpSum(x[(c, b)] for b in B) == 1
    for i in range(lv.items):
        if any(not isinstance(y[(i, b)], int) for b in B):  # (a fixed item's row is constant)
            prob += pulp.lpSum(y[(i, b)] for b in B) == 1
    for b in B:
        if lv.fixed is None:
            prob += pulp.lpSum(y[(i, b)] for i in range(lv.items) if lv.counted[i]) == lv.per_bin
        prob += pulp.lpSum(lv.weight[c] * x[(c, b)] for c in range(len(lv.cells))) <= lv.cap


def _crossing_vars(prob, groups: dict[int, list[int]], x: dict, y: dict, B: range, tag: str) -> tuple[dict, dict]:
    """For each item (a row of cells, or with ``tag`` "c" a column): f[(i, b)] >= 1 when bin b computes one of its
    cells without owning it (the item travels in), u[(i, b)] >= the number of such bins when b owns it (it
    travels out that many times). Variables are named ``a{tag}``, ``f{tag}``, ``u{tag}``."""
    pulp = require_pulp()
    nb = len(B)
    a = {(i, b): pulp.LpVariable(f"a{tag}_{i}_{b}", 0, 1) for i in groups for b in B}
    f = {(i, b): pulp.LpVariable(f"f{tag}_{i}_{b}", 0, 1) for i in groups for b in B}
    u = {(i, b): pulp.LpVariable(f"u{tag}_{i}_{b}", 0) for i in groups for b in B}
    for i, cs in groups.items():
        for b in B:
            for c in cs:
                prob += a[(i, b)] >= x[(c, b)]
            prob += f[(i, b)] >= a[(i, b)] - y[(i, b)]
        total = pulp.lpSum(f[(i, b)] for b in B)
        for b in B:
            prob += u[(i, b)] >= total - nb * (1 - y[(i, b)])
    return f, u


def _warm_start(lv: Level, incumbent: Solution, x: dict, y: dict, B: range) -> None:
    """The incumbent as the MILP's starting point, its bins relabelled to satisfy the symmetry breaking."""
    inc = canonical(lv, incumbent)
    for c, b0 in enumerate(inc.at):
        for b in B:
            x[(c, b)].setInitialValue(1 if b == b0 else 0)
    for i, b0 in enumerate(inc.own):
        for b in B:
            if not isinstance(y[(i, b)], int):
                y[(i, b)].setInitialValue(1 if b == b0 else 0)


def canonical(lv: Level, sol: Solution) -> Solution:
    """Relabel bins (they are interchangeable) so bins appear in order of their first counted item.

    Under a fixed layout bins are not interchangeable: the solution is returned as it is."""
    if lv.fixed is not None:
        return sol
    perm: dict[int, int] = {}
    for i in range(lv.items):
        if lv.counted[i] and sol.own[i] not in perm:
            perm[sol.own[i]] = len(perm)
    for b in range(lv.bins):
        perm.setdefault(b, len(perm))
    out = evaluate(lv, [perm[b] for b in sol.own], [perm[b] for b in sol.at])
    out.source = sol.source
    return out


def _val(v) -> float:
    return float(v) if isinstance(v, int) else (v.value() or 0.0)
