"""The baselines written loop by loop, as their systems describe them: the test oracle of their one form.

``planner/baselines.py`` writes each baseline once, in the fast planner's array form (``Baseline.fixed`` /
``assign`` / ``draft``, assembled into a ``TilePlan`` by ``Baseline.tile_plan``). These builders are the same
plans written the slow, obvious way (a Python loop per chunk and hop); ``test_fast_planner.py`` checks every
registered baseline's plan equals its builder's here, kernels and messages in order.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from ultraattn.planner.baselines import NotApplicable, ulysses_degree, zigzag_owner
from ultraattn.planner.build import group_kernels
from ultraattn.planner.plan import AttnShape, Kernel, Mesh, TilePlan, Transfer


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


def ring_plan(nonempty_PP, *, mesh: Mesh, shape: AttnShape, chunk: int, backward: bool, owner: list[int],
              method: str) -> TilePlan:
    """Cells computed at their row's owner, K/V circulating rank -> rank + 1 (``ring``: contiguous ``owner``,
    ``zigzag``: head-tail)."""
    world = mesh.world
    assign = _assign_at_row_owner(nonempty_PP, owner)
    transfers = _ring_transfers(owner=owner, assign_PP=assign[0], mesh=mesh, shape=shape, chunk=chunk,
                                backward=backward, ring=list(range(world)))
    return TilePlan(method=method, mesh=mesh, shape=shape, chunk_size=chunk,
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


def usp_plan(nonempty_GPP, *, mesh: Mesh, shape: AttnShape, chunk: int, backward: bool,
             pure_ulysses: bool = False) -> TilePlan:
    """Ulysses (u = world) or Ulysses x zigzag-ring (u | devices). ``nonempty_GPP`` has u head groups."""
    world = mesh.world
    if pure_ulysses:
        u = ulysses_degree(mesh, shape, within_node=False)
        if not u:
            raise NotApplicable(
                f"ulysses needs num_heads={shape.num_heads} and num_kv_heads={shape.kv_heads} to be multiples of "
                f"the world size {world}"
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


def oracle_plan(name: str, nonempty_GPP, *, mesh: Mesh, shape: AttnShape, chunk: int, backward: bool) -> TilePlan:
    """The builder's ``TilePlan`` of baseline ``name`` for the non-empty cells (bool [G, P, P])."""
    if name in ("ring", "zigzag"):
        owner = list(range(mesh.world)) if name == "ring" else zigzag_owner(mesh.world)
        return ring_plan(nonempty_GPP[0], mesh=mesh, shape=shape, chunk=chunk, backward=backward, owner=owner,
                         method=name)
    if name == "allgather":
        return allgather_plan(nonempty_GPP[0], mesh=mesh, shape=shape, chunk=chunk, backward=backward)
    if name in ("ulysses", "usp"):
        return usp_plan(nonempty_GPP, mesh=mesh, shape=shape, chunk=chunk, backward=backward,
                        pure_ulysses=name == "ulysses")
    raise KeyError(f"no oracle for baseline {name!r}: write its loop-by-loop builder here")
