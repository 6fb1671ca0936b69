"""Sequence sharding (``ultraattn/passes/shard/``): the whole graph on local tokens, exact against one process.

Numerics: tests/numerics.py (the loss and every parameter gradient of the compiled model on each rank
against the fp64 eager single-process model by the 2x rule).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from numerics import check_step, fresh_dynamo  # noqa: F401 - fresh_dynamo: an autouse fixture
from shard_models import VOCAB, batch, build, oracle, shard_worker

import ultraattn
from ultraattn.passes import shard as SH
from ultraattn.passes import side_table
from ultraattn.testing import run_ranks

FAST = {"ilp_time_limit": 1.0, "time_budget": 2.0, "timeout": 60.0, "block_size": 32}  # small chunks: little padding

# ----------------------------------------------------------------------------- pure pieces (no ranks)
@pytest.mark.parametrize("src,dst,spec,want", [
    ((2, 96, 32), (2, 96, 4, 8), SH.Seq(1, 96), SH.Seq(1, 96)),            # split the hidden dim
    ((2, 96, 32), (192, 32), SH.Seq(1, 96), SH.Seq(0, 96)),                # [batch * seq]: outer 2
    ((2, 96, 32), (2, 3072), SH.Seq(1, 96), SH.Seq(1, 96, 32)),            # [seq * hidden]: inner 32
    ((2, 96, 32), (6144,), SH.Seq(1, 96), SH.Seq(0, 96, 32)),
    ((2, 96, 32), (2, 48, 64), SH.Seq(1, 96), None),                       # splits the sequence
    ((192, 32), (2, 96, 32), SH.Seq(0, 96), SH.Seq(1, 96)),
    ((2, 1, 96, 1, 8), (2, 96, 8), SH.Seq(2, 96), SH.Seq(1, 96)),          # size-1 dims
])
def test_reshapes_follow_the_sequence_through_merged_dims(src, dst, spec, want):
    assert SH.band(src, dst, spec) == want
    if want is not None:
        assert SH.band(dst, src, want) == spec


@pytest.mark.parametrize("length,outer,inner", [(96, 1, 1), (77, 2, 1), (96, 3, 5), (50, 2, 4)])
def test_shard_and_gather_round_trip(length, outer, inner):
    """Every rank's shard of a [.., outer * length * inner, ..] tensor, reassembled, is the tensor; the tail
    padding repeats the last position (finite wherever the data is)."""
    from ultraattn.planner.plan import TokenSharding
    from ultraattn.runtime.sequence import SequenceShards

    lay = TokenSharding(chunk_size=32, owner=(0, 1, 2, 1, 0, 2))  # 3 ranks, 192 padded positions
    x = torch.randn(4, outer * length * inner, 3)
    shards = [SequenceShards(lay, rank=r, global_ranks=(0, 1, 2)).shard(x, 1, length, inner) for r in range(3)]
    assert all(s.shape == (4, outer * lay.local_len * inner, 3) for s in shards)
    # reassemble by hand from the layout (gather's own collective is exercised across ranks below)
    full = torch.empty(4, outer, lay.padded_len, inner, 3)
    for r, s in enumerate(shards):
        pos = torch.tensor(lay.local_positions(r))
        full[:, :, pos] = s.view(4, outer, lay.local_len, inner, 3)
    assert torch.equal(full[:, :, :length].reshape(x.shape), x)
    tail = full[:, :, length:]
    assert torch.equal(tail, full[:, :, length - 1:length].expand_as(tail))
    valid = SequenceShards(lay, rank=1, global_ranks=(0, 1, 2)).valid(length)
    assert valid.tolist() == [p < length for p in lay.local_positions(1)]


def _analysis(model, *args):
    """The pass's analysis of ``model``'s graph, planned as for 2 ranks (no process group needed)."""
    from ultraattn.passes import find_sites, parse_options, side_table
    from ultraattn.passes.fx_util import placeholders, refresh_fake_values
    from ultraattn.passes.rewrite import rewrite_sites

    out = {}

    def backend(gm, example_inputs):
        opts = parse_options({"world_size": 2}, require_group=False)
        rewrite_sites(gm, find_sites(gm, 2), opts, graph_index=0, table=side_table())
        refresh_fake_values(gm, placeholders(gm), example_inputs)
        out["gm"], out["an"] = gm, SH.analyse(gm)
        return gm.forward

    torch.compile(model, backend=backend)(*args)
    return out["gm"], out["an"]


@pytest.mark.parametrize("style", ["llama", "gpt2", "hf", "titan"])
def test_the_common_vocabulary_runs_on_local_tokens(style):
    """Every op that carries the sequence is in the region; what stays replicated is what must (factories,
    the S x S mask, the shifted labels), never an activation."""
    data = batch(style, 96)
    gm, an = _analysis(build(style), *(data[:3] if style == "hf" else data))  # (hf: the loss is outside)
    assert len(an.sites) == 2 and not an.skipped_sites
    outside = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method") and n not in an.mode]
    for n in outside:  # nothing outside is computed from sharded values (no gather needed)
        assert not any(m in an.mode for m in n.all_input_nodes), (n.format_node(), [m.name for m in n.all_input_nodes])
    kinds = {SH.opname(n) for n in an.mode}
    assert {"linear", "ultraattn_site", "cross_entropy" if style != "hf" else "linear"} <= kinds


def test_an_op_along_the_sequence_stays_outside():
    gm, an = _analysis(build("unknown"), *batch("unknown", 96))
    cums = [n for n in gm.graph.nodes if SH.opname(n) == "cumsum"]
    assert len(cums) == 1 and cums[0] not in an.mode
    assert isinstance(an.specs.get(cums[0]), SH.Seq)  # aligned, but not token-wise along it


# ----------------------------------------------------------------------------- across ranks
@pytest.mark.parametrize("world,style", [(2, "llama"), (2, "gpt2"), (2, "hf"), (2, "pool"), (2, "titan"), (4, "llama"),
                                         (4, "gpt2"), (4, "hf")])
def test_model_styles_match_one_process(style, world):
    """At 4 ranks the graphs run under aot_eager: the same sharded graph and explicit per-rank programs as under
    Inductor (which the 2-rank runs and test_backend's 4-rank runs compile), at a third of the compile time."""
    seqlen = 120  # not a multiple of the block: the layout pads the tail
    opts = dict(FAST, compiler="aot_eager") if world == 4 else FAST
    res = run_ranks(shard_worker, world, args=(style, seqlen, opts), timeout=900)
    ref64, ref32 = oracle(style, seqlen)
    for r, got in enumerate(res):
        assert not check_step(got, ref64, ref32), (r, check_step(got, ref64, ref32))
        (rec,) = got["records"]
        sh = rec["shard"]
        assert sh is not None and sh["sharded_ops"] > 20 and sh["fallbacks"] == [], sh
        assert sh["entered"] > 0 and not sh["skipped_sites"]
        assert "site_attention_local" in rec["code"] and "site_attention.default" not in rec["code"]
        # the loss inside forward: one all-reduce (pool: the mean over tokens; its loss is per sequence)
        assert sh["reductions"] == (0 if style == "hf" else 1)


def test_checkpointed_layers_are_sharded_and_still_recomputed():
    """torch.utils.checkpoint around each layer (HF's gradient_checkpointing): the regions are inlined into the
    sharded graph, and the backward still recomputes them (the attention tiles' forward runs again there)."""
    res = run_ranks(shard_worker, 2, args=("llama_ckpt", 120, FAST), timeout=900)
    ref64, ref32 = oracle("llama", 120)
    for r, got in enumerate(res):
        assert not check_step(got, ref64, ref32), (r, check_step(got, ref64, ref32))
        (rec,) = got["records"]
        sh = rec["shard"]
        assert sh["inlined_checkpoints"] == 2 and sh["fallbacks"] == [] and sh["sharded_ops"] > 20, sh
        assert "tag_activation_checkpoint" not in rec["code"]
        fwd, bwd = rec["aot"]["forward"], rec["aot"]["backward"]
        assert fwd.count("cp_tiles_fwd.default(") == bwd.count("cp_tiles_fwd.default(") > 0  # recomputed, every tile


def test_an_unknown_op_falls_back_and_is_reported(tmp_path):
    path = tmp_path / "report.json"
    res = run_ranks(shard_worker, 2, args=("unknown", 96, dict(FAST, report_file=str(path))), timeout=900)
    ref64, ref32 = oracle("unknown", 96)
    for r, got in enumerate(res):
        assert not check_step(got, ref64, ref32), (r, check_step(got, ref64, ref32))
        (fb,) = got["records"][0]["shard"]["fallbacks"]
        assert fb["op"] == "cumsum" and "not token-wise" in fb["why"] and fb["bytes"] == 2 * 96 * 32 * 4
    out = subprocess.run([sys.executable, "-m", "ultraattn.cli", "report", str(path)], capture_output=True,
                         text=True, timeout=120, env=dict(os.environ, COLUMNS="200"))
    assert out.returncode == 0, out.stderr
    assert "sequence sharding" in out.stdout and "gathered fallbacks 1" in out.stdout
    assert "ops run on gathered data" in out.stdout and "cumsum" in out.stdout and "24,576" in out.stdout


def test_explain_shows_what_would_be_sharded():
    import io

    from rich.console import Console

    import ultraattn

    buf = io.StringIO()
    res = ultraattn.explain(build("unknown"), *batch("unknown", 256), world_size=4, options=FAST,
                            console=Console(file=buf, width=200))
    info = res.sharding[0]
    assert info.sharded_ops > 50 and [f.op for f in info.fallbacks] == ["cumsum"]
    assert "sequence sharding would run" in buf.getvalue() and "1 ops on gathered data: cumsum" in buf.getvalue()


def _break_worker(rank: int, world: int) -> dict:
    model = build("llama")
    ids, labels = batch("llama", 96)

    def run(ids, labels):
        h = model.embed_tokens(ids)
        h = model.layers[0](h)
        torch._dynamo.graph_break()
        h = model.layers[1](h)
        logits = model.lm_head(model.norm(h)).float()
        return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1))

    model.zero_grad(set_to_none=True)
    loss = torch.compile(run, backend="ultraattn", options=FAST)(ids, labels)
    loss.backward()
    return {"loss": loss.detach().double(), "grads": {n: p.grad.double() for n, p in model.named_parameters()},
            "shards": [r.shard.to_json() for r in side_table().graphs]}


