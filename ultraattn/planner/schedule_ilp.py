"""Scheduling ILP (UltraAttn's runtime ILP), applied where it pays: the critical rank.

The list scheduler (``schedule.simulate``, critical-path priorities) gives every task a
start time: that is the incumbent. The ILP then reorders the compute stream of the rank
that finishes last, with the other ranks' message arrivals fixed as release times:

    min E  s.t.  s_v >= release_v,  s_v >= s_u + t_u        (u -> v on this rank)
                 s_u + t_u <= s_v + M o_uv,  s_v + t_v <= s_u + M (1 - o_uv)
                 E >= s_v + t_v

warm-started from the list schedule, under a time and node limit. Its order becomes the
priority of those tasks and the whole graph is replayed by the list scheduler: the
refined schedule is kept only when the replayed makespan is shorter. Repeated over the
rank that is critical next, within the budget. A time-out or an infeasible model keeps
the list schedule with a note, never an exception.
"""

from __future__ import annotations

import time

from .ilp import SolveInfo, require_pulp, solve
from .schedule import Schedule, bottom_levels, simulate

MAX_TASKS = 36


def _order_critical_rank(sched: Schedule, rank: int, *, time_limit: float) -> tuple[list[int] | None, SolveInfo]:
    pulp = require_pulp()
    g = sched.graph
    tasks = [t for t in g.tasks if (rank, "compute") in t.streams and t.duration > 0]
    info = SolveInfo(name=f"schedule (rank {rank})", status="Skipped")
    if len(tasks) < 2:
        info.note = "fewer than two compute tasks"
        return None, info
    if len(tasks) > MAX_TASKS:
        info.note = f"{len(tasks)} compute tasks > {MAX_TASKS}: list schedule kept"
        return None, info
    ids = {t.id for t in tasks}
    release = {t.id: max((sched.end[d] for d in t.deps if d not in ids), default=0.0) for t in tasks}
    # internal precedence (transitively through other ranks' tasks is ignored: release times cover it)
    scale = 1e3  # milliseconds keep CBC's numbers well conditioned
    big_m = scale * (sum(t.duration for t in tasks) + max(release.values()))
    prob = pulp.LpProblem("schedule", pulp.LpMinimize)
    s = {t.id: pulp.LpVariable(f"s_{t.id}", lowBound=scale * release[t.id]) for t in tasks}
    e = pulp.LpVariable("E", lowBound=0)
    prob += e
    for t in tasks:
        prob += e >= s[t.id] + scale * t.duration
        for d in t.deps:
            if d in ids:
                prob += s[t.id] >= s[d] + scale * g.tasks[d].duration
    order = sorted(tasks, key=lambda t: sched.start[t.id])
    for a in range(len(order)):
        for b in range(a + 1, len(order)):
            u, v = order[a], order[b]
            o = pulp.LpVariable(f"o_{u.id}_{v.id}", cat="Binary")
            o.setInitialValue(1)
            prob += s[u.id] + scale * u.duration <= s[v.id] + big_m * (1 - o)
            prob += s[v.id] + scale * v.duration <= s[u.id] + big_m * o
    for t in tasks:
        s[t.id].setInitialValue(scale * sched.start[t.id])
    e.setInitialValue(scale * max(sched.end[t.id] for t in tasks))
    info = solve(prob, name=f"schedule (rank {rank})", time_limit=time_limit, max_nodes=2000)
    if info.status not in ("Optimal", "Stopped"):
        return None, info
    return [t.id for t in sorted(tasks, key=lambda t: (s[t.id].value() or 0.0, t.id))], info


def refine_schedule(ev, *, time_limit: float, rounds: int = 3):
    """Try the ILP on the critical rank(s) of the forward schedule; keep any improvement.

    Only the forward graph is replayed (the backward schedule is untouched); ``ev`` is updated
    in place and returned with the last ``SolveInfo``.
    """
    t_end = time.perf_counter() + time_limit
    best = ev
    last_info = SolveInfo(name="schedule", status="Skipped", note="no critical rank to refine")
    tried: set[int] = set()
    priority = None
    for _ in range(rounds):
        left = t_end - time.perf_counter()
        if left <= 0.2:
            break
        sched = best.fwd
        g = sched.graph
        crit = max(range(len(g.tasks)), key=lambda i: sched.end[i]) if g.tasks else None
        if crit is None:
            break
        rank = g.tasks[crit].rank
        if rank in tried:
            break
        tried.add(rank)
        order, info = _order_critical_rank(sched, rank, time_limit=left)
        last_info = info
        if order is None:
            continue
        if priority is None:
            priority = [-b for b in bottom_levels(g)]
        trial = list(priority)
        base = min(priority) - len(order) - 1
        for n, tid in enumerate(order):
            trial[tid] = base + n
        cand = simulate(g, trial)
        if cand.makespan * 1e3 < best.fwd_ms * (1 - 1e-9):
            info.used = True
            info.note = (info.note + "; " if info.note else "") + (
                f"replayed makespan {best.fwd_ms:.4f} -> {cand.makespan * 1e3:.4f} ms")
            best.fwd, best.fwd_ms, priority = cand, cand.makespan * 1e3, trial
        else:
            info.note = (info.note + "; " if info.note else "") + "list schedule already as good: kept"
    return best, last_info
