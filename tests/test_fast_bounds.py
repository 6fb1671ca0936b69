"""The fast planner's candidates and bounds: bounds made best first, a step at a time (``FastPlanner.candidates``),
with the prices and plans of making every bound first; chunks finer than ``FINE_CHUNK_BLOCKS`` blocks only up to
two per rank."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

import ultraattn.planner.fast as fast
from ultraattn.masks.cells import cells_from_pattern
from ultraattn.masks.convert import pattern_from_mask_mod
from ultraattn.masks.factories import generate_document
from ultraattn.planner.fast import ROBUST_WINDOW, FastPlanner
from ultraattn.planner.plan import AttnShape, Mesh
from ultraattn.planner.price import busy_bound

MESH = Mesh(nodes=8, devices=8)


def shape(s: int) -> AttnShape:
    return AttnShape(seq_len=s, num_heads=32, head_dim=128, num_kv_heads=8, dtype="bf16")


def document_cells(s: int, seed: int = 32768):
    """A packed-document mask as ``benchmarks/replan.py`` draws them: lognormal lengths, median 1024, sigma 1.2."""
    rng, lengths = np.random.default_rng(seed), []
    while sum(lengths) < s:
        lengths.append(min(s - sum(lengths), max(1, int(rng.lognormal(np.log(1024), 1.2)))))
    return cells_from_pattern(pattern_from_mask_mod(generate_document(lengths), s, block_size=128))


@pytest.mark.parametrize("fine_blocks", [1, fast.FINE_CHUNK_BLOCKS])
def test_candidates_are_routed_only_where_their_kernels_can_win(monkeypatch, fine_blocks):
    """``FastPlanner.candidates`` takes the candidate with the least bound known so far one step further (compute at
    peak, then its kernels' busiest compute stream, then every stream once routed, then the price). On a 64K
    packed-document mask on 8x8 the balanced candidate (and, with chunks of 2 blocks allowed, the 8-chunks-per-rank
    ones) is never routed: its kernels alone cost more than the cheapest price allows. The result is the one of
    bounds made in full for every candidate first: the same candidates priced, at the same prices (the pruning loop
    of before, replayed here over full bounds), and the same plan as a planner without the kernel step."""
    monkeypatch.setattr(fast, "FINE_CHUNK_BLOCKS", fine_blocks)

    class NoKernelStep(FastPlanner):   # every candidate of ours routed before its compute stream bounds it
        def _at(self, *a, **kw):
            return dataclasses.replace(super()._at(*a, **kw), kernels=None)

    cells = document_cells(65536)
    fp, ref = FastPlanner(shape=shape(65536), mesh=MESH), NoKernelStep(shape=shape(65536), mesh=MESH)
    cands = {c.name: c for c in fp.candidates(cells) if c.eligible}
    unrouted = {n for n, c in cands.items() if c._draft is None}
    assert ({"tiled-k8", "tiled-k8-flat", "balanced"} if fine_blocks == 1 else {"balanced"}) <= unrouted, unrouted
    assert all(cands[n].seconds is None for n in unrouted)
    # the same prices as the pruning loop over full bounds (every eligible candidate drafted first)
    full = {c.name: c for c in ref.candidates(cells) if c.eligible}
    bound = {n: c.bound if ref._batchable(c.get()) else max(c.bound, busy_bound(c.get().kernels, c.get().messages,
                                                                                   MESH, ref.cost))
             for n, c in full.items()}
    best, priced = math.inf, {}
    for n in sorted(full, key=lambda n: (bound[n], n)):
        if bound[n] <= best * ROBUST_WINDOW:
            priced[n] = full[n].seconds
            best = min(best, full[n].seconds)
    assert priced == {n: c.seconds for n, c in cands.items() if c.seconds is not None}, (priced, cands)
    assert fp.plan(cells).content_hash() == ref.plan(cells).content_hash()


def test_more_than_two_chunks_per_rank_only_where_a_chunk_holds_four_blocks(monkeypatch):
    """``FINE_CHUNK_BLOCKS``: our structure tries 4 and 8 chunks per rank only where a chunk then holds at least 4
    mask blocks (2-block chunks make many short launches: on ``replan.py``'s 128K 8x8 and 32K 2x8 masks such a
    candidate was never among the finalists, only placed, at a fifth of the planning time). One or two chunks per
    rank stay at any size, and the balanced candidate keeps the finest chunks of a block or more. On 64K and 128K
    8x8 document masks the plans equal those of a planner that tries every granularity."""
    for s, kept in ((65536, {1, 2}), (131072, {1, 2, 4}), (262144, {1, 2, 4, 8})):
        cands = {c.name: c for c in FastPlanner(shape=shape(s), mesh=MESH).candidates(document_cells(s, seed=s))}
        ks = {int(n.split("-")[1][1:]) for n in cands if n.startswith("tiled")}
        assert ks == kept, (s, ks)
        assert cands["balanced"].get().meta["chunks_per_rank"] == 8
    for s in (65536, 131072):
        for seed in (1, 2):
            cells = document_cells(s, seed=seed)
            ours = FastPlanner(shape=shape(s), mesh=MESH).plan(cells)
            monkeypatch.setattr(fast, "FINE_CHUNK_BLOCKS", 1)
            every = FastPlanner(shape=shape(s), mesh=MESH).plan(cells)
            monkeypatch.undo()
            assert ours.content_hash() == every.content_hash(), (s, seed, ours.meta["candidate"],
                                                                 every.meta["candidate"])
