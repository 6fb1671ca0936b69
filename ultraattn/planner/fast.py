"""The online planner: a new mask planned in milliseconds, the same plan on every rank.

For masks met at run time (packed documents: a new mask every batch) the ILP planner
(``planner.api.plan``: CBC, a scheduling ILP, every baseline simulated) takes seconds. This planner
makes a complete ``TilePlan`` (ownership, compute placement, transfers with exact bytes, kernel
grouping, stages) with no ILP and no wall-clock limit in any decision (replays are bounded by task counts), so every
rank computes the identical plan from the identical mask (no rank-0 planning, no broadcast).

    planner = FastPlanner(shape=shape, mesh=mesh, cost=cost, layout=layout)   # once per configuration
    tile_plan = planner.plan(cells)     # per mask: BlockCells (cells_from_block_mask) or a BlockPattern

Algorithm (every statistic is vectorised over cells; loops run over chunks, ranks or moves; the full account, with
the measurements behind each rule, is docs/planner.md, "The fast planner"):

1. Chunk statistics at 1, 2, 4, 8 chunks per rank (4 and 8 only where a chunk holds ``FINE_CHUNK_BLOCKS`` blocks).
2. Our structure per granularity: chunks to nodes, then to devices (longest processing time first), cells where
   their query rows live, overloaded ranks handing cells on; on several nodes two placements (``place``,
   ``place_flat``). A given token layout fixes ownership: only placement is chosen.
3. The balanced fine-chunk candidate (``balanced``: MagiAttention's dispatch, routed hierarchically).
4. Every registered baseline (``baselines.REGISTRY``) in its array form.
5. Bounds, best first, then the closed-form price (``price.replay_bound``: a lower bound of the simulator's replay)
   of every candidate that can still win.
6. Small plans (``REPLAY_TASKS``) priced in kernel batches of 2, 4, 8 chunks too (``price.batches``).
7. The robust choice: the finalists (``ROBUST_WINDOW``, ``FINALISTS``) priced under the band's corners
   (``planner.robust``), the least worst-case regret wins; near-ties in price are replayed (``NEAR_TIE`` on small
   plans, ``PRICE_TIE`` on large ones).
8. The kernel level on small plans: the winner's cells regrouped in longer launches, kept when its replay is faster.
   Where small plans replay within ``EXECUTED_TIE`` of each other (7 and 8), the replay as executed decides.

Determinism: integer and float64 arithmetic in a fixed order (no threaded BLAS in a decision), ties broken by index.

Reused between masks (``FastPlanner``): unit bytes and message costs per granularity, the baselines' ownerships
and their mask-independent messages (all-gather, the Ulysses all-to-all).
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ..cache import gc_paused
from ..masks.cells import BlockCells, cells_from_pattern
from ..masks.pattern import BlockPattern
from .balance import balanced_ownership, ownership, place, place_flat
from .baselines import BASELINES, REGISTRY, Baseline, NotApplicable
from .build import kernel_groups
from .cost import DEFAULT_COST, CostModel
from .plan import AttnShape, Mesh, TilePlan, TokenSharding, padded_chunk
from .price import (
    PHASES,
    Draft,
    Grid,
    Kernels,
    assemble,
    batches,
    busy_bound,
    cheapest,
    compute_bound,
    grid_of,
    price,
    route,
)
from .program import executed_makespan, with_order
from .robust import DEFAULT_BAND, Band, band_prices, regrets
from .schedule import Schedule, replay_phases

#: chunks per rank tried for our own structure (the ILP planner starts at 2 and refines to 8)
CHUNKS_PER_RANK = (1, 2, 4, 8)
#: more than two chunks per rank only where a chunk holds this many mask blocks: finer chunks make many short launches
#: (on ``replan.py``'s 128K 8x8 and 32K 2x8 document masks ``tiled-k8``, 2-block chunks, was never a finalist, only
#: placed, at a fifth of the planning time; plans unchanged on 240 masks: docs/planner_results.md). The balanced
#: candidate keeps the finest chunks of a block or more.
FINE_CHUNK_BLOCKS = 4
#: candidates priced within this factor of the cheapest are the finalists (at most ``FINALISTS`` of them, cheapest
#: first): the plan is the finalist whose worst-case regret over the cost-model band is smallest
#: (``planner.robust``), priced under the band's corners only for them (the planning budget). A candidate dearer
#: than this under the nominal model already has a regret above it there, so the window is the regret the issue
#: accepts (1.15): robustness never costs more than that under the model the planner was given. (With 1.5, the
#: robust choice ran 21 % slower than the best baseline under the nominal model on a 128K 8x8 mask.)
ROBUST_WINDOW = 1.15
FINALISTS = 3
#: finalists whose worst-case regrets differ by less than this are equally robust: the nominal price decides
REGRET_TIE = 0.02
#: the runner-up priced within this fraction of the cheapest is a near-tie ...
NEAR_TIE = 0.10
#: ... and both are replayed by the simulator when they have at most this many tasks together (kernels x phases
#: + messages: replays cost ~10 us a task here)
REPLAY_TASKS = 2500
#: a larger plan and a finalist priced within this fraction of it, whatever its regret, are replayed and the faster
#: wins: the price is 5-30 % below the replay on ``replan.py``'s 128K 8x8 masks and cannot tell them apart (one choice
#: replayed 7 % slower than USP priced 1 % above it). A tie costs one more replay (~30 ms at 128K on 8x8)
PRICE_TIE = 0.02
#: where the planner replays small plans to choose (the near-tie, the kernel level), those whose plain replay is
#: within this fraction of the fastest are replayed again as the executor runs them (``program.executed_makespan``)
#: and the fastest of that replay wins: the two replays differ by up to ~12 % on one plan (a row's launches fused into
#: one waits for its last input; its partials leave later) and can order near plans differently (a 512K 2x8 document
#: mask ran 2.4 % slower than the balanced dispatch as executed with the launches its plain replay preferred)
EXECUTED_TIE = 0.03


# ----------------------------------------------------------------------------- candidates
@dataclass(slots=True)
class Candidate:
    """One structure: a cheap bound first, its closed-form price when it can win."""

    name: str
    """tiled-k<k> (tiled for a given layout) or a baseline name."""
    bound: float
    """Seconds no price of this candidate can undercut (``price.compute_bound``)."""
    imbalance: float
    """Max over mean of per-rank work (``planner.api.work_imbalance``)."""
    draft: Callable[[], Draft]
    """Builds the array-form plan (routing, kernel grouping)."""
    kernels: Callable[[], Kernels] | None = None
    """The draft's kernels alone, before its messages are routed (the same object ``draft`` then uses), where the
    structure can make them first (ours; a baseline drafts in one step)."""
    seconds: float | None = None
    """Closed-form fwd (+ bwd) seconds; None when skipped (its bound exceeds the best price)."""
    eligible: bool = True
    """False for our structure at a granularity that misses the balance tolerance while another meets it."""
    same_as: tuple | None = None
    """What makes two of our candidates the same plan (grid, ownership, placement): a duplicate is not priced."""
    unbatched: tuple[Kernels, float] | None = None
    """Its own launches and their price, where ``FastPlanner.batched_candidate`` regrouped its draft's."""
    batch_tries: list[tuple[int, Kernels, float]] | None = None
    """Its cells in each kernel batch above 1, priced (``price.batches``), where ``FastPlanner.batched_candidate`` tried
    them, adopted or not: the kernel level replays them without grouping and pricing them again."""
    _draft: Draft | None = None

    @property
    def baseline(self) -> bool:
        """A registered baseline (``baselines.REGISTRY``), not one of our structures."""
        return self.name in REGISTRY

    def get(self) -> Draft:
        if self._draft is None:
            self._draft = self.draft()
        return self._draft


