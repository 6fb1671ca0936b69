"""The fast planner's bounds: made best first, a step at a time (``FastPlanner.candidates``), with the prices and
plans of making every bound first."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from ultraattn.masks.cells import cells_from_pattern
from ultraattn.masks.convert import pattern_from_mask_mod
from ultraattn.masks.factories import generate_document
from ultraattn.planner.fast import ROBUST_WINDOW, FastPlanner
from ultraattn.planner.plan import AttnShape, Mesh
from ultraattn.planner.price import busy_bound


def test_candidates_are_routed_only_where_their_kernels_can_win():
    """``FastPlanner.candidates`` takes the candidate with the least bound known so far one step further (compute at
    peak, then its kernels' busiest compute stream, then every stream once routed, then the price). On a 64K
    packed-document mask on 8x8 the 8-chunks-per-rank candidates and the balanced one are never routed: their
    kernels alone cost more than the cheapest price allows. The result is the one of bounds made in full for every
    candidate first: the same candidates priced, at the same prices (the pruning loop of before, replayed here over
    full bounds), and the same plan as a planner without the kernel step."""
    class NoKernelStep(FastPlanner):   # every candidate of ours routed before its compute stream bounds it
        def _at(self, *a, **kw):
            return dataclasses.replace(super()._at(*a, **kw), kernels=None)

    rng, lengths, s = np.random.default_rng(32768), [], 65536
    while sum(lengths) < s:   # replan.py's document lengths: lognormal, median 1024, sigma 1.2
        lengths.append(min(s - sum(lengths), max(1, int(rng.lognormal(np.log(1024), 1.2)))))
    cells = cells_from_pattern(pattern_from_mask_mod(generate_document(lengths), s, block_size=128))
    shape = AttnShape(seq_len=s, num_heads=32, head_dim=128, num_kv_heads=8, dtype="bf16")
    mesh = Mesh(nodes=8, devices=8)
    fp, ref = FastPlanner(shape=shape, mesh=mesh), NoKernelStep(shape=shape, mesh=mesh)
    cands = {c.name: c for c in fp.candidates(cells) if c.eligible}
    unrouted = {n for n, c in cands.items() if c._draft is None}
    assert {"tiled-k8", "tiled-k8-flat", "balanced"} <= unrouted, unrouted
    assert all(cands[n].seconds is None for n in unrouted)
    # the same prices as the pruning loop over full bounds (every eligible candidate drafted first)
    full = {c.name: c for c in ref.candidates(cells) if c.eligible}
    bound = {n: c.bound if ref._batchable(c.get()) else max(c.bound, busy_bound(c.get().kernels, c.get().messages,
                                                                                   mesh, ref.cost))
             for n, c in full.items()}
    best, priced = math.inf, {}
    for n in sorted(full, key=lambda n: (bound[n], n)):
        if bound[n] <= best * ROBUST_WINDOW:
            priced[n] = full[n].seconds
            best = min(best, full[n].seconds)
    assert priced == {n: c.seconds for n, c in cands.items() if c.seconds is not None}, (priced, cands)
    assert fp.plan(cells).content_hash() == ref.plan(cells).content_hash()
