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

A baseline is ONE object: a ``Baseline`` subclass, registered with ``@register``, holds its name, where it
applies (``grid`` raises ``NotApplicable``), its ``TilePlan`` builder (``plan``) and the same plan in the fast
planner's array form (``fixed``, ``assign``, ``draft``: equal to the builder's, tested for every registered
baseline). ``REGISTRY`` maps names to baselines; ``BASELINES`` (the names, in registration order), ``METHODS``
and ``Method`` are derived from it. The planners (``api.baseline_plan``, ``fast.FastPlanner``), the runtime's and
the backend's ``method`` checks, the CLI's ``--baselines`` and the tests read them: a new baseline is one class
here.

Closed forms (tested): ring forward moves, per K/V chunk j, (last hop distance) messages
of one chunk; all-gather delivers each chunk to every rank exactly once.
"""

from __future__ import annotations

from collections import defaultdict
from typing import ClassVar, Literal

import numpy as np
import torch

from .build import group_kernels, kernel_groups
from .cost import CostModel
from .plan import AttnShape, Kernel, Mesh, TilePlan, Transfer
from .price import Draft, Grid, Kernels, Messages, ring_messages


class NotApplicable(ValueError):
    """A baseline cannot run this configuration (the message says why)."""


class HeadsIndivisible(NotApplicable):
    """A head-parallel baseline needs the world size to divide both head counts (front ends word their own
    message from the mesh and shape they hold)."""


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


# ----------------------------------------------------------------------------- array forms (fast planner)
def allgather_messages(owner: np.ndarray, mesh: Mesh, shape: AttnShape, chunk: int, backward: bool) -> Messages:
    """``allgather_plan``'s transfers as arrays: every chunk to every rank, across nodes between equal device indices
    (the NIC rails), then inside the node; backward re-gathers K/V and reduces dK/dV back."""
    dev = mesh.devices
    parts = {"fwd": [], "bwd": [], "dkv": []}
    for c, src in enumerate(owner.tolist()):
        hops = []
        for node in range(mesh.nodes):
            rail = node * dev + src % dev
            if node != src // dev:
                hops.append((src, rail))
            hops += [(rail, node * dev + d) for d in range(dev) if node * dev + d not in (rail, src)]
        s, d = (np.asarray(x, dtype=np.int64) for x in zip(*hops)) if hops else (np.zeros(0, np.int64),) * 2
        parts["fwd"].append(Messages.make("kv", "fwd", np.full(s.size, c), 0, s, d, shape.unit_bytes("kv", chunk)))
        if backward:
            parts["bwd"].append(Messages.make("kv", "bwd", np.full(s.size, c), 0, s, d,
                                              shape.unit_bytes("kv", chunk)))
            parts["dkv"].append(Messages.make("dkv", "bwd", np.full(s.size, c), 0, d[::-1], s[::-1],
                                              shape.unit_bytes("dkv", chunk)))
    # the builder's order: per chunk, forward hops, backward hops, reversed dK/dV hops
    per_chunk = [[parts[k][c] for k in ("fwd", "bwd", "dkv") if parts[k]] for c in range(owner.size)]
    return Messages.concat([m for ms in per_chunk for m in ms])


def all_to_all_messages(owner: np.ndarray, computer_GP: np.ndarray, shape: AttnShape, chunk: int,
                        backward: bool) -> Messages:
    """``usp_plan``'s sequence-to-head all-to-all as arrays: each chunk's Q and K/V to the rank computing its head
    group, the output back; backward dO in, dQ and dK/dV out."""
    u, p = computer_GP.shape
    g, c = np.nonzero(computer_GP != owner[None, :])
    home, src = computer_GP[g, c], owner[c]
    flows = [("q", "fwd", src, home), ("kv", "fwd", src, home), ("out", "fwd", home, src)]
    if backward:
        flows += [("do", "bwd", src, home), ("dq_out", "bwd", home, src), ("dkv_out", "bwd", home, src)]
    parts = [Messages.make(t, ph, c, g, s, d, shape.unit_bytes(t, chunk, u)) for t, ph, s, d in flows]
    # the builder's order: per (head group, chunk), its flows in turn
    msgs = Messages.concat(parts)
    flow = np.repeat(np.arange(len(parts)), c.size)
    return msgs.select(np.lexsort((flow, msgs.chunk, msgs.group)))


def _phases(backward: bool) -> tuple[int, ...]:
    return (0, 1) if backward else (0,)


def _row_owner_kernels(grid: Grid, owner: np.ndarray, assign: np.ndarray, *, shape: AttnShape, cost: CostModel,
                       backward: bool) -> Kernels:
    """``group_kernels``' launches of a plan as arrays, priced on ``grid``."""
    return Kernels.of_groups(grid, kernel_groups(owner, assign), head_dim=shape.head_dim, cost=cost,
                             phases=_phases(backward))


