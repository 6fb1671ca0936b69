"""Assemble a ``TilePlan`` from ownership and cell assignment: transfers and kernels.

Routing (hierarchical, the comm side of context tiling): a Q or KV unit that ranks of
another node need crosses the node boundary ONCE, landing on one of those ranks, and
is relayed over NVLink to the node's other consumers. Partial results travel the other
way: ranks of a remote node reduce into the landing rank, which sends one partial
across. The landing rank of each (unit, node) is the consumer with the least
inter-node traffic so far (spreads the load over the node's NICs).

Kernel-level tiling: a rank's cells are grouped into launches by which remote inputs
they need: cells on local data form stage 0, one launch per local row (they run while
the first messages fly, and a remote-dependent launch can slip in between), then one
launch per remote KV column (over all local rows), per remote Q row, and per (row,
column) pair needing both. Fewer launches cost overlap, more cost launch overhead and efficiency on
short tiles; the cost model prices both.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from .plan import AttnShape, Kernel, Mesh, TilePlan, Transfer


def _unit_flows(backward: bool) -> tuple[list[tuple[str, str, str]], list[tuple[str, str, str]]]:
    """(input tensor, partial tensor, phase) triples moved for rows and for columns."""
    rows = [("q", "o", "fwd")]
    cols = [("kv", "", "fwd")]
    if backward:
        rows.append(("qdo", "dq", "bwd"))
        cols.append(("kv", "dkv", "bwd"))
    return rows, cols


def route_transfers(
    *, owner: list[int], assign_GPP: torch.Tensor, mesh: Mesh, shape: AttnShape, chunk: int,
    backward: bool = True, hierarchical: bool = True, landing: dict[tuple[int, int], int] | None = None,
) -> list[Transfer]:
    """Transfers that bring every cell's inputs to its computing rank and partials back."""
    g_count, p, _ = assign_GPP.shape
    out: list[Transfer] = []
    inter_load: dict[int, int] = defaultdict(int)
    rows_flows, cols_flows = _unit_flows(backward)
    a = assign_GPP.tolist()
    for g in range(g_count):
        for axis, flows in (("row", rows_flows), ("col", cols_flows)):
            for c in range(p):
                line = a[g][c] if axis == "row" else [a[g][i][c] for i in range(p)]
                consumers = sorted({r for r in line if r >= 0} - {owner[c]})
                if not consumers:
                    continue
                src = owner[c]
                by_node: dict[int, list[int]] = defaultdict(list)
                for r in consumers:
                    by_node[mesh.node_of(r)].append(r)
                for node, ranks in sorted(by_node.items()):
                    if node == mesh.node_of(src) or not hierarchical or len(ranks) == 1:
                        hops = [(src, r) for r in ranks]
                        land = None
                    else:
                        land = (landing or {}).get((c, node))
                        if land is None:
                            land = min(ranks, key=lambda r: (inter_load[r], r))
                        hops = [(src, land)] + [(land, r) for r in ranks if r != land]
                    for inp, part, phase in flows:
                        n_in = shape.unit_bytes(inp, chunk, g_count)
                        for s, d in hops:
                            out.append(Transfer(tensor=inp, chunk=c, head_group=g, src=s, dst=d,
                                                nbytes=n_in, phase=phase))
                            if not mesh.same_node(s, d):
                                inter_load[d] += n_in
                        if part:
                            n_p = shape.unit_bytes(part, chunk, g_count)
                            for s, d in reversed(hops):
                                out.append(Transfer(tensor=part, chunk=c, head_group=g, src=d, dst=s,
                                                    nbytes=n_p, phase=phase))
                                if not mesh.same_node(s, d):
                                    inter_load[d] += n_p
    return out


def group_kernels(*, owner: list[int], assign_GPP: torch.Tensor) -> list[Kernel]:
    """Kernel-level tiling (module docstring); deterministic order."""
    g_count, p, _ = assign_GPP.shape
    groups: dict[tuple, list[tuple[int, int]]] = defaultdict(list)
    a = assign_GPP.tolist()
    for g in range(g_count):
        for i in range(p):
            row = a[g][i]
            for j in range(p):
                r = row[j]
                if r < 0:
                    continue
                li, lj = owner[i] == r, owner[j] == r
                # local rows x local columns: one launch per row, so remote-dependent work can
                # interleave; a remote column: one launch over all local rows (as a ring step)
                key = (r, g, i if (lj or not li) else -1, -1 if lj else j)
                groups[key].append((i, j))
    kernels = []
    for (r, g, ki, kj), cells in sorted(groups.items()):
        stage = (ki >= 0 and owner[ki] != r) + (kj >= 0)
        kernels.append(Kernel(rank=r, head_group=g, cells=tuple(cells), stage=stage))
    kernels.sort(key=lambda k: (k.rank, k.head_group, k.stage, k.cells[0]))
    return kernels


def make_plan(
    *, method: str, owner: list[int], assign_GPP: torch.Tensor, mesh: Mesh, shape: AttnShape,
    chunk: int, backward: bool = True, hierarchical: bool = True, meta: dict | None = None,
    landing: dict[tuple[int, int], int] | None = None,
) -> TilePlan:
    """A direct-routed plan from ownership + assignment (used by the planner and by baselines)."""
    return TilePlan(
        method=method, mesh=mesh, shape=shape, chunk_size=chunk, num_chunks=len(owner),
        owner=tuple(owner), num_head_groups=assign_GPP.shape[0], assign_GPP=assign_GPP.to(torch.int32),
        kernels=tuple(group_kernels(owner=owner, assign_GPP=assign_GPP)),
        transfers=tuple(route_transfers(owner=owner, assign_GPP=assign_GPP, mesh=mesh, shape=shape,
                                        chunk=chunk, backward=backward, hierarchical=hierarchical,
                                        landing=landing)),
        meta=dict(meta or {}),
    )
