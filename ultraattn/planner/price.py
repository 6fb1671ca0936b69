"""Plans as arrays, routed, grouped and priced in closed form (the fast planner's working form).

A candidate plan is held as numpy arrays (``Messages``: one entry per transfer; ``Kernels``: the cells
of every launch) until it is chosen; only then are ``Transfer`` and ``Kernel`` objects made
(``assemble``). Its price is ``replay_bound``: a lower bound, computed in closed form, of the makespan
the schedule simulator (``schedule.build_graph`` + ``simulate``) replays for it, per phase.

Legend: N cells, K kernels, M messages, G head groups, P chunks, W ranks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from ..masks.cells import BlockCells
from ..masks.pattern import BlockPattern
from .arrays import renumber, run_ends, run_starts
from .build import BATCHES, NodeLinks, kernel_groups
from .cost import CostModel, block_flops
from .plan import AttnShape, Kernel, Mesh, TilePlan, Transfer

#: transfer tensors by code (the message arrays store codes)
TENSORS = ("q", "kv", "o", "out", "qdo", "do", "dq", "dkv", "dq_out", "dkv_out")
_CODE = {t: n for n, t in enumerate(TENSORS)}
PHASES = ("fwd", "bwd")


# ----------------------------------------------------------------------------- messages
@dataclass(slots=True)
class Messages:
    """Transfers as arrays (one entry per message), in plan order."""

    tensor: np.ndarray
    """int64 code into ``TENSORS``."""
    chunk: np.ndarray
    group: np.ndarray
    src: np.ndarray
    dst: np.ndarray
    nbytes: np.ndarray
    phase: np.ndarray
    """0 forward, 1 backward."""

    @staticmethod
    def concat(parts: list[Messages]) -> Messages:
        parts = [p for p in parts if p.tensor.size]
        if not parts:
            z = np.zeros(0, dtype=np.int64)
            return Messages(tensor=z, chunk=z, group=z, src=z, dst=z, nbytes=z, phase=z)
        return Messages(*(np.concatenate([getattr(p, f) for p in parts]) for f in Messages.__slots__))

    @staticmethod
    def make(tensor: str, phase: str, chunk, group, src, dst, nbytes: int) -> Messages:
        n = np.asarray(src).size
        full = lambda v: np.full(n, v, dtype=np.int64)  # noqa: E731
        return Messages(tensor=full(_CODE[tensor]), chunk=np.asarray(chunk, dtype=np.int64),
                        group=np.broadcast_to(np.asarray(group, dtype=np.int64), (n,)).copy(),
                        src=np.asarray(src, dtype=np.int64), dst=np.asarray(dst, dtype=np.int64),
                        nbytes=full(nbytes), phase=full(PHASES.index(phase)))

    @staticmethod
    def of(transfers) -> Messages:
        rows = [(_CODE[t.tensor], t.chunk, t.head_group, t.src, t.dst, t.nbytes, PHASES.index(t.phase))
                for t in transfers]
        a = np.asarray(rows, dtype=np.int64).reshape(-1, 7)
        return Messages(*(a[:, n].copy() for n in range(7)))

    def select(self, mask: np.ndarray) -> Messages:
        return Messages(*(getattr(self, f)[mask] for f in Messages.__slots__))

    def to_transfers(self) -> tuple[Transfer, ...]:
        cols = [getattr(self, f).tolist() for f in Messages.__slots__]
        return tuple(Transfer(tensor=TENSORS[t], chunk=c, head_group=g, src=s, dst=d, nbytes=b, phase=PHASES[ph])
                     for t, c, g, s, d, b, ph in zip(*cols))


def route(owner: np.ndarray, assign_GPP: np.ndarray, mesh: Mesh, shape: AttnShape, chunk: int,
          backward: bool) -> Messages:
    """Messages that bring every cell's inputs to its computing rank and partials back (vectorised).

    Hierarchical, as ``build.route_transfers`` routes (``build`` module docstring, "Routing"): a unit crosses a
    node link once per node that needs it, landing and sent where ``build.NodeLinks`` says (a loop over the
    crossings, in order), relayed inside the node; partials reduce the other way. With one head group, the same
    transfers as ``build.route_transfers`` (tested), the ILP planner's router.
    """
    g_count, p, _ = assign_GPP.shape
    w, dev = mesh.world, mesh.devices
    g, i, j = np.nonzero(assign_GPP >= 0)
    r = assign_GPP[g, i, j].astype(np.int64)
    flows = {"row": [("q", "o", "fwd")] + ([("qdo", "dq", "bwd")] if backward else []),
             "col": [("kv", "", "fwd")] + ([("kv", "dkv", "bwd")] if backward else [])}
    parts: dict[str, list[Messages]] = {"fwd": [], "bwd": []}
    links = NodeLinks(w, dev)
    for axis, unit in (("row", i), ("col", j)):
        used = np.zeros((g_count, p, w), dtype=bool)
        used[g, unit, r] = True
        used[:, np.arange(p), owner] = False
        gg, cc, dd = np.nonzero(used)  # (group, chunk, consumer) ascending
        src = owner[cc]
        dnode = dd // dev
        grp = (gg * p + cc) * mesh.nodes + dnode  # consumers of a (unit, node) are contiguous
        starts = run_starts(grp)
        ends = run_ends(starts, grp.size)
        links.unit(flows[axis], shape, chunk, g_count)
        prio = np.full(grp.size, 2, dtype=np.int64)   # 0 owner -> sender, 1 sender -> landing rank, 2 inside a node
        hop_src = src.copy()
        dl, ul, sl = dd.tolist(), (gg * p + cc).tolist(), src.tolist()
        cross = (dnode != src // dev)[starts]
        local = {ul[a]: set(dl[a:b]) for a, b in zip(starts[~cross].tolist(), ends[~cross].tolist())}
        held: dict[int, set[int]] = {}   # unit -> its owner and its senders so far
        extra: list[tuple[int, int, int, int, int]] = []   # (unit, src, dst, group key, prio): hops to a relay
        for a, b in zip(starts[cross].tolist(), ends[cross].tolist()):
            u, o = ul[a], sl[a]
            mine = dl[a:b]
            land, snd, fetch = links.cross(o, mine, held.setdefault(u, {o}), local.get(u, ()))
            if fetch:
                extra.append((u, o, snd, int(grp[a]), 0))
            hop_src[a:b] = land
            if land in mine:
                n = a + mine.index(land)
                hop_src[n], prio[n] = snd, 1
            else:
                extra.append((u, snd, land, int(grp[a]), 1))
        if extra:
            eu, es, ed, eg, ep = (np.asarray(x, dtype=np.int64) for x in zip(*extra))
            gg, cc, dd = np.concatenate((gg, eu // p)), np.concatenate((cc, eu % p)), np.concatenate((dd, ed))
            hop_src, grp, prio = np.concatenate((hop_src, es)), np.concatenate((grp, eg)), np.concatenate((prio, ep))
        # per (unit, node): the owner -> sender hop first, then the landing hop, then the relays inside the node
        order = np.lexsort((dd, prio, grp))
        gg, cc, dd, hop_src = gg[order], cc[order], dd[order], hop_src[order]
        for inp, part, phase in flows[axis]:
            parts[phase].append(Messages.make(inp, phase, cc, gg, hop_src, dd, shape.unit_bytes(inp, chunk, g_count)))
            if part:
                rev = slice(None, None, -1)  # leaves first, the landing rank's partial, the sender's last
                parts[phase].append(Messages.make(part, phase, cc[rev], gg[rev], dd[rev], hop_src[rev],
                                                  shape.unit_bytes(part, chunk, g_count)))
    return Messages.concat(parts["fwd"] + parts["bwd"])


# ----------------------------------------------------------------------------- the closed-form price
@dataclass(slots=True)
class Grid:
    """Cost-relevant statistics of one mask on one chunk grid (float64 numpy, one planner head group each)."""

    chunk: int
    """Tokens per chunk."""
    num_chunks: int
    """Chunks in the padded sequence."""
    block: int
    """Mask block size in tokens."""
    blocks_GPP: np.ndarray
    """Cost-weighted blocks per cell (FULL = 1, PARTIAL = 1 + overhead), summed over heads and batch."""
    nonempty_GPP: np.ndarray
    """Non-empty blocks per cell (FULL + PARTIAL)."""
    rows_per_chunk: float
    """Query block rows per chunk and head group (heads and batch included), as ``Workload.rows_per_chunk``."""


def grid_of(mask: BlockCells | BlockPattern, shape: AttnShape, cost: CostModel, *, chunk: int, num_chunks: int,
            head_groups: int = 1) -> Grid:
    """A mask's ``Grid`` on ``num_chunks`` chunks of ``chunk`` tokens and ``head_groups`` equal head groups (batch
    entries and heads summed in, PARTIAL blocks at their overhead)."""
    h = shape.num_heads
    hg = [list(range(g * h // head_groups, (g + 1) * h // head_groups)) for g in range(head_groups)]
    if isinstance(mask, BlockCells):
        entries, st = mask.num_batch, mask.chunk_stats(chunk, num_chunks, hg, num_heads=h, stats=("full", "partial"))
    else:
        entries, st = mask.num_batch_patterns, mask.chunk_stats(chunk, num_chunks, hg, num_heads=h)
    bmul = shape.batch if entries == 1 else 1
    # (in place where the arrays are ours: at 512 chunks each is 2 MiB, and fresh ones cost page faults)
    copy = None if isinstance(mask, BlockCells) else True
    full, part = (np.array(st[k], dtype=np.float64, copy=copy) for k in ("full", "partial"))
    if bmul != 1:
        full *= bmul
        part *= bmul
    blocks = part * (1.0 + cost.partial_block_overhead)
    blocks += full
    full += part
    return Grid(chunk=chunk, num_chunks=num_chunks, block=mask.q_block, blocks_GPP=blocks, nonempty_GPP=full,
                rows_per_chunk=(chunk // mask.q_block) * (h // head_groups) * shape.batch)


@dataclass(slots=True)
class Kernels:
    """A plan's kernels as arrays: the cells of each (grouped kernel by kernel, in plan order), its rank
    and stage, and its seconds per phase."""

    g_N: np.ndarray
    """Head group of each cell."""
    i_N: np.ndarray
    """Query chunk of each cell."""
    j_N: np.ndarray
    """Key/value chunk of each cell."""
    k_N: np.ndarray
    """Kernel of each cell (non-decreasing)."""
    rank_K: np.ndarray
    """Rank of each kernel."""
    stage_K: np.ndarray
    """Stage of each kernel (``Kernel.stage``)."""
    seconds: dict[int, np.ndarray]
    """Phase (0 fwd, 1 bwd) -> seconds of each kernel."""

    @staticmethod
    def make(grid: Grid, g_N, i_N, j_N, k_N, rank_K, stage_K, rows_K, *, head_dim: int, cost: CostModel,
             phases: tuple[int, ...]) -> Kernels:
        """Kernels of cells already grouped (``k_N`` non-decreasing), with ``rows_K`` distinct rows each."""
        n = rank_K.size
        blocks = np.bincount(k_N, grid.blocks_GPP[g_N, i_N, j_N], minlength=n)
        nonempty = np.bincount(k_N, grid.nonempty_GPP[g_N, i_N, j_N], minlength=n)
        sec = {ph: cost.blocks_seconds(blocks, nonempty, rows_K, block=grid.block, head_dim=head_dim,
                                       rows_per_chunk=grid.rows_per_chunk, phase=PHASES[ph])
               for ph in phases}
        return Kernels(g_N=g_N, i_N=i_N, j_N=j_N, k_N=k_N, rank_K=rank_K, stage_K=stage_K, seconds=sec)

    @staticmethod
    def of_groups(grid: Grid, groups: tuple, *, head_dim: int, cost: CostModel, phases: tuple[int, ...]) -> Kernels:
        """Kernels of a ``build.kernel_groups`` grouping."""
        g_N, i_N, j_N, start_K, rank_K, _group_K, stage_K, col_K = groups
        k_N = np.repeat(np.arange(rank_K.size), np.diff(start_K))
        rows = np.where(col_K, np.diff(start_K), 1)
        return Kernels.make(grid, g_N, i_N, j_N, k_N, rank_K, stage_K, rows, head_dim=head_dim, cost=cost,
                            phases=phases)

    def same_launches(self, other: Kernels) -> bool:
        """Whether ``other`` groups the same cells into the same kernels (two batch sizes can: no row has more remote
        chunks than the smaller batch)."""
        return all(np.array_equal(getattr(self, f), getattr(other, f))
                   for f in ("k_N", "rank_K", "stage_K", "g_N", "i_N", "j_N"))

    def to_kernels(self) -> tuple[Kernel, ...]:
        cells = list(zip(self.i_N.tolist(), self.j_N.tolist()))
        bounds = np.searchsorted(self.k_N, np.arange(self.rank_K.size + 1)).tolist()
        group_K = self.g_N[bounds[:-1]].tolist() if self.g_N.size else []
        return tuple(Kernel(rank=r, head_group=g, cells=tuple(cells[bounds[n]:bounds[n + 1]]), stage=s)
                     for n, (r, g, s) in enumerate(zip(self.rank_K.tolist(), group_K, self.stage_K.tolist())))


def message_seconds(msgs: Messages, mesh: Mesh, cost: CostModel) -> np.ndarray:
    """Seconds of every message (latency + bytes / bandwidth of its link)."""
    inter = (msgs.src // mesh.devices) != (msgs.dst // mesh.devices)
    return np.where(inter, cost.inter_latency_us * 1e-6 + msgs.nbytes / (cost.inter_bw_GBps * 1e9),
                    cost.intra_latency_us * 1e-6 + msgs.nbytes / (cost.intra_bw_GBps * 1e9))


#: per phase: input tensors by axis, and (partial, final) tensors by axis
_INPUTS = {0: {"row": ("q",), "col": ("kv",)}, 1: {"row": ("qdo", "do"), "col": ("kv",)}}
_RESULTS = {0: [("row", "o", "out")], 1: [("row", "dq", "dq_out"), ("col", "dkv", "dkv_out")]}


def _codes(names) -> list[int]:
    return [_CODE[t] for t in names]


def shared_speedup(mesh: Mesh, cost: CostModel) -> float:
    """How much faster than its all-busy duration a task may run where a node's ranks share compute
    (``schedule.SharedCompute``): ``cost.alone_speedup`` on a node of several ranks, else 1."""
    return cost.alone_speedup if cost.alone_speedup > 1 and mesh.devices > 1 else 1.0


def _node_bound(mesh: Mesh, compute_rank: np.ndarray, compute_sec: np.ndarray, m: Messages, dur: np.ndarray) -> float:
    """Shared nodes: a node runs at most ``devices`` all-busy seconds of its kernels, merges and messages between its
    ranks per second (processor sharing: ``k`` tasks at ``min(speedup, devices / k)`` each)."""
    node = np.bincount(compute_rank // mesh.devices, compute_sec, minlength=mesh.nodes).astype(np.float64)
    intra = (m.src // mesh.devices) == (m.dst // mesh.devices)
    node += np.bincount(m.src[intra] // mesh.devices, dur[intra], minlength=mesh.nodes)
    return float(node.max(initial=0.0)) / mesh.devices


def _stream_bound(stream: np.ndarray, release: np.ndarray, duration: np.ndarray) -> float:
    """Largest over streams of ``max_i (release_i + sum of durations released at or after release_i)``: no
    order of the items on one stream finishes earlier (one machine with release times)."""
    if not stream.size:
        return 0.0
    # by stream, then latest release first: two stable sorts, the same order as ``np.lexsort((-release, stream))``,
    # and the second a radix sort where streams fit in 16 bits (``Replay.stream``): ~1.5x faster
    order = np.argsort(-release, kind="stable")
    order = order[np.argsort(stream[order], kind="stable")]
    s, rel, dur = stream[order], release[order], duration[order]
    starts = run_starts(s)
    csum = np.cumsum(dur)
    base = np.repeat(csum[starts] - dur[starts], run_ends(starts, s.size) - starts)
    return float((rel + csum - base).max())


@dataclass(frozen=True, slots=True)
class _Hops:
    """Messages ``idx`` that move units hop by hop (what ``_hops`` reads, for any model), sorted by destination
    (``order``): their flat (group, chunk, rank) sources in that order, where each destination's messages begin
    (``starts``) and that destination (``to``)."""

    idx: np.ndarray
    src: np.ndarray
    order: np.ndarray
    starts: np.ndarray
    to: np.ndarray

    @staticmethod
    def of(idx: np.ndarray, src: np.ndarray, dst: np.ndarray) -> _Hops:
        """From the messages' flat sources and destinations."""
        order = np.argsort(dst, kind="stable")
        dst = dst[order]
        starts = run_starts(dst)
        return _Hops(idx=idx, src=src[order], order=order, starts=starts, to=dst[starts])