# ----------------------------------------------------------------------------- the registry
class Baseline:
    """One baseline: its name, where it applies, its ``TilePlan`` builder and the same plan in array form.

    Subclass, set ``name``, implement ``grid``, ``plan``, ``fixed`` and ``draft`` (and ``assign`` unless cells are
    computed where their query rows live), decorate with ``@register``. The fast planner prices and builds the
    array form; the ILP planner, the runtime and the comparisons build ``plan``; a test checks they agree.
    """

    name: ClassVar[str]
    """The method name users pass (``method=``, ``--baselines``) and reports show."""
    head_parallel: ClassVar[bool] = False
    """Computes whole heads over the whole sequence: the backward keeps Q/K/V from the forward (no Q re-sent)."""

    def grid(self, mesh: Mesh, shape: AttnShape) -> tuple[int, int]:
        """(chunks, head groups) of its plan on ``mesh``; raises ``NotApplicable`` (saying why) where it cannot run."""
        raise NotImplementedError

    def check(self, mesh: Mesh, shape: AttnShape) -> None:
        """Raise ``NotApplicable`` where it cannot run (front ends refuse such a request up front)."""
        self.grid(mesh, shape)

    def plan(self, nonempty_GPP: torch.Tensor, *, mesh: Mesh, shape: AttnShape, chunk: int,
             backward: bool) -> TilePlan:
        """Its ``TilePlan`` for the non-empty cells (bool [G, P, P] on ``grid``'s chunks and head groups)."""
        raise NotImplementedError

    def fixed(self, *, mesh: Mesh, shape: AttnShape, chunk: int, num_chunks: int, backward: bool) -> dict:
        """Array form, the parts that do not depend on the mask (the fast planner caches them per grid): at least
        ``owner`` (int64 [P], the rank owning each chunk)."""
        raise NotImplementedError

    def assign(self, fixed: dict, nonempty_GPP: np.ndarray) -> np.ndarray:
        """Array form: the rank computing each cell (int64 [G, P, P], -1 empty). Default: its row's owner."""
        return np.where(nonempty_GPP[0], fixed["owner"][:, None], -1)[None]

    def draft(self, grid: Grid, fixed: dict, assign: np.ndarray, *, mesh: Mesh, shape: AttnShape, cost: CostModel,
              backward: bool) -> Draft:
        """Array form: kernels and messages (in ``plan``'s order) of the plan on ``grid``."""
        raise NotImplementedError


#: every baseline by name, in registration order (``register``)
REGISTRY: dict[str, Baseline] = {}


def register(cls: type[Baseline]) -> type[Baseline]:
    """Class decorator: add one instance of the baseline ``cls`` to ``REGISTRY`` under ``cls.name``."""
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name or name == "ultraattn":
        raise ValueError(f"a baseline needs a name other than 'ultraattn', {cls.__name__} has {name!r}")
    if name in REGISTRY:
        raise ValueError(f"baseline {name!r} is registered twice ({type(REGISTRY[name]).__name__}, {cls.__name__})")
    REGISTRY[name] = cls()
    return cls


