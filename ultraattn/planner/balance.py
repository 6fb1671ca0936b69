"""Chunk ownership and cell placement for the online planner (``planner.fast``, step 2 of its docstring).

Pure numpy over a chunk-level work matrix ``weight_PP`` [P, P] (cost-weighted blocks of every (q chunk,
kv chunk) cell): chunks to nodes (an affinity greedy or a balanced contiguous cut, whichever the node-level
price prefers), chunks to a node's devices by a min-heap balancer, then cells moved off overloaded ranks:
nodes first, then devices (``place``), or rank by rank in one level (``place_flat``).
Every decision is deterministic: sorts are stable and ties go to the lower index.
"""

from __future__ import annotations

import heapq

import numpy as np

from .arrays import run_ends, run_starts
from .plan import Mesh


def _lpt(work: np.ndarray, items: np.ndarray, bins: int, per_bin: int) -> np.ndarray:
    """Longest processing time first with a cardinality: items by decreasing work to the least loaded bin
    that has room (MagiAttention's min-heap dispatch; ties to the lower bin). Returns the bin of each item."""
    order = np.lexsort((np.arange(items.size), -work[items])).tolist()
    wk = work[items].tolist()
    heap = [(0.0, b) for b in range(bins)]
    room = [per_bin] * bins
    out = [0] * items.size
    for n in order:
        load, b = heapq.heappop(heap)
        out[n] = b
        room[b] -= 1
        if room[b]:
            heapq.heappush(heap, (load + wk[n], b))
    return np.asarray(out, dtype=np.int64)


def _node_affinity(weight_PP: np.ndarray, nodes: int, per_node: int, tol: float) -> np.ndarray:
    """Chunks to nodes: by decreasing row work, to the node sharing the most non-empty cells with the chunk
    among nodes with room for its work (compute within ``(1 + tol / 2) x mean``), else the least loaded."""
    p = weight_PP.shape[0]
    work = weight_PP.sum(1)
    ii, jj = np.nonzero(weight_PP > 0)
    a = np.concatenate([ii, jj])
    b = np.concatenate([jj, ii])
    keep = a != b
    order = np.argsort(a[keep], kind="stable")
    nbr = b[keep][order]
    bounds = np.searchsorted(a[keep][order], np.arange(p + 1)).tolist()
    cap = (1 + tol / 2) * float(work.sum()) / nodes
    aff = np.zeros((nodes, p))
    load = [0.0] * nodes
    room = [per_node] * nodes
    wk = work.tolist()
    least = float(work.min())  # every chunk still to come weighs at least this
    node_of = np.empty(p, dtype=np.int64)
    for c in np.lexsort((np.arange(p), -work)).tolist():
        col = aff[:, c].tolist()
        best, best_key = -1, None
        for n in range(nodes):
            # room for this chunk and for the (room - 1) chunks the node must still take
            if room[n] and load[n] + wk[c] + (room[n] - 1) * least <= cap:
                key = (-col[n], load[n], n)  # most shared cells, then least load, then lowest index
                if best_key is None or key < best_key:
                    best, best_key = n, key
        if best < 0:
            best = min((n for n in range(nodes) if room[n]), key=lambda n: (load[n], n))
        node_of[c] = best
        load[best] += wk[c]
        room[best] -= 1
        np.add.at(aff[best], nbr[bounds[c]:bounds[c + 1]], 1.0)
    return node_of


def _node_contiguous(weight_PP: np.ndarray, nodes: int, per_node: int) -> np.ndarray:
    """Chunks to nodes in sequence order, cut where the work balances (documents stay whole); then each node with
    too many chunks hands its most self-contained light chunks (fewest non-empty cells shared with its other
    chunks, then least work) to the least loaded nodes with too few."""
    p = weight_PP.shape[0]
    work = weight_PP.sum(1)
    total = float(work.sum())
    mid = np.cumsum(work) - work / 2
    node_of = np.clip((nodes * mid / total).astype(np.int64), 0, nodes - 1) if total > 0 else np.arange(p) // per_node
    ii, jj = np.nonzero(weight_PP > 0)
    off = ii != jj
    count = np.bincount(node_of, minlength=nodes)
    load = np.bincount(node_of, work, minlength=nodes)
    for n in np.flatnonzero(count > per_node).tolist():
        mine = node_of == n
        shared = np.bincount(np.concatenate([ii[off & mine[jj] & mine[ii]], jj[off & mine[jj] & mine[ii]]]),
                             minlength=p)
        items = np.flatnonzero(mine)
        for c in items[np.lexsort((items, work[items], shared[items]))][: count[n] - per_node].tolist():
            short = np.flatnonzero(count < per_node)
            t = int(short[np.lexsort((short, load[short]))[0]])
            node_of[c] = t
            count[n] -= 1
            count[t] += 1
            load[n] -= work[c]
            load[t] += work[c]
    return node_of


