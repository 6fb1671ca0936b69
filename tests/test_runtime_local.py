"""Runtime pieces that need no process group: LSE merge, programs, packing, input errors."""

from __future__ import annotations

import math

import pytest
import torch

import ultraattn
from ultraattn.masks import generate_sliding_window, pattern_from_mask_mod
from ultraattn.planner.api import baseline_plan
from ultraattn.planner.plan import AttnShape, Kernel, Mesh, TilePlan, Transfer
from ultraattn.runtime.comm import pack, spec_bytes, unpack
from ultraattn.runtime.executor import PlanExecutionError, build_program
from ultraattn.runtime.tiles import merge_partial


def _partial(scores: torch.Tensor, v: torch.Tensor):
    lse = torch.logsumexp(scores, -1)
    p = torch.softmax(scores, -1).nan_to_num(0.0)
    return p @ v, lse


def test_merge_equals_one_softmax_over_the_union():
    g = torch.Generator().manual_seed(0)
    s = torch.randn(3, 5, 40, generator=g, dtype=torch.float64) * 30  # large logits: exp would overflow
    v = torch.randn(3, 40, 7, generator=g, dtype=torch.float64)
    whole = _partial(s, v)
    a = _partial(s[..., :13], v[:, :13])
    b = _partial(s[..., 13:], v[:, 13:])
    o, lse = merge_partial(a, b)
    assert torch.allclose(o, whole[0], atol=1e-12) and torch.allclose(lse, whole[1], atol=1e-12)


def test_merge_of_empty_rows_stays_finite():
    o = torch.zeros(2, 4, 3)
    lse = torch.full((2, 4), -math.inf)
    lse_b = lse.clone()
    lse_b[0, 1] = 0.5
    o_b = o.clone()
    o_b[0, 1] = 1.0
    mo, ml = merge_partial((o, lse), (o_b, lse_b))
    assert not torch.isnan(mo).any() and not torch.isnan(ml).any()
    assert ml[0, 1] == 0.5 and torch.equal(mo[0, 1], torch.ones(3))
    assert torch.isinf(ml[1]).all() and (mo[1] == 0).all()


def test_pack_roundtrip_and_sizes():
    a = torch.randn(2, 3, 4).to(torch.bfloat16)
    b = torch.randn(2, 3)
    spec = [((2, 3, 4), torch.bfloat16), ((2, 3), torch.float32)]
    buf = pack([a, b])
    assert buf.dtype == torch.uint8 and buf.numel() == spec_bytes(spec) == 2 * 3 * 4 * 2 + 2 * 3 * 4
    a2, b2 = unpack(buf, spec)
    assert torch.equal(a2, a) and torch.equal(b2, b)
    with pytest.raises(RuntimeError, match="does not match"):
        unpack(buf[:-1], spec)


def _shape():
    return AttnShape(seq_len=256, num_heads=4, head_dim=16, dtype="fp32")


def test_program_levels_follow_the_ring():
    pat = pattern_from_mask_mod(generate_sliding_window(256, causal=False), 256, block_size=32)
    plan = baseline_plan("ring", pat, _shape(), Mesh(nodes=1, devices=4))
    prog = build_program(plan, 1)
    # K/V of chunk 0 travel 0 -> 1 -> 2 -> 3: three hops, at levels 0, 1, 2
    levels = {(t.src, t.dst): n for n, lv in enumerate(prog.inputs["fwd"]) for _, t in lv if t.chunk == 0}
    assert levels == {(0, 1): 0, (1, 2): 1, (2, 3): 2}
    # dK/dV of chunk 0 return along the chain and end at the owner: one level per hop
    dkv = {(t.src, t.dst): n for n, lv in enumerate(prog.partials["bwd"]) for _, t in lv if t.chunk == 0}
    assert dkv == {(1, 2): 0, (2, 3): 1, (3, 0): 2}


