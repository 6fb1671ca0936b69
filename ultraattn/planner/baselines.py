"""Baseline context-parallel plans in the planner's data model (the yardstick).

Each baseline is a ``TilePlan`` built the way its system works, then replayed by the
same simulator and cost model as ours:

* ``ring``: contiguous shards (one chunk per rank); K/V circulate rank -> rank+1;
  cells are computed where Q lives, EMPTY cells are skipped, and K/V stop travelling
  after the last rank that needs them. Backward re-circulates K/V with the dK/dV
  accumulators (ring-flash-attention).
* ``zigzag``: ring over head-tail shards (rank r owns chunks r and 2R-1-r).
* ``allgather``: head-tail shards; every rank gathers ALL K/V (Llama-3 / PyTorch
  FlexAttention CP), hierarchically: across nodes between equal device indices (the
  NIC rails), then inside the node. Backward re-gathers K/V and reduce-scatters dK/dV
  along the reverse path.
* ``ulysses``: all-to-all from sequence to heads (DeepSpeed-Ulysses); needs the world
  size to divide both head counts. Each rank computes its heads over the whole sequence
  in one launch and sends its final output back; backward moves dO in and dQ/dK/dV out
  (Q/K/V kept from the forward).
* ``usp``: Ulysses inside the node (degree u = the largest divisor of the devices that
  divides both head counts), zigzag ring across the u-groups (Fang & Zhao 2024).

Closed forms (tested): ring forward moves, per K/V chunk j, (last hop distance) messages
of one chunk; all-gather delivers each chunk to every rank exactly once.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from .build import group_kernels
from .plan import AttnShape, Kernel, Mesh, TilePlan, Transfer

BASELINES = ("ring", "zigzag", "allgather", "ulysses", "usp")


class NotApplicable(ValueError):
    """A baseline cannot run this configuration (the message says why)."""


def zigzag_owner(world: int, copies: int = 1) -> list[int]:
    """Head-tail ownership of 2*world*copies chunks: rank r gets positions r and 2*world-1-r."""
    owner = []
    for s in range(2 * world):
        pos = s if s < world else 2 * world - 1 - s
        owner.extend([pos] * copies)
    return owner


def striped_owner(world: int, stripes: int) -> list[int]:
    """Head-tail ownership repeated ``stripes`` times along the sequence (2*world*stripes chunks): each stripe of
    2*world chunks is dealt like ``zigzag_owner``. Fine stripes spread any mask's dense regions over all ranks:
    the fixed owners of a graph whose mask changes every batch (``benchmarks/exchange_owners.py``)."""
    return zigzag_owner(world) * stripes


def _assign_at_row_owner(nonempty_PP: torch.Tensor, owner: list[int]) -> torch.Tensor:
    own = torch.tensor(owner, dtype=torch.int32)
    a = own[:, None].expand_as(nonempty_PP).clone()
    a[~nonempty_PP] = -1
    return a[None]


def _ring_transfers(*, owner, assign_PP, mesh, shape, chunk, backward, head_group=0, groups=1,
                    ring: list[int], start_of=None) -> list[Transfer]:
    """K/V of each column travel along ``ring`` (a list of ranks) from the column's ring origin."""
    pos = {r: n for n, r in enumerate(ring)}
    n = len(ring)
    out = []
    a = assign_PP.tolist()
    p = len(owner)
    kv = shape.unit_bytes("kv", chunk, groups)
    dkv = shape.unit_bytes("dkv", chunk, groups)
    for j in range(p):
        origin = start_of(j) if start_of else owner[j]
        needers = {a[i][j] for i in range(p) if a[i][j] >= 0 and a[i][j] != origin}
        if not needers:
            continue
        last = max((pos[r] - pos[origin]) % n for r in needers)
        hops = [(ring[(pos[origin] + t) % n], ring[(pos[origin] + t + 1) % n]) for t in range(last)]
        phases = ("fwd", "bwd") if backward else ("fwd",)
        for ph in phases:
            for s, d in hops:
                out.append(Transfer(tensor="kv", chunk=j, head_group=head_group, src=s, dst=d, nbytes=kv, phase=ph))
        if backward:
            # dK/dV ride along the same hops, then the last holder returns the sum to the origin
            chain = [d for _, d in hops]
            for s, d in zip(chain, chain[1:] + [origin]):
                out.append(Transfer(tensor="dkv", chunk=j, head_group=head_group, src=s, dst=d, nbytes=dkv,
                                    phase="bwd"))
    return out


def ring_plan(nonempty_PP, *, mesh: Mesh, shape: AttnShape, chunk: int, backward: bool, zigzag: bool) -> TilePlan:
    world = mesh.world
    owner = zigzag_owner(world) if zigzag else list(range(world))
    assign = _assign_at_row_owner(nonempty_PP, owner)
    transfers = _ring_transfers(owner=owner, assign_PP=assign[0], mesh=mesh, shape=shape, chunk=chunk,
                                backward=backward, ring=list(range(world)))
    return TilePlan(method="zigzag" if zigzag else "ring", mesh=mesh, shape=shape, chunk_size=chunk,
                    num_chunks=len(owner), owner=tuple(owner), num_head_groups=1, assign_GPP=assign,
                    kernels=tuple(group_kernels(owner=owner, assign_GPP=assign)), transfers=tuple(transfers))


