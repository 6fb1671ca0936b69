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
applies (``grid`` raises ``NotApplicable``) and its plan, written once in the fast planner's array form
(``fixed``, ``assign``, ``draft``; ``tile_plan`` assembles its ``TilePlan``), tested for every registered baseline
against a loop-by-loop builder of the same plan (``tests/baseline_oracles.py``). ``REGISTRY`` maps names to
baselines; ``BASELINES`` (the names, in registration order), ``METHODS`` and ``Method`` are derived from it. The
planners (``api.baseline_plan``, ``fast.FastPlanner``), the runtime's and the backend's ``method`` checks, the
CLI's ``--baselines`` and the tests read them: a new baseline is one class here.

Closed forms (tested): ring forward moves, per K/V chunk j, (last hop distance) messages
of one chunk; all-gather delivers each chunk to every rank exactly once.
"""

from __future__ import annotations

from typing import ClassVar, Literal

import numpy as np

from ..masks.cells import BlockCells
from ..masks.pattern import BlockPattern
from .build import kernel_groups
from .cost import DEFAULT_COST, CostModel
from .plan import AttnShape, Mesh, TilePlan, Transfer
from .price import Draft, Grid, Kernels, Messages, assemble, grid_of


def ring_messages(owner: np.ndarray, assign_PP: np.ndarray, *, ring: np.ndarray, start_of: np.ndarray,
                  shape: AttnShape, chunk: int, backward: bool, group: int = 0, groups: int = 1) -> Messages:
    """``_ring_transfers`` as arrays (vectorised): K/V of column j travel along ``ring`` from
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


def ulysses_degree(mesh: Mesh, shape: AttnShape, *, within_node: bool) -> int:
    h, hk = shape.num_heads, shape.kv_heads
    if not within_node:
        return mesh.world if (h % mesh.world == 0 and hk % mesh.world == 0) else 0
    return max(u for u in range(1, mesh.devices + 1) if mesh.devices % u == 0 and h % u == 0 and hk % u == 0)


# ----------------------------------------------------------------------------- array forms (fast planner)
def allgather_messages(owner: np.ndarray, mesh: Mesh, shape: AttnShape, chunk: int, backward: bool) -> Messages:
    """The all-gather's transfers as arrays: every chunk to every rank, across nodes between equal device indices
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
    # per chunk: forward hops, backward hops, reversed dK/dV hops (the oracle builder's order)
    per_chunk = [[parts[k][c] for k in ("fwd", "bwd", "dkv") if parts[k]] for c in range(owner.size)]
    return Messages.concat([m for ms in per_chunk for m in ms])


def all_to_all_messages(owner: np.ndarray, computer_GP: np.ndarray, shape: AttnShape, chunk: int,
                        backward: bool) -> Messages:
    """USP's and Ulysses' sequence-to-head all-to-all as arrays: each chunk's Q and K/V to the rank computing its head
    group, the output back; backward dO in, dQ and dK/dV out."""
    u, p = computer_GP.shape
    g, c = np.nonzero(computer_GP != owner[None, :])
    home, src = computer_GP[g, c], owner[c]
    flows = [("q", "fwd", src, home), ("kv", "fwd", src, home), ("out", "fwd", home, src)]
    if backward:
        flows += [("do", "bwd", src, home), ("dq_out", "bwd", home, src), ("dkv_out", "bwd", home, src)]
    parts = [Messages.make(t, ph, c, g, s, d, shape.unit_bytes(t, chunk, u)) for t, ph, s, d in flows]
    # per (head group, chunk), its flows in turn (the oracle builder's order)
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
    """One baseline: its name, where it applies, and its plan, written once in the fast planner's array form.

    Subclass, set ``name``, implement ``grid``, ``fixed`` and ``draft`` (and ``assign`` unless cells are computed
    where their query rows live), decorate with ``@register``. The fast planner prices the array form;
    ``tile_plan`` assembles it into the ``TilePlan`` the ILP planner, the runtime and the comparisons use. A test
    checks it against a loop-by-loop builder of the same plan (``tests/baseline_oracles.py``).
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

    def tile_plan(self, mask: BlockCells | BlockPattern, *, mesh: Mesh, shape: AttnShape, chunk: int,
                  backward: bool, cost: CostModel = DEFAULT_COST) -> TilePlan:
        """Its ``TilePlan`` for ``mask`` on ``grid``'s chunks of ``chunk`` tokens: the array form (``fixed``,
        ``assign``, ``draft``) assembled (``price.assemble``), its own launches ungrouped. ``cost`` only prices the
        draft's kernels; the plan does not depend on it."""
        num_chunks, groups = self.grid(mesh, shape)
        grid = grid_of(mask, shape, cost, chunk=chunk, num_chunks=num_chunks, head_groups=groups)
        fixed = self.fixed(mesh=mesh, shape=shape, chunk=chunk, num_chunks=num_chunks, backward=backward)
        d = self.draft(grid, fixed, self.assign(fixed, grid.nonempty_GPP > 0), mesh=mesh, shape=shape, cost=cost,
                       backward=backward)
        return assemble(d, mesh=mesh, shape=shape, meta={k: v for k, v in d.meta.items() if k != "structure"},
                        method=self.name)

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
    """Cells computed where their query rows live, K/V circulating rank -> rank + 1."""

    chunks_per_rank: ClassVar[int]

    def owner(self, world: int) -> list[int]:
        """The rank owning each of the ``chunks_per_rank * world`` chunks."""
        raise NotImplementedError

    def grid(self, mesh: Mesh, shape: AttnShape) -> tuple[int, int]:
        return self.chunks_per_rank * mesh.world, 1

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
    """Ulysses (``pure``: head groups over the whole world) or Ulysses inside a node x zigzag ring."""

    head_parallel = True
    pure: ClassVar[bool]

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
        # kernels: one launch per rank, head group and ring step
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
        # per head group: its all-to-all, then its ring (the oracle builder's order)
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