def baseline_of(name: str) -> Baseline:
    """The registered baseline ``name``; a ValueError lists the valid names."""
    try:
        return REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(f"baseline must be one of {', '.join(REGISTRY)}, got {name!r}") from None


class RingFamily(Baseline):
    """Cells computed where their query rows live, K/V circulating rank -> rank + 1 (``ring_plan``)."""

    chunks_per_rank: ClassVar[int]

    def owner(self, world: int) -> list[int]:
        """The rank owning each of the ``chunks_per_rank * world`` chunks."""
        raise NotImplementedError

    def grid(self, mesh: Mesh, shape: AttnShape) -> tuple[int, int]:
        return self.chunks_per_rank * mesh.world, 1

    def plan(self, nonempty_GPP, *, mesh, shape, chunk, backward) -> TilePlan:
        return ring_plan(nonempty_GPP[0], mesh=mesh, shape=shape, chunk=chunk, backward=backward,
                         owner=self.owner(mesh.world), method=self.name)

    def fixed(self, *, mesh, shape, chunk, num_chunks, backward) -> dict:
        return {"owner": np.asarray(self.owner(mesh.world), dtype=np.int64)}

    def draft(self, grid, fixed, assign, *, mesh, shape, cost, backward) -> Draft:
        owner = fixed["owner"]
        kern = _row_owner_kernels(grid, owner, assign, shape=shape, cost=cost, backward=backward)
        msgs = ring_messages(owner, assign[0], ring=np.arange(mesh.world), start_of=owner, shape=shape,
                             chunk=grid.chunk, backward=backward)
        return Draft(owner=owner, assign_GPP=assign, kernels=kern, messages=msgs, chunk=grid.chunk,
                     meta={"structure": self.name})


@register
class Ring(RingFamily):
    name = "ring"
    chunks_per_rank = 1

    def owner(self, world: int) -> list[int]:
        return list(range(world))


@register
class Zigzag(RingFamily):
    name = "zigzag"
    chunks_per_rank = 2

    def owner(self, world: int) -> list[int]:
        return zigzag_owner(world)


@register
class AllGather(Baseline):
    name = "allgather"

    def grid(self, mesh, shape) -> tuple[int, int]:
        return 2 * mesh.world, 1

    def plan(self, nonempty_GPP, *, mesh, shape, chunk, backward) -> TilePlan:
        return allgather_plan(nonempty_GPP[0], mesh=mesh, shape=shape, chunk=chunk, backward=backward)

    def fixed(self, *, mesh, shape, chunk, num_chunks, backward) -> dict:
        owner = np.asarray(zigzag_owner(mesh.world), dtype=np.int64)
        msgs = allgather_messages(owner, mesh, shape, chunk, backward)
        return {"owner": owner, "msgs": msgs, "transfers": [msgs.to_transfers()]}

    def draft(self, grid, fixed, assign, *, mesh, shape, cost, backward) -> Draft:
        owner = fixed["owner"]
        kern = _row_owner_kernels(grid, owner, assign, shape=shape, cost=cost, backward=backward)
        return Draft(owner=owner, assign_GPP=assign, kernels=kern, messages=fixed["msgs"], chunk=grid.chunk,
                     meta={"structure": self.name}, transfers=lambda: fixed["transfers"][0])