def allgather_plan(nonempty_PP, *, mesh: Mesh, shape: AttnShape, chunk: int, backward: bool) -> TilePlan:
    world, dev = mesh.world, mesh.devices
    owner = zigzag_owner(world)
    p = len(owner)
    assign = _assign_at_row_owner(nonempty_PP, owner)
    kv = shape.unit_bytes("kv", chunk)
    dkv = shape.unit_bytes("dkv", chunk)
    out = []
    phases = ("fwd", "bwd") if backward else ("fwd",)
    for j in range(p):
        src = owner[j]
        hops = []
        for node in range(mesh.nodes):
            rail = node * dev + src % dev
            if node != mesh.node_of(src):
                hops.append((src, rail))
            for d in range(dev):
                r = node * dev + d
                if r != rail and r != src:
                    hops.append((rail, r))
        for ph in phases:
            out.extend(Transfer(tensor="kv", chunk=j, head_group=0, src=s, dst=d, nbytes=kv, phase=ph)
                       for s, d in hops)
        if backward:
            out.extend(Transfer(tensor="dkv", chunk=j, head_group=0, src=d, dst=s, nbytes=dkv, phase="bwd")
                       for s, d in reversed(hops))
    return TilePlan(method="allgather", mesh=mesh, shape=shape, chunk_size=chunk, num_chunks=p,
                    owner=tuple(owner), num_head_groups=1, assign_GPP=assign,
                    kernels=tuple(group_kernels(owner=owner, assign_GPP=assign)), transfers=tuple(out))


def ulysses_degree(mesh: Mesh, shape: AttnShape, *, within_node: bool) -> int:
    h, hk = shape.num_heads, shape.kv_heads
    if not within_node:
        return mesh.world if (h % mesh.world == 0 and hk % mesh.world == 0) else 0
    return max(u for u in range(1, mesh.devices + 1) if mesh.devices % u == 0 and h % u == 0 and hk % u == 0)


def usp_plan(nonempty_GPP, *, mesh: Mesh, shape: AttnShape, chunk: int, backward: bool,
             pure_ulysses: bool = False) -> TilePlan:
    """Ulysses (u = world) or Ulysses x zigzag-ring (u | devices). ``nonempty_GPP`` has u head groups."""
    world = mesh.world
    if pure_ulysses:
        u = ulysses_degree(mesh, shape, within_node=False)
        if not u:
            raise NotApplicable(
                f"ulysses needs the world size {world} to divide num_heads={shape.num_heads} and "
                f"num_kv_heads={shape.kv_heads}"
            )
    else:
        u = ulysses_degree(mesh, shape, within_node=True)
    rd = world // u
    if pure_ulysses:
        owner = [r for r in range(world)]
        super_of = list(range(world))
        pos_of_super = [0] * world
    else:
        owner_pos = zigzag_owner(rd)  # ring position of each super chunk
        owner = [owner_pos[s] * u + m for s in range(2 * rd) for m in range(u)]
        super_of = [i // u for i in range(len(owner))]
        pos_of_super = owner_pos
    p = len(owner)
    if nonempty_GPP.shape[0] != u or nonempty_GPP.shape[1] != p:
        raise ValueError(f"usp_plan needs the pattern on {u} head groups and {p} chunks, "
                         f"got {tuple(nonempty_GPP.shape)}")

    def computer(i: int, g: int) -> int:
        return g if pure_ulysses else pos_of_super[super_of[i]] * u + g

    assign = torch.full((u, p, p), -1, dtype=torch.int32)
    for g in range(u):
        rows = torch.tensor([computer(i, g) for i in range(p)], dtype=torch.int32)
        assign[g] = torch.where(nonempty_GPP[g], rows[:, None].expand(p, p), assign[g])
    out: list[Transfer] = []
    b = {t: shape.unit_bytes(t, chunk, u) for t in ("q", "kv", "out", "do", "dq_out", "dkv_out")}
    for g in range(u):
        for c in range(p):
            home = computer(c, g)
            src = owner[c]
            if home == src:
                continue
            out.append(Transfer(tensor="q", chunk=c, head_group=g, src=src, dst=home, nbytes=b["q"], phase="fwd"))
            out.append(Transfer(tensor="kv", chunk=c, head_group=g, src=src, dst=home, nbytes=b["kv"], phase="fwd"))
            out.append(Transfer(tensor="out", chunk=c, head_group=g, src=home, dst=src, nbytes=b["out"], phase="fwd"))
            if backward:
                out.append(Transfer(tensor="do", chunk=c, head_group=g, src=src, dst=home, nbytes=b["do"], phase="bwd"))
                out.append(Transfer(tensor="dq_out", chunk=c, head_group=g, src=home, dst=src, nbytes=b["dq_out"],
                                    phase="bwd"))
                out.append(Transfer(tensor="dkv_out", chunk=c, head_group=g, src=home, dst=src,
                                    nbytes=b["dkv_out"], phase="bwd"))
        if not pure_ulysses:
            ring = [pos * u + g for pos in range(rd)]
            out.extend(_ring_transfers(owner=owner, assign_PP=assign[g], mesh=mesh, shape=shape, chunk=chunk,
                                       backward=backward, head_group=g, groups=u, ring=ring,
                                       start_of=lambda j, g=g: computer(j, g)))
    # kernels: one launch per rank and ring step (columns grouped by the super chunk they came from)
    groups: dict[tuple, list] = defaultdict(list)
    a = assign.tolist()
    for g in range(u):
        for i in range(p):
            for j in range(p):
                r = a[g][i][j]
                if r >= 0:
                    step = 0 if pure_ulysses else (pos_of_super[super_of[j]] - r // u) % rd
                    groups[(r, g, step)].append((i, j))
    kernels = tuple(Kernel(rank=r, head_group=g, cells=tuple(c), stage=s) for (r, g, s), c in sorted(groups.items()))
    return TilePlan(method="ulysses" if pure_ulysses else "usp", mesh=mesh, shape=shape, chunk_size=chunk,
                    num_chunks=p, owner=tuple(owner), num_head_groups=u, assign_GPP=assign, kernels=kernels,
                    transfers=tuple(out), meta={"ulysses_degree": u, "ring_degree": rd})
