"""Runtime across ranks (gloo on 127.0.0.1, spawned processes, every wait bounded).

Every case is checked against the single-device dense reference: forward, LSE and dq/dk/dv,
by the 2x rule (docs/numerics.md): the error against fp64 is at most twice that of the same-precision
single-device reference. The bytes each rank actually moved must equal the planner's
transfers touching that rank, message by message.
"""

from __future__ import annotations

import pytest
import torch
from runtime_cases import (
    LIB,
    Case,
    absent_worker,
    cases_worker,
    check_bytes,
    check_numerics,
    group_errors_worker,
    mismatch_worker,
    run_case,
)

from ultraattn.testing import RankFailure, run_ranks


def run_and_check(cases: list[Case], world: int, timeout: float = 420.0, env: dict | None = None) -> list[dict]:
    """Every case exact and moving the plan's bytes; returns each case's rank-0 result (``run_case``)."""
    per_rank = run_ranks(cases_worker, world, args=(cases,), timeout=timeout, env=env)
    problems = []
    for n, case in enumerate(cases):
        results = [per_rank[r][n] for r in range(world)]
        assert results[0]["world"] == world
        problems += check_numerics(case, results[0])
        problems += [f"{case.name}: {m}" for m in check_bytes(results)]
    assert not problems, "\n".join(problems)
    return [per_rank[0][n] for n in range(len(cases))]


def batches(results: list[dict]) -> set[int]:
    """The kernel batches the cases' plans used (``build.BATCHES``)."""
    return {r["kernel_batch"] for r in results}


def _lib(**kw) -> list[Case]:
    return [Case(mask=m, kwargs=a, **kw) for m, a in LIB]


# ----------------------------------------------------------------------------- world 1 (no process group)
@pytest.mark.parametrize("case", _lib(seqlen=200, heads=4, kv_heads=2, batch=2), ids=lambda c: c.name)
def test_world1_matches_reference(case):
    res = run_case(case, 0, 1)
    assert not check_numerics(case, res)
    assert res["records"] == [] and res["transfers"] == []


@pytest.mark.parametrize("case", _lib(seqlen=200, heads=4, kv_heads=2, batch=2)[:4], ids=lambda c: c.name)
def test_world1_tiles_in_column_pieces(case, monkeypatch):
    """A workspace cap below one KV block: every tile runs one KV block at a time (forward merges, backward sums)."""
    import ultraattn.runtime.tiles as tiles

    monkeypatch.setattr(tiles, "TILE_ELEMS", 1)
    res = run_case(case, 0, 1)
    assert not check_numerics(case, res)


# ----------------------------------------------------------------------------- rows on FlexAttention
@pytest.mark.parametrize("case", _lib(seqlen=200, heads=4, kv_heads=2, batch=2), ids=lambda c: c.name)
def test_world1_rows_on_flex_attention(case, monkeypatch):
    """``ULTRAATTN_TILE_KERNEL=flex``: every row runs on FlexAttention (eager on CPU; its backward operator given the
    merged LSE), and the result is exact."""
    from ultraattn.kernels import flex_tile

    monkeypatch.setenv("ULTRAATTN_TILE_KERNEL", "flex")
    calls = {"fwd": 0, "bwd": 0}
    fwd, bwd = flex_tile.flex_forward, flex_tile.flex_backward

    def counted(phase, fn):
        def call(*args, **kwargs):
            calls[phase] += 1
            return fn(*args, **kwargs)
        return call

    monkeypatch.setattr(flex_tile, "flex_forward", counted("fwd", fwd))
    monkeypatch.setattr(flex_tile, "flex_backward", counted("bwd", bwd))
    res = run_case(case, 0, 1)
    assert not check_numerics(case, res)
    assert calls["fwd"] > 0 and calls["bwd"] > 0, calls


