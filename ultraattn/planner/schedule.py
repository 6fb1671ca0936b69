"""Kernel graph, list scheduling and the schedule simulator.

``build_graph(plan, work, cost, phase)`` turns a ``TilePlan`` into tasks with
dependencies and durations:

* attention kernels run on the rank's ``compute`` stream;
* a message occupies the sender's ``send_<link>`` and the receiver's ``recv_<link>``
  stream (``link`` = ``intra`` or ``inter``: NVLink and the NIC are separate engines);
* merges of partial results (o, dq, dkv) run on the owner's compute stream;
* ranks that share compute hardware (``CostModel.alone_speedup`` > 1: CPU ranks on fewer cores) share it:
  a node's compute tasks run faster while fewer of its ranks compute, and messages inside the node (copies on the
  same cores) take their share too (``SharedCompute``).

Dependencies: a kernel waits for the messages that bring its remote inputs; an input
message leaves a relay only after it arrived there; a partial leaves a rank after that
rank's contributing kernels and all incoming partials of the same unit (a reduction
chain); a merge waits for every partial of its unit.

``simulate(graph, priority)`` is a non-delay list scheduler: whenever a stream is
free it starts the ready task of best (lowest) priority whose streams are all free.
It never deadlocks (the graph is a DAG) and replays any priority order into a
makespan. The default priority is the critical-path rule (longest path to the end
first, HLFET), the classic strong list-scheduling heuristic.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from . import native
from .cost import CostModel
from .plan import (
    PARTIAL_TENSORS,
    ROW_TENSORS,
    AttnShape,
    TilePlan,
    padded_chunk,
)

if TYPE_CHECKING:
    from ..masks.cells import BlockCells
    from ..masks.pattern import BlockPattern

INPUT_TENSORS = {"fwd": ("q", "kv"), "bwd": ("qdo", "do", "kv")}
FINAL_TENSORS = frozenset({"out", "dq_out", "dkv_out"})
#: the partial whose reduction a final message completes (Ulysses x ring sends o/dq/dkv sums onward)
PARTIAL_OF_FINAL = {"out": "o", "dq_out": "dq", "dkv_out": "dkv"}


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class Workload:
    """Per-cell work of one attention on the planner grid (from ``BlockPattern.chunk_stats``)."""

    full_GPP: torch.Tensor
    """float64 [G, P, P]: FULL blocks per cell, summed over the head group's heads and batch."""
    partial_GPP: torch.Tensor
    """float64 [G, P, P]: PARTIAL blocks per cell."""
    pairs_GPP: torch.Tensor
    """float64 [G, P, P]: attending (q, kv) pairs per cell (useful work)."""
    block: int
    """Pattern block size in tokens."""
    head_dim: int
    rows_per_chunk: float
    """Query block rows per chunk and head group: (chunk / block) * heads_in_group * batch."""

    def cell_blocks(self, cost: CostModel) -> torch.Tensor:
        """Cost-weighted block count per cell (FULL = 1, PARTIAL = 1 + overhead)."""
        return self.full_GPP + self.partial_GPP * (1.0 + cost.partial_block_overhead)

    def nonempty_GPP(self) -> torch.Tensor:
        return (self.full_GPP + self.partial_GPP) > 0

    def kernel_seconds(self, g: int, cells, cost: CostModel, phase: str) -> float:
        """Seconds of one kernel over ``cells`` of head group ``g`` (``kernels_seconds`` of one)."""
        return float(self.kernels_seconds([(g, cells)], cost, phase)[0])

    def kernels_seconds(self, kernels, cost: CostModel, phase: str) -> np.ndarray:
        """Seconds of every kernel, given as (head group, cells) pairs, at once (``CostModel.blocks_seconds``)."""
        sizes = np.fromiter((len(c) for _, c in kernels), dtype=np.int64)
        n = sizes.size
        k_N = np.repeat(np.arange(n), sizes)
        g_N = np.repeat(np.fromiter((g for g, _ in kernels), dtype=np.int64, count=n), sizes)
        ij = np.fromiter((x for _, cs in kernels for c in cs for x in c), dtype=np.int64,
                         count=2 * int(sizes.sum())).reshape(-1, 2)
        full = self.full_GPP.numpy()[g_N, ij[:, 0], ij[:, 1]]
        part = self.partial_GPP.numpy()[g_N, ij[:, 0], ij[:, 1]]
        blocks = np.bincount(k_N, full + part * (1.0 + cost.partial_block_overhead), minlength=n)
        nonempty = np.bincount(k_N, full + part, minlength=n)
        p = self.full_GPP.shape[1]
        rows = np.bincount(np.unique(k_N * p + ij[:, 0]) // p, minlength=n)
        return cost.blocks_seconds(blocks, nonempty, rows, block=self.block, head_dim=self.head_dim,
                                   rows_per_chunk=self.rows_per_chunk, phase=phase)


def workload(pattern: BlockPattern | BlockCells, shape: AttnShape, *, num_chunks: int, head_groups: int = 1,
             chunk: int | None = None) -> Workload:
    """Per-cell work of ``pattern`` on a num_chunks grid with ``head_groups`` equal head groups
    (chunks of ``chunk`` tokens; default: the smallest block multiple that covers the sequence).
    ``BlockCells`` give the same numbers without a dense grid (``evaluate`` takes them too)."""
    if pattern.q_len != shape.seq_len:
        raise ValueError(f"pattern q_len {pattern.q_len} must equal seq_len {shape.seq_len}")
    if chunk is None:
        chunk = padded_chunk(shape.seq_len, num_chunks, pattern.q_block)
    h = shape.num_heads
    hg = [list(range(g * h // head_groups, (g + 1) * h // head_groups)) for g in range(head_groups)]
    st = {k: torch.as_tensor(v) for k, v in pattern.chunk_stats(chunk, num_chunks, hg, num_heads=h).items()}
    bmul = shape.batch if pattern.num_batch_patterns == 1 else 1
    if pattern.num_batch_patterns not in (1, shape.batch):
        raise ValueError(f"pattern has {pattern.num_batch_patterns} batch entries, shape.batch is {shape.batch}")
    return Workload(full_GPP=st["full"] * bmul, partial_GPP=st["partial"] * bmul, pairs_GPP=st["pairs"] * bmul,
                    block=pattern.q_block, head_dim=shape.head_dim,
                    rows_per_chunk=(chunk // pattern.q_block) * (h // head_groups) * shape.batch)


@dataclass(slots=True)
class Task:
    id: int
    kind: str
    """'attn', 'merge', or the tensor name of a message."""
    rank: int
    """Compute rank, or the sender of a message."""
    streams: tuple[tuple[int, str], ...]
    duration: float
    deps: list[int] = field(default_factory=list)
    dst: int = -1
    nbytes: int = 0
    where: tuple = ()
    """What ``label`` names besides kind and ranks: a kernel's (head group, stage, cells), a message's (chunk, head
    group). (Formatted only when read: a replay makes thousands of tasks and reads no label.)"""
    unit: tuple = ()
    """A merge's (partial tensor, chunk, head group)."""

    def with_deps(self, deps: list[int]) -> Task:
        """A copy with ``deps`` (``dataclasses.replace`` took a third of an executed replay's time)."""
        return Task(self.id, self.kind, self.rank, self.streams, self.duration, deps, self.dst, self.nbytes,
                    self.where, self.unit)

    @property
    def label(self) -> str:
        if self.kind == "attn":
            g, stage, cells = self.where
            return f"attn r{self.rank} g{g} s{stage} n{cells}"
        if self.kind == "merge":
            tensor, chunk, g = self.unit
            return f"merge {tensor} c{chunk} g{g} @{self.rank}"
        chunk, g = self.where
        return f"{self.kind} c{chunk} g{g} {self.rank}->{self.dst}"


@dataclass(frozen=True, slots=True)
class SharedCompute:
    """Compute shared by the ranks of a node (``CostModel.alone_speedup`` > 1): kernel and message durations are
    for every rank of the node busy; with ``k`` tasks running on the node (kernels, and messages between its ranks,
    which copy on the same cores), each runs ``min(speedup, ranks / k)`` times faster (processor sharing:
    ``ranks / speedup`` cores' worth of hardware, at most one per task)."""

    node_of: tuple[int, ...]
    """Node of each rank."""
    ranks: int
    """Ranks per node."""
    speedup: float
    """``CostModel.alone_speedup``."""

    def speed(self, busy: int) -> float:
        return min(self.speedup, self.ranks / busy) if busy else self.speedup


@dataclass(slots=True)
class Graph:
    tasks: list[Task]
    phase: str
    succ: list[list[int]] = field(default_factory=list)
    shared: SharedCompute | None = None
    """Ranks that share compute hardware (CPU ranks on fewer cores), or None: every rank has its own device."""
    kernels: int = 0
    """The first ``kernels`` tasks are the plan's kernels, the next ``messages`` its messages (``build_graph``)."""
    messages: int = 0

    def __post_init__(self) -> None:
        self.succ = [[] for _ in self.tasks]
        for t in self.tasks:
            for d in t.deps:
                self.succ[d].append(t.id)


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class Schedule:
    """Start and end time of every task of a graph (seconds)."""

    graph: Graph
    start: list[float]
    end: list[float]

    @property
    def makespan(self) -> float:
        return max(self.end, default=0.0)

    def stream_busy(self) -> dict[tuple[int, str], float]:
        busy: dict[tuple[int, str], float] = defaultdict(float)
        for t in self.graph.tasks:
            for s in t.streams:
                busy[s] += t.duration
        return dict(busy)

    def gantt_tasks(self, ranks=None) -> list[dict]:
        """Plain dicts for the report's Gantt chart (one entry per task and stream)."""
        out = []
        for t in self.graph.tasks:
            for rank, stream in t.streams:
                if ranks is None or rank in ranks:
                    out.append({"rank": rank, "stream": stream, "start": self.start[t.id],
                                "end": self.end[t.id], "kind": t.kind})
        return out

    def check(self, tol: float = 1e-12) -> None:
        """Assert precedence and one task at a time per stream (used by tests)."""
        for t in self.graph.tasks:
            for d in t.deps:
                if self.start[t.id] < self.end[d] - tol:
                    raise AssertionError(f"task {t.id} ({t.label}) starts before its dependency {d} ends")
        per: dict = defaultdict(list)
        for t in self.graph.tasks:
            if t.duration > 0:
                for s in t.streams:
                    per[s].append((self.start[t.id], self.end[t.id], t.id))
        for s, iv in per.items():
            iv.sort()
            for (_a0, a1, ia), (b0, _b1, ib) in zip(iv, iv[1:]):
                if b0 < a1 - tol:
                    raise AssertionError(f"tasks {ia} and {ib} overlap on stream {s}")


#: a message's streams at its sender and receiver, by whether it crosses nodes
_SEND = ("send_intra", "send_inter")
_RECV = ("recv_intra", "recv_inter")


def _kernel_index(kernels) -> tuple[list, dict, dict]:
    """Each kernel's (rows, columns), and the kernels (task ids: kernels come first) by (rank, head group, row) and by
    (rank, head group, column): the same in every phase of a plan (``replay_phases`` makes them once)."""
    axes, by_row, by_col = [], defaultdict(list), defaultdict(list)
    for n, k in enumerate(kernels):
        rows, cols = {c[0] for c in k.cells}, {c[1] for c in k.cells}
        axes.append((rows, cols))
        for i in rows:
            by_row[(k.rank, k.head_group, i)].append(n)
        for j in cols:
            by_col[(k.rank, k.head_group, j)].append(n)
    return axes, by_row, by_col


def build_graph(plan: TilePlan, work: Workload | None, cost: CostModel | None, phase: str, *,
                kernel_seconds=None, index: tuple | None = None) -> Graph:
    """Kernel graph of one phase of a plan (module docstring): the plan's kernels first (in plan order), then one task
    per message of ``plan.transfers_for(phase)``, then the merges. ``kernel_seconds``: each kernel's duration, where
    the caller has them (the fast planner's arrays), instead of ``work``'s; ``index``: ``_kernel_index`` of the plan's
    kernels, where the caller made it. Without ``work`` and ``cost``, unit
    durations (a kernel: its cells; a message: 1; a merge: 1/2), for an order without a cost model
    (``program.unit_order``)."""
    kernels = plan.kernels
    axes, kern_by_row, kern_by_col = _kernel_index(kernels) if index is None else index
    if kernel_seconds is not None:
        durations = [float(x) for x in kernel_seconds]
    elif work is None:
        durations = [float(len(k.cells)) for k in kernels]
    else:
        durations = work.kernels_seconds([(k.head_group, k.cells) for k in kernels], cost, phase).tolist()
    # (Tasks made positionally: 0.28 us each against 0.83 with keywords and the deps default; thousands a replay)
    tasks = [Task(n, "attn", k.rank, ((k.rank, "compute"),), dur, [], -1, 0, (k.head_group, k.stage, len(k.cells)))
             for n, (k, dur) in enumerate(zip(kernels, durations))]
    kernel_ids = range(len(tasks))

    msgs = plan.transfers_for(phase)
    arrive: dict[tuple[str, int, int, int], int] = {}  # (tensor, chunk, g, dst) -> task id
    incoming: dict[tuple[str, int, int, int], list[int]] = defaultdict(list)
    msg_ids = []
    devices = plan.mesh.devices
    seconds: dict[tuple[int, bool], float] = {}   # (bytes, across nodes) -> duration: few sizes, many messages
    for m in msgs:
        inter = m.src // devices != m.dst // devices
        dur = seconds.get((m.nbytes, inter))
        if dur is None:
            dur = seconds[(m.nbytes, inter)] = 1.0 if cost is None else cost.message_seconds(m.nbytes,
                                                                                              inter_node=inter)
        t = Task(len(tasks), m.tensor, m.src, ((m.src, _SEND[inter]), (m.dst, _RECV[inter])), dur, [], m.dst,
                 m.nbytes, (m.chunk, m.head_group))
        tasks.append(t)
        msg_ids.append(t.id)
        key = (m.tensor, m.chunk, m.head_group, m.dst)
        if m.tensor in PARTIAL_TENSORS:
            incoming[key].append(t.id)
        else:
            if key in arrive:
                raise ValueError(f"input unit {key} is delivered twice in plan {plan.method}")
            arrive[key] = t.id

    def contributors(tensor: str, chunk: int, g: int, rank: int) -> list[int]:
        table = kern_by_row if tensor in ROW_TENSORS else kern_by_col
        return table.get((rank, g, chunk), [])

    for m, tid in zip(msgs, msg_ids):
        t = tasks[tid]
        if m.tensor in PARTIAL_TENSORS or m.tensor in FINAL_TENSORS:
            t.deps.extend(contributors(m.tensor, m.chunk, m.head_group, m.src))
            part = PARTIAL_OF_FINAL.get(m.tensor, m.tensor)
            t.deps.extend(incoming.get((part, m.chunk, m.head_group, m.src), []))
        else:
            prev = arrive.get((m.tensor, m.chunk, m.head_group, m.src))
            if prev is not None:
                t.deps.append(prev)
    # kernels wait for their remote inputs
    for k, tid, (rows, cols) in zip(kernels, kernel_ids, axes):
        deps = tasks[tid].deps
        for tensor in INPUT_TENSORS[phase]:
            idx = rows if tensor in ROW_TENSORS else cols
            for c in idx:
                a = arrive.get((tensor, c, k.head_group, k.rank))
                if a is not None:
                    deps.append(a)
    # merges at the final holder of each partial unit; a relay that forwards the unit
    # accumulates on the way (its add is folded into the message, as in ring attention)
    forwards = {(PARTIAL_OF_FINAL.get(m.tensor, m.tensor), m.chunk, m.head_group, m.src)
                for m in msgs if m.tensor in PARTIAL_TENSORS or m.tensor in FINAL_TENSORS}
    for (tensor, chunk, g, dst), ids in incoming.items():
        if (tensor, chunk, g, dst) in forwards:
            continue
        nbytes = sum(tasks[i].nbytes for i in ids)
        t = Task(id=len(tasks), kind="merge", rank=dst, streams=((dst, "compute"),),
                 duration=0.5 if cost is None else cost.merge_seconds(2 * nbytes, lse=tensor == "o"),
                 unit=(tensor, chunk, g))
        t.deps.extend(ids)
        t.deps.extend(contributors(tensor, chunk, g, dst))
        tasks.append(t)
    shared = None
    if cost is not None and cost.alone_speedup > 1 and plan.mesh.devices > 1:
        shared = SharedCompute(node_of=tuple(plan.mesh.node_of(r) for r in range(plan.world)),
                               ranks=plan.mesh.devices, speedup=cost.alone_speedup)
    return Graph(tasks=tasks, phase=phase, shared=shared, kernels=len(kernels), messages=len(msgs))


def replay_phases(plan: TilePlan, cells: BlockPattern | BlockCells | None, cost: CostModel, *, backward: bool,
                  kernel_seconds: dict[str, np.ndarray] | None = None) -> dict[str, Schedule]:
    """The simulator's replay of each phase of ``plan`` (``planner.api.evaluate``'s, without its reports): kernel
    durations from the mask's workload (``cells``), or ``kernel_seconds`` (phase -> each kernel's seconds, as the fast
    planner's price has them: the same replay, without the workload)."""
    phases = ("fwd", "bwd") if backward else ("fwd",)
    index = _kernel_index(plan.kernels)
    if kernel_seconds is not None:
        return {ph: simulate(build_graph(plan, None, cost, ph, kernel_seconds=kernel_seconds[ph], index=index))
                for ph in phases}
    work = workload(cells, plan.shape, num_chunks=plan.num_chunks, head_groups=plan.num_head_groups,
                    chunk=plan.chunk_size)
    return {ph: simulate(build_graph(plan, work, cost, ph, index=index)) for ph in phases}


def evaluate_plan(plan: TilePlan, cells: BlockPattern | BlockCells, cost: CostModel, *, backward: bool) -> float:
    """The simulator's fwd (+ bwd) makespan of ``plan`` (``replay_phases``)."""
    return sum(s.makespan for s in replay_phases(plan, cells, cost, backward=backward).values())


def bottom_levels(graph: Graph) -> list[float]:
    """Longest duration path from each task to the end (inclusive)."""
    n = len(graph.tasks)
    indeg = [len(graph.succ[i]) for i in range(n)]
    bl = [0.0] * n
    stack = [i for i in range(n) if indeg[i] == 0]
    pred = [t.deps for t in graph.tasks]
    succ = graph.succ
    dur = [t.duration for t in graph.tasks]
    at = bl.__getitem__
    while stack:
        v = stack.pop()
        after = succ[v]
        bl[v] = (dur[v] + max(map(at, after))) if after else (dur[v] + 0.0)
        for p in pred[v]:
            indeg[p] -= 1
            if indeg[p] == 0:
                stack.append(p)
    return bl


class _Pool:
    """Processor sharing of the tasks that use a node's cores (``SharedCompute``: kernels, merges, messages between
    its ranks) inside ``simulate``: a running task keeps its remaining work (seconds at the all-busy rate);
    whenever a node's count of running tasks changes, their ends are re-timed and pushed again (an event carries a
    version; stale ones are skipped)."""

    def __init__(self, graph: Graph, end: list[float], events: list):
        sh = graph.shared
        self.sh, self.end, self.events = sh, end, events
        # compute tasks, and messages inside a node (loopback copies on the same cores), share the node
        self.node = [sh.node_of[t.rank] if t.streams[0][1] == "compute" or (t.dst >= 0 and t.streams[0][1] ==
                     "send_intra") else -1 for t in graph.tasks]
        self.left = [t.duration for t in graph.tasks]
        self.since = [0.0] * len(graph.tasks)
        self.version = [0] * len(graph.tasks)
        self.running: dict[int, list[int]] = defaultdict(list)

    def __getitem__(self, i: int) -> int:
        return self.node[i]

    def current(self, i: int, ver: int) -> bool:
        return self.node[i] < 0 or ver == self.version[i]

    def _advance(self, n: int, now: float) -> None:
        speed = self.sh.speed(len(self.running[n]))
        for j in self.running[n]:
            self.left[j] = max(self.left[j] - (now - self.since[j]) * speed, 0.0)
            self.since[j] = now

    def _retime(self, n: int, now: float) -> None:
        speed = self.sh.speed(len(self.running[n]))
        for j in self.running[n]:
            self.version[j] += 1
            self.end[j] = now + self.left[j] / speed
            heapq.heappush(self.events, (self.end[j], self.version[j], j))

    def start(self, i: int, now: float) -> None:
        n = self.node[i]
        self._advance(n, now)
        self.since[i] = now
        self.running[n].append(i)
        self._retime(n, now)

    def finish(self, i: int, now: float) -> None:
        n = self.node[i]
        self._advance(n, now)
        self.running[n].remove(i)
        self.end[i] = now
        self.version[i] += 1   # any end pushed for it before is stale now
        self._retime(n, now)


def simulate(graph: Graph, priority: list[float] | None = None) -> Schedule:
    """Non-delay list scheduling of ``graph`` (module docstring); lower priority runs first.

    Ready tasks wait in heaps keyed by (first stream, second stream): when a stream frees, only
    the heads of its heaps whose second stream is free are looked at, so a rank with thousands of
    queued messages to busy receivers costs one look per receiver, not per message.

    One function on purpose (over 80 lines): it is the planners' innermost loop (~10 us a task), its state
    is a handful of local lists and heaps the closure and the loop share, and locals are what keeps it fast.
    Without shared compute the same loop runs in C where it could be built (``native.py``, ``simulate.c``: the same
    decisions in the same order, so the same schedule to the last bit); this one is its definition and fallback.
    """
    tasks = graph.tasks
    n = len(tasks)
    # (the same loop in C, ``native.py``, where it is built and nothing is shared: the same schedule, 4x faster)
    lib = native.LIBRARY.get() if graph.shared is None else None
    if priority is None and lib is None:
        priority = [-b for b in bottom_levels(graph)]
    # streams as integers in the order of their (rank, name) tuples: lists, heaps and the sort below index and
    # compare ints, not tuples; the second stream of a one-stream task is -1
    names = sorted({x for t in tasks for x in t.streams})
    sid = {x: k for k, x in enumerate(names)}
    first = [sid[t.streams[0]] for t in tasks]
    second = [sid[t.streams[1]] if len(t.streams) > 1 else -1 for t in tasks]
    dur = [t.duration for t in tasks]
    succ = graph.succ
    stride = len(names) + 1
    missing = [len(t.deps) for t in tasks]
    if lib is not None:
        start, end = native.simulate(lib, len(names), first, second, dur, priority, succ, missing)
        return Schedule(graph=graph, start=start, end=end)
    ready_time = [0.0] * n
    start = [0.0] * n
    end = [0.0] * n
    busy = [False] * len(names)
    heaps: dict[int, list] = {}  # first stream * stride + second stream + 1 -> heap of (priority, id)
    pending = [set() for _ in names]  # first stream -> second streams with a non-empty heap
    waiting_on = [set() for _ in names]  # second stream -> first streams with tasks for it
    events: list = []
    done = 0
    now = 0.0
    dirty: set = set()
    pool = _Pool(graph, end, events) if graph.shared is not None else None
    push, pop = heapq.heappush, heapq.heappop

    def make_ready(i: int) -> None:
        s0, s1 = first[i], second[i]
        key = s0 * stride + s1 + 1
        h = heaps.get(key)
        if h is None:
            h = heaps[key] = []
        push(h, (priority[i], i))
        pending[s0].add(s1)
        if s1 >= 0:
            waiting_on[s1].add(s0)
        dirty.add(s0)

    for i in range(n):
        if missing[i] == 0:
            make_ready(i)
    while done < n:
        # [Note] freed streams are served in a fixed order (the streams' order, not a set's, which follows string
        # hashes and so changes between processes): the same plan replays to the same makespan in every process
        for s0 in sorted(dirty):
            todo = pending[s0]
            if busy[s0] or not todo:
                continue
            best = None
            for s1 in todo:
                if s1 >= 0 and busy[s1]:
                    continue
                head = heaps[s0 * stride + s1 + 1][0]
                if best is None or head < best[0]:
                    best = (head, s1)
            if best is None:
                continue
            (_, i), s1 = best
            h = heaps[s0 * stride + s1 + 1]
            pop(h)
            if not h:
                todo.discard(s1)
                if s1 >= 0:
                    waiting_on[s1].discard(s0)
            st = ready_time[i]
            if st < now:
                st = now
            start[i] = st
            end[i] = st + dur[i]
            busy[s0] = True
            if s1 >= 0:
                busy[s1] = True
            if pool is not None and pool[i] >= 0:
                pool.start(i, st)
            else:
                push(events, (end[i], 0, i))
        dirty.clear()
        if not events:
            raise RuntimeError("schedule simulation stalled: the task graph has a cycle")
        now, ver, i = pop(events)
        batch = [i] if pool is None or pool.current(i, ver) else []
        while events and events[0][0] <= now:
            _, ver, j = pop(events)
            if pool is None or pool.current(j, ver):
                batch.append(j)
        if pool is not None:
            for i in batch:
                if pool[i] >= 0:
                    pool.finish(i, now)
        for i in batch:
            done += 1
            x = first[i]
            busy[x] = False
            dirty.add(x)
            if waiting_on[x]:
                dirty.update(waiting_on[x])
            x = second[i]
            if x >= 0:
                busy[x] = False
                dirty.add(x)
                if waiting_on[x]:
                    dirty.update(waiting_on[x])
            for j in succ[i]:
                missing[j] -= 1
                if ready_time[j] < now:
                    ready_time[j] = now
                if missing[j] == 0:
                    make_ready(j)
    return Schedule(graph=graph, start=start, end=end)
