"""``benchmarks/plan_time.py --breakdown``: the planner's steps timed around their calls, and put back after."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch.nn.attention.flex_attention import create_block_mask

from ultraattn.masks.cells import cells_from_block_mask
from ultraattn.masks.factories import generate_document
from ultraattn.planner import fast, schedule
from ultraattn.planner.fast import FastPlanner
from ultraattn.planner.plan import AttnShape, Mesh

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


def test_breakdown_times_each_step_and_restores_the_planner(monkeypatch):
    import os

    # (the script sets OMP_NUM_THREADS for itself when imported: kept out of the ranks later tests spawn)
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", str(torch.get_num_threads())))
    from plan_time import STEPS, breakdown

    shape = AttnShape(seq_len=2048, num_heads=4, head_dim=32, num_kv_heads=2)
    blocks = [create_block_mask(generate_document(lens), None, None, 2048, 2048, device="cpu", BLOCK_SIZE=64)
              for lens in ([700, 900, 448], [1500, 548])]
    before = {(m, n): getattr({"fast": fast, "schedule": schedule}[m], n) for m, n in STEPS}
    planner = FastPlanner(shape=shape, mesh=Mesh(nodes=2, devices=2))
    got = breakdown(planner, blocks)
    assert list(got) == [n for _, n in STEPS]
    assert all(v >= 0 for v in got.values())
    # every plan replays for its run order, and prices its candidates
    assert got["simulate"] > 0 and got["build_graph"] > 0 and got["price"] > 0
    assert {(m, n): getattr({"fast": fast, "schedule": schedule}[m], n) for m, n in STEPS} == before
    # timing the steps changes no plan
    fresh = FastPlanner(shape=shape, mesh=Mesh(nodes=2, devices=2))
    for bm in blocks:
        a, b = planner.plan(cells_from_block_mask(bm)), fresh.plan(cells_from_block_mask(bm))
        assert a.kernels == b.kernels and a.transfers == b.transfers and a.owner == b.owner