@pytest.mark.parametrize("method", ["ultraattn", "ring", "usp"])
def test_executed_replay_launches_what_the_executor_runs(method):
    """``schedule.executed_order``, the simulator's model of the executor, against the executor's own program and
    ready rule (``build_program``, ``_split_ready``), walked without data: per rank and level the same fused row
    launches, and the same message levels. Its replay keeps the executor's waits: a launch of call c starts after
    every receive of its rank below level c, a relay after its rank's receives and launches below its level, a
    partial after every launch of its rank."""
    from ultraattn.planner.api import evaluate, plan
    from ultraattn.planner.schedule import INPUT_TENSORS, executed_order
    from ultraattn.planner.tiling import PlannerOptions
    from ultraattn.runtime.executor import _split_ready

    s = 512
    pat = pattern_from_mask_mod(generate_sliding_window(160, causal=True), s, block_size=32)
    shape = AttnShape(seq_len=s, num_heads=4, head_dim=16, num_kv_heads=2, dtype="fp32")
    mesh = Mesh(nodes=2, devices=2)
    if method == "ultraattn":
        tp = plan(pat, shape, mesh, options=PlannerOptions(ilp_time_limit=1.0, heuristic_seconds=0.05,
                                                             time_budget=3.0, schedule_ilp=False)).plan
    else:
        tp = baseline_plan(method, pat, shape, mesh)
    order = executed_order(tp, "fwd")
    msgs = tp.transfers_for("fwd")
    index = {id(t): n for n, t in enumerate(msgs)}
    want = sorted((k.rank, c, k.head_group, k.cells) for k, c in zip(order.kernels, order.call))
    got = []
    for r in range(tp.world):
        prog = build_program(tp, r)
        for lv, level in enumerate(prog.inputs["fwd"]):
            assert all(order.level[index[id(t)]] == lv for _, t in level)
        rows = {(c, g): True for c in tp.local_chunks(r) for g in range(tp.num_head_groups)}
        cols = dict(rows)
        todo = list(prog.rows)
        for call in range(len(prog.inputs["fwd"]) + 1):
            ready, todo = _split_ready(todo, rows, cols)
            got += [(r, call, g, tuple((i, j) for j in js)) for (g, i), js in ready.items()]
            for _, t in prog.inputs["fwd"][call] if call < len(prog.inputs["fwd"]) else ():
                if t.dst == r:
                    (rows if t.tensor == "q" else cols)[(t.chunk, t.head_group)] = True
        assert not todo
    assert sorted(got) == want
    sched = evaluate(tp, pat, backward=False, executed=True).fwd
    sched.check()
    tasks = sched.graph.tasks
    first = len(order.kernels)
    recv_end: dict = {}
    for n, t in enumerate(msgs):
        if t.tensor in INPUT_TENSORS["fwd"]:
            lv = order.level[n]
            recv_end[(t.dst, lv)] = max(recv_end.get((t.dst, lv), 0.0), sched.end[first + n])
    for k, (kern, c) in enumerate(zip(order.kernels, order.call)):
        assert sched.start[k] >= max((recv_end.get((kern.rank, lv), 0.0) for lv in range(c)), default=0.0) - 1e-12
    launch_end = {r: max(sched.end[k] for k, kern in enumerate(order.kernels) if kern.rank == r)
                  for r in {kern.rank for kern in order.kernels}}
    for n, t in enumerate(msgs):
        if t.tensor == "o":
            assert sched.start[first + n] >= launch_end[t.src] - 1e-12
        assert tasks[first + n].kind == t.tensor


def test_program_rejects_a_plan_that_sends_data_its_source_lacks():
    assign = torch.full((1, 2, 2), -1, dtype=torch.int32)
    assign[0, 0, 0] = 0
    assign[0, 1, 1] = 1
    bad = TilePlan(method="bad", mesh=Mesh(nodes=1, devices=2), shape=_shape(), chunk_size=128, num_chunks=2,
                   owner=(0, 1), num_head_groups=1, assign_GPP=assign,
                   kernels=(Kernel(rank=0, head_group=0, cells=((0, 0),)),
                            Kernel(rank=1, head_group=0, cells=((1, 1),))),
                   transfers=(Transfer(tensor="kv", chunk=0, head_group=0, src=1, dst=0, nbytes=1, phase="fwd"),))
    with pytest.raises(PlanExecutionError, match="leaves rank 1, which never holds that unit"):
        build_program(bad, 0)