def _hops(h: _Hops, dur: np.ndarray, base: np.ndarray, ranks: int) -> np.ndarray:
    """When each (group, chunk, rank) (flat) holds a unit that messages ``h.idx`` move hop by hop: its own ``base``
    time, or a message's arrival, which leaves when its source holds the unit (a fixed point: relay chains and
    reduction trees alike; at most one round per hop, ``ranks + 1`` rounds). Only the messages' destinations change,
    so a round is one gather and one segmented max over the messages sorted by destination (``np.maximum.at`` over
    the whole grid was most of the price's time)."""
    if not h.idx.size:
        return base
    d = dur[h.idx][h.order]
    ready = base.copy()
    held = ready[h.to]
    for _ in range(ranks + 1):
        new = np.maximum(base[h.to], np.maximum.reduceat(ready[h.src] + d, h.starts))
        if np.array_equal(new, held):
            break
        ready[h.to] = held = new
    return ready


@dataclass(frozen=True, slots=True)
class _Input:
    """One input axis of a phase, in unit indices (``arrays.renumber``): its messages' hops and sources (a message
    leaves when its unit is there), and every cell's (group, unit, computing rank) (its kernel waits for the unit)."""

    hops: _Hops
    src: np.ndarray
    cell: np.ndarray
    size: int
    """How many units."""


