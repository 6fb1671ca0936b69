"""Assemble a ``TilePlan`` from ownership and cell assignment: transfers and kernels.

Routing (hierarchical, the comm side of context tiling): a Q or KV unit that ranks of
another node need crosses the node boundary ONCE per node, landing on one rank there, and
is relayed over NVLink to the node's consumers. Partial results travel the other way:
the node's consumers reduce into the landing rank, which sends one partial across. Both
ends of a crossing spread over the NICs (``NodeLinks``, one NIC per GPU as on a DGX H100):
the landing rank is the receiving node's rank whose link has carried least so far
(preferring the consumers), and the sending rank likewise on the owner's node (preferring
the owner and the unit's senders so far, which hold it; any other rank gets the unit from
the owner over NVLink first and reduces the partials of the nodes it serves). Before
(landing on a consumer, sending from the owner), a rank that alone needed a long
document's earlier K/V received all of it through its own NIC while its node's other
NICs idled: on the 32K packed-document mask of ``benchmarks/replan.py`` on 8x8, rank 57
took 12 units and was the busiest stream of the fast planner's plan (0.80 of its 1.25 ms
priced backward+forward); spread, the plan prices 0.72 ms.

Kernel-level tiling: a rank's cells are grouped into launches by which remote inputs
they need: cells on local data form stage 0, one launch per local row (they run while
the first messages fly, and a remote-dependent launch can slip in between), then one
launch per remote KV column (over all local rows), per remote Q row, and per (row,
column) pair needing both. Fewer launches cost overlap, more cost launch overhead and efficiency on
short tiles; the cost model prices both.

Batched kernels (``batch`` >= 2): the same local launches, but a rank's remote cells of one query row go in
launches of ``batch`` cells each, in the order their inputs are expected (inside the node before across nodes,
then by column), so each launch runs over ``batch`` chunks of keys: a chunk of 4096 keys per row runs at 91 % of
the kernel's peak under the cost model (``eff_half_tokens``), four of them at 98 %; but a launch waits for the
last of its inputs. The planners try ``BATCHES`` on the plan they chose and keep the fastest (``api.plan``:
replayed; ``fast``: on small plans, priced then replayed: the price favours the longest launches, its bound of a
launch's wait being loose).
"""

from __future__ import annotations

import math
from collections import defaultdict

import numpy as np
import torch

from .arrays import run_ends, run_starts
from .plan import AttnShape, Kernel, Mesh, TilePlan, Transfer


def _unit_flows(backward: bool) -> tuple[list[tuple[str, str, str]], list[tuple[str, str, str]]]:
    """(input tensor, partial tensor, phase) triples moved for rows and for columns."""
    rows = [("q", "o", "fwd")]
    cols = [("kv", "", "fwd")]
    if backward:
        rows.append(("qdo", "dq", "bwd"))
        cols.append(("kv", "dkv", "bwd"))
    return rows, cols