def test_a_graph_break_between_two_sharded_regions():
    res = run_ranks(_break_worker, 2, timeout=900)
    ref = []
    for dt in (torch.float64, torch.float32):
        m = build("llama", dt)
        m.zero_grad(set_to_none=True)
        ids, labels = batch("llama", 96)
        logits = m.lm_head(m.norm(m.layers[1](m.layers[0](m.embed_tokens(ids))))).float()
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1))
        loss.backward()
        ref.append({"loss": loss.detach().double(), "grads": {n: p.grad.double() for n, p in m.named_parameters()}})
    for got in res:
        assert not check_step(got, *ref), check_step(got, *ref)
        assert len(got["shards"]) == 2 and all(s["sharded_ops"] > 10 and not s["fallbacks"] for s in got["shards"])


def _sharded_outputs_worker(rank: int, world: int) -> dict:
    import numpy as np

    import ultraattn

    model = build("hf")
    ids, mask, pos, labels = batch("hf", 96)
    cm = torch.compile(model, backend="ultraattn", options=FAST)  # outputs="sharded": the default
    logits = cm(ids, mask, pos)
    full = ultraattn.undispatch(logits)
    loss = F.cross_entropy(full[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1), ignore_index=-100)
    loss.backward()
    out = {"type": type(logits).__name__, "shape": tuple(logits.shape), "local_shape": tuple(logits._local.shape),
           "full": full.detach(), "loss": loss.detach().double(),
           "grads": {n: p.grad.double() for n, p in model.named_parameters()},
           "local_len": side_table().graphs[-1].shard.local_len}
    x = logits.detach()
    out["eager"] = {  # eager code on the shard: the global value, exactly
        "cumsum": torch.cumsum(x, 1), "prefix": x[:, :-1] * 2, "sum": (x + x).sum(),
        "tolist": torch.tensor(x.tolist()), "numpy": torch.from_numpy(np.asarray(x.numpy()))}
    out["pair_type"] = type(x + x.detach()).__name__  # two shards of one layout: stays a shard

    def attend(x):  # [2, 1, tokens, vocab] as q, k, v: attention over the logits
        q = x[:, None]
        return F.scaled_dot_product_attention(q, q, q, is_causal=True).sum()

    def mean_of(x):  # no attention: the mean over the whole sequence
        return x.float().mean()

    table = torch.arange(96.0)[None, :, None]

    def add_positions(x):  # a table sized for the whole sequence
        return (x + table).sum(1)

    for name, fn in (("attend", attend), ("mean", mean_of), ("positions", add_positions)):
        out[name] = torch.compile(fn, backend="ultraattn", options=dict(FAST, compiler="aot_eager"))(x).detach()
        out[name] = ultraattn.undispatch(out[name]) if type(out[name]).__name__ == "SeqShard" else out[name]
    try:
        x.add_(torch.ones_like(full))
        out["inplace"] = "no error"
    except RuntimeError as exc:
        out["inplace"] = str(exc)
    return out


