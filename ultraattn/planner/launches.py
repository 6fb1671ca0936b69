"""Kernel launches timed by a replay: a rank's remote cells grouped by when their inputs arrive.

``build.kernel_groups`` batches a row's remote cells in a fixed order, ``batch`` cells to a launch. A launch waits
for the last of its inputs, so a rank whose first batch waits for a slow input idles: star at 8x8 nodes, 512K,
batch 8, sat 10.5 ms between its local launches and its first remote one. Here a replay of the plan says when
each input reached each rank, and each rank's compute stream is walked in time:

1. its local cells first, one launch per row (as ``kernel_groups``);
2. then, whenever the stream is free, the row whose next input came first launches every cell whose inputs are
   there by then, at most ``cap`` of them, also taking a cell that arrives within ``slack`` (in seconds) of the
   launch's start; if nothing is there, the stream waits for the first arrival.

Arrivals move when the grouping changes, since the simulator orders each send engine's messages by the kernels
they feed. ``api`` therefore regroups from each new replay again and keeps whichever grouping replays fastest.
The result is a list of launches in the order the walk made them, per rank.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from .build import input_stage
from .cost import CostModel
from .plan import ROW_TENSORS, Kernel, TilePlan
from .schedule import INPUT_TENSORS, Schedule, Workload


def arrivals(plan: TilePlan, schedule: Schedule, phase: str) -> dict[tuple[str, int, int, int], float]:
    """When each input unit reached each rank in ``schedule`` (a replay of ``plan``'s ``phase``):
    (tensor, chunk, head group, rank) -> seconds. ``build_graph`` lays out the kernels first, then the messages
    in ``transfers_for(phase)`` order."""
    first = len(plan.kernels)
    return {(m.tensor, m.chunk, m.head_group, m.dst): schedule.end[first + n]
            for n, m in enumerate(plan.transfers_for(phase)) if m.tensor in INPUT_TENSORS[phase]}


def timed_kernels(plan: TilePlan, schedule: Schedule, work: Workload, cost: CostModel, phase: str, *,
                  cap: int, slack: float = 0.0) -> tuple[Kernel, ...]:
    """``plan``'s cells regrouped into launches by the arrival times of ``schedule`` (module docstring)."""
    if cap < 1:
        raise ValueError(f"`cap` must be at least 1, got {cap!r}")
    arrive = arrivals(plan, schedule, phase)
    own = np.asarray(plan.owner, dtype=np.int64)
    a = plan.assign_GPP.numpy()
    g_n, i_n, j_n = np.nonzero(a >= 0)
    r_n = a[g_n, i_n, j_n].astype(np.int64)
    stage_n = input_stage(own, r_n, i_n, j_n, plan.mesh.devices)
    local: dict[int, dict[tuple[int, int], list]] = defaultdict(lambda: defaultdict(list))
    remote: dict[int, dict[tuple[int, int], list]] = defaultdict(lambda: defaultdict(list))
    for g, i, j, r, stage in zip(g_n.tolist(), i_n.tolist(), j_n.tolist(), r_n.tolist(), stage_n.tolist()):
        if stage == 0:
            local[r][(g, i)].append((i, j))
        else:   # (a unit this rank holds, owned or kept from the forward, arrives at 0)
            ready = max(arrive.get((tensor, i if tensor in ROW_TENSORS else j, g, r), 0.0)
                        for tensor in INPUT_TENSORS[phase])
            remote[r][(g, i)].append((ready, j, stage))
    kernels: list[Kernel] = []
    for r in sorted(set(local) | set(remote)):
        now = 0.0
        for (g, _i), cells in sorted(local[r].items()):
            kernels.append(Kernel(rank=r, head_group=g, cells=tuple(sorted(cells)), stage=0))
            now += work.kernel_seconds(g, cells, cost, phase)
        queue = {row: sorted(cells) for row, cells in remote[r].items()}
        while queue:
            first, row = min((cells[0][0], row) for row, cells in queue.items())
            now = max(now, first)
            cells = queue[row]
            n = 1
            while n < min(cap, len(cells)) and cells[n][0] <= now + slack:
                n += 1
            take, rest = cells[:n], cells[n:]
            now = max(now, take[-1][0])
            g, i = row
            launch = tuple(sorted((i, j) for _, j, _ in take))
            kernels.append(Kernel(rank=r, head_group=g, cells=launch, stage=max(s for *_, s in take)))
            now += work.kernel_seconds(g, launch, cost, phase)
            if rest:
                queue[row] = rest
            else:
                del queue[row]
    return tuple(kernels)
