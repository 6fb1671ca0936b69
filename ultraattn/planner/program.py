"""A rank's program for one phase of a plan: the posts, waits and launches it runs, in one global run order.

Every rank sorts its part of the plan by the plan's ``RunOrder`` (the planner's replay: a kernel's start, a message's
payload-ready time) and walks it:

* ``Post``: messages whose turn has come are posted (sends with their payload, receives into new buffers); nothing
  waits. The receives of one post are grouped by the step that first needs them, so a wait never holds up work for
  a message that lands later. Relays (``relays``) are posted apart from other sends, so that on a GPU a relay
  waits for no launch (below);
* ``Wait``: right before the first step that needs a received message (a launch, a relay's send, a partial's
  onward send; the rest at the end of the phase);
* ``Launch``: the plan's kernels whose turn has come, consecutive ones fused per (head group, row).

So a launch runs as soon as its own inputs are here, a relay leaves when its unit lands, and a partial leaves when
its row's (or column's) launches are done. Why it cannot deadlock: a step waits only for a message whose payload was
ready before the step's own key in the replay (a message takes time), so the sender posts it at an earlier key;
by induction over the keys every wait ends. Every rank posts in the same key order, so per pair of ranks the
sends and receives come in one order (what NCCL's matching needs).

The planner prices exactly this program (``executed_graph``): the replay's graph, plus what the rank adds.
Launches run in program order, each after the waits before it. On CPU ranks a send cannot leave before the
launches and waits before it in the program have ended (the host runs them). On a GPU the executor posts on a
communication stream (``runtime/streams.py``): a post that only relays (``relays``) leaves once the receives waited
for before it have landed, any other post after the compute stream's work before it too.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .plan import COL_TENSORS, RunOrder, TilePlan, Transfer
from .schedule import INPUT_TENSORS, PARTIAL_OF_FINAL, Graph, Schedule, build_graph, simulate, workload

if TYPE_CHECKING:
    from ..masks.cells import BlockCells
    from ..masks.pattern import BlockPattern
    from .cost import CostModel


Message = tuple[int, Transfer]
"""(index in ``plan.transfers``: the message's tag, transfer)."""


@dataclass(frozen=True, slots=True)
class Post:
    """Post these messages (one ``io.start``)."""

    sends: tuple[Message, ...]
    recvs: tuple[Message, ...]


@dataclass(frozen=True, slots=True)
class Wait:
    """Wait for the receives of post ``post`` (its index in the program)."""

    post: int


@dataclass(frozen=True, slots=True)
class Launch:
    """Tiles: one call per (head group, row) over its kv chunks (ascending), rows in first-named order."""

    rows: tuple[tuple[int, int, tuple[int, ...]], ...]
    """(head group, q chunk, kv chunks)."""
    kernels: tuple[int, ...]
    """The plan kernels (indices in ``plan.kernels``) this launch runs."""


Step = Post | Wait | Launch


def run_order(sched: Schedule) -> RunOrder:
    """The run order of a replay (``build_graph`` + ``simulate``): each kernel's start, each message's ready time."""
    g = sched.graph
    tasks = g.tasks
    msgs = range(g.kernels, g.kernels + g.messages)
    ready = [max((sched.end[d] for d in tasks[i].deps), default=0.0) for i in msgs]
    return RunOrder(kernels=tuple(sched.start[:g.kernels]), transfers=tuple(ready),
                    leaves=tuple(sched.start[i] for i in msgs))


def unit_order(plan: TilePlan, phase: str) -> RunOrder:
    """The run order of a plan made without a cost model: its replay with unit durations (``build_graph``)."""
    return run_order(simulate(build_graph(plan, None, None, phase)))


def order_of(plan: TilePlan, phase: str) -> RunOrder:
    """The plan's run order of ``phase``, else ``unit_order``."""
    return plan.order.get(phase) or unit_order(plan, phase)


def with_order(plan: TilePlan, schedules: dict[str, Schedule]) -> TilePlan:
    """``plan`` carrying the run order of each replayed phase (``schedules``: phase -> the plan's replay)."""
    return dataclasses.replace(plan, order={ph: run_order(s) for ph, s in schedules.items()})


def ordered(plan: TilePlan, mask: BlockPattern | BlockCells, cost: CostModel, *, backward: bool = True) -> TilePlan:
    """``plan`` carrying the run order of its replay under ``cost`` (each phase replayed once; without ``backward``
    the backward runs in ``unit_order``)."""
    work = workload(mask, plan.shape, num_chunks=plan.num_chunks, head_groups=plan.num_head_groups,
                    chunk=plan.chunk_size)
    phases = ("fwd", "bwd") if backward else ("fwd",)
    return with_order(plan, {ph: simulate(build_graph(plan, work, cost, ph)) for ph in phases})


class ProgramError(ValueError):
    """The plan cannot run in its order (a rank would send data before it has it, ...)."""

    def __init__(self, msg: str):
        super().__init__(f"ultraattn: {msg}")


def _unit(t: Transfer) -> tuple[int, int]:
    return (t.chunk, t.head_group)


def kept_from_forward(plan: TilePlan) -> list[tuple[set[tuple[int, int]], set[tuple[int, int]]]]:
    """Per rank, the (chunk, group) rows and columns it keeps from the forward for the backward: what the forward
    brought it that its backward needs (to compute, or to send on) and the backward does not bring again (Ulysses
    keeps q, k, v and the LSE at the computing rank). A kept row is its q and LSE; a kept column its K and V."""
    sent: dict[tuple[str, str, int], set] = defaultdict(set)   # (phase, tensor, src) -> units
    got: dict[tuple[str, str, int], set] = defaultdict(set)    # (phase, tensor, dst) -> units
    for t in plan.transfers:
        sent[(t.phase, t.tensor, t.src)].add(_unit(t))
        got[(t.phase, t.tensor, t.dst)].add(_unit(t))
    computes_row: dict[int, set] = defaultdict(set)
    computes_col: dict[int, set] = defaultdict(set)
    for k in plan.kernels:
        for i, j in k.cells:
            computes_row[k.rank].add((i, k.head_group))
            computes_col[k.rank].add((j, k.head_group))
    out = []
    for r in range(plan.world):
        rows = (computes_row[r] | sent[("bwd", "do", r)]) - got[("bwd", "qdo", r)]
        cols = (computes_col[r] | sent[("bwd", "kv", r)]) - got[("bwd", "kv", r)]
        out.append(({u for u in rows if plan.owner[u[0]] != r and u in got[("fwd", "q", r)]},
                    {u for u in cols if plan.owner[u[0]] != r and u in got[("fwd", "kv", r)]}))
    return out


def held_units(plan: TilePlan, rank: int, phase: str, kept: list | None = None) -> set[tuple[str, int, int]]:
    """The (tensor, chunk, group) input units ``rank`` holds before any message of ``phase``: its own chunks', and
    in the backward the columns it kept from the forward (``kept``: ``kept_from_forward(plan)``, made here if not
    given; a kept row also needs its dO)."""
    mine = plan.local_chunks(rank)
    held = {(tn, c, g) for tn in INPUT_TENSORS[phase] for c in mine for g in range(plan.num_head_groups)}
    if phase == "bwd":
        held |= {("kv", c, g) for c, g in (kept if kept is not None else kept_from_forward(plan))[rank][1]}
    return held


@dataclass(frozen=True, slots=True)
class PhaseIndex:
    """Where each rank's messages and kernels are in one phase of a plan: what ``rank_program`` reads of the whole
    plan, made once where every rank's program is made (``executed_graph``; scanning the plan per rank was 40 % of
    an executed replay at 8x8)."""

    msgs: list[tuple[int, Transfer]]
    """The phase's messages: (index in ``plan.transfers``, transfer), in plan order."""
    touching: dict[int, list[int]]
    """Rank -> the positions in ``msgs`` of the messages it sends or receives, ascending."""
    kernels: dict[int, list[int]]
    """Rank -> the indices of its kernels in ``plan.kernels``, ascending."""

    @staticmethod
    def of(plan: TilePlan, phase: str) -> PhaseIndex:
        msgs = [(idx, t) for idx, t in enumerate(plan.transfers) if t.phase == phase]
        touching: dict[int, list[int]] = defaultdict(list)
        for n, (_idx, t) in enumerate(msgs):
            touching[t.src].append(n)
            if t.dst != t.src:
                touching[t.dst].append(n)
        kernels: dict[int, list[int]] = defaultdict(list)
        for k, kern in enumerate(plan.kernels):
            kernels[kern.rank].append(k)
        return PhaseIndex(msgs=msgs, touching=touching, kernels=kernels)


def rank_program(plan: TilePlan, rank: int, phase: str, order: RunOrder | None = None, *,
                 kept: list | None = None, index: PhaseIndex | None = None) -> list[Step]:
    """The steps of ``rank`` in ``phase`` (module docstring), in ``order`` (default: ``order_of``). ``kept``
    (``kept_from_forward(plan)``) and ``index`` (``PhaseIndex.of(plan, phase)``): where the caller makes every
    rank's program, made once, not per rank."""
    order = order or order_of(plan, phase)
    index = index or PhaseIndex.of(plan, phase)
    msgs = index.msgs
    mine_msgs, mine_kernels = index.touching.get(rank, []), index.kernels.get(rank, [])
    leaves = order.leaves or order.transfers
    items = []   # (key, 0 message / 1 kernel, index); messages of one key in the order they leave
    for n in mine_msgs:
        items.append((order.transfers[n], 0, leaves[n], n))
    for k in mine_kernels:
        items.append((order.kernels[k], 1, 0.0, k))
    items.sort()
    items = [(key, kind, n) for key, kind, _leave, n in items]
    pos = {(kind, n): p for p, (_key, kind, n) in enumerate(items)}
    inputs = INPUT_TENSORS[phase]
    row_input = {"fwd": ("q",), "bwd": ("qdo", "do")}[phase]
    # what each received message is first needed by (a position in items; len(items): the end of the phase)
    recv_of: dict[tuple[str, int, int], list[int]] = defaultdict(list)   # (tensor, chunk, g) -> received messages
    for n in mine_msgs:
        t = msgs[n][1]
        if t.dst == rank:
            recv_of[(PARTIAL_OF_FINAL.get(t.tensor, t.tensor), t.chunk, t.head_group)].append(n)
    needs: dict[int, list[int]] = {}   # position -> received messages it needs
    for p, (_key, kind, n) in enumerate(items):
        if kind == 1:
            kern = plan.kernels[n]
            g = kern.head_group
            want = [(tn, i, g) for i in {c[0] for c in kern.cells} for tn in row_input]
            want += [("kv", j, g) for j in {c[1] for c in kern.cells}]
        else:
            t = msgs[n][1]
            if t.src != rank:
                continue
            want = [(PARTIAL_OF_FINAL.get(t.tensor, t.tensor), t.chunk, t.head_group)]
        needs[p] = [m for w in want for m in recv_of.get(w, ()) if pos[(0, m)] < p]
    first_need = {}
    for p in sorted(needs):
        for m in needs[p]:
            first_need.setdefault(m, p)
    end = len(items)
    # contributions: a partial (or final) leaves only after this rank's launches of its row / column
    contrib: dict[tuple[str, int, int], int] = defaultdict(int)   # (row|col, chunk, g) -> launches left
    for kern in (plan.kernels[k] for k in mine_kernels):
        for i in {c[0] for c in kern.cells}:
            contrib[("row", i, kern.head_group)] += 1
        for j in {c[1] for c in kern.cells}:
            contrib[("col", j, kern.head_group)] += 1
    have = held_units(plan, rank, phase, kept)

    steps: list[Step] = []
    pending_sends: list[Message] = []
    pending_recvs: list[int] = []
    post_of: dict[int, int] = {}     # message n -> its post's step index
    waited: set[int] = set()

    def flush() -> None:
        if not pending_sends and not pending_recvs:
            return
        runs: list[list[int]] = []
        for m in pending_recvs:   # consecutive receives needed by the same step share a post (and a wait)
            if runs and first_need.get(runs[-1][-1], end) == first_need.get(m, end):
                runs[-1].append(m)
            else:
                runs.append([m])
        for r, run in enumerate(runs or [[]]):
            for m in run:
                post_of[m] = len(steps)
            steps.append(Post(sends=tuple(pending_sends) if r == 0 else (), recvs=tuple(msgs[m] for m in run)))
        pending_sends.clear()
        pending_recvs.clear()

    def wait_for(ms: list[int]) -> None:
        if any(m in pending_recvs for m in ms):
            flush()
        for m in sorted(ms, key=lambda m: post_of[m]):
            if post_of[m] not in waited:
                flush()
                waited.add(post_of[m])
                steps.append(Wait(post_of[m]))

    for p, (_key, kind, n) in enumerate(items):
        if kind == 1:
            kern = plan.kernels[n]
            g = kern.head_group
            flush()
            wait_for(needs[p])
            rows: dict[int, list[int]] = {}
            for i, j in kern.cells:
                rows.setdefault(i, []).append(j)
            for i, js in rows.items():
                missing = [("row", i)] if not any((tn, i, g) in have for tn in row_input) else []
                missing += [("col", j) for j in js if ("kv", j, g) not in have]
                if missing:
                    raise ProgramError(f"rank {rank}: {phase} row {i} (group {g}) never received its inputs "
                                       f"({', '.join(f'{a} {c}' for a, c in missing)})")
                contrib[("row", i, g)] -= 1
            for j in {c[1] for c in kern.cells}:
                contrib[("col", j, g)] -= 1
            last = steps[-1] if steps else None
            if isinstance(last, Launch):   # fused with the launch before it: no post or wait between them
                fused: dict[tuple[int, int], list[int]] = {(gg, i): list(js) for gg, i, js in last.rows}
                for i, js in rows.items():
                    fused.setdefault((g, i), []).extend(js)
                steps[-1] = Launch(rows=tuple((gg, i, tuple(sorted(js))) for (gg, i), js in fused.items()),
                                   kernels=(*last.kernels, n))
            else:
                steps.append(Launch(rows=tuple((g, i, tuple(sorted(js))) for i, js in rows.items()), kernels=(n,)))
            continue
        idx, t = msgs[n]
        if t.dst == rank:
            pending_recvs.append(n)
            if t.tensor in inputs:
                have.add((t.tensor, t.chunk, t.head_group))
            continue
        # a send: its payload must be here
        if t.tensor in inputs:
            if (t.tensor, t.chunk, t.head_group) not in have:
                raise ProgramError(f"transfer #{idx} ({t.phase} {t.tensor} chunk {t.chunk} group {t.head_group}) "
                                   f"leaves rank {t.src}, which never holds that unit (in the plan's run order)")
        else:
            side = "col" if t.tensor in COL_TENSORS else "row"
            if contrib.get((side, t.chunk, t.head_group), 0) > 0:
                raise ProgramError(f"transfer #{idx} ({t.phase} {t.tensor} chunk {t.chunk} group {t.head_group}) "
                                   f"leaves rank {t.src} before its launches there (the run order does not fit the "
                                   f"plan)")
        wait_for(needs[p])
        if pending_sends and relays(plan, t) != relays(plan, pending_sends[-1][1]):
            flush()   # relays and sends of what launches make go in separate posts: a relay's waits for no launch
        pending_sends.append((idx, t))
    flush()
    if not any(isinstance(s, Post) for s in steps):
        steps.insert(0, Post(sends=(), recvs=()))   # every phase posts once (a traced program begins it there)
    for i, s in enumerate(steps):
        if isinstance(s, Post) and i not in waited:
            waited.add(i)
            steps.append(Wait(i))
    return steps


def order_priority(graph: Graph, order: RunOrder) -> list[float]:
    """The simulator's priorities for ``executed_graph``: the run order's keys (a kernel's start, a message's start
    on its link, a merge after its partials' starts), so that each stream serves its tasks in the replay's order."""
    k, m = graph.kernels, graph.messages
    pri = [0.0] * len(graph.tasks)
    pri[:k] = order.kernels
    leaves = order.leaves or order.transfers
    pri[k:k + m] = leaves
    for t in graph.tasks[k + m:]:
        pri[t.id] = max((leaves[d - k] for d in t.deps if k <= d < k + m), default=0.0)
    return pri


def replay_executed(plan: TilePlan, graph: Graph, order: RunOrder, cost: CostModel) -> Schedule:
    """One phase of ``plan`` replayed as the executor runs it: ``graph`` (its ``build_graph``) with every rank's
    program in ``order`` (``executed_graph``; a communication stream where ``cost`` models GPUs), each stream serving
    its tasks in that order (``order_priority``)."""
    return simulate(executed_graph(plan, graph, order, streams=cost.async_kernels > 0), order_priority(graph, order))


def executed_makespan(plan: TilePlan, schedules: dict[str, Schedule], cost: CostModel) -> float:
    """The fwd (+ bwd) makespan of ``plan`` as executed, in the run order of its plain replay (``schedules``: phase ->
    that replay; the order ``with_order`` gives the plan)."""
    return sum(replay_executed(plan, s.graph, run_order(s), cost).makespan for s in schedules.values())


def relays(plan: TilePlan, t: Transfer) -> bool:
    """Whether ``t`` forwards an input unit its sender did not make in this phase (a unit it received, or in the
    backward kept from the forward): no kernel of the sender writes its bytes."""
    return t.tensor in INPUT_TENSORS[t.phase] and plan.owner[t.chunk] != t.src


def executed_graph(plan: TilePlan, graph: Graph, order: RunOrder, *, streams: bool = False) -> Graph:
    """``graph`` (``build_graph`` of ``plan``'s phase) with each rank's program (``rank_program``) added: a launch
    waits for the launches and waits before it; a merge runs when its last partial is taken (module docstring).
    A send waits for the launches and waits before it in its rank's program (the host posts it after them), except
    with ``streams`` (GPUs: ``runtime/streams.py``): a post whose sends all relay (``relays``) waits only for the
    communication stream's earlier work (the receives waited for, and what earlier posts waited for), another post
    for the compute stream's work before it too."""
    tasks = [t.with_deps(list(t.deps)) for t in graph.tasks]
    first_msg = graph.kernels
    msg_task = {}
    n = 0
    for idx, t in enumerate(plan.transfers):
        if t.phase == graph.phase:
            msg_task[idx] = first_msg + n
            n += 1
    merge_of = {(t.rank, *t.unit): t.id for t in tasks if t.kind == "merge"}
    kept = kept_from_forward(plan) if graph.phase == "bwd" else None
    index = PhaseIndex.of(plan, graph.phase)
    for r in range(plan.world):
        barrier: list[int] = []    # tasks the rank's host (its compute stream) has waited for since its last launch
        comm: set[int] = set()     # what the communication stream has waited for so far (``streams``)
        posted: dict[int, list[Message]] = {}
        steps = rank_program(plan, r, graph.phase, order, kept=kept, index=index)
        last_wait = {}   # merge task -> the wait that takes its last partial here
        for i, s in enumerate(steps):
            if isinstance(s, Wait):
                for _idx, t in steps[s.post].recvs:
                    m = merge_of.get((r, PARTIAL_OF_FINAL.get(t.tensor, t.tensor), t.chunk, t.head_group))
                    if m is not None:
                        last_wait[m] = i
        for i, s in enumerate(steps):
            if isinstance(s, Post):
                if streams:
                    if not all(relays(plan, t) for _idx, t in s.sends):
                        comm.update(barrier)
                    for idx, _t in s.sends:
                        comm.update(tasks[msg_task[idx]].deps)
                for idx, _t in s.sends:
                    tasks[msg_task[idx]].deps.extend(comm if streams else barrier)
                posted[i] = list(s.recvs)
            elif isinstance(s, Wait):
                got = [msg_task[idx] for idx, _t in posted[s.post]]
                barrier.extend(got)
                comm.update(got)
                merges = sorted(m for m, at in last_wait.items() if at == i)
                for m in merges:   # partials are merged as they are taken, on the compute stream, in program order
                    tasks[m].deps = list(barrier)
                barrier.extend(merges)
            else:
                for k in s.kernels:
                    tasks[k].deps.extend(barrier)
                    barrier = [k]
    for t in tasks:
        t.deps = sorted(set(t.deps) - {t.id})
    return Graph(tasks=tasks, phase=graph.phase, shared=graph.shared, kernels=graph.kernels, messages=graph.messages)