def node_seconds(weight_PP: np.ndarray, node_of: np.ndarray, nodes: int, devices: int, block_seconds: float,
                 col_cost_inter: float) -> float:
    """Node-level price of a chunk-to-node assignment (rows computed where they live): the busiest node's compute
    (spread over its devices, at ``block_seconds`` per cost-weighted block) or its NIC traffic (the K/V units its
    rows need from other nodes, in and out, spread over its devices' NICs)."""
    ii, jj = np.nonzero(weight_PP > 0)
    comp = np.bincount(node_of[ii], weight_PP[ii, jj], minlength=nodes) * block_seconds / devices
    ni, nj = node_of[ii], node_of[jj]
    cross = ni != nj
    pairs = np.unique(jj[cross] * nodes + ni[cross])
    units_in = np.bincount(pairs % nodes, minlength=nodes)
    units_out = np.bincount(node_of[pairs // nodes], minlength=nodes)
    nic = np.maximum(units_in, units_out) * col_cost_inter / devices
    return float(np.maximum(comp, nic).max())


def ownership(weight_PP: np.ndarray, mesh: Mesh, k: int, tol: float, *, block_seconds: float = 0.0,
              col_cost_inter: float = 0.0) -> np.ndarray:
    """int64 [P]: the rank owning each chunk. Across nodes: the cheaper (``node_seconds``) of the affinity greedy
    and the balanced contiguous cut; inside a node: the min-heap balancer."""
    p = weight_PP.shape[0]
    work = weight_PP.sum(1)
    if mesh.nodes == 1:
        return _lpt(work, np.arange(p), mesh.devices, k)
    per_node = mesh.devices * k
    cands = [_node_affinity(weight_PP, mesh.nodes, per_node, tol), _node_contiguous(weight_PP, mesh.nodes, per_node)]
    node_of = min(cands, key=lambda a: node_seconds(weight_PP, a, mesh.nodes, mesh.devices, block_seconds,
                                                    col_cost_inter))
    owner = np.empty(p, dtype=np.int64)
    for n in range(mesh.nodes):
        items = np.flatnonzero(node_of == n)
        owner[items] = n * mesh.devices + _lpt(work, items, mesh.devices, k)
    return owner


def balanced_ownership(weight_PP: np.ndarray, mesh: Mesh, k: int) -> np.ndarray:
    """int64 [P]: the rank owning each chunk when balance is all that counts (MagiAttention's dispatch): every
    chunk, by decreasing row work, to the least loaded rank with room for it (``k`` chunks each), over the whole
    mesh: no node affinity, so the work per rank is as even as chunks allow and remote K/V is the price paid.
    The fast planner's ``balanced`` candidate, computed where its query rows live."""
    return _lpt(weight_PP.sum(1), np.arange(weight_PP.shape[0]), mesh.world, k)


def place(weight_PP: np.ndarray, owner: np.ndarray, mesh: Mesh, tol: float, row_cost: np.ndarray,
          col_cost: np.ndarray) -> np.ndarray:
    """int64 [P, P]: the rank computing each cell (-1 empty): the row owner, then cells move off ranks above
    ``(1 + tol) x mean`` (module docstring, step 2). Hierarchical on several nodes, as the ILP planner's levels:

    1. nodes first (``place_flat`` on a mesh of one device per node, at ``tol / 2`` so that the devices of a node
       near its cap can still meet theirs): what crosses a node link moves as whole rows' worth of cells,
       decided once for the node rather than rank by rank;
    2. the cells a node takes from another node's row land on its least loaded device, heaviest first (one
       device per (row, node): the row's Q crosses once);
    3. devices inside each node (``place_flat(local=True)``), then a last pass anywhere for a rank still above its
       cap (cells too coarse to fit inside its node).

    Moving rank by rank across nodes (``place_flat`` alone) moves single cells of many rows over the node links
    (on a 32K packed-document mask on 8x8: 31 (row, rank) pairs across nodes where the ILP planner's plan has 11).
    It is not always worse, so the fast planner prices both (``FastPlanner._tiled``).
    """
    if mesh.nodes == 1:
        return place_flat(weight_PP, owner, mesh, tol, row_cost, col_cost)
    d = mesh.devices
    far_row, far_col = np.full(2, row_cost[1]), np.full(2, col_cost[1])
    node_at = place_flat(weight_PP, owner // d, Mesh(nodes=mesh.nodes, devices=1), tol / 2, far_row, far_col)
    ii, jj = np.nonzero(weight_PP > 0)
    wt = weight_PP[ii, jj]
    dest = node_at[ii, jj]
    stay = dest == owner[ii] // d
    at = owner[ii].copy()
    moved = np.flatnonzero(~stay)
    load = np.bincount(at, np.where(stay, wt, 0.0), minlength=mesh.world)
    if moved.size:
        key = ii[moved] * mesh.nodes + dest[moved]
        order = np.lexsort((moved, key))
        moved, key = moved[order], key[order]
        starts = run_starts(key)
        sums = np.add.reduceat(wt[moved], starts)
        bounds = [*starts.tolist(), moved.size]
        for g in np.lexsort((key[starts], -sums)).tolist():
            devs = int(key[starts[g]]) % mesh.nodes * d + np.arange(d)
            t = int(devs[np.argmin(load[devs])])
            at[moved[bounds[g]:bounds[g + 1]]] = t
            load[t] += sums[g]
    start = np.full(weight_PP.shape, -1, dtype=np.int64)
    start[ii, jj] = at
    start = place_flat(weight_PP, owner, mesh, tol, row_cost, col_cost, start=start, local=True)
    return place_flat(weight_PP, owner, mesh, tol, row_cost, col_cost, start=start)


def place_flat(weight_PP: np.ndarray, owner: np.ndarray, mesh: Mesh, tol: float, row_cost: np.ndarray,
               col_cost: np.ndarray, *, start: np.ndarray | None = None, local: bool = False) -> np.ndarray:
    """One level of ``place``: cells move from ``start`` (default: the row owners) off ranks above
    ``(1 + tol) x mean``, to any rank or (``local``) to ranks of the same node.

    Each move takes cells of one query row from the most loaded rank to one rank with room, choosing the
    (row, rank) pair with the most work moved per second of new traffic: the row's Q unit (unless the
    rank already computes in that row) and the K/V units of the moved cells the rank does not hold yet.
    ``row_cost``/``col_cost`` [2]: seconds to move one row / column unit inside a node / across nodes.
    """
    w, p = mesh.world, owner.size
    ii, jj = np.nonzero(weight_PP > 0)
    wt = weight_PP[ii, jj]
    at = owner[ii].copy() if start is None else start[ii, jj].copy()
    load = np.bincount(at, wt, minlength=w)
    cap = (1 + tol) * load.sum() / w
    node = np.arange(w) // mesh.devices
    has_row = np.zeros((p, w), dtype=bool)
    has_row[np.arange(p), owner] = True
    has_row[ii, at] = True
    has_col = np.zeros((p, w), dtype=bool)
    has_col[np.arange(p), owner] = True
    has_col[jj, at] = True
    stuck = np.zeros(w, dtype=bool)
    reach = node[:, None] == node[None, :] if local else np.ones((w, w), dtype=bool)   # [from rank, to rank]
    np.fill_diagonal(reach, False)
    for _ in range(8 * w + 4 * p):
        over = np.where(stuck, -np.inf, load)
        r = int(np.argmax(over))
        if over[r] <= cap * (1 + 1e-12):
            break
        need = load[r] - cap
        room = cap - load
        targets = np.flatnonzero((room > 0) & reach[r])
        on = np.flatnonzero(at == r)
        if not targets.size or not on.size:
            stuck[r] = True
            continue
        # every (cell on r, target) pair that fits, cells major: its K/V price, grouped by (row, target)
        ci, ti = np.nonzero(wt[on][:, None] <= room[targets][None, :])
        if not ci.size:
            stuck[r] = True
            continue
        c_, t_ = on[ci], targets[ti]
        far = (node[t_] != node[r]).astype(np.int64)
        col_price = np.where(has_col[jj[c_], t_], 0.0, col_cost[far])
        # per (row, target): cells whose K/V the target holds first, then by weight; the price is the row's Q
        # plus the K/V of the cells needed to move the amount
        key = ii[c_] * w + t_
        order = np.lexsort((jj[c_], -wt[c_], col_price, key))
        c_, t_, key, col_price = c_[order], t_[order], key[order], col_price[order]
        starts = run_starts(key)
        ends = run_ends(starts, key.size)
        grp = np.repeat(np.arange(starts.size), ends - starts)
        w_c = wt[c_]
        cum = np.cumsum(w_c)
        before = cum - w_c - (cum[starts] - w_c[starts])[grp]
        t_u, rows_u = t_[starts], ii[c_[starts]]
        amount = np.minimum(np.minimum(np.add.reduceat(w_c, starts), room[t_u]), need)
        taken = before < amount[grp]
        price = (np.where(has_row[rows_u, t_u], 0.0, row_cost[(node[t_u] != node[r]).astype(np.int64)])
                 + np.add.reduceat(np.where(taken, col_price, 0.0), starts))
        moved = 0.0
        for n in np.lexsort((key[starts], -(amount / (price + 1e-12)))).tolist():
            t = int(t_u[n])
            for c in c_[starts[n]:ends[n]].tolist():   # (a group's cells are contiguous: sorted by key)
                if moved >= need:
                    break
                if load[t] + wt[c] > cap:
                    continue
                at[c] = t
                load[r] -= wt[c]
                load[t] += wt[c]
                moved += wt[c]
                has_row[ii[c], t] = True
                has_col[jj[c], t] = True
            if moved > 0:
                break
        if moved == 0.0:
            stuck[r] = True
    out = np.full(weight_PP.shape, -1, dtype=np.int64)
    out[ii, jj] = at
    return out