@dataclass(slots=True)
class _Scale:
    """What does not change between masks for one chunk grid."""

    chunk: int
    num_chunks: int
    row_cost: np.ndarray
    """Seconds to move one query-row unit (both phases) inside a node, across nodes."""
    col_cost: np.ndarray
    """The same for one key/value unit."""


@dataclass(slots=True, kw_only=True)
class FastPlanner:
    """Plans run-time masks for one attention configuration, reusing what does not change between masks.

    One per attention site and configuration (``key``); ``plan`` is a pure function of the mask's cells
    and this configuration. Not thread-safe: one planning at a time (callers on several threads lock).
    """

    shape: AttnShape
    """The attention's shapes."""
    mesh: Mesh
    """Nodes x devices."""
    cost: CostModel = DEFAULT_COST
    """Prices candidates (the model the simulator replays)."""
    layout: TokenSharding | None = None
    """A given token layout (a sequence-sharded model's): ownership is kept, only placement is chosen."""
    balance_tol: float = 0.05
    """Allowed compute imbalance of our structure: max rank load <= (1 + tol) x mean."""
    backward: bool = True
    """Plan (and price) the backward too."""
    baselines: tuple[str, ...] = BASELINES
    """Baseline structures considered as candidates."""
    band: Band | None = DEFAULT_BAND
    """How wrong the cost model may be (``planner.robust``): the plan is the finalist with the smallest worst-case
    regret over it. Narrow it to a calibrated profile's fit errors (``Band.of_profile``); None picks the nominal
    cheapest."""
    _scales: dict = field(default_factory=dict, repr=False)
    _fixed: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.shape, AttnShape):
            raise TypeError(f"`shape` must be an AttnShape, got {type(self.shape).__name__}")
        if not isinstance(self.mesh, Mesh):
            raise TypeError(f"`mesh` must be a Mesh, got {type(self.mesh).__name__}")
        if not 0 <= self.balance_tol < 1:
            raise ValueError(f"`balance_tol` must lie in [0, 1), got {self.balance_tol}")
        bad = [b for b in self.baselines if b not in REGISTRY]
        if bad:
            raise ValueError(f"`baselines` must be among {', '.join(BASELINES)}, got {bad}")
        if self.layout is not None:
            if not isinstance(self.layout, TokenSharding):
                raise TypeError(f"`layout` must be a TokenSharding or None, got {type(self.layout).__name__}")
            if self.layout.world != self.mesh.world:
                raise ValueError(f"`layout` spreads tokens over {self.layout.world} ranks but the mesh has "
                                 f"{self.mesh.world}; pass the layout of this mesh")
            if self.layout.padded_len < self.shape.seq_len:
                raise ValueError(f"`layout` covers {self.layout.padded_len} tokens, fewer than seq_len="
                                 f"{self.shape.seq_len}")

    @property
    def key(self) -> tuple:
        """Everything a plan depends on besides the mask."""
        return planner_key(self.shape, self.mesh, self.cost, self.layout, self.balance_tol, self.backward,
                           self.baselines, self.band)

    @property
    def _phases(self) -> tuple[int, ...]:
        return (0, 1) if self.backward else (0,)

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

    def _grid(self, cells: BlockCells, sc: _Scale, head_groups: int = 1, made: dict | None = None) -> Grid:
        """The mask's ``Grid`` at this scale; ``made``: the grids made so far for this mask (one ``candidates`` call:
        structures on the same chunks share one, read only)."""
        key = (sc.chunk, sc.num_chunks, head_groups)
        if made is not None and key in made:
            return made[key]
        grid = grid_of(cells, self.shape, self.cost, chunk=sc.chunk, num_chunks=sc.num_chunks, head_groups=head_groups)
        if made is not None:
            made[key] = grid
        return grid

    # ------------------------------------------------------------------ plan
    def plan(self, mask: BlockCells | BlockPattern) -> TilePlan:
        """The most robust finalist's ``TilePlan`` (``ROBUST_WINDOW``); ``meta`` says planner ("fast"), structure,
        estimate_ms, planning_ms, every candidate's price (None: skipped), the finalists' worst-case regrets over
        the band (``regrets``; ``regret``: the chosen plan's) and the band. Python's cyclic garbage collector waits
        meanwhile (``cache.gc_paused``)."""
        with gc_paused():
            return self._plan(mask)

    def _plan(self, mask: BlockCells | BlockPattern) -> TilePlan:
        t0 = time.perf_counter()
        cells = self._check(mask)
        cands = self.candidates(cells)
        priced = sorted((c for c in cands if c.seconds is not None), key=lambda c: (c.seconds, c.name))
        summary = {c.name: None if c.seconds is None else round(c.seconds * 1e3, 6) for c in cands}
        finalists = [c for c in priced if c.seconds <= priced[0].seconds * ROBUST_WINDOW][:FINALISTS]
        reg: dict[str, float] = {}
        if self.band is not None and len(finalists) > 1:
            # (on several nodes, half the corners: ``Band.corners``; the planning budget)
            reg = regrets(band_prices({c.name: c.get() for c in finalists}, self.mesh, self.cost, self.band,
                                      half=True, nominal={c.name: c.seconds for c in finalists}))
        least = min(reg.values(), default=1.0)
        robust = [c for c in finalists if reg.get(c.name, 1.0) <= least + REGRET_TIE]   # cheapest first
        best, tp, replayed = robust[0], None, {}
        # id(plan) -> (plan, its replay): the chosen plan's replay gives its run order (the plan is held, so its id
        # is not reused)
        schedules: dict[int, tuple[TilePlan, dict[str, Schedule]]] = {}

        def replay(p: TilePlan) -> float:
            schedules[id(p)] = (p, replay_phases(p, cells, self.cost, backward=self.backward))
            return sum(s.makespan for s in schedules[id(p)][1].values())

        executed: dict[str, float] = {}   # label -> makespan as executed, where a choice needed it (for ``meta``)
        executed_of: dict[int, float] = {}   # id(plan) -> the same

        def fastest(tries: list[tuple[str, TilePlan, float]]) -> int:
            """The index of the fastest of small plans (label, plan, its plain replay): by the plain replay, or where
            others replay within ``EXECUTED_TIE`` of it, by the replay as executed (the first wins a tie)."""
            lead = min(t[2] for t in tries)
            near = [n for n, t in enumerate(tries) if t[2] <= lead * (1 + EXECUTED_TIE)]
            if len(near) == 1:
                return near[0]
            for n in near:
                label, p, _ = tries[n]
                if id(p) not in executed_of:
                    executed_of[id(p)] = executed_makespan(p, schedules[id(p)][1], self.cost)
                executed[label] = executed_of[id(p)]
            return min(near, key=lambda n: (executed_of[id(tries[n][1])], n))

        # [Note] near-ties: the price is a lower bound of the replay, closer for some structures than for others;
        # the cheapest two of the most robust, when within NEAR_TIE and small (a task count, not a time limit:
        # still deterministic), are replayed to decide
        close = [c for c in robust if c.seconds <= best.seconds * (1 + NEAR_TIE)][:2]
        if len(close) > 1 and sum(_tasks(c.get()) for c in close) <= REPLAY_TASKS:
            plans = {c.name: self.build(c) for c in close}
            replayed = {n: replay(p) for n, p in plans.items()}
            tries = sorted((n, plans[n], replayed[n]) for n in plans)   # (by name: ties as before)
            best = next(c for c in close if c.name == tries[fastest(tries)][0])
            tp = plans[best.name]
        elif _tasks(best.get()) > REPLAY_TASKS:
            # [Note] a large plan: a finalist priced within PRICE_TIE of it, its regret aside (the regrets come from the
            # same prices). The chosen plan is replayed for its run order anyway, so this costs one more replay (from
            # the price's kernel seconds: the same replay as above), and the faster replay wins
            rival = next((c for c in finalists if c is not best and c.seconds <= best.seconds * (1 + PRICE_TIE)), None)
            if rival is not None:
                close = [best, rival]
                plans = {c.name: self.build(c) for c in close}
                replayed = {c.name: self._replay_from_draft(plans[c.name], c.get(), schedules) for c in close}
                best = min(close, key=lambda c: (replayed[c.name], c.name))
                tp = plans[best.name]
        if tp is None:
            tp = self.build(best)
        # the kernel level (``build.kernel_groups(batch=)``): on a small plan, its remote cells in longer launches
        # when the cheapest-priced batch also replays faster (the price bounds a long launch's wait for its last input
        # loosely: its longest launches replayed up to 1.36x slower on 128K 8x8 document masks). On several nodes every
        # batch is replayed: there the price orders them least reliably (up to 1.10x on 128K 2x8, docs/planner.md).
        # One node keeps the one replay, within the planning-time target (128K on 1x8). Replays within EXECUTED_TIE
        # of the fastest are decided as executed (``fastest``).
        d = best.get()
        batched_already = "kernel_batch" in d.meta and self.mesh.nodes == 1
        if self._batchable(d) and not batched_already:
            tries = best.batch_tries if best.batch_tries is not None else self._batch_tries(cells, d)
            if self.mesh.nodes == 1:
                tries = [cheapest(tries)]
            if best.unbatched is not None:   # batched before the choice: its own launches are one more try
                tries = [(1, *best.unbatched)] + [t for t in tries if t[0] != d.meta["kernel_batch"]]
            own = f"{best.name} batch {d.meta.get('kernel_batch', 1)}"
            replays = [(own, tp, replayed.get(best.name) or replay(tp))]
            seen = [d.kernels]
            for batch, kern, sec in tries:
                if any(kern.same_launches(k) for k in seen):   # the same plan: replayed already (the first kept)
                    continue
                seen.append(kern)
                batched = self.build(best, kernels=kern, kernel_batch=batch, estimate_ms=sec * 1e3)
                if batch == 1:
                    del batched.meta["kernel_batch"]
                replays.append((f"{best.name} batch {batch}", batched, replay(batched)))
            tp = replays[fastest(replays)][1]
        tp.meta.update(candidates=summary, replayed={n: round(v * 1e3, 6) for n, v in replayed.items()},
                       executed={n: round(v * 1e3, 6) for n, v in executed.items()},
                       candidate=best.name, regrets={n: round(r, 4) for n, r in reg.items()},
                       regret=round(reg.get(best.name, 1.0), 4),
                       band=None if self.band is None else {"rate": self.band.rate, "latency": self.band.latency})
        # the run order every rank follows: the chosen plan's replay (made above on most small plans and on ties; else
        # now, from the kernels' seconds the price has, without the mask's workload)
        if id(tp) not in schedules:
            self._replay_from_draft(tp, best.get(), schedules)
        tp = with_order(tp, schedules[id(tp)][1])
        tp.meta["planning_ms"] = (time.perf_counter() - t0) * 1e3
        return tp

    def _replay_from_draft(self, tp: TilePlan, d: Draft, schedules: dict) -> float:
        """The simulator's fwd (+ bwd) makespan of ``tp`` (built from draft ``d``) from the kernels' seconds the price
        has, without the mask's workload (~18 ms a phase at 64 ranks); its schedules go to ``schedules[id(tp)]``."""
        sched = replay_phases(tp, None, self.cost, backward=self.backward,
                              kernel_seconds={PHASES[ph]: sec for ph, sec in d.kernels.seconds.items()})
        schedules[id(tp)] = (tp, sched)
        return sum(s.makespan for s in sched.values())

    def batched_candidate(self, cells: BlockCells, c: Candidate) -> Candidate:
        """``c`` with its cells in the kernel batch that prices cheapest (``price.cheapest``), when that is cheaper
        than its own launches and the plan is small (``REPLAY_TASKS``); else ``c``."""
        d = c.get()
        if not self._batchable(d):
            return c
        own = c.seconds if c.seconds is not None else price(d.kernels, d.messages, d.owner, d.assign_GPP.shape[0],
                                                            self.mesh, self.cost)
        tries = self._batch_tries(cells, d)
        b, kern, sec = cheapest(tries)
        if sec >= own * (1 - 1e-9):
            return dataclasses.replace(c, batch_tries=tries)
        batched = dataclasses.replace(d, kernels=kern, meta={**d.meta, "kernel_batch": b})
        return dataclasses.replace(c, seconds=sec, unbatched=(d.kernels, own), batch_tries=tries, _draft=batched)

    def _batch_tries(self, cells: BlockCells, d: Draft) -> list[tuple[int, Kernels, float]]:
        """``d``'s cells in each kernel batch above 1, priced (``price.batches``)."""
        grid = grid_of(cells, self.shape, self.cost, chunk=d.chunk, num_chunks=d.assign_GPP.shape[1],
                       head_groups=d.assign_GPP.shape[0])
        return batches(d.owner, d.assign_GPP, d.messages, grid, self.mesh, self.shape, self.cost, phases=self._phases)

    def regrets(self, cells: BlockCells | BlockPattern, band: Band = DEFAULT_BAND) -> dict[str, float]:
        """Every eligible candidate's worst-case regret over ``band`` (``planner.robust``) against the others, each
        priced in full (no pruning: for reports, not the planning budget) in its best-priced kernel batch
        (``batched_candidate``, as ``plan`` prices its leading candidates). ``plan``'s choice is
        ``meta["candidate"]``."""
        cells = self._check(cells)
        # (``candidates`` put every candidate it priced in its batched form already)
        cands = [c if c.seconds is not None else self.batched_candidate(cells, c)
                 for c in self.candidates(cells) if c.eligible]
        return regrets(band_prices({c.name: c.get() for c in cands}, self.mesh, self.cost, band))

    def build(self, cand: Candidate, kernels: Kernels | None = None, **meta) -> TilePlan:
        """The ``TilePlan`` of one candidate (``plan`` builds the cheapest; tests and reports any), with its own
        kernels or ``kernels`` (the same cells grouped otherwise)."""
        d = cand.get()
        meta = {**d.meta, "planner": "fast", **({} if cand.seconds is None else {"estimate_ms": cand.seconds * 1e3}),
                **meta}
        return assemble(d, mesh=self.mesh, shape=self.shape, meta=meta, kernels=kernels)

    def _check(self, mask) -> BlockCells:
        if isinstance(mask, BlockPattern):
            mask = cells_from_pattern(mask)
        if not isinstance(mask, BlockCells):
            raise TypeError(f"`mask` must be BlockCells or a BlockPattern, got {type(mask).__name__}")
        if (mask.q_len, mask.kv_len) != (self.shape.seq_len, self.shape.seq_len):
            raise ValueError(f"`mask` is for lengths ({mask.q_len}, {mask.kv_len}) but shape.seq_len is "
                             f"{self.shape.seq_len}; build it for the attention's sequence length")
        if mask.q_block != mask.kv_block:
            raise NotImplementedError(f"planning needs equal Q and KV blocks, got ({mask.q_block}, {mask.kv_block})")
        if mask.num_batch not in (1, self.shape.batch):
            raise ValueError(f"`mask` has {mask.num_batch} batch entries but shape.batch is {self.shape.batch}")
        mask.heads_per_group(self.shape.num_heads)  # raises on a head count mismatch
        if self.layout is not None and self.layout.chunk_size % mask.q_block:
            raise ValueError(f"the layout's chunk size {self.layout.chunk_size} is not a multiple of the mask's "
                             f"block {mask.q_block}; use mask blocks that divide it")
        return mask

    def candidates(self, cells: BlockCells) -> list[Candidate]:
        """Every structure with its bound, priced in increasing bound order while it can still win (be a finalist:
        within ``ROBUST_WINDOW`` of the cheapest price, with a band)."""
        w, block, seq = self.mesh.world, cells.q_block, self.shape.seq_len

        def tried(blocks: int) -> list[int]:   # chunks per rank: more than two only where a chunk holds ``blocks``
            return [k for k in CHUNKS_PER_RANK if k <= 2 or w * k * block * blocks <= seq]

        if self.layout is not None:
            ks = [(self.layout.chunks_per_rank, self.layout.chunk_size)]
        elif w == 1:  # one rank: every structure computes everything there
            ks = [(1, None)]
        else:
            ks = [(k, None) for k in tried(FINE_CHUNK_BLOCKS)]
        grids: dict = {}
        cands = [c for k, chunk in ks for c in self._tiled(cells, k, chunk, grids)]
        if w > 1 and self.layout is None:   # (at the finest chunks of a block or more)
            fine = self._balanced(cells, max(tried(1)), grids)
            if fine.same_as not in {c.same_as for c in cands}:
                cands.append(fine)
        if w > 1:
            cands += [c for c in (self._baseline(cells, name, grids) for name in self.baselines) if c is not None]
        # our structure must balance when one of its granularities can
        tol = 1 + self.balance_tol + 1e-9
        strict = any(c.imbalance <= tol for c in cands if c.name.startswith("tiled"))
        for c in cands:
            c.eligible = not (strict and c.name.startswith("tiled") and c.imbalance > tol)
        eligible = [c for c in cands if c.eligible]
        # bounds below the price, cheap to costly: compute at peak rate, then the busiest compute stream (needs the
        # kernels), then the busiest stream (needs the messages: routing), then the price. [Note] best first, lazily:
        # the candidate with the least bound known so far goes one step further (a bound raised is put back, a full
        # bound is priced), so candidates are priced in the order of their full bounds and pruned against the same
        # cheapest price so far as when every bound is made first (the same prices, the same plan), and a candidate
        # whose kernels alone cannot win is never routed. A small plan is priced in its best kernel batch too (step
        # 6), whose launches the bounds of its own launches do not bound: it keeps the compute bound alone (the
        # kernel step only where the kernels alone make the plan too big for that)
        best = math.inf
        reach = ROBUST_WINDOW if self.band is not None else 1.0   # a finalist may cost up to ROBUST_WINDOW x the best
        batched: dict[str, Candidate] = {}
        heap = [(c.bound, c.name, 0, n) for n, c in enumerate(eligible)]   # (bound, name, steps taken, index)
        heapq.heapify(heap)
        while heap and heap[0][0] <= best * reach:
            _, name, step, n = heapq.heappop(heap)
            c = eligible[n]
            if step == 0 and c.kernels is not None:
                kern = c.kernels()
                if kern.rank_K.size * len(kern.seconds) > REPLAY_TASKS:
                    c.bound = max(c.bound, busy_bound(kern, None, self.mesh, self.cost))
                    heapq.heappush(heap, (c.bound, name, 1, n))
                    continue
            d = c.get()
            if step < 2 and not self._batchable(d):
                c.bound = max(c.bound, busy_bound(d.kernels, d.messages, self.mesh, self.cost))
                heapq.heappush(heap, (c.bound, name, 2, n))
                continue
            c.seconds = price(d.kernels, d.messages, d.owner, d.assign_GPP.shape[0], self.mesh, self.cost,
                              d.replays(self.mesh))
            if self._batchable(d):
                c = batched[c.name] = self.batched_candidate(cells, c)
            best = min(best, c.seconds)
        return [batched.get(c.name, c) for c in cands]

    def _batchable(self, d: Draft) -> bool:
        """Whether a draft is small enough to be priced in kernel batches too (``REPLAY_TASKS``)."""
        return self.mesh.world > 1 and _tasks(d) <= REPLAY_TASKS

    # ------------------------------------------------------------------ our structure
    def _tiled(self, cells: BlockCells, k: int, chunk: int | None, grids: dict | None = None) -> list[Candidate]:
        sc = self._scale(self.mesh.world * k, cells.q_block, chunk)
        grid = self._grid(cells, sc, made=grids)
        weight = grid.blocks_GPP[0]
        if self.layout is not None:
            owner = np.asarray(self.layout.owner, dtype=np.int64)
        else:
            owner = ownership(weight, self.mesh, k, self.balance_tol, block_seconds=self._block_seconds(grid),
                              col_cost_inter=float(sc.col_cost[1]))
        name = "tiled" if self.layout is not None else f"tiled-k{k}"
        meta = {"structure": "tiled", "chunks_per_rank": k}
        assign = place(weight, owner, self.mesh, self.balance_tol, sc.row_cost, sc.col_cost)
        out = [self._at(grid, owner, assign, name=name, meta={**meta, "placement": "nodes first"})]
        if self.mesh.nodes > 1:   # [Note] neither placement wins everywhere: both are priced (module docstring)
            flat = place_flat(weight, owner, self.mesh, self.balance_tol, sc.row_cost, sc.col_cost)
            if not np.array_equal(flat, assign):
                out.append(self._at(grid, owner, flat, name=f"{name}-flat", meta={**meta, "placement": "flat"}))
        return out

    def _balanced(self, cells: BlockCells, k: int, grids: dict | None = None) -> Candidate:
        """The balanced fine-chunk candidate (``balance.balanced_ownership``): ``k`` chunks per rank dealt by
        longest processing time first over the whole mesh, every cell computed where its query rows live; only
        the K/V a rank needs move, crossing a node link once (``route``)."""
        sc = self._scale(self.mesh.world * k, cells.q_block)
        grid = self._grid(cells, sc, made=grids)
        weight = grid.blocks_GPP[0]
        owner = balanced_ownership(weight, self.mesh, k)
        assign = np.where(weight > 0, owner[:, None], -1)
        return self._at(grid, owner, assign, name="balanced", meta={"structure": "balanced", "chunks_per_rank": k})

    def _at(self, grid: Grid, owner: np.ndarray, assign: np.ndarray, *, name: str, meta: dict) -> Candidate:
        """A candidate of our own from its ownership and placement (one head group): kernels grouped per rank and
        row, messages routed hierarchically."""
        assign = assign[None]
        per_rank = _work_per_rank(grid.blocks_GPP[0], assign, self.mesh.world)

        @functools.cache   # (made once: the kernel step's bound and the draft share them)
        def kernels() -> Kernels:
            return Kernels.of_groups(grid, kernel_groups(owner, assign), head_dim=self.shape.head_dim,
                                     cost=self.cost, phases=self._phases)

        def draft() -> Draft:
            msgs = route(owner, assign, self.mesh, self.shape, grid.chunk, self.backward)
            return Draft(owner=owner, assign_GPP=assign, kernels=kernels(), messages=msgs, chunk=grid.chunk, meta=meta)

        return Candidate(name=name, draft=draft, kernels=kernels, bound=self._bound(per_rank, grid),
                         imbalance=_ratio(per_rank), same_as=(grid.chunk, owner.tobytes(), assign.tobytes()))

    def _block_seconds(self, grid: Grid) -> float:
        """Seconds of one cost-weighted block at the peak rates (fwd + bwd when planned)."""
        return compute_bound(np.ones(1), grid, head_dim=self.shape.head_dim, cost=self.cost, phases=self._phases)

    def _bound(self, per_rank: np.ndarray, grid: Grid) -> float:
        return compute_bound(per_rank, grid, head_dim=self.shape.head_dim, cost=self.cost, phases=self._phases)

    # ------------------------------------------------------------------ baselines
    def _baseline(self, cells: BlockCells, name: str, grids: dict | None = None) -> Candidate | None:
        """A registered baseline (``planner.baselines.REGISTRY``) in its array form: the same ownership, placement,
        kernels and transfers as ``api.baseline_plan`` (one form: ``Baseline.tile_plan``). None where it cannot
        run, or (given a layout) holds tokens in another layout."""
        base = REGISTRY[name]
        try:
            p, u = base.grid(self.mesh, self.shape)
        except NotApplicable:
            return None
        sc = self._scale(p, cells.q_block)
        fixed = self._fixed_parts(base, sc, cells.q_block)
        owner = fixed["owner"]
        if self.layout is not None and (sc.chunk, tuple(owner.tolist())) != (self.layout.chunk_size,
                                                                             self.layout.owner):
            return None  # a baseline keeps its own layout
        grid = self._grid(cells, sc, head_groups=u, made=grids)
        assign = base.assign(fixed, grid.nonempty_GPP > 0)

        def draft() -> Draft:
            return base.draft(grid, fixed, assign, mesh=self.mesh, shape=self.shape, cost=self.cost,
                              backward=self.backward)

        per_rank = _work_per_rank(grid.blocks_GPP, assign, self.mesh.world)
        return Candidate(name=name, draft=draft, bound=self._bound(per_rank, grid), imbalance=_ratio(per_rank))

    def _fixed_parts(self, base: Baseline, sc: _Scale, block: int) -> dict:
        """A baseline's mask-independent parts on this grid (``Baseline.fixed``, cached): its ownership, and the
        messages that do not depend on the mask (all-gather: all of them; Ulysses, USP: the all-to-all)."""
        key = (base.name, sc.num_chunks, block)
        hit = self._fixed.get(key)
        if hit is None:
            hit = self._fixed[key] = base.fixed(mesh=self.mesh, shape=self.shape, chunk=sc.chunk,
                                                num_chunks=sc.num_chunks, backward=self.backward)
        return hit


def _tasks(d: Draft) -> int:
    return int(d.messages.tensor.size + d.kernels.rank_K.size * len(d.kernels.seconds))


def planner_key(shape: AttnShape, mesh: Mesh, cost: CostModel, layout: TokenSharding | None, balance_tol: float,
                backward: bool, baselines: tuple[str, ...], band: Band | None = DEFAULT_BAND) -> tuple:
    """``FastPlanner.key`` from its arguments (to find a cached planner before making one)."""
    s = shape
    return ((s.seq_len, s.num_heads, s.head_dim, s.kv_heads, s.batch, s.dtype), (mesh.nodes, mesh.devices), cost,
            None if layout is None else (layout.chunk_size, layout.owner), balance_tol, backward, tuple(baselines),
            band)


def _work_per_rank(weight, assign: np.ndarray, world: int) -> np.ndarray:
    sel = assign >= 0
    return np.bincount(assign[sel], np.broadcast_to(weight, assign.shape)[sel], minlength=world)


def _ratio(per_rank: np.ndarray) -> float:
    """Max over mean of per-rank work (``planner.api.work_imbalance``)."""
    mean = per_rank.mean()
    return float(per_rank.max() / mean) if mean > 0 else 1.0