@dataclass(frozen=True, slots=True)
class _Result:
    """One result axis of a phase (o, dq or dkv), in unit indices (``arrays.renumber``): every cell's unit on its
    rank, each (unit, kernel) pair once, the partials' hops and sources, the final messages and their sources, where
    merges happen (a partial's reduction ends: unit and rank) and their bytes, and whether it is the output (merged
    with its LSE)."""

    cell: np.ndarray
    own: tuple[np.ndarray, np.ndarray]
    hops: _Hops
    part_src: np.ndarray
    fin: np.ndarray
    fin_src: np.ndarray
    merge_at: np.ndarray
    merge_rank: np.ndarray
    merge_bytes: np.ndarray
    lse: bool
    size: int


@dataclass(frozen=True, slots=True)
class Replay:
    """What ``replay_bound`` reads of one phase of a plan that no cost model changes (which message carries what
    where, which kernel needs which message, where merges happen): made once per plan and phase, priced under any
    model (``robust.band_prices`` prices each finalist under 9 to 17 models). ``shape``: (head groups, chunks,
    ranks); ``m``: the phase's messages, ``link`` 1 where one crosses nodes; ``pairs``: each (kernel, input message)
    pair once; ``stream``: every task's stream in ``replay_bound``'s order (kernels, merges, sends, receives)."""

    shape: tuple[int, int, int]
    m: Messages
    link: np.ndarray
    n_k: int
    inputs: tuple[_Input, ...]
    pairs: tuple[np.ndarray, np.ndarray] | None
    results: tuple[_Result, ...]
    stream: np.ndarray

    @staticmethod
    def of(kern: Kernels, msgs: Messages, owner: np.ndarray, num_groups: int, mesh: Mesh, phase: int) -> Replay:
        shape = (num_groups, owner.size, mesh.world)
        g_count, p, w = shape
        m = msgs.select(msgs.phase == phase)
        flat = lambda sel, at: np.ravel_multi_index((m.group[sel], m.chunk[sel], at[sel]), shape)  # noqa: E731
        link = ((m.src // mesh.devices) != (m.dst // mesh.devices)).astype(np.int64)
        n_k = kern.seconds[phase].size
        r_N = kern.rank_K[kern.k_N]
        cell_N = {axis: np.ravel_multi_index((kern.g_N, unit, r_N), shape)
                  for axis, unit in (("row", kern.i_N), ("col", kern.j_N))}
        inputs, deliver = [], {}
        for axis, names in _INPUTS[phase].items():
            idx = np.flatnonzero(np.isin(m.tensor, _codes(names)))
            d = np.full(g_count * p * w, -1, dtype=np.int64)
            d[flat(idx, m.dst)] = idx
            u, (src, dst, cell) = renumber(flat(idx, m.src), flat(idx, m.dst), cell_N[axis])
            inputs.append(_Input(hops=_Hops.of(idx, src, dst), src=src, cell=cell, size=u.size))
            deliver[axis] = d
        msg_N = np.concatenate([deliver[a][cell_N[a]] for a in ("row", "col")])
        k2 = np.concatenate([kern.k_N, kern.k_N])
        ok = msg_N >= 0
        pairs = None
        if ok.any():   # each (kernel, message) pair once (one int64 key: np.unique over axis=1 sorts rows, ~5x slower)
            u = np.unique(k2[ok] * m.tensor.size + msg_N[ok])
            pairs = (u // m.tensor.size, u % m.tensor.size)
        results = []
        for axis, part, final in _RESULTS[phase]:
            idx = np.flatnonzero(m.tensor == _CODE[part])
            fin = np.flatnonzero(m.tensor == _CODE[final])
            u, (key, src, dst, fin_src) = renumber(cell_N[axis], flat(idx, m.src), flat(idx, m.dst), flat(fin, m.src))
            uk = np.unique(key * n_k + kern.k_N)
            # merges where a partial's reduction ends (it receives partials and sends none on)
            inbytes = np.zeros(u.size)
            np.add.at(inbytes, dst, m.nbytes[idx])
            inbytes[src] = 0.0
            # (a rank that sends the final result on folds its add into that message too, as the simulator does)
            inbytes[fin_src] = 0.0
            at = np.flatnonzero(inbytes)
            results.append(_Result(cell=key, own=(uk // n_k, uk % n_k), hops=_Hops.of(idx, src, dst), part_src=src,
                                   fin=fin, fin_src=fin_src, merge_at=at, merge_rank=u[at] % w,
                                   merge_bytes=inbytes[at], lse=part == "o", size=u.size))
        # streams: 5 per rank (compute, send intra/inter, recv intra/inter)
        stream = np.concatenate([kern.rank_K * 5, *[r.merge_rank * 5 for r in results], m.src * 5 + 1 + link,
                                 m.dst * 5 + 3 + link])
        if 5 * w <= np.iinfo(np.int16).max:   # (``_stream_bound`` sorts 16-bit integers by radix)
            stream = stream.astype(np.int16)
        return Replay(shape=shape, m=m, link=link, n_k=n_k, inputs=tuple(inputs), pairs=pairs,
                      results=tuple(results), stream=stream)


def replay_bound(kern: Kernels, msgs: Messages, owner: np.ndarray, num_groups: int, mesh: Mesh, cost: CostModel,
                 phase: int, replay: Replay | None = None) -> float:
    """A lower bound of the simulator's makespan of one phase (``schedule.build_graph`` + ``simulate``).

    Every task gets a release time, a bound on when it can start: an input message when its sender holds
    the unit (relays: after it arrived there), a kernel when its inputs can have arrived (each one's path,
    and every input it needs through one receive engine, one after another), a partial or final result
    when the kernels that produce it can have run (their chain, and their sum on the compute stream) and
    the partials it reduces arrived, a merge when its partials arrived. Each stream (a rank's compute
    engine, its send and receive engine per link) then needs at least ``max_i (release_i + work released at
    or after release_i)``; the bound is the largest over streams. ``replay``: the plan's ``Replay`` of this
    phase, where the caller prices it under several models.
    """
    rp = replay if replay is not None else Replay.of(kern, msgs, owner, num_groups, mesh, phase)
    m, link, shape = rp.m, rp.link, rp.shape
    dur = message_seconds(m, mesh, cost)
    sec_K = kern.seconds[phase]
    share = shared_speedup(mesh, cost)
    if share > 1:   # a task of a shared node may run up to `share` times faster than its all-busy duration
        node_work = (sec_K, dur)
        sec_K = sec_K / share
        dur = np.where(link == 0, dur / share, dur)
    release = np.zeros(m.tensor.size)

    # inputs: arrival of each (group, chunk, rank), hop by hop; a kernel after each input's path
    start = np.zeros(rp.n_k)
    for inp in rp.inputs:
        arr = _hops(inp.hops, dur, np.zeros(inp.size), shape[2])
        release[inp.hops.idx] = arr[inp.src]
        np.maximum.at(start, kern.k_N, arr[inp.cell])
    if rp.pairs is not None:   # and the inputs through one receive engine in a row
        pk, pm = rp.pairs
        through = np.bincount(pk * 2 + link[pm], dur[pm], minlength=2 * rp.n_k).reshape(rp.n_k, 2)
        start = np.maximum(start, through.max(1))
    end = start + sec_K
    # results: ready on a rank when its kernels for the unit ran and the partials it reduces arrived
    merge_rel, merge_dur = [], []
    for res in rp.results:
        own_end = np.zeros(res.size)
        np.maximum.at(own_end, res.cell, end[kern.k_N])
        own_sum = np.bincount(res.own[0], sec_K[res.own[1]], minlength=res.size)
        ready = _hops(res.hops, dur, np.maximum(own_end, own_sum), shape[2])
        release[res.hops.idx] = ready[res.part_src]
        release[res.fin] = ready[res.fin_src]
        merge_rel.append(ready[res.merge_at])
        # (divided by what a shared node allows at most)
        merge_dur.append(cost.merge_seconds(2 * res.merge_bytes, lse=res.lse) / share)
    rel = np.concatenate([start, *merge_rel, release, release])
    du = np.concatenate([sec_K, *merge_dur, dur, dur])
    bound = max(_stream_bound(rp.stream, rel, du), float(end.max(initial=0.0)))
    if share > 1:   # the node's kernels, merges and inner messages at their all-busy durations
        secs = np.concatenate([node_work[0], *(d * share for d in merge_dur)])
        ranks = np.concatenate([kern.rank_K, *(r.merge_rank for r in rp.results)])
        bound = max(bound, _node_bound(mesh, ranks, secs, m, node_work[1]))
    return bound


def busy_bound(kern: Kernels, msgs: Messages | None, mesh: Mesh, cost: CostModel) -> float:
    """A cheaper bound below ``price``: per phase, the busiest stream of any rank (its compute engine, its send and
    receive engines per link), no dependency counted. ``msgs`` None: before routing, the compute engines alone."""
    msgs = msgs if msgs is not None else Messages.concat([])
    total = 0.0
    w = mesh.world
    share = shared_speedup(mesh, cost)
    for ph, sec_K in kern.seconds.items():
        sel = msgs.phase == ph
        src, dst = msgs.src[sel], msgs.dst[sel]
        dur = message_seconds(msgs.select(sel), mesh, cost)
        link = ((src // mesh.devices) != (dst // mesh.devices)).astype(np.int64)
        if share > 1:   # as replay_bound: tasks of a shared node up to `share` times faster, the node's total
            node = _node_bound(mesh, kern.rank_K, sec_K, msgs.select(sel), dur)
            sec_K = sec_K / share
            dur = np.where(link == 0, dur / share, dur)
        # float even with no kernel: numpy's weighted bincount of an empty index array is int64 (an all-empty mask)
        busy = np.bincount(kern.rank_K * 5, sec_K, minlength=5 * w).astype(np.float64)
        busy += np.bincount(src * 5 + 1 + link, dur, minlength=5 * w) + np.bincount(dst * 5 + 3 + link, dur,
                                                                                      minlength=5 * w)
        total += max(float(busy.max(initial=0.0)), node if share > 1 else 0.0)
    return total


def price(kern: Kernels, msgs: Messages, owner: np.ndarray, num_groups: int, mesh: Mesh, cost: CostModel,
          replays: dict[int, Replay] | None = None) -> float:
    """Closed-form fwd (+ bwd) seconds of a plan: the sum over its phases of ``replay_bound`` (``replays``: the plan's
    ``Replay`` per phase, where the caller prices it under several models)."""
    return sum(replay_bound(kern, msgs, owner, num_groups, mesh, cost, ph, None if replays is None else replays[ph])
               for ph in kern.seconds)


def compute_bound(blocks_W: np.ndarray, grid: Grid, *, head_dim: int, cost: CostModel, phases: tuple[int, ...]
                  ) -> float:
    """A bound below any price: per phase, the busiest rank's cost-weighted blocks at the peak rate (every
    launch is slower: efficiency below 1, launch overhead)."""
    flops = float(blocks_W.max(initial=0.0)) * block_flops(grid.block, grid.block, head_dim, 1, 1)
    rates = {0: cost.fwd_tflops * 1e12, 1: cost.bwd_tflops * 1e12 / cost.bwd_flops_factor}
    # ranks sharing compute may run a kernel up to alone_speedup times faster than the all-busy rate
    return sum(flops / rates[ph] for ph in phases) / cost.alone_speedup


@dataclass(slots=True)
class Draft:
    """A candidate plan in array form (the fast planner's own structure or a baseline's, ``Baseline.draft``)."""

    owner: np.ndarray
    """int64 [P]: rank owning each chunk."""
    assign_GPP: np.ndarray
    """int64 [G, P, P]: rank computing each cell, -1 empty."""
    kernels: Kernels
    messages: Messages
    chunk: int
    """Tokens per chunk."""
    meta: dict
    """``TilePlan.meta`` of the built plan."""
    transfers: Callable[[], tuple[Transfer, ...]] | None = None
    """``messages`` as ``Transfer`` objects, from cached mask-independent parts (None: made from the arrays)."""
    _replays: tuple[Mesh, dict[int, Replay]] | None = field(default=None, init=False, repr=False)
    """Its ``Replay`` per phase on a mesh once made (``replays``; not carried over by ``dataclasses.replace``)."""

    def replays(self, mesh: Mesh) -> dict[int, Replay]:
        """Its ``Replay`` of each phase on ``mesh``, made once: its price and the band's prices read the same ones."""
        if self._replays is None or self._replays[0] != mesh:
            groups = self.assign_GPP.shape[0]
            self._replays = (mesh, {ph: Replay.of(self.kernels, self.messages, self.owner, groups, mesh, ph)
                                    for ph in self.kernels.seconds})
        return self._replays[1]


def assemble(d: Draft, *, mesh: Mesh, shape: AttnShape, meta: dict, kernels: Kernels | None = None,
             method: str = "ultraattn") -> TilePlan:
    """The ``TilePlan`` of an array-form plan (Kernel and Transfer objects are made here, once; the draft's
    ``transfers``, when it has them, are its messages as objects already, e.g. cached mask-independent ones).
    ``kernels``: the same cells grouped otherwise (a kernel batch); ``method``: a baseline's name for its own plan
    (``Baseline.tile_plan``), else ours."""
    kern = d.kernels if kernels is None else kernels
    return TilePlan(method=method, mesh=mesh, shape=shape, chunk_size=d.chunk, num_chunks=int(d.owner.size),
                    owner=tuple(d.owner.tolist()), num_head_groups=int(d.assign_GPP.shape[0]),
                    assign_GPP=torch.from_numpy(d.assign_GPP.astype(np.int32)), kernels=kern.to_kernels(),
                    transfers=d.messages.to_transfers() if d.transfers is None else d.transfers(), meta=meta)


def batches(owner: np.ndarray, assign_GPP: np.ndarray, msgs: Messages, grid: Grid, mesh: Mesh, shape: AttnShape,
            cost: CostModel, *, phases: tuple[int, ...]) -> list[tuple[int, Kernels, float]]:
    """Each batch size above 1 (``build.BATCHES``): the plan's cells grouped so, as kernels, and their price."""
    out = []
    for b in BATCHES[1:]:
        kern = Kernels.of_groups(grid, kernel_groups(owner, assign_GPP, batch=b, devices=mesh.devices),
                                 head_dim=shape.head_dim, cost=cost, phases=phases)
        out.append((b, kern, price(kern, msgs, owner, assign_GPP.shape[0], mesh, cost)))
    return out


def cheapest(tries: list[tuple[int, Kernels, float]]) -> tuple[int, Kernels, float]:
    """The cheapest-priced of ``batches``' groupings (the smallest batch of equal prices)."""
    best = None
    for b, kern, sec in tries:
        if best is None or sec < best[2] * (1 - 1e-9):
            best = (b, kern, sec)
    return best


def price_plan(plan: TilePlan, grid: Grid, cost: CostModel, *, backward: bool = True) -> float:
    """``price`` of any ``TilePlan`` (its kernels and transfers as they are), on ``grid`` (the plan's chunks)."""
    cells = [(n, k.head_group, i, j) for n, k in enumerate(plan.kernels) for i, j in k.cells]
    k_N, g_N, i_N, j_N = (np.asarray(x, dtype=np.int64) for x in zip(*cells)) if cells else (np.zeros(0, np.int64),) * 4
    n = len(plan.kernels)
    rows = np.bincount(np.unique(k_N * plan.num_chunks + i_N) // plan.num_chunks, minlength=n)
    phases = (0, 1) if backward else (0,)
    kern = Kernels.make(grid, g_N, i_N, j_N, k_N, np.asarray([k.rank for k in plan.kernels], dtype=np.int64),
                        np.asarray([k.stage for k in plan.kernels], dtype=np.int64), rows,
                        head_dim=plan.shape.head_dim, cost=cost, phases=phases)
    return price(kern, Messages.of(plan.transfers), np.asarray(plan.owner, dtype=np.int64), plan.num_head_groups,
                 plan.mesh, cost)