def test_world2_rows_on_flex_attention_exact_with_gqa_and_a_tail():
    """Two ranks, every row on FlexAttention where it applies: partial rows merged across ranks, dK/dV summed."""
    cases = _lib(seqlen=232, heads=4, kv_heads=1)
    run_and_check(cases, 2, env={"ULTRAATTN_TILE_KERNEL": "flex"})


# ----------------------------------------------------------------------------- world 2, 3, 4
def test_world2_every_mask_gqa4_on_the_staged_transport():
    """The transport gloo gets on a CUDA machine (host-staged messages; on CPU tensors the staging is a no-op, so
    this checks its posting, waits and byte records; benchmarks/gpu_check.py runs it on a GPU)."""
    run_and_check(_lib(seqlen=200, heads=4, kv_heads=1), 2, env={"ULTRAATTN_TRANSPORT": "staged"})


def test_world3_every_mask_gqa8_tail_on_the_batched_transport():
    """Also the NCCL-style transport (one ``batch_isend_irecv`` per stage), here on gloo; the others run the tagged
    one gloo gets by default. Bytes are checked message by message either way."""
    # S = 232 is not a multiple of the block (32) and past the documents' 200 tokens rows attend nothing
    cases = _lib(seqlen=232, heads=8, kv_heads=1)
    cases.append(Case(mask="document", kwargs=(("lengths", ((100, 132), (32, 200))),), seqlen=232, batch=2))
    run_and_check(cases, 3, env={"ULTRAATTN_TRANSPORT": "batched"})


def test_the_transport_is_chosen_by_the_group_or_the_environment(monkeypatch):
    from ultraattn.runtime.transport import BatchedTransport, StagedTransport, TaggedTransport, transport_for

    monkeypatch.delenv("ULTRAATTN_TRANSPORT", raising=False)
    assert type(transport_for(rank=0, global_ranks=(0,))) is TaggedTransport  # no group: not NCCL
    monkeypatch.setenv("ULTRAATTN_TRANSPORT", "batched")
    assert type(transport_for(rank=0, global_ranks=(0,))) is BatchedTransport
    assert type(transport_for(rank=0, global_ranks=(0,), kind="tagged")) is TaggedTransport
    assert type(transport_for(rank=0, global_ranks=(0,), kind="staged")) is StagedTransport
    monkeypatch.setenv("ULTRAATTN_TRANSPORT", "carrier-pigeon")
    with pytest.raises(ValueError, match=r"ultraattn: transport 'carrier-pigeon'.*unset ULTRAATTN_TRANSPORT"):
        transport_for(rank=0, global_ranks=(0,))


def test_world4_every_mask_and_baselines():
    cases = _lib(seqlen=250, heads=4, kv_heads=2)
    cases += [Case(mask="causal", seqlen=250, heads=4, kv_heads=2, method=m)
              for m in ("ring", "zigzag", "allgather", "usp")]
    cases += [Case(mask="document", kwargs=(("lengths", (50, 90, 60, 50)),), seqlen=250, method=m)
              for m in ("ulysses", "allgather")]
    # the planner's plans run with their remote cells batched in longer launches and without (build.kernel_groups)
    assert len(batches(run_and_check(cases, 4))) > 1


def test_world4_low_precision():
    cases = [Case(mask=m, kwargs=a, seqlen=256, heads=4, kv_heads=2, head_dim=32, dtype="bf16") for m, a in LIB
             if m in ("causal", "document", "random", "strided")]
    cases.append(Case(mask="global_local", kwargs=(("num_global", 16), ("window", 40)), seqlen=256, dtype="fp16"))
    run_and_check(cases, 4)