def test_plan_attention_argument_errors():
    with pytest.raises(ValueError, match="`seqlen` must be a positive int"):
        ultraattn.plan_attention("causal", seqlen=0, num_heads=2, head_dim=16)
    with pytest.raises(ValueError, match="`method` must be one of"):
        ultraattn.plan_attention("causal", seqlen=64, num_heads=2, head_dim=16, method="magic")
    with pytest.raises(ValueError, match="`dtype` must be one of"):
        ultraattn.plan_attention("causal", seqlen=64, num_heads=2, head_dim=16, dtype=torch.int32)
    with pytest.raises(ValueError, match="'causal' or 'full'"):
        ultraattn.plan_attention("diagonal", seqlen=64, num_heads=2, head_dim=16)
    with pytest.raises(ValueError, match="num_kv_heads must divide"):
        ultraattn.plan_attention("causal", seqlen=64, num_heads=4, num_kv_heads=3, head_dim=16)
    pat = pattern_from_mask_mod(generate_sliding_window(20), 64, block_size=16)
    with pytest.raises(ValueError, match="PARTIAL blocks but no `mask_mod`"):
        ultraattn.plan_attention(pat, seqlen=64, num_heads=2, head_dim=16)
    with pytest.raises(ValueError, match="lengths \\(64, 64\\) but seqlen=32"):
        ultraattn.plan_attention(pat, seqlen=32, num_heads=2, head_dim=16)
    with pytest.raises(TypeError, match="ultraattn: `score_mod` must be a FlexAttention score_mod .* got 3.0"):
        ultraattn.plan_attention("causal", seqlen=64, num_heads=2, head_dim=16, score_mod=3.0)


def test_world_size_without_process_group_is_an_error(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(RuntimeError, match="WORLD_SIZE=4 but torch.distributed is not initialised"):
        ultraattn.plan_attention("causal", seqlen=64, num_heads=2, head_dim=16)
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(RuntimeError, match="`mesh`/`group` given but torch.distributed is not initialised"):
        ultraattn.plan_attention("causal", seqlen=64, num_heads=2, head_dim=16, group=object())


def test_dispatch_undispatch_roundtrip_and_errors():
    plan = ultraattn.plan_attention("causal", seqlen=100, num_heads=2, head_dim=8, dtype=torch.float32,
                                    block_size=16)
    x = torch.randn(1, 2, 100, 8)
    loc = ultraattn.dispatch(x, plan)
    assert loc.shape[2] == plan.local_len >= 100
    assert torch.equal(ultraattn.undispatch(loc, plan), x)
    with pytest.raises(ValueError, match="has 99 tokens on seq_dim=2 but the plan is for seqlen=100"):
        ultraattn.dispatch(x[:, :, :99], plan)
    with pytest.raises(ValueError, match="seq_dim`=5 is out of range"):
        ultraattn.dispatch(x, plan, seq_dim=5)
    with pytest.raises(ValueError, match="did you pass a global tensor"):
        ultraattn.undispatch(x, plan)
    with pytest.raises(TypeError, match="`plan` must be an AttentionPlan"):
        ultraattn.dispatch(x, "causal")
    q = torch.randn(1, 2, plan.local_len, 8)
    with pytest.raises(ValueError, match="dtype torch.float16 but the plan was made for torch.float32"):
        ultraattn.dist_attention(q.half(), q, q, plan)
    with pytest.raises(ValueError, match="`k_local` has shape"):
        ultraattn.dist_attention(q, q[:, :1, :5], q, plan)