def test_sharded_outputs_and_undispatch():
    """options outputs='sharded' (the default): the logits come back as a SeqShard, the global shape holding this
    rank's tokens; ultraattn.undispatch gathers them (differentiably), giving one process's logits and gradients.
    Eager code and other compiled functions that take the shard get the global value exactly (a graph with
    attention, one without, one with a table sized for the sequence); an in-place write that would be lost on a
    gathered copy is an error naming the fix."""
    res = run_ranks(_sharded_outputs_worker, 2, timeout=900)
    ref64, ref32 = oracle("hf", 96)
    want = build("hf")(*batch("hf", 96)[:3]).detach()
    for got in res:
        assert got["type"] == "SeqShard" and got["shape"] == tuple(want.shape)
        assert got["local_shape"] == (2, got["local_len"], VOCAB) and got["local_len"] < 96
        torch.testing.assert_close(got["full"], want, rtol=1e-5, atol=1e-5)
        assert not check_step(got, ref64, ref32), check_step(got, ref64, ref32)
        e = got["eager"]
        for name, ref in (("cumsum", torch.cumsum(want, 1)), ("prefix", want[:, :-1] * 2), ("sum", (want + want).sum()),
                          ("tolist", want), ("numpy", want)):
            torch.testing.assert_close(e[name], ref, rtol=1e-5, atol=1e-4, msg=name)
        assert got["pair_type"] == "SeqShard"
        q = want[:, None]
        torch.testing.assert_close(got["attend"], F.scaled_dot_product_attention(q, q, q, is_causal=True).sum(),
                                   rtol=1e-5, atol=1e-3)
        torch.testing.assert_close(got["mean"], want.mean(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got["positions"], (want + torch.arange(96.0)[None, :, None]).sum(1),
                                   rtol=1e-5, atol=1e-3)
        assert "ultraattn" in got["inplace"] and "undispatch" in got["inplace"] and "x = x + y" in got["inplace"]


# ----------------------------------------------------------------------------- must not fire
def test_shard_false_keeps_activations_replicated():
    res = run_ranks(shard_worker, 2, args=("llama", 96, dict(FAST, shard=False, compiler="aot_eager")), timeout=900)
    ref64, ref32 = oracle("llama", 96)
    for got in res:
        assert not check_step(got, ref64, ref32)
        (rec,) = got["records"]
        assert rec["shard"] is None and "sp_dispatch" not in rec["code"] and "site_attention.default" in rec["code"]


def test_world1_does_not_shard():
    got = shard_worker(0, 1, "gpt2", 96, FAST)
    assert got["records"][0]["shard"] is None and "sp_dispatch" not in got["records"][0]["code"]
    ref64, ref32 = oracle("gpt2", 96)
    assert not check_step(got, ref64, ref32)


def test_options_are_checked():
    with pytest.raises(ultraattn.BackendError, match=r"options\['outputs'\]='local': expected one of global, sharded"):
        torch.compile(lambda q: q * 2, backend="ultraattn", options={"outputs": "local"})(torch.randn(2))
    torch._dynamo.reset()
    with pytest.raises(ultraattn.BackendError, match=r"options\['shard'\]='yes': expected True or False"):
        torch.compile(lambda q: q * 2, backend="ultraattn", options={"shard": "yes"})(torch.randn(2))


def test_undispatch_needs_a_shard_or_a_plan():
    import ultraattn

    with pytest.raises(TypeError, match="not a shard an ultraattn graph returned"):
        ultraattn.undispatch(torch.randn(2, 8))
