"""Explicit per-rank programs for masks that arrive at run time (BlockMask and boolean-mask SDPA sites).

Every run compiles a two-layer model once and steps it over several batches, each with a new mask: every
step must match the fp64 oracle by the 2x rule (forward: loss; backward: every gradient), the graphs
Inductor received must hold the run-time program's stage and tile nodes and no opaque site op, each stage
must move exactly the bytes its plan says, and Dynamo must not compile again.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from backend_models import build, inputs, make_masks, oracle, runtime_mask_worker
from numerics import check_step

from ultraattn.kernels.block_lists import dense_block_kinds
from ultraattn.masks.convert import block_table_kinds
from ultraattn.testing import run_ranks

FAST = {"ilp_time_limit": 1.0, "time_budget": 2.0, "timeout": 60.0}
DOCS = ([50, 70, 40], [160], [10, 90, 30, 30], [80, 80], [33, 33, 33, 61])


def _count(code: str, op: str) -> int:
    """Calls of ``op`` in the graph's code."""
    return code.count(f"torch.ops.ultraattn.{op}.default(")


def _block_tables(specs: list[dict], block_size: int = 128) -> int:
    """How many different block tables the specs' masks have, as the runtime reduces them (a boolean mask in the
    backend's ``block_size``, a BlockMask in its own blocks): what a run-time mask is planned once per."""
    seen = set()
    for s in specs:
        _, bm, dense = inputs(s)
        if s["attn"] == "dense_mask":
            kinds = dense_block_kinds(dense, block_size, block_size)
        else:
            nq, nk = (-(-s["seqlen"] // b) for b in bm.BLOCK_SIZE)
            kinds = block_table_kinds(bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices, nq,
                                      nk)
        seen.add((tuple(kinds.shape), kinds.numpy().tobytes()))
    return len(seen)


def _check_run(res: list[dict], specs: list[dict], *, graphs: int = 1, local: bool = False,
               distinct: int | None = None, calls: int = 1) -> None:
    """``distinct``: how many plans ``specs`` need (default: one per block table, ``_block_tables``); ``calls``:
    forward runs per step of each site (2 with activation checkpointing: the backward recomputes it)."""
    refs = [oracle(s) for s in specs]
    for r, got in enumerate(res):
        for i, (step, ref) in enumerate(zip(got["steps"], refs)):
            bad = check_step(step, *ref)
            assert not bad, f"rank {r}, batch {i}: {bad}"
            assert step["sites"], f"rank {r}, batch {i}: no run-time program ran"
            for name, s in step["sites"].items():
                assert s["calls"] == calls * (i + 1), (r, i, name, s)  # no call beyond the model's
                for ph in ("fwd", "bwd"):
                    moved = {k: s["moved"][ph][k] for k in ("sent", "recv")}
                    assert moved == s["planned"][ph], (r, i, name, ph, s)
        # compiled once: the first step's graph count holds through every later batch
        assert all(f == got["frames"][0] for f in got["frames"]), got["frames"]
        assert got["frames"][0][0] == graphs, got["frames"]
        kinds = [g["kind"] for g in got["aot"]]
        assert kinds.count("forward") == kinds.count("backward") == graphs, kinds
        # every site runs its fixed plan in its run order: its own chunks' rows over its own keys (while the K/V
        # messages fly), then over the received keys; in the backward its rows over the received keys first (their
        # dK/dV partials go home while the rows over its own keys run): one stage per site and phase
        for g in got["aot"]:
            code = g["code"]
            assert "site_attention" not in code, g["kind"]
            assert g["expanded"], g["kind"]
            n = len(set(g["expanded"]))
            # forwards in this graph (with checkpointing the backward recomputes each site's forward)
            fwd = n if g["kind"] == "forward" else (calls - 1) * n
            bwd = 0 if g["kind"] == "forward" else n
            assert _count(code, "cp_mask_plan") == fwd
            assert _count(code, "cp_start") == _count(code, "cp_wait") == fwd + bwd
            # one tile node per launch of the schedule (own keys, received keys; in the backward the other way round),
            # each over every row of the rank's own chunks
            assert _count(code, "cp_tiles_fwd") == 2 * fwd and _count(code, "cp_tiles_bwd") == 2 * bwd
            gathers = 2 * fwd + 3 * bwd
            assert _count(code, "cp_gather") == (0 if local else gathers)
        # one plan per block table: a mask whose blocks were seen before is not planned again (its tiles read its own
        # elements), and the later layers' sites (same configuration, same mask; in this graph or the next) take the
        # first one's plan
        made = [(e["graph"], e["site"]) for e in got["events"] if e["planner"] == "exchange"]  # (not seed plans)
        assert len(made) == (distinct or _block_tables(specs)), made
    # the same plans on every rank
    for i in range(len(specs)):
        assert len({tuple(sorted((n, s["plan"]) for n, s in got["steps"][i]["sites"].items())) for got in res}) == 1


@pytest.mark.parametrize("world,shard", [(2, True), (4, False)])
def test_document_masks_over_five_batches_compile_once(world, shard, tmp_path):
    """Sequence-sharded graphs (2 ranks, GQA, batch 2: fixed owners, the graph's layout) and the global view
    (4 ranks: owners chosen per batch), five document masks each. The saved report shows each graph's skeleton
    once and the plan of every step (bytes per stage, imbalance, planning time)."""
    base = {"attn": "flex", "mask": "document", "seqlen": 160}
    if world == 2:  # (32-token blocks: the graph's head-tail stripes give each rank 4 chunks to balance over)
        base.update(kv_heads=2, batch=2, block=32)
    specs = [dict(base, lengths=list(d)) for d in DOCS]
    path = tmp_path / "report.json"
    # (2 ranks: the exchange on the batched transport, NCCL's batch_isend_irecv per stage, here over gloo)
    env = {"ULTRAATTN_TRANSPORT": "batched"} if world == 2 else None
    res = run_ranks(runtime_mask_worker, world, args=(specs, dict(FAST, shard=shard, report_file=str(path))),
                    timeout=900, env=env)
    _check_run(res, specs, local=shard)
    owners = {s["ownership"] for got in res for step in got["steps"] for s in step["sites"].values()}
    assert owners == {"fixed" if shard else "per-batch"}
    assert all(ev["stages"]["fwd"] for ev in res[0]["events"] if ev["planner"] == "exchange")
    out = subprocess.run([sys.executable, "-m", "ultraattn.cli", "report", str(path)], capture_output=True,
                         text=True, timeout=120, env=dict(os.environ, COLUMNS="250"))
    assert out.returncode == 0, out.stderr
    text = out.stdout
    for kind in ("forward", "backward"):
        assert text.count(f"{kind} graph for Inductor: ") == 1, text
    # two sites, each: the K/V stage; a tile node over its own keys and one over the received keys
    assert "forward graph for Inductor: 2 communication stages, 4 tile nodes" in text, text
    assert "cp_start" in text and "cp_wait" in text and "fwd bytes / stage" in text
    assert "post the K/V chunks each rank needs" in text and "partials for this rank's chunks, summed" in text
    if shard:  # the graph's layout: head-tail stripes, not the first mask's plan
        assert "head-tail stripes x2 (a new mask every batch)" in text, text
    rows = [ln for ln in text.splitlines() if " exchange " in ln and ln.lstrip().startswith("flex#")
            and "latest plan" not in ln]
    assert len(rows) == _block_tables(specs), rows  # a plan per block table (both layers' sites use it)
    fwd_bytes = {sum(s["moved"]["fwd"]["sent"] for got in res for s in [got["steps"][i]["sites"]["flex#0"]])
                 for i in range(len(DOCS))}
    assert len(fwd_bytes) > 1 and all(any(f" {b} " in ln for ln in rows) for b in fwd_bytes), (fwd_bytes, rows)


def test_sliding_window_with_sharded_outputs_and_random_block_masks_across_a_graph_break():
    """A sliding window (MQA: one KV head; the same mask every batch) with outputs="sharded" at 2 ranks, then
    windows that change (the mask_mod closes over a Python int); random BlockMasks (FULL, PARTIAL and EMPTY
    blocks, a new one per batch) across a graph break at 4 ranks."""
    sliding = [{"attn": "flex", "mask": "sliding", "window": w, "seqlen": 192, "kv_heads": 1}
               for w in (40, 40, 40, 56, 72)]
    res = run_ranks(runtime_mask_worker, 2, args=(sliding, FAST, "sharded"), timeout=900)
    first = [dict(got, steps=got["steps"][:3], frames=got["frames"][:3], aot=got["aot"][:2],
                  events=[e for e in got["events"] if e["graph"] == 0]) for got in res]
    _check_run(first, sliding[:3], local=True, distinct=1)  # built once: planned once
    # a window that changes: Dynamo compiles once more with the int as a SymInt (its automatic dynamic shapes),
    # which reaches the program as a 0-d mask tensor; no compile for the next window
    refs = [oracle(sp) for sp in sliding[3:]]
    for r, got in enumerate(res):
        assert [f[0] for f in got["frames"]] == [1, 1, 1, 2, 2], got["frames"]
        assert all("site_attention" not in g["code"] for g in got["aot"]) and len(got["aot"]) == 4
        # the SymInt enters through an op: an aten.scalar_tensor would be a host (C++) kernel in a CUDA graph
        assert "ultraattn.int_tensor" in got["aot"][2]["code"], got["aot"][2]["code"]
        assert not [ln for g in got["aot"] for ln in g["code"].splitlines() if "aten.scalar_tensor" in ln
                    and "int64" in ln]
        for i, (st, ref) in enumerate(zip(got["steps"][3:], refs)):
            assert not check_step(st, *ref), (r, i, check_step(st, *ref))
            for name, site in st["sites"].items():
                for ph in ("fwd", "bwd"):
                    assert {k: site["moved"][ph][k] for k in ("sent", "recv")} == site["planned"][ph], (r, name)
    rand = [{"attn": "flex", "mask": "random", "mask_seed": s, "seqlen": 192} for s in (1, 2, 3)]
    res = run_ranks(runtime_mask_worker, 4, args=(rand, FAST, "break"), timeout=900)
    _check_run(res, rand, graphs=2, local=True)


def test_boolean_mask_sdpa_sites_with_activation_checkpointing():
    specs = [{"attn": "dense_mask", "mask": "document", "seqlen": 160, "lengths": list(d), "checkpoint": True}
             for d in DOCS[:3]]
    res = run_ranks(runtime_mask_worker, 2, args=(specs, dict(FAST, shard=False)), timeout=900)
    _check_run(res, specs, calls=2)


def test_a_mask_whose_shape_disagrees_with_the_inputs_is_named():
    spec = {"attn": "flex", "mask": "document", "seqlen": 160, "lengths": [100, 60]}
    model = build(spec)
    bm, _ = make_masks("document", 128, [64, 64])
    with pytest.raises(ValueError, match="block_mask") as info:
        torch.compile(model, backend="ultraattn")(torch.randint(0, 64, (1, 160)), bm)
    assert "128" in str(info.value) and "160" in str(info.value), str(info.value)
    # a boolean SDPA mask of the wrong size: Dynamo's tracing fails first, naming attn_mask and both shapes
    torch._dynamo.reset()  # (the failed frame above would otherwise run eagerly, with eager SDPA's message)
    dense = build({"attn": "dense_mask", "mask": "document", "seqlen": 160, "lengths": [100, 60]})
    _, bad = make_masks("document", 128, [64, 64])
    with pytest.raises(Exception, match="attn_mask") as info:
        torch.compile(dense, backend="ultraattn")(torch.randint(0, 64, (1, 160)), bad)
    assert "(128, 128)" in str(info.value) and "160" in str(info.value), str(info.value)


def test_dynamic_tiles_run_the_triton_kernels_under_the_interpreter():
    """On GPUs a per-mask program's tile op runs the block-sparse Triton kernels with its mask's row layouts; here
    the same path under Triton's interpreter (aot_eager), two document masks at 2 ranks."""
    specs = [{"attn": "flex", "mask": "document", "seqlen": 128, "lengths": list(d)} for d in ([50, 78], [30, 98])]
    res = run_ranks(runtime_mask_worker, 2, args=(specs, dict(FAST, compiler="aot_eager")), timeout=900,
                    env={"ULTRAATTN_KERNELS": "triton", "TRITON_INTERPRET": "1"})
    refs = [oracle(s) for s in specs]
    for r, got in enumerate(res):
        for i, (step, ref) in enumerate(zip(got["steps"], refs)):
            assert not check_step(step, *ref), (r, i, check_step(step, *ref))
            assert all(s["kernel_rows"] > 0 for s in step["sites"].values()), (r, i, step["sites"])
