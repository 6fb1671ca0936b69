"""The fast planner's near-ties in price on large plans (``fast.PRICE_TIE``): where a finalist is priced within 2 % of
the choice, the price (a lower bound) cannot tell them apart and the simulator's replay decides; the winner's replay
is its run order. Made small here: every plan counts as large (``REPLAY_TASKS = 0``)."""

from __future__ import annotations

import numpy as np
import pytest

import ultraattn.planner.fast as fast
from ultraattn.masks.cells import cells_from_pattern
from ultraattn.masks.convert import pattern_from_mask_mod
from ultraattn.masks.factories import generate_document
from ultraattn.planner.fast import FastPlanner
from ultraattn.planner.plan import AttnShape, Mesh
from ultraattn.planner.price import PHASES
from ultraattn.planner.program import with_order
from ultraattn.planner.schedule import build_graph, simulate

S = 8192
MESH = Mesh(nodes=2, devices=4)


def document_cells(seed: int):
    rng, lengths = np.random.default_rng(seed), []
    while sum(lengths) < S:
        lengths.append(min(S - sum(lengths), max(1, int(rng.lognormal(np.log(512), 1.2)))))
    return cells_from_pattern(pattern_from_mask_mod(generate_document(lengths), S, block_size=128))


def planner(band=None) -> FastPlanner:
    return FastPlanner(shape=AttnShape(seq_len=S, num_heads=8, head_dim=64, num_kv_heads=2, dtype="bf16"), mesh=MESH,
                       **({} if band == "default" else {"band": band}))


def draft_replay_ms(fp: FastPlanner, cand) -> tuple[float, dict]:
    """A candidate's plan replayed from its draft's kernel seconds, both phases: (ms, schedules)."""
    tp, d = fp.build(cand), cand.get()
    sched = {PHASES[ph]: simulate(build_graph(tp, None, fp.cost, PHASES[ph], kernel_seconds=sec))
             for ph, sec in d.kernels.seconds.items()}
    return sum(s.makespan for s in sched.values()) * 1e3, sched


@pytest.mark.parametrize("band", [None, "default"])
def test_a_near_tie_in_price_is_decided_by_the_replay(monkeypatch, band):
    """The most robust finalist (the cheapest without a band) and the next finalist priced within ``PRICE_TIE`` of it,
    whatever its regret, are replayed and the faster wins; the winner's replay is its run order."""
    monkeypatch.setattr(fast, "REPLAY_TASKS", 0)
    monkeypatch.setattr(fast, "PRICE_TIE", fast.NEAR_TIE)   # (a wider tie: some occur at this size)
    fp = planner(band)
    decided = 0
    for seed in range(8):
        cells = document_cells(seed)
        tp = fp.plan(cells)
        replayed, reg = tp.meta["replayed"], tp.meta["regrets"]
        cands = {c.name: c for c in fp.candidates(cells)}
        priced = sorted((c.seconds, n) for n, c in cands.items() if c.seconds is not None and c.eligible)
        finalists = [n for p, n in priced if p <= priced[0][0] * fast.ROBUST_WINDOW][:fast.FINALISTS]
        least = min(reg.values(), default=1.0)
        first = next(n for n in finalists if reg.get(n, 1.0) <= least + fast.REGRET_TIE)   # the most robust
        rival = next((n for n in finalists if n != first
                      and cands[n].seconds <= cands[first].seconds * (1 + fast.PRICE_TIE)), None)
        if rival is None:   # no tie: the most robust finalist, not replayed
            assert not replayed and tp.meta["candidate"] == first, (seed, replayed, priced)
            continue
        decided += 1
        assert set(replayed) == {first, rival}, (seed, replayed, first, rival)
        got = {n: draft_replay_ms(fp, cands[n]) for n in replayed}
        for n, (ms, _) in got.items():
            assert replayed[n] == pytest.approx(ms, abs=1e-6), (seed, n)
        chosen = tp.meta["candidate"]
        assert got[chosen][0] == min(ms for ms, _ in got.values()), (seed, chosen, got)
        # the winner's replay is its run order
        assert tp.order == with_order(fp.build(cands[chosen]), got[chosen][1]).order
    assert decided >= 2, decided


def test_outside_the_tie_the_price_and_regret_decide(monkeypatch):
    """With no tie allowed (``PRICE_TIE = 0``) a large plan is never replayed to choose: the cheapest finalist (no
    band) is the plan, whatever the replay says."""
    monkeypatch.setattr(fast, "REPLAY_TASKS", 0)
    monkeypatch.setattr(fast, "PRICE_TIE", 0.0)
    fp = planner()
    for seed in range(4):
        cells = document_cells(seed)
        tp = fp.plan(cells)
        priced = sorted((c.seconds, c.name) for c in fp.candidates(cells) if c.seconds is not None and c.eligible)
        assert tp.meta["replayed"] == {} and tp.meta["candidate"] == priced[0][1], (seed, tp.meta["replayed"])
