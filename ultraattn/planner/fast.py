"""The online planner: a new mask planned in milliseconds, the same plan on every rank.

For masks met at run time (packed documents: a new mask every batch) the ILP planner
(``planner.api.plan``: CBC, a scheduling ILP, every baseline simulated) takes seconds. This planner
makes a complete ``TilePlan`` (ownership, compute placement, transfers with exact bytes, kernel
grouping, stages) with no ILP, no simulation and no wall-clock limit in any decision, so every rank
computes the identical plan from the identical mask (no rank-0 planning, no broadcast).

    planner = FastPlanner(shape, mesh, cost=cost, layout=layout)   # once per configuration
    tile_plan = planner.plan(cells)          # per mask: BlockCells (from a BlockMask) or BlockPattern

Algorithm (numbers are per rank and phase; every statistic is vectorised over cells):

1. Chunk statistics: cost-weighted work of every (q chunk, kv chunk) cell at several granularities
   (k = 1, 2, 4, 8 chunks per rank), one ``bincount`` over the mask's non-empty blocks each.
2. Our structure, per k (MagiAttention's dispatch, made hierarchical): chunks go to nodes by a greedy
   over decreasing row work that keeps chunks with shared cells on one node while the node has room
   (compute within half the balance tolerance), then to the node's devices by a min-heap balancer
   (longest processing time first, ``k`` chunks each). Cells are computed where their query rows live
   (only K/V move: with GQA, K/V are the cheap side); a rank still above ``(1 + tol) x mean`` hands
   cells of its heaviest rows to the owner of their K/V (only Q moves) or, failing that, to the least
   loaded rank. A given token layout skips the ownership step.
3. The baselines (ring, zigzag, all-gather, Ulysses, USP) as candidates in the same data model.
4. Each candidate is priced in closed form from its exact messages and kernels: per phase, the
   busiest stream of any rank (compute, or a send/receive engine per link), which overlap allows;
   head-parallel plans (Ulysses, USP) cannot overlap their all-to-all with compute, so theirs is the
   sum of the three steps. The cheapest is built as the ``TilePlan``.

Determinism: integer and float64 arithmetic in a fixed order (bincounts, no threaded BLAS in a
decision), ties broken by index.

What is reused between masks (``FastPlanner``): unit bytes and message costs per granularity,
the baselines' ownerships and their mask-independent all-to-all / all-gather messages.

Caution: the quality yardstick is the ILP planner's plan replayed by the simulator
(``benchmarks/replan.py``); the closed-form price ignores waits the simulator sees (it is a lower
bound of that replay), so near-ties between structures can go either way.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from ..masks.cells import BlockCells, cells_from_pattern
from ..masks.pattern import BlockPattern
from .baselines import BASELINES, allgather_plan, ring_plan, ulysses_degree, usp_plan, zigzag_owner
from .build import kernel_groups
from .cost import DEFAULT_COST, CostModel, block_flops
from .plan import AttnShape, Kernel, Mesh, TilePlan, TokenLayout, Transfer

#: chunks per rank tried for our own structure (the ILP planner starts at 2 and refines to 8)
CHUNKS_PER_RANK = (1, 2, 4, 8)
#: transfer tensors by code (the message arrays store codes)
TENSORS = ("q", "kv", "o", "out", "qdo", "do", "dq", "dkv", "dq_out", "dkv_out")
_CODE = {t: n for n, t in enumerate(TENSORS)}
_PHASES = ("fwd", "bwd")
#: per-rank streams of the closed-form price: compute, then send/recv per link
_STREAMS = ("compute", "send_intra", "send_inter", "recv_intra", "recv_inter")


def padded_chunk(seq_len: int, num_chunks: int, block: int) -> int:
    """Smallest chunk (a multiple of ``block``) with num_chunks * chunk >= seq_len (as ``planner.api``)."""
    return math.ceil(seq_len / (num_chunks * block)) * block


# ----------------------------------------------------------------------------- message arrays
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
                        nbytes=full(nbytes), phase=full(_PHASES.index(phase)))

    @staticmethod
    def of(transfers) -> Messages:
        rows = [(_CODE[t.tensor], t.chunk, t.head_group, t.src, t.dst, t.nbytes, _PHASES.index(t.phase))
                for t in transfers]
        a = np.asarray(rows, dtype=np.int64).reshape(-1, 7)
        return Messages(*(a[:, n].copy() for n in range(7)))

    def select(self, mask: np.ndarray) -> Messages:
        return Messages(*(getattr(self, f)[mask] for f in Messages.__slots__))

    def to_transfers(self) -> tuple[Transfer, ...]:
        cols = [getattr(self, f).tolist() for f in Messages.__slots__]
        return tuple(Transfer(tensor=TENSORS[t], chunk=c, head_group=g, src=s, dst=d, nbytes=b, phase=_PHASES[ph])
                     for t, c, g, s, d, b, ph in zip(*cols))


def route(owner: np.ndarray, assign_GPP: np.ndarray, mesh: Mesh, shape: AttnShape, chunk: int,
          backward: bool) -> Messages:
    """Messages that bring every cell's inputs to its computing rank and partials back (vectorised).

    Hierarchical like ``build.route_transfers``: a unit that several ranks of another node need crosses
    the node boundary once, landing on one of them, and is relayed inside the node; partials reduce the
    other way. The landing rank of (unit, node) is its ``(chunk + group) mod n``-th consumer there (n
    consumers, ascending rank), which spreads the landings over the node's NICs without sequential state.
    """
    g_count, p, _ = assign_GPP.shape
    w, dev = mesh.world, mesh.devices
    g, i, j = np.nonzero(assign_GPP >= 0)
    r = assign_GPP[g, i, j].astype(np.int64)
    flows = {"row": [("q", "o", "fwd")] + ([("qdo", "dq", "bwd")] if backward else []),
             "col": [("kv", "", "fwd")] + ([("kv", "dkv", "bwd")] if backward else [])}
    parts: dict[str, list[Messages]] = {"fwd": [], "bwd": []}
    for axis, unit in (("row", i), ("col", j)):
        used = np.zeros((g_count, p, w), dtype=bool)
        used[g, unit, r] = True
        used[:, np.arange(p), owner] = False
        gg, cc, dd = np.nonzero(used)  # (group, chunk, consumer) ascending
        src = owner[cc]
        dnode = dd // dev
        grp = (gg * p + cc) * mesh.nodes + dnode  # consumers of a (unit, node) are contiguous
        cnt = np.bincount(grp, minlength=g_count * p * mesh.nodes)[grp]
        starts = np.flatnonzero(np.r_[True, grp[1:] != grp[:-1]])
        pos = np.arange(grp.size) - np.repeat(starts, np.diff(np.r_[starts, grp.size]))
        relay = (dnode != src // dev) & (cnt > 1)
        is_land = relay & (pos == (cc + gg) % np.maximum(cnt, 1))
        land_of = np.full(g_count * p * mesh.nodes, -1, dtype=np.int64)
        land_of[grp[is_land]] = dd[is_land]
        hop_src = np.where(relay & ~is_land, land_of[grp], src)
        # the landing hop first within each (unit, node): relays forward what arrived there
        order = np.lexsort((dd, ~is_land, grp))
        gg, cc, dd, hop_src = gg[order], cc[order], dd[order], hop_src[order]
        for inp, part, phase in flows[axis]:
            parts[phase].append(Messages.make(inp, phase, cc, gg, hop_src, dd, shape.unit_bytes(inp, chunk, g_count)))
            if part:
                rev = slice(None, None, -1)  # leaves first, the landing rank's partial last
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


def kernel_seconds(grid: Grid, blocks: np.ndarray, nonempty: np.ndarray, rows: np.ndarray, *, head_dim: int,
                   cost: CostModel, phase: str) -> np.ndarray:
    """Seconds of kernels with these cost-weighted blocks, non-empty blocks and distinct query rows
    (``Workload.kernel_seconds``, vectorised)."""
    b = grid.block
    return cost.kernel_seconds_array(flops=blocks * block_flops(b, b, head_dim, 1, 1),
                                     kv_tokens_per_row=nonempty * b / (np.maximum(rows, 1) * grid.rows_per_chunk),
                                     phase=phase)


def grouped_kernel_seconds(grid: Grid, kern: tuple, *, head_dim: int, cost: CostModel, phase: str) -> np.ndarray:
    """Seconds of every kernel of ``kern`` (``build.kernel_groups`` output)."""
    g_N, i_N, j_N, start_K, _, _, _, col_K = kern
    n = start_K.size - 1
    k_of = np.repeat(np.arange(n), np.diff(start_K))
    blocks = np.bincount(k_of, grid.blocks_GPP[g_N, i_N, j_N], minlength=n)
    nonempty = np.bincount(k_of, grid.nonempty_GPP[g_N, i_N, j_N], minlength=n)
    rows = np.where(col_K, np.diff(start_K), 1)
    return kernel_seconds(grid, blocks, nonempty, rows, head_dim=head_dim, cost=cost, phase=phase)


def stream_busy(msgs: Messages, mesh: Mesh, cost: CostModel, phase: int, sel: np.ndarray | None = None) -> np.ndarray:
    """float64 [world, 5]: seconds each rank's streams (``_STREAMS``) are busy with the messages of ``phase``."""
    keep = msgs.phase == phase if sel is None else (msgs.phase == phase) & sel
    sub = msgs.select(keep)
    src, dst = sub.src, sub.dst
    inter = (src // mesh.devices) != (dst // mesh.devices)
    sec = message_seconds(sub, mesh, cost)
    w = mesh.world
    busy = np.zeros(w * 5)
    busy += np.bincount(src * 5 + 1 + inter, sec, minlength=w * 5)
    busy += np.bincount(dst * 5 + 3 + inter, sec, minlength=w * 5)
    return busy.reshape(w, 5)


def message_seconds(msgs: Messages, mesh: Mesh, cost: CostModel) -> np.ndarray:
    """Seconds of every message (latency + bytes / bandwidth of its link)."""
    inter = (msgs.src // mesh.devices) != (msgs.dst // mesh.devices)
    return np.where(inter, cost.inter_latency_us * 1e-6 + msgs.nbytes / (cost.inter_bw_GBps * 1e9),
                    cost.intra_latency_us * 1e-6 + msgs.nbytes / (cost.intra_bw_GBps * 1e9))


_ROW_IN = {0: ("q",), 1: ("qdo", "do")}
_COL_IN = ("kv",)
_ROW_PART = {0: "o", 1: "dq"}


def earliest_finish(kern: tuple, kernel_sec: np.ndarray, msgs: Messages, owner: np.ndarray, num_groups: int,
                    mesh: Mesh, cost: CostModel, phase: int) -> float:
    """The longest dependency chain of one phase, streams ignored: input messages (relayed hop by hop), the
    kernels that need them, the partial results they send back (reduced hop by hop) and the final merge.
    A lower bound of the simulated makespan, like the busiest stream; the price takes the larger."""
    g_N, i_N, j_N, start_K, rank_K = kern[:5]
    g_count, p, w = num_groups, owner.size, mesh.world
    sel = msgs.phase == phase
    m = msgs.select(sel)
    sec = message_seconds(m, mesh, cost)
    code = m.tensor
    k_of = np.repeat(np.arange(start_K.size - 1), np.diff(start_K))
    r_N = rank_K[k_of]

    def relay(is_kind: np.ndarray, ready0: np.ndarray) -> np.ndarray:
        """Arrival [G, P, W] of units moved by messages ``is_kind``: a hop leaves when its source holds the
        unit (``ready0`` at the source, plus any arrival there for inputs)."""
        arr = np.zeros((g_count, p, w))
        idx = np.flatnonzero(is_kind)
        for _ in range(w + 1):
            dep = ready0[m.group[idx], m.chunk[idx], m.src[idx]]
            new = np.zeros_like(arr)
            np.maximum.at(new, (m.group[idx], m.chunk[idx], m.dst[idx]), dep + sec[idx])
            new = np.maximum(new, arr)
            if np.array_equal(new, arr):
                break
            arr = new
            ready0 = np.maximum(ready0, arr)
        return arr

    row_in = np.isin(code, [_CODE[t] for t in _ROW_IN[phase]])
    col_in = np.isin(code, [_CODE[t] for t in _COL_IN])
    arr_row = relay(row_in, np.zeros((g_count, p, w)))
    arr_col = relay(col_in, np.zeros((g_count, p, w)))
    need = np.maximum(arr_row[g_N, i_N, r_N], arr_col[g_N, j_N, r_N])
    start = np.zeros(start_K.size - 1)
    np.maximum.at(start, k_of, need)
    end = start + kernel_sec
    chain = float(end.max(initial=0.0))
    parts = [(_ROW_PART[phase], i_N)] + ([("dkv", j_N)] if phase == 1 else [])
    for tensor, unit_N in parts:
        own_end = np.zeros((g_count, p, w))
        np.maximum.at(own_end, (g_N, unit_N, r_N), end[k_of])
        is_part = code == _CODE[tensor]
        if not is_part.any():
            continue
        arr = relay(is_part, own_end)
        ready = np.maximum(own_end, arr)
        # final holders: receive partials of a unit and send none on
        idx = np.flatnonzero(is_part)
        sends = np.zeros((g_count, p, w), dtype=bool)
        sends[m.group[idx], m.chunk[idx], m.src[idx]] = True
        inbytes = np.zeros((g_count, p, w))
        np.add.at(inbytes, (m.group[idx], m.chunk[idx], m.dst[idx]), m.nbytes[idx])
        fin = (inbytes > 0) & ~sends
        done = ready[fin] + cost.merge_seconds(2 * inbytes[fin])
        chain = max(chain, float(done.max(initial=0.0)))
    return chain


def edge_seconds(kern: tuple, kernel_sec: np.ndarray, msgs: Messages, mesh: Mesh, cost: CostModel,
                 phase: int) -> float:
    """Per rank and link: its input messages arrive one after another, and at least one kernel needing the
    last of them runs after it; its partial results leave one after another, and not before the first kernel
    producing one has run. The larger over ranks and links (a lower bound of the replayed makespan)."""
    g_N, i_N, j_N, start_K, rank_K = kern[:5]
    w = mesh.world
    m = msgs.select(msgs.phase == phase)
    if not m.tensor.size or not kernel_sec.size:
        return 0.0
    sec = message_seconds(m, mesh, cost)
    inter = ((m.src // mesh.devices) != (m.dst // mesh.devices)).astype(np.int64)
    k_of = np.repeat(np.arange(start_K.size - 1), np.diff(start_K))
    r_N = rank_K[k_of]
    g_count, p = int(g_N.max(initial=0)) + 1, int(max(i_N.max(initial=0), j_N.max(initial=0))) + 1
    g_count = max(g_count, int(m.group.max()) + 1)
    p = max(p, int(m.chunk.max()) + 1)
    best = 0.0
    for tensors, unit_N, direction in ((_ROW_IN[phase], i_N, "in"), (_COL_IN, j_N, "in"),
                                       ((_ROW_PART[phase],), i_N, "out"), (("dkv",) if phase else (), j_N, "out")):
        sel = np.isin(m.tensor, [_CODE[t] for t in tensors])
        if not sel.any():
            continue
        rank = m.dst[sel] if direction == "in" else m.src[sel]
        link = np.full((g_count, p, w), -1, dtype=np.int64)
        link[m.group[sel], m.chunk[sel], rank] = inter[sel]
        busy = np.bincount(rank * 2 + inter[sel], sec[sel], minlength=2 * w)
        cell_link = link[g_N, unit_N, r_N]
        first = np.full(2 * w, np.inf)
        ok = cell_link >= 0
        np.minimum.at(first, r_N[ok] * 2 + cell_link[ok], kernel_sec[k_of[ok]])
        tot = np.where(np.isfinite(first), first, 0.0) + busy
        best = max(best, float(tot.max()))
    return best


def overlapped_seconds(kern: tuple, kernel_sec: dict[int, np.ndarray], msgs: Messages, owner: np.ndarray,
                       num_groups: int, mesh: Mesh, cost: CostModel, phases: tuple[int, ...]) -> float:
    """Sum over phases of the largest of three lower bounds of the replayed makespan: the busiest stream of
    any rank (compute overlaps communication), the longest dependency chain (``earliest_finish``) and the
    edges of each rank's message streams (``edge_seconds``)."""
    total = 0.0
    for ph in phases:
        busy = stream_busy(msgs, mesh, cost, ph)
        busy[:, 0] += np.bincount(kern[4], kernel_sec[ph], minlength=mesh.world)
        chain = earliest_finish(kern, kernel_sec[ph], msgs, owner, num_groups, mesh, cost, ph)
        edge = edge_seconds(kern, kernel_sec[ph], msgs, mesh, cost, ph)
        total += max(float(busy.max()), chain, edge)
    return total


# ----------------------------------------------------------------------------- ownership
def _lpt(work: np.ndarray, items: np.ndarray, bins: int, per_bin: int) -> np.ndarray:
    """Longest processing time first with a cardinality: items by decreasing work to the least loaded bin
    that has room (MagiAttention's min-heap dispatch). Returns the bin of each item."""
    order = items[np.lexsort((items, -work[items]))]
    load = np.zeros(bins)
    room = np.full(bins, per_bin)
    out = np.empty(items.size, dtype=np.int64)
    pos = {int(c): n for n, c in enumerate(items)}
    big = np.inf
    for c in order.tolist():
        b = int(np.argmin(np.where(room > 0, load, big)))
        out[pos[c]] = b
        load[b] += work[c]
        room[b] -= 1
    return out


def _node_affinity(weight_PP: np.ndarray, nodes: int, per_node: int, tol: float) -> np.ndarray:
    """Chunks to nodes: by decreasing row work, to the node sharing the most non-empty cells with the chunk
    among nodes with room for its work (compute within ``(1 + tol / 2) x mean``), else the least loaded."""
    p = weight_PP.shape[0]
    work = weight_PP.sum(1)
    link = weight_PP > 0
    link = (link | link.T).astype(np.float64)
    cap = (1 + tol / 2) * work.sum() / nodes
    aff = np.zeros((nodes, p))
    load = np.zeros(nodes)
    room = np.full(nodes, per_node)
    node_of = np.empty(p, dtype=np.int64)
    for c in np.lexsort((np.arange(p), -work)).tolist():
        ok = room > 0
        fits = ok & (load + work[c] <= cap)
        if fits.any():
            # most shared cells, then least load, then lowest index
            cand = np.flatnonzero(fits)
            best = cand[np.lexsort((cand, load[cand], -aff[cand, c]))[0]]
        else:
            best = int(np.argmin(np.where(ok, load, np.inf)))
        node_of[c] = best
        load[best] += work[c]
        room[best] -= 1
        aff[best] += link[c]
    return node_of


def ownership(weight_PP: np.ndarray, mesh: Mesh, k: int, tol: float) -> np.ndarray:
    """int64 [P]: the rank owning each chunk (node affinity greedy, then a min-heap balancer per node)."""
    p = weight_PP.shape[0]
    work = weight_PP.sum(1)
    if mesh.nodes == 1:
        return _lpt(work, np.arange(p), mesh.devices, k)
    node_of = _node_affinity(weight_PP, mesh.nodes, mesh.devices * k, tol)
    owner = np.empty(p, dtype=np.int64)
    for n in range(mesh.nodes):
        items = np.flatnonzero(node_of == n)
        owner[items] = n * mesh.devices + _lpt(work, items, mesh.devices, k)
    return owner


def place(weight_PP: np.ndarray, owner: np.ndarray, mesh: Mesh, tol: float, row_cost: np.ndarray,
          col_cost: np.ndarray) -> np.ndarray:
    """int64 [P, P]: the rank computing each cell (-1 empty): the row owner, then cells move off ranks above
    ``(1 + tol) x mean`` (module docstring, step 2). ``row_cost``/``col_cost`` [2]: seconds to move one row /
    column unit inside a node and across nodes (both phases)."""
    w = mesh.world
    ii, jj = np.nonzero(weight_PP > 0)
    wt = weight_PP[ii, jj]
    at = owner[ii].copy()
    load = np.bincount(at, wt, minlength=w)
    cap = (1 + tol) * load.sum() / w
    node = np.arange(w) // mesh.devices
    has_row = np.zeros((weight_PP.shape[0], w), dtype=bool)
    has_row[ii, at] = True
    has_col = np.zeros((weight_PP.shape[0], w), dtype=bool)
    has_col[jj, at] = True
    has_col[np.arange(owner.size), owner] = True
    stuck = np.zeros(w, dtype=bool)
    for _ in range(4 * w + 4 * owner.size):
        over = np.where(stuck, -np.inf, load)
        r = int(np.argmax(over))
        if over[r] <= cap * (1 + 1e-12):
            break
        need = load[r] - cap
        on = np.flatnonzero(at == r)
        room = cap - load
        best = None
        # (a) to the owner of the cell's K/V: only the query row moves
        t_of = owner[jj[on]]
        ok = (t_of != r) & (room[t_of] > 0)
        if ok.any():
            cand = on[ok]
            key = ii[cand] * w + owner[jj[cand]]
            uniq, inv = np.unique(key, return_inverse=True)
            amount = np.bincount(inv, wt[cand])
            rows_u, t_u = np.divmod(uniq, w)
            amount = np.minimum(np.minimum(amount, room[t_u]), need)
            price = np.where(has_row[rows_u, t_u], 0.0, row_cost[(node[t_u] != node[r]).astype(np.int64)])
            score = amount / (price + 1e-9)
            n = int(np.lexsort((uniq, -score))[0])
            best = (int(t_u[n]), cand[inv == n])
        else:
            # (b) to the least loaded rank (this node first): the row and its columns move
            t = int(np.lexsort((np.arange(w), load, node != node[r]))[0])
            if room[t] > 0 and t != r:
                rows_on = ii[on]
                work_row = np.bincount(rows_on, wt[on], minlength=owner.size)
                top = int(np.argmax(work_row))
                best = (t, on[rows_on == top])
        if best is None:
            stuck[r] = True
            continue
        t, cells = best
        cells = cells[np.lexsort((jj[cells], -wt[cells]))]
        moved = 0.0
        for c in cells.tolist():
            if moved >= need or load[t] + wt[c] > cap:
                continue
            at[c] = t
            load[r] -= wt[c]
            load[t] += wt[c]
            moved += wt[c]
            has_row[ii[c], t] = True
            has_col[jj[c], t] = True
        if moved == 0.0:
            stuck[r] = True
    out = np.full(weight_PP.shape, -1, dtype=np.int64)
    out[ii, jj] = at
    return out


# ----------------------------------------------------------------------------- the planner
@dataclass(slots=True)
class Candidate:
    """One priced structure."""

    name: str
    """tiled-k<k> or a baseline name."""
    seconds: float
    """Closed-form fwd (+ bwd) seconds."""
    build: object
    """Zero-argument callable returning the ``TilePlan``."""
    imbalance: float = 1.0
    """Max over mean of per-rank work (as ``planner.api.work_imbalance``)."""


@dataclass(slots=True)
class _Scale:
    """What does not change between masks for one chunk grid."""

    chunk: int
    num_chunks: int
    row_cost: np.ndarray
    col_cost: np.ndarray


@dataclass(slots=True)
class FastPlanner:
    """Plans run-time masks for one attention configuration, reusing what does not change between masks.

    Keyed on ``(shape, mesh, cost, layout, balance_tol, backward, baselines)`` (``key``): one per attention
    site and configuration. ``plan`` is a pure function of the mask's cells and this configuration.
    """

    shape: AttnShape
    """The attention's shapes."""
    mesh: Mesh
    """Nodes x devices."""
    cost: CostModel = DEFAULT_COST
    """Prices candidates (the same model the simulator replays)."""
    layout: TokenLayout | None = None
    """A given token layout (a sequence-sharded model's): ownership is kept, only placement is chosen."""
    balance_tol: float = 0.05
    """Allowed compute imbalance of our structure: max rank load <= (1 + tol) x mean."""
    backward: bool = True
    """Plan (and price) the backward too."""
    baselines: tuple[str, ...] = BASELINES
    """Baseline structures considered as candidates."""
    _scales: dict = field(default_factory=dict, repr=False)
    _fixed: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if not 0 <= self.balance_tol < 1:
            raise ValueError(f"balance_tol must lie in [0, 1), got {self.balance_tol}")
        bad = [b for b in self.baselines if b not in BASELINES]
        if bad:
            raise ValueError(f"baselines must be among {', '.join(BASELINES)}, got {bad}")
        if self.layout is not None and self.layout.world != self.mesh.world:
            raise ValueError(f"the layout spreads tokens over {self.layout.world} ranks but the mesh has "
                             f"{self.mesh.world}")

    @property
    def key(self) -> tuple:
        s = self.shape
        return ((s.seq_len, s.num_heads, s.head_dim, s.kv_heads, s.batch, s.dtype), (self.mesh.nodes, self.mesh.devices),
                self.cost, None if self.layout is None else (self.layout.chunk_size, self.layout.owner),
                self.balance_tol, self.backward, self.baselines)

    # ------------------------------------------------------------------ per-grid constants
    def _scale(self, num_chunks: int, block: int, chunk: int | None = None) -> _Scale:
        key = (num_chunks, block, chunk)
        sc = self._scales.get(key)
        if sc is None:
            chunk = chunk or padded_chunk(self.shape.seq_len, num_chunks, block)
            ub = lambda t: float(self.shape.unit_bytes(t, chunk))  # noqa: E731
            row = ub("q") + ub("o") + ((ub("qdo") + ub("dq")) if self.backward else 0.0)
            col = ub("kv") + ((ub("kv") + ub("dkv")) if self.backward else 0.0)
            bw = np.array([self.cost.intra_bw_GBps, self.cost.inter_bw_GBps]) * 1e9
            sc = self._scales[key] = _Scale(chunk=chunk, num_chunks=num_chunks, row_cost=row / bw, col_cost=col / bw)
        return sc

    def _grid(self, cells: BlockCells, sc: _Scale, head_groups: int = 1) -> Grid:
        h = self.shape.num_heads
        hg = [list(range(g * h // head_groups, (g + 1) * h // head_groups)) for g in range(head_groups)]
        st = cells.chunk_stats(sc.chunk, sc.num_chunks, hg, num_heads=h)
        bmul = self.shape.batch if cells.num_batch == 1 else 1
        full, part = st["full"] * bmul, st["partial"] * bmul
        return Grid(chunk=sc.chunk, num_chunks=sc.num_chunks, block=cells.q_block,
                    blocks_GPP=full + part * (1.0 + self.cost.partial_block_overhead), nonempty_GPP=full + part,
                    rows_per_chunk=(sc.chunk // cells.q_block) * (h // head_groups) * self.shape.batch)

    # ------------------------------------------------------------------ plan
    def plan(self, mask: BlockCells | BlockPattern) -> TilePlan:
        """The cheapest candidate's ``TilePlan`` (``meta``: planner, structure, planning_ms, candidates)."""
        t0 = time.perf_counter()
        cells = self._check(mask)
        cands = self.candidates(cells)
        best = min(cands, key=lambda c: (c.seconds, c.name))
        tp = best.build()
        meta = {**tp.meta, "planner": "fast", "structure": tp.meta.get("structure", best.name),
                "estimate_ms": best.seconds * 1e3,
                "candidates": {c.name: round(c.seconds * 1e3, 6) for c in cands}}
        meta["planning_ms"] = (time.perf_counter() - t0) * 1e3
        return TilePlan(method="ultraattn", mesh=tp.mesh, shape=tp.shape, chunk_size=tp.chunk_size,
                        num_chunks=tp.num_chunks, owner=tp.owner, num_head_groups=tp.num_head_groups,
                        assign_GPP=tp.assign_GPP, kernels=tp.kernels, transfers=tp.transfers, meta=meta)

    def _check(self, mask) -> BlockCells:
        if isinstance(mask, BlockPattern):
            mask = cells_from_pattern(mask)
        if not isinstance(mask, BlockCells):
            raise TypeError(f"`mask` must be BlockCells or a BlockPattern, got {type(mask).__name__}")
        if (mask.q_len, mask.kv_len) != (self.shape.seq_len, self.shape.seq_len):
            raise ValueError(f"the mask is for lengths ({mask.q_len}, {mask.kv_len}) but shape.seq_len is "
                             f"{self.shape.seq_len}")
        if mask.q_block != mask.kv_block:
            raise NotImplementedError(f"the planner needs equal Q and KV blocks, got ({mask.q_block}, {mask.kv_block})")
        if mask.num_batch not in (1, self.shape.batch):
            raise ValueError(f"the mask has {mask.num_batch} batch entries, shape.batch is {self.shape.batch}")
        mask.heads_per_group(self.shape.num_heads)  # raises on a head count mismatch
        if self.layout is not None and self.layout.chunk_size % mask.q_block:
            raise ValueError(f"the layout's chunk size {self.layout.chunk_size} is not a multiple of the mask's "
                             f"block {mask.q_block}; use mask blocks that divide it")
        return mask

    def candidates(self, cells: BlockCells) -> list[Candidate]:
        """Every structure priced in closed form (module docstring, steps 2-4)."""
        w, block = self.mesh.world, cells.q_block
        out: list[Candidate] = []
        if self.layout is not None:
            ks = [(self.layout.chunks_per_rank, self.layout.chunk_size)]
        else:
            ks = [(k, None) for k in CHUNKS_PER_RANK if k <= 2 or w * k * block <= self.shape.seq_len]
        for k, chunk in ks:
            out.append(self._tiled(cells, k, chunk))
        for name in self.baselines:
            c = self._baseline(cells, name)
            if c is not None:
                out.append(c)
        return out

    # ------------------------------------------------------------------ our structure
    def _tiled(self, cells: BlockCells, k: int, chunk: int | None) -> Candidate:
        mesh, w = self.mesh, self.mesh.world
        sc = self._scale(w * k, cells.q_block, chunk)
        grid = self._grid(cells, sc)
        weight = grid.blocks_GPP[0]
        if self.layout is not None:
            owner = np.asarray(self.layout.owner, dtype=np.int64)
        else:
            owner = ownership(weight, mesh, k, self.balance_tol)
        assign = place(weight, owner, mesh, self.balance_tol, sc.row_cost, sc.col_cost)[None]
        kern = kernel_groups(owner, assign)
        msgs = route(owner, assign, mesh, self.shape, sc.chunk, self.backward)
        seconds = self._price_overlapped(grid, kern, msgs, owner)
        name = "tiled" if self.layout is not None else f"tiled-k{k}"

        def build() -> TilePlan:
            return _assemble(method="ultraattn", owner=owner, assign_GPP=assign, kern=kern, msgs=msgs, mesh=mesh,
                             shape=self.shape, chunk=sc.chunk, meta={"structure": "tiled", "chunks_per_rank": k})

        return Candidate(name=name, seconds=seconds, build=build, imbalance=_imbalance(weight, assign[0], w))

    def _price_overlapped(self, grid: Grid, kern: tuple, msgs: Messages, owner: np.ndarray) -> float:
        phases = (0, 1) if self.backward else (0,)
        sec = {ph: grouped_kernel_seconds(grid, kern, head_dim=self.shape.head_dim, cost=self.cost,
                                          phase=_PHASES[ph]) for ph in phases}
        return overlapped_seconds(kern, sec, msgs, owner, grid.blocks_GPP.shape[0], self.mesh, self.cost, phases)

    # ------------------------------------------------------------------ baselines
    def _baseline(self, cells: BlockCells, name: str) -> Candidate | None:
        mesh, shape, w = self.mesh, self.shape, self.mesh.world
        block = cells.q_block
        if name in ("ulysses", "usp"):
            u = ulysses_degree(mesh, shape, within_node=name == "usp")
            if not u:
                return None
            p = w if name == "ulysses" else 2 * w
        else:
            u, p = 1, (w if name == "ring" else 2 * w)
        sc = self._scale(p, block)
        if self.layout is not None:
            owner = self._fixed_parts(name, sc, block)["owner"]
            if (sc.chunk, tuple(owner.tolist())) != (self.layout.chunk_size, self.layout.owner):
                return None
        grid = self._grid(cells, sc, head_groups=u)
        nonempty = grid.nonempty_GPP > 0
        fixed = self._fixed_parts(name, sc, block)
        owner = fixed["owner"]
        backward = self.backward
        phases = (0, 1) if backward else (0,)
        if name in ("ring", "zigzag", "allgather"):
            assign = np.where(nonempty[0], owner[:, None], -1)[None]
            kern = kernel_groups(owner, assign)
            if name == "allgather":
                msgs = fixed["msgs"]
            else:
                msgs = ring_messages(owner, assign[0], ring=np.arange(w), start_of=owner, shape=shape,
                                     chunk=sc.chunk, backward=backward)
            seconds = self._price_overlapped(grid, kern, msgs, owner)
            nonempty_t = torch.from_numpy(nonempty[0])

            def build() -> TilePlan:
                if name == "allgather":
                    return allgather_plan(nonempty_t, mesh=mesh, shape=shape, chunk=sc.chunk, backward=backward)
                return ring_plan(nonempty_t, mesh=mesh, shape=shape, chunk=sc.chunk, backward=backward,
                                 zigzag=name == "zigzag")

            imb = _imbalance(grid.blocks_GPP[0], assign[0], w)
        else:
            comp, ring_busy, assign = self._usp_compute(grid, fixed, u, name == "ulysses")
            a2a = fixed["msgs"]
            seconds = 0.0
            for ph in phases:
                ins = np.isin(a2a.tensor, [_CODE[t] for t in (("q", "kv") if ph == 0 else ("do",))])
                outs = np.isin(a2a.tensor, [_CODE[t] for t in (("out",) if ph == 0 else ("dq_out", "dkv_out"))])
                t_in = float(stream_busy(a2a, mesh, self.cost, ph, ins).max(initial=0.0))
                t_out = float(stream_busy(a2a, mesh, self.cost, ph, outs).max(initial=0.0))
                mid = np.maximum(comp[ph], ring_busy[ph].max(1) if ring_busy else 0.0)
                seconds += t_in + float(mid.max()) + t_out
            nonempty_t = torch.from_numpy(nonempty)

            def build() -> TilePlan:
                return usp_plan(nonempty_t, mesh=mesh, shape=shape, chunk=sc.chunk, backward=backward,
                                pure_ulysses=name == "ulysses")

            imb = _imbalance(grid.blocks_GPP, assign, w)

        def build_named() -> TilePlan:
            bp = build()
            return TilePlan(method="ultraattn", mesh=bp.mesh, shape=bp.shape, chunk_size=bp.chunk_size,
                            num_chunks=bp.num_chunks, owner=bp.owner, num_head_groups=bp.num_head_groups,
                            assign_GPP=bp.assign_GPP, kernels=bp.kernels, transfers=bp.transfers,
                            meta={**bp.meta, "structure": name})

        return Candidate(name=name, seconds=seconds, build=build_named, imbalance=imb)

    def _fixed_parts(self, name: str, sc: _Scale, block: int) -> dict:
        """A baseline's mask-independent parts on this grid: its ownership and, for all-gather, Ulysses and USP,
        the messages that do not depend on the mask (cached)."""
        key = (name, sc.num_chunks, block)
        hit = self._fixed.get(key)
        if hit is not None:
            return hit
        mesh, shape, w, p = self.mesh, self.shape, self.mesh.world, sc.num_chunks
        out: dict = {}
        if name == "ring":
            out["owner"] = np.arange(w, dtype=np.int64)
        elif name in ("zigzag", "allgather"):
            out["owner"] = np.asarray(zigzag_owner(w), dtype=np.int64)
            if name == "allgather":
                full = torch.ones(p, p, dtype=torch.bool)
                out["msgs"] = Messages.of(allgather_plan(full, mesh=mesh, shape=shape, chunk=sc.chunk,
                                                         backward=self.backward).transfers)
        else:
            pure = name == "ulysses"
            u = ulysses_degree(mesh, shape, within_node=not pure)
            # the all-to-all part: with no cell at all, the ring part is empty
            empty = torch.zeros(u, p, p, dtype=torch.bool)
            bp = usp_plan(empty, mesh=mesh, shape=shape, chunk=sc.chunk, backward=self.backward, pure_ulysses=pure)
            out["owner"] = np.asarray(bp.owner, dtype=np.int64)
            out["msgs"] = Messages.of(bp.transfers)
            rd = w // u
            if pure:
                out["computer_GP"] = np.broadcast_to(np.arange(u)[:, None], (u, p)).copy()
                out["step_of_col"] = np.zeros(p, dtype=np.int64)
                out["pos_of_col"] = np.zeros(p, dtype=np.int64)
            else:
                pos_of_super = np.asarray(zigzag_owner(rd), dtype=np.int64)
                pos = pos_of_super[np.arange(p) // u]
                out["computer_GP"] = pos[None, :] * u + np.arange(u)[:, None]
                out["pos_of_col"] = pos
            out["u"], out["rd"] = u, rd
        self._fixed[key] = out
        return out

    def _usp_compute(self, grid: Grid, fixed: dict, u: int, pure: bool):
        """Per-phase compute seconds per rank of a Ulysses / USP plan, its ring busy time, and its assignment."""
        w, p = self.mesh.world, grid.num_chunks
        comp_G = fixed["computer_GP"]
        g, i, j = np.nonzero(grid.nonempty_GPP > 0)
        r = comp_G[g, i]
        assign = np.full((u, p, p), -1, dtype=np.int64)
        assign[g, i, j] = r
        step = np.zeros_like(r) if pure else (fixed["pos_of_col"][j] - r // u) % fixed["rd"]
        key = (r * u + g) * max(1, fixed["rd"]) + step
        uniq, inv = np.unique(key, return_inverse=True)
        blocks = np.bincount(inv, grid.blocks_GPP[g, i, j])
        nonempty = np.bincount(inv, grid.nonempty_GPP[g, i, j])
        rows = np.bincount(np.unique(np.stack([inv, i]), axis=1)[0], minlength=uniq.size)
        rank_K = uniq // (u * max(1, fixed["rd"]))
        phases = (0, 1) if self.backward else (0,)
        comp = {ph: np.bincount(rank_K, kernel_seconds(grid, blocks, nonempty, rows, head_dim=self.shape.head_dim,
                                                       cost=self.cost, phase=_PHASES[ph]), minlength=w)
                for ph in phases}
        ring_busy = {}
        if not pure:
            msgs = Messages.concat([ring_messages(fixed["owner"], assign[gg], ring=np.arange(fixed["rd"]) * u + gg,
                                                  start_of=fixed["computer_GP"][gg], shape=self.shape,
                                                  chunk=grid.chunk, backward=self.backward, group=gg, groups=u)
                                    for gg in range(u)])
            ring_busy = {ph: stream_busy(msgs, self.mesh, self.cost, ph)[:, 1:] for ph in phases}
        return comp, ring_busy, assign


def ring_messages(owner: np.ndarray, assign_PP: np.ndarray, *, ring: np.ndarray, start_of: np.ndarray,
                  shape: AttnShape, chunk: int, backward: bool, group: int = 0, groups: int = 1) -> Messages:
    """``baselines._ring_transfers`` as arrays (vectorised): K/V of column j travel along ``ring`` from
    ``start_of[j]`` to the farthest rank that needs them; dK/dV ride back along the same hops."""
    n = ring.size
    pos = np.full(int(max(ring.max(), assign_PP.max(initial=0), start_of.max())) + 1, -1, dtype=np.int64)
    pos[ring] = np.arange(n)
    ii, jj = np.nonzero(assign_PP >= 0)
    r = assign_PP[ii, jj]
    origin = start_of[jj]
    dist = (pos[r] - pos[origin]) % n
    dist = np.where(r == origin, 0, dist)
    last = np.zeros(assign_PP.shape[1], dtype=np.int64)
    np.maximum.at(last, jj, dist)
    cols = np.flatnonzero(last > 0)
    hops = last[cols]
    col_h = np.repeat(cols, hops)
    t = np.arange(hops.sum()) - np.repeat(np.cumsum(hops) - hops, hops)
    o = pos[start_of[col_h]]
    src, dst = ring[(o + t) % n], ring[(o + t + 1) % n]
    kv, dkv = shape.unit_bytes("kv", chunk, groups), shape.unit_bytes("dkv", chunk, groups)
    parts = [Messages.make("kv", "fwd", col_h, group, src, dst, kv)]
    if backward:
        parts.append(Messages.make("kv", "bwd", col_h, group, src, dst, kv))
        # dK/dV: along the chain of receivers, then the last holder returns the sum to the origin
        last_hop = np.r_[col_h[1:] != col_h[:-1], True]
        d_dst = np.where(last_hop, start_of[col_h], np.r_[dst[1:], 0])
        parts.append(Messages.make("dkv", "bwd", col_h, group, dst, d_dst, dkv))
    # plan order: per column, forward K/V hops, backward K/V hops, then dK/dV
    msgs = Messages.concat(parts)
    order = np.lexsort((np.arange(msgs.chunk.size), msgs.chunk))
    return msgs.select(order)


def _imbalance(weight, assign, world: int) -> float:
    """Max over mean of per-rank work (``planner.api.work_imbalance``)."""
    sel = assign >= 0
    per = np.bincount(assign[sel], np.broadcast_to(weight, assign.shape)[sel], minlength=world)
    mean = per.mean()
    return float(per.max() / mean) if mean > 0 else 1.0


def _assemble(*, method: str, owner: np.ndarray, assign_GPP: np.ndarray, kern: tuple, msgs: Messages, mesh: Mesh,
              shape: AttnShape, chunk: int, meta: dict) -> TilePlan:
    """A ``TilePlan`` from arrays (Kernel and Transfer objects made once, for the chosen candidate only)."""
    g_N, i_N, j_N, start_K, rank_K, group_K, stage_K, _ = kern
    cells = list(zip(i_N.tolist(), j_N.tolist()))
    b = start_K.tolist()
    kernels = tuple(Kernel(rank=r, head_group=g, cells=tuple(cells[b[n]:b[n + 1]]), stage=s)
                    for n, (r, g, s) in enumerate(zip(rank_K.tolist(), group_K.tolist(), stage_K.tolist())))
    return TilePlan(method=method, mesh=mesh, shape=shape, chunk_size=chunk, num_chunks=int(owner.size),
                    owner=tuple(owner.tolist()), num_head_groups=int(assign_GPP.shape[0]),
                    assign_GPP=torch.from_numpy(assign_GPP.astype(np.int32)), kernels=kernels,
                    transfers=msgs.to_transfers(), meta=meta)