def test_mesh_2x2_two_nodes():
    cases = [Case(mask=m, kwargs=a, seqlen=256, heads=4, kv_heads=2, mesh=(2, 2)) for m, a in LIB
             if m in ("causal", "global_local", "document", "random")]
    cases.append(Case(mask="causal", seqlen=256, heads=4, kv_heads=2, mesh=(2, 2), method="usp"))
    cases.append(Case(mask="strided", kwargs=(("block", 32),), seqlen=256, heads=4, kv_heads=2, mesh=(2, 2)))
    # pure relays at both ends of a node crossing (``build.NodeLinks``): a rank lands K/V only its node's other rank
    # uses, and a rank sends K/V it got from its node's owner, reducing the partials that come back
    cases.append(Case(mask="causal", seqlen=256, heads=4, kv_heads=2, block=16, mesh=(2, 2),
                      extra={"remake": "node_one_on_its_last_rank"}))
    res = run_and_check(cases, 4)
    assert max(batches(res)) > 1   # batched launches over inputs from the other node too
    assert res[-1]["structure"] == "hand-routed" and min(res[-1]["relays"].values()) > 0, res[-1]["relays"]


def test_world8():
    cases = [Case(mask=m, kwargs=a, seqlen=512, heads=8, kv_heads=2) for m, a in LIB
             if m in ("causal", "strided", "document")]
    run_and_check(cases, 8, timeout=600)


# ----------------------------------------------------------------------------- failures
def test_ranks_that_planned_differently_get_an_error_naming_it():
    msgs = run_ranks(mismatch_worker, 2, timeout=120)
    for m in msgs:
        assert "rank 1 differs from rank 0 in: mask pattern" in m, m


@pytest.mark.parametrize("how,absent", [("stall", 2), ("die", 2), ("die", 0)])
def test_absent_rank_is_named_within_the_timeout(how, absent):
    # absent=0 also kills the rendezvous store's host: the others must still name rank 0, not
    # surface a socket error. (absent=2 can see that too when rank 0 fails first and exits.)
    timeout = 4.0
    res = run_ranks(absent_worker, 3, args=(how, timeout, absent), timeout=120, may_exit=frozenset({absent}))
    for r in {0, 1, 2} - {absent}:
        assert res[r]["error"] is not None, res[r]
        assert f"rank {absent}" in res[r]["error"], res[r]["error"]
        assert res[r]["seconds"] < 2 * timeout + 5, res[r]


def test_group_and_input_errors():
    res = run_ranks(group_errors_worker, 4, timeout=120)
    for r in res:
        assert "mesh" in r["mesh_vs_group"] and "process group has ranks" in r["mesh_vs_group"], r
        assert "dtype torch.bfloat16" in r["dtype"] and "plan" in r["dtype"], r
        assert "shape (1, 2, 128, 16)" in r["shape"] and "dispatch" in r["shape"], r


def test_run_ranks_reports_a_failing_rank():
    with pytest.raises(RankFailure, match="rank 1 failed"):
        run_ranks(_fail_on_rank1, 2, timeout=60)


def _fail_on_rank1(rank: int, world: int) -> int:
    if rank == 1:
        raise RuntimeError("boom")
    return rank


# ----------------------------------------------------------------------------- the Triton tile kernels
@pytest.mark.parametrize("world", [2, 4])
def test_runtime_on_the_triton_kernels(world):
    """The GPU tile path (the block-sparse Triton kernels, fp32 partials) run by Triton's interpreter on CPU."""
    import os

    if not os.environ.get("TRITON_INTERPRET") and not torch.cuda.is_available():
        pytest.skip("needs TRITON_INTERPRET=1 (tests/conftest.py sets it) or a GPU")
    cases = [Case(mask="causal", seqlen=200, heads=4, kv_heads=2, batch=2),
             Case(mask="document", kwargs=(("lengths", (50, 90, 60)),), seqlen=200, heads=4, kv_heads=1),
             Case(mask="random", seqlen=200, seed=2),
             Case(mask="strided", kwargs=(("block", 32),), seqlen=256, dtype="bf16"),
             # per-head KV block lists under noop_mask: the row layouts are exact per (batch, head)
             Case(mask="block_select", seqlen=200, heads=4, kv_heads=2, batch=2)]
    run_and_check(cases if world == 2 else cases[:2], world, env={"ULTRAATTN_KERNELS": "triton"})