class NodeLinks:
    """Where each unit crosses a node link: the rank that lands it and the rank that sends it, chosen to spread the
    crossings over the NICs (module docstring, "Routing"). The routers' one rule: ``route_transfers`` here, and
    ``price.route`` (vectorised) for the fast planner.

    It counts the bytes each rank's node link has carried so far, per phase and direction (a NIC is full duplex;
    the phases are priced apart), and takes the rank whose busiest count stays least: for landing, among the
    receiving node's ranks; for sending, among the owner's node's ranks except the node's own consumers of the unit
    (their launches would hold the partials the sender reduces). A rank that neither uses nor holds the unit
    counts one unit's bytes more (it costs a hop over NVLink, and a level of the executor's exchange); ties go to the
    ranks that do, then to the lowest."""

    def __init__(self, world: int, devices: int, spread: bool = True) -> None:
        self.dev = devices
        self.spread = spread
        """False: land on a consumer and send from the owner (no relay outside the unit's users)."""
        self.load = [[0.0] * 4 for _ in range(world)]
        """Bytes each rank's node link has sent and received: [fwd out, fwd in, bwd out, bwd in]."""
        self._land = self._send = (0.0,) * 4
        self._after = {self._land: [0.0] * world}
        """Per delta (landing, sending): each rank's busiest count once it is added (kept up to date by ``_add``)."""

    def unit(self, flows, shape: AttnShape, chunk: int, groups: int) -> None:
        """Set the unit the next crossings move (call before ``cross``): its (input, partial, phase) flows. The
        inputs go sender -> landing rank, the partials come back."""
        land, send = [0.0] * 4, [0.0] * 4
        for inp, part, phase in flows:
            k = 2 * ("fwd", "bwd").index(phase)
            n_in = shape.unit_bytes(inp, chunk, groups)
            n_p = shape.unit_bytes(part, chunk, groups) if part else 0
            land[k + 1] += n_in
            land[k] += n_p
            send[k] += n_in
            send[k + 1] += n_p
        self._land, self._send = tuple(land), tuple(send)
        self._after = {d: [max(x + y for x, y in zip(ld, d)) for ld in self.load] for d in (self._land, self._send)}

    def cross(self, owner: int, consumers, have: set[int], skip=(), land: int | None = None) -> tuple[int, int, bool]:
        """(landing rank, sending rank, whether the sender must first get the unit from the owner) of the unit
        crossing to the node of ``consumers`` (its ranks that need it): ``have`` the owner's node's ranks that hold it
        (the owner, its senders so far; the sender joins it), ``skip`` that node's own consumers, ``land`` a landing
        rank chosen already (the ILP planner's)."""
        dev = self.dev
        if land is None:
            base = next(iter(consumers)) // dev * dev
            others = () if self.spread else set(range(base, base + dev)) - set(consumers)
            land = self._least(base, self._after[self._land], max(self._land), consumers, others)
        self._add(land, self._land)
        snd = (self._least(owner // dev * dev, self._after[self._send], max(self._send), have, skip) if self.spread
               else owner)
        self._add(snd, self._send)
        fetch = snd not in have
        have.add(snd)
        return land, snd, fetch

    def _least(self, base: int, after: list[float], pen: float, free, skip) -> int:
        best, best_v, best_out = -1, math.inf, True
        for x in range(base, base + self.dev):
            if x in skip:
                continue
            out = x not in free
            v = after[x] + pen if out else after[x]
            if v < best_v or (v == best_v and best_out and not out):
                best, best_v, best_out = x, v, out
        return best

    def _add(self, rank: int, delta: tuple[float, ...]) -> None:
        # (four counts, spelled out: this runs thousands of times per plan at 64 ranks)
        a, b, c, d = self.load[rank]
        self.load[rank] = ld = [a + delta[0], b + delta[1], c + delta[2], d + delta[3]]
        a, b, c, d = ld
        for (e, f, g, h), aft in self._after.items():
            aft[rank] = max(a + e, b + f, c + g, d + h)


def route_transfers(
    *, owner: list[int], assign_GPP: torch.Tensor, mesh: Mesh, shape: AttnShape, chunk: int,
    backward: bool = True, hierarchical: bool = True, landing: dict[tuple[int, int], int] | None = None,
    spread: bool = True,
) -> list[Transfer]:
    """Transfers that bring every cell's inputs to its computing rank and partials back (module docstring,
    "Routing"); ``landing``: the landing rank of (chunk, node) where the ILP planner chose it; ``spread``: as
    ``NodeLinks``."""
    g_count, p, _ = assign_GPP.shape
    out: list[Transfer] = []
    links = NodeLinks(mesh.world, mesh.devices, spread)
    rows_flows, cols_flows = _unit_flows(backward)
    a = assign_GPP.tolist()
    for g in range(g_count):
        for axis, flows in (("row", rows_flows), ("col", cols_flows)):
            links.unit(flows, shape, chunk, g_count)
            for c in range(p):
                line = a[g][c] if axis == "row" else [a[g][i][c] for i in range(p)]
                consumers = sorted({r for r in line if r >= 0} - {owner[c]})
                if not consumers:
                    continue
                src = owner[c]
                by_node: dict[int, list[int]] = defaultdict(list)
                for r in consumers:
                    by_node[mesh.node_of(r)].append(r)
                have = {src}
                local = by_node.get(mesh.node_of(src), [])
                for node, ranks in sorted(by_node.items()):
                    if node == mesh.node_of(src) or not hierarchical:
                        hops = [(src, r) for r in ranks]
                    else:
                        land, snd, fetch = links.cross(src, ranks, have, local, (landing or {}).get((c, node)))
                        hops = ([(src, snd)] if fetch else []) + [(snd, land)] + [(land, r) for r in ranks if r != land]
                    for inp, part, phase in flows:
                        n_in = shape.unit_bytes(inp, chunk, g_count)
                        out.extend(Transfer(tensor=inp, chunk=c, head_group=g, src=s, dst=d, nbytes=n_in,
                                            phase=phase) for s, d in hops)
                        if part:
                            n_p = shape.unit_bytes(part, chunk, g_count)
                            out.extend(Transfer(tensor=part, chunk=c, head_group=g, src=d, dst=s, nbytes=n_p,
                                                phase=phase) for s, d in reversed(hops))
    return out


def input_stage(owner: np.ndarray, rank_N: np.ndarray, i_N: np.ndarray, j_N: np.ndarray, devices: int) -> np.ndarray:
    """Where each cell's inputs come from, the later of its row's and its column's: 0 the computing rank, 1 its node,
    2 another node (``devices`` per node)."""
    node = rank_N // devices
    return np.maximum(*(np.where(owner[c] == rank_N, 0, np.where(owner[c] // devices == node, 1, 2))
                        for c in (i_N, j_N)))


#: batch sizes the planners try for remote cells (``kernel_groups``; 1: the unbatched launches)
BATCHES = (1, 2, 4, 8)


def kernel_groups(owner, assign_GPP, *, batch: int = 1, devices: int = 1) -> tuple[np.ndarray, ...]:
    """Kernel-level tiling as arrays (vectorised): the cells of every kernel, in ``group_kernels`` order.

    Returns ``(g_N, i_N, j_N, start_K, rank_K, group_K, stage_K, col_kernel_K)``: the non-empty cells
    sorted kernel by kernel (cells of kernel k are ``start_K[k]:start_K[k + 1]``, in (row, column)
    order); per kernel its rank, head group, stage, and whether it is a one-column launch over several
    local rows (its rows are distinct: as many as its cells) rather than a launch on one row.
    ``batch`` >= 2: remote cells in per-row launches of ``batch`` cells (module docstring); ``devices``
    per node tells inputs from inside the node from those that cross nodes.
    """
    if not isinstance(batch, int) or batch < 1:
        raise ValueError(f"`batch` must be a positive int, got {batch!r}")
    a = assign_GPP.numpy() if isinstance(assign_GPP, torch.Tensor) else np.asarray(assign_GPP)
    own = np.asarray(owner, dtype=np.int64)
    g, i, j = np.nonzero(a >= 0)
    r = a[g, i, j].astype(np.int64)
    if batch == 1:
        li, lj = own[i] == r, own[j] == r
        # local rows x local columns: one launch per row, so remote-dependent work can interleave; a remote
        # column: one launch over all local rows (as a ring step); a remote row: one launch per (row, column)
        ki = np.where(lj | ~li, i, -1)
        kj = np.where(lj, -1, j)
        stage_N = ((ki >= 0) & ~li).astype(np.int64) + (kj >= 0)
    else:
        stage_N = input_stage(own, r, i, j, devices)
        # per (rank, group, row): the local cells one launch, the remote ones in expected arrival order (stage, then
        # column), ``batch`` to a launch
        order = np.lexsort((j, stage_N, i, g, r))
        key = np.stack([r, g, i])[:, order]
        row_start = run_starts(key)
        seg = np.repeat(np.arange(row_start.size), run_ends(row_start, order.size) - row_start)
        local = np.bincount(seg, stage_N[order] == 0, minlength=row_start.size).astype(np.int64)
        pos = np.arange(order.size) - row_start[seg] - local[seg]   # place among the row's remote cells
        nth = np.empty(order.size, dtype=np.int64)
        nth[order] = np.where(pos >= 0, 1 + pos // batch, 0)
        ki, kj = i, nth   # a kernel: (rank, group, row, launch number)
    first = np.lexsort((kj, ki, g, r))  # group the cells (stable: (row, column) order inside a group)
    key = np.stack([r, g, ki, kj])[:, first]
    new = np.ones(first.size, dtype=bool)
    new[1:] = (key[:, 1:] != key[:, :-1]).any(0)
    starts = np.flatnonzero(new)
    # kernels in (rank, head group, stage, first cell) order; a kernel's stage is its latest cell's
    f = first[starts]
    stage_K = np.maximum.reduceat(stage_N[first], starts) if starts.size else stage_N[f]
    order = np.lexsort((j[f], i[f], stage_K, g[f], r[f]))
    bounds = np.append(starts, first.size)
    sizes = np.diff(bounds)[order]
    start_K = np.concatenate([[0], np.cumsum(sizes)])
    # the groups' cells in kernel order: each kernel's run of ``first``, gathered at once
    idx = first[np.repeat(bounds[order] - start_K[:-1], sizes) + np.arange(first.size)]
    f = f[order]
    return g[idx], i[idx], j[idx], start_K, r[f], g[f], stage_K[order], ki[f] < 0


def group_kernels(*, owner: list[int], assign_GPP: torch.Tensor, batch: int = 1, devices: int = 1) -> list[Kernel]:
    """Kernel-level tiling (module docstring); deterministic order."""
    g_N, i_N, j_N, start_K, rank_K, group_K, stage_K, _ = kernel_groups(owner, assign_GPP, batch=batch,
                                                                        devices=devices)
    cells = list(zip(i_N.tolist(), j_N.tolist()))
    bounds = start_K.tolist()
    return [Kernel(rank=r, head_group=g, cells=tuple(cells[bounds[k]:bounds[k + 1]]), stage=s)
            for k, (r, g, s) in enumerate(zip(rank_K.tolist(), group_K.tolist(), stage_K.tolist()))]


def make_plan(
    *, method: str, owner: list[int], assign_GPP: torch.Tensor, mesh: Mesh, shape: AttnShape,
    chunk: int, backward: bool = True, hierarchical: bool = True, meta: dict | None = None,
    landing: dict[tuple[int, int], int] | None = None, spread: bool = True,
) -> TilePlan:
    """A direct-routed plan from ownership + assignment (used by the planner and by baselines)."""
    return TilePlan(
        method=method, mesh=mesh, shape=shape, chunk_size=chunk, num_chunks=len(owner),
        owner=tuple(owner), num_head_groups=assign_GPP.shape[0], assign_GPP=assign_GPP.to(torch.int32),
        kernels=tuple(group_kernels(owner=owner, assign_GPP=assign_GPP)),
        transfers=tuple(route_transfers(owner=owner, assign_GPP=assign_GPP, mesh=mesh, shape=shape,
                                        chunk=chunk, backward=backward, hierarchical=hierarchical,
                                        landing=landing, spread=spread)),
        meta=dict(meta or {}),
    )