class HeadParallel(Baseline):
    """Ulysses (``pure``: head groups over the whole world) or Ulysses inside a node x zigzag ring (``usp_plan``)."""

    head_parallel = True
    pure: ClassVar[bool]

    def plan(self, nonempty_GPP, *, mesh, shape, chunk, backward) -> TilePlan:
        return usp_plan(nonempty_GPP, mesh=mesh, shape=shape, chunk=chunk, backward=backward, pure_ulysses=self.pure)

    def fixed(self, *, mesh, shape, chunk, num_chunks, backward) -> dict:
        w, p, pure = mesh.world, num_chunks, self.pure
        u = self.grid(mesh, shape)[1]
        rd = w // u
        # ring position of each chunk's super chunk (zigzag over the u-groups)
        pos = np.zeros(p, dtype=np.int64) if pure else np.asarray(zigzag_owner(rd), dtype=np.int64)[np.arange(p) // u]
        out = {"owner": np.arange(w, dtype=np.int64) if pure else pos * u + np.arange(p) % u,
               "computer_GP": (np.broadcast_to(np.arange(u)[:, None], (u, p)).copy() if pure
                               else pos[None, :] * u + np.arange(u)[:, None]),
               "pos_of_col": pos, "rd": rd}
        out["msgs"] = all_to_all_messages(out["owner"], out["computer_GP"], shape, chunk, backward)
        out["transfers"] = [out["msgs"].select(out["msgs"].group == g).to_transfers() for g in range(u)]
        return out

    def assign(self, fixed, nonempty_GPP) -> np.ndarray:
        g, i, j = np.nonzero(nonempty_GPP)
        assign = np.full(nonempty_GPP.shape, -1, dtype=np.int64)
        assign[g, i, j] = fixed["computer_GP"][g, i]
        return assign

    def draft(self, grid, fixed, assign, *, mesh, shape, cost, backward) -> Draft:
        u, rd, owner = assign.shape[0], fixed["rd"], fixed["owner"]
        # kernels: usp_plan's grouping, per rank, head group and ring step
        g, i, j = np.nonzero(assign >= 0)
        r = assign[g, i, j]
        step = np.zeros_like(r) if self.pure else (fixed["pos_of_col"][j] - r // u) % rd
        uniq, k_N = np.unique((r * u + g) * rd + step, return_inverse=True)
        order = np.argsort(k_N, kind="stable")
        g, i, j, k_N = g[order], i[order], j[order], k_N[order]
        rows = np.bincount(np.unique(k_N * grid.num_chunks + i) // grid.num_chunks, minlength=uniq.size)
        kern = Kernels.make(grid, g, i, j, k_N, uniq // (u * rd), uniq % rd, rows, head_dim=shape.head_dim,
                            cost=cost, phases=_phases(backward))
        # each head group's ring (none for Ulysses)
        rings = [Messages.concat([]) if self.pure else
                 ring_messages(owner, assign[gg], ring=np.arange(rd) * u + gg, start_of=fixed["computer_GP"][gg],
                               shape=shape, chunk=grid.chunk, backward=backward, group=gg, groups=u)
                 for gg in range(u)]
        a2a = fixed["msgs"]
        # per head group: its all-to-all, then its ring (the builder's order)
        msgs = Messages.concat([m for gg in range(u) for m in (a2a.select(a2a.group == gg), rings[gg])])

        def transfers() -> tuple[Transfer, ...]:
            return tuple(t for gg in range(u) for t in (*fixed["transfers"][gg], *rings[gg].to_transfers()))

        return Draft(owner=owner, assign_GPP=assign, kernels=kern, messages=msgs, chunk=grid.chunk,
                     meta={"structure": self.name, "ulysses_degree": u, "ring_degree": mesh.world // u},
                     transfers=transfers)


@register
class Ulysses(HeadParallel):
    name = "ulysses"
    pure = True

    def grid(self, mesh, shape) -> tuple[int, int]:
        u = ulysses_degree(mesh, shape, within_node=False)
        if not u:
            raise HeadsIndivisible(f"ulysses needs num_heads={shape.num_heads} and num_kv_heads={shape.kv_heads} to "
                                   f"be multiples of the world size {mesh.world}")
        return mesh.world, u


@register
class USP(HeadParallel):
    name = "usp"
    pure = False

    def grid(self, mesh, shape) -> tuple[int, int]:
        return 2 * mesh.world, ulysses_degree(mesh, shape, within_node=True)


# register every baseline above: the names below are read once, at import
#: baseline names, in registration order
BASELINES: tuple[str, ...] = tuple(REGISTRY)
#: what ``method=`` accepts: the planner and every baseline
METHODS: tuple[str, ...] = ("ultraattn", *BASELINES)
Method = Literal[METHODS]  # the same, as a type (``typing.get_args`` lists it)
