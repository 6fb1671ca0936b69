"""Regional compilation: a model compiled block by block keeps the sequence sharded from block to block.

Each block is compiled on its own (``ultraattn.compile_blocks(model.layers)``, as torchtitan's ``apply_compile``
does); the model's own eager code runs around the blocks. The first block meets the global sequence and slices it,
every block returns this rank's tokens as a ``SeqShard`` (``ultraattn/passes/carrier.py``) and the next takes them
as they are. Checked here, on every rank, against the single process by the numerics policy (tests/numerics.py):
the loss and every parameter gradient; and, counted by wrapping ``torch.distributed``, that no all-gather happens
between blocks: one of the last block's output (the eager norm and head need the global value) and one of the
first block's input gradient (the eager embedding's backward), whatever the number of blocks.
"""

from __future__ import annotations

import pytest
import torch
from numerics import check_step, fresh_dynamo  # noqa: F401 - fresh_dynamo: an autouse fixture
from shard_models import batch, build, forward, oracle

from ultraattn.passes import side_table
from ultraattn.testing import CommSpy, run_ranks

FAST = {"ilp_time_limit": 1.0, "time_budget": 2.0, "timeout": 60.0, "block_size": 32}
LIGHT = dict(FAST, compiler="aot_eager")
"""For the cases that repeat one under Inductor (the default compiler): the regions and their shards are the
backend's, whichever compiler runs the graphs; Inductor's CPU code generation is what costs the suite time."""


GATHERS = ("all_gather_into_tensor", "all_gather_single", "all_gather", "_all_gather_base")
"""Every all-gather ``torch.distributed`` has (``CommSpy.count`` tallies their calls and buffer bytes)."""


# ----------------------------------------------------------------------------- the carrier, in one process
def _one_rank_shard(x: torch.Tensor, length: int, requires_grad: bool = False):
    """A SeqShard of ``x`` (sequence on dim 1) in a one-rank layout of four 16-token chunks (the tail padded):
    (the shard, its local leaf, the layout)."""
    from ultraattn.passes.carrier import Carried, SeqShard
    from ultraattn.planner.plan import TokenSharding
    from ultraattn.runtime.sequence import SequenceShards

    seq = SequenceShards(TokenSharding(chunk_size=16, owner=(0, 0, 0, 0)), rank=0, global_ranks=(0,))
    side_table().add_layout("test-layout", seq)
    local = seq.shard(x, 1, length).detach().requires_grad_(requires_grad)
    return SeqShard.from_local(local, Carried("test-layout", 1, length)), local, seq


def test_eager_ops_on_a_shard_see_the_global_value():
    """Any op on a SeqShard runs on its exact global value (order restored, padding dropped), autograd included:
    the gradient reaching the local tensor is this rank's slice of the global one, zeros at the padding. Two shards
    added stay a shard; an in-place op that would write a gathered copy is an error naming the fix."""
    from ultraattn.passes.carrier import SeqShard

    x = torch.randn(2, 50, 3)
    s, local, seq = _one_rank_shard(x, 50, requires_grad=True)
    assert s.shape == x.shape and local.shape == (2, 64, 3)
    torch.testing.assert_close(s.cumsum(1), x.cumsum(1))
    torch.testing.assert_close(s[:, :-1] * 2, x[:, :-1] * 2)
    assert torch.tensor(s.detach().tolist()).equal(x)
    w = torch.randn(2, 50, 3)
    (s.cumsum(1) * w).sum().backward()
    want = w.flip(1).cumsum(1).flip(1)  # d/dx of sum(cumsum(x) * w)
    torch.testing.assert_close(local.grad, seq.shard(want, 1, 50, zero_pad=True))
    pad = ~seq.valid(50)
    assert pad.sum() == 14 and local.grad[:, pad].abs().max() == 0  # padding: no output, zero gradient
    pair = s.detach() + s.detach().detach()
    assert isinstance(pair, SeqShard)
    torch.testing.assert_close(pair.full_tensor(), 2 * x)
    with pytest.raises(RuntimeError, match=r"ultraattn: the in-place op .*x = x \+ y.*ultraattn.undispatch"):
        s.detach().index_add_(1, torch.tensor([0]), torch.ones(2, 1, 3))


def test_compile_blocks_checks_its_argument():
    import ultraattn

    with pytest.raises(TypeError, match=r"compile_blocks: `blocks` is one Linear; pass the container"):
        ultraattn.compile_blocks(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match=r"`blocks` holds int, not a module"):
        ultraattn.compile_blocks([1, 2])
    with pytest.raises(TypeError, match=r"`blocks` must be an nn.ModuleDict, nn.ModuleList or an iterable"):
        ultraattn.compile_blocks(3)
    with pytest.raises(TypeError, match=r"`backend` is always 'ultraattn'"):
        ultraattn.compile_blocks(torch.nn.ModuleList([torch.nn.Linear(2, 2)]), backend="inductor")


def records(since: int = 0) -> list[dict]:
    """The sharding records of the graphs compiled since the ``since``-th."""
    return [{"sharded_ops": g.shard.sharded_ops, "replicated_ops": g.shard.replicated_ops,
             "carried": g.shard.carried, "outputs": g.shard.outputs, "fallbacks": g.shard.fallbacks,
             "layout": g.shard.layout} if g.shard else None for g in side_table().graphs[since:]]


def _fresh() -> int:
    """Before the next case of a worker: Dynamo's graphs go, ultraattn's process state stays (the cases share one
    process, as a sweep would); the number of graphs compiled so far."""
    torch._dynamo.reset()
    return len(side_table().graphs)


SEQLEN = 96


def _two_ranks_worker(rank: int, world: int) -> dict:
    """Every two-rank case of this file in one spawn: the project's model, then transformers' Llama."""
    return {"blocks": _blocks_run(SEQLEN, FAST), "hf": _hf_run()}


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return run_ranks(_two_ranks_worker, 2, timeout=1800)


def _blocks_run(seqlen: int, options: dict) -> dict:
    import ultraattn
    from ultraattn.report.compile_report import shard_summary

    ultraattn.reset()
    model = build("llama")
    data = batch("llama", seqlen)
    assert ultraattn.compile_blocks(model.layers, options=options) == 2
    model.zero_grad(set_to_none=True)
    with CommSpy() as spy:
        loss = forward("llama", model, data)  # the model's own forward: eager embedding, norm, head and loss
        loss.backward()
    gathers, gathered = spy.count(*GATHERS)
    out = {"loss": loss.detach().double(), "grads": {n: p.grad.double() for n, p in model.named_parameters()},
           "gathers": gathers, "gathered": gathered, "graphs": records(),
           "local_len": side_table().graphs[0].shard.local_len,
           "report": [shard_summary(g).plain for g in side_table().graphs]}
    # a second step, the same graphs: nothing recompiles, and the gradients are the same
    model.zero_grad(set_to_none=True)
    forward("llama", model, data).backward()
    out["again"] = {n: p.grad.double() for n, p in model.named_parameters()}
    out["graphs_after"] = len(side_table().graphs)
    return out


def test_blocks_hand_shards_to_each_other(two_ranks):
    """The project's Llama-style model, its 2 blocks compiled one by one (Inductor), 2 ranks: exact on every rank;
    the second block's graph takes its input as it arrives (carried), both return a shard, nothing of a block runs
    on gathered data; two all-gathers per step in all (the eager head's input, the eager embedding's gradient),
    each of one [batch, seq, hidden] tensor."""
    seqlen, world = SEQLEN, 2
    ref64, ref32 = oracle("llama", seqlen)
    for got in (r["blocks"] for r in two_ranks):
        assert not check_step(got, ref64, ref32), check_step(got, ref64, ref32)
        for n, g in got["again"].items():
            torch.testing.assert_close(g, got["grads"][n], rtol=0, atol=0)
        first, second = got["graphs"]
        assert got["graphs_after"] == 2  # the second step reuses both graphs
        assert first["carried"] == () and len(second["carried"]) == 1, got["graphs"]
        for g in (first, second):
            assert g["sharded_ops"] > 40 and not g["fallbacks"], g
            assert g["outputs"] == ((1, seqlen, 1),)  # the block's output leaves as a shard
            assert g["layout"].startswith(first["layout"].split(" (")[0])  # one layout for the run
        first_report, second_report = got["report"]  # what the report says of each block's graph
        assert "inputs arriving as shards (no communication) 1" in second_report, second_report
        assert all("outputs returned as shards 1" in r and "gathered fallbacks 0" in r for r in got["report"])
        hidden = 2 * world * got["local_len"] * 32 * 4  # [batch 2, world * local tokens, hidden 32] fp32
        assert got["gathers"] == 2 and got["gathered"] == 2 * hidden, (got["gathers"], got["gathered"])


# ----------------------------------------------------------------------------- torchtitan's Llama 3
def _titan_args(attn: str):
    from types import SimpleNamespace

    return SimpleNamespace(attn=attn, seqlen=256, batch=1, layers=2, dim=128, heads=8, kv_heads=4, vocab=2048,
                           seed=0)


def _titan_example():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    import torchtitan_cp

    return torchtitan_cp


def _titan_step(ex, model, args, loss_fn=None) -> dict:
    model.zero_grad(set_to_none=True)
    with CommSpy() as spy:
        loss = ex.loss_of(model, ex.make_batch(args, model), loss_fn or ex.cross_entropy)
        loss.backward()
    gathers, gathered = spy.count(*GATHERS)
    return {"loss": loss.detach().double(), "gathers": gathers, "gathered": gathered,
            "grads": {n.removeprefix("_orig_mod."): p.grad.detach().double().clone()
                      for n, p in model.named_parameters()}}


def _titan_worker(rank: int, world: int, attns: tuple[str, ...], whole: bool, options: dict) -> dict:

    ex = _titan_example()
    out = {}
    for attn in attns:
        args = _titan_args(attn)
        since = _fresh()
        model = ex.build(args)
        ex.compile_like_torchtitan(model, LIGHT, head=False)  # (the loss it returns is not used: eager)
        out[attn] = _titan_step(ex, model, args)
        out[attn]["graphs"] = records(since)
        since = _fresh()
        model = ex.build(args)
        loss_fn = ex.compile_like_torchtitan(model, options)  # blocks, norm, output projection and loss: regions
        out[attn]["regions"] = _titan_step(ex, model, args, loss_fn)
        out[attn]["regions"]["graphs"] = records(since)
        if whole:
            _fresh()
            model = ex.build(args)
            compiled = torch.compile(model, backend="ultraattn", options=dict(LIGHT, report="off"))
            out[attn]["whole"] = _titan_step(ex, compiled, args)
    return out


def _titan_reference(rank: int, world: int, attns: tuple[str, ...]) -> dict:
    ex = _titan_example()
    ex.eager_reference_mode()
    out = {}
    for attn in attns:
        args = _titan_args(attn)
        out[attn] = [_titan_step(ex, ex.build(args, dt), args) for dt in (torch.float64, torch.float32)]
    return out


TITAN_ATTNS = ("flex", "sdpa")


@pytest.fixture(scope="module")
def titan_reference() -> dict:
    """The eager single process, fp64 and fp32, per attention kind (one spawn for both rank counts)."""
    pytest.importorskip("torchtitan", reason="torchtitan is an optional dependency (pip install --no-deps "
                                             "torchtitan==0.3.0 spmd_types==0.2.3 tyro einops)")
    (ref,) = run_ranks(_titan_reference, 0, args=(TITAN_ATTNS,), timeout=900)
    return ref


@pytest.mark.parametrize("world", [2, 4])
def test_torchtitan_llama_compiled_block_by_block(world, titan_reference):
    """torchtitan 0.3.0's Llama 3 (its debug model, smaller), each TransformerBlock compiled on its own as its
    apply_compile does, with flex document masks (its own mask builder) and with causal SDPA: the loss and every
    gradient match the eager single process on every rank; no all-gather between blocks (two per step in all; at 2
    ranks checked against the whole-model compile too: no more bytes than it gathers, the logits); every block's
    norm, projections, RoPE and MLP run on local tokens (its graph has no op on gathered data and takes the previous
    block's shard as is). Then with the final norm, output projection and loss as regions too: one all-gather."""
    res = run_ranks(_titan_worker, world, args=(TITAN_ATTNS, world == 2, FAST if world == 2 else LIGHT),
                    timeout=1800)
    for attn in TITAN_ATTNS:
        ref64, ref32 = titan_reference[attn]
        for got in (r[attn] for r in res):
            assert not check_step(got, ref64, ref32), (attn, check_step(got, ref64, ref32))
            if world == 2:  # the whole-model compile, for its all-gathered bytes (it gathers the logits)
                whole = got["whole"]
                assert not check_step(whole, ref64, ref32), (attn, "whole", check_step(whole, ref64, ref32))
                assert got["gathered"] <= whole["gathered"], (attn, got["gathered"], whole["gathered"])
            assert got["gathers"] == 2, (attn, got["gathers"])  # the eager head's input, the embedding's gradient
            first, second = got["graphs"][:2]
            assert first["carried"] == () and len(second["carried"]) == 1, got["graphs"]
            for g in (first, second):
                assert g["sharded_ops"] > 30 and not g["fallbacks"], (attn, g)
                assert len(g["outputs"]) == 1 and g["outputs"][0] is not None, (attn, g)
            # with the head and the loss as regions: the logits never exist whole; one all-gather in all (the
            # eager embedding's gradient), and every region after the first block takes its input as it arrives
            reg = got["regions"]
            assert not check_step(reg, ref64, ref32), (attn, "regions", check_step(reg, ref64, ref32))
            assert reg["gathers"] == 1, (attn, reg["gathers"])
            first, rest, norm, head, loss = reg["graphs"]
            assert first["carried"] == () and not first["fallbacks"], reg["graphs"]
            assert all(len(g["carried"]) == 1 and not g["fallbacks"] for g in (rest, norm, head, loss)), reg["graphs"]
            assert loss["outputs"] == (None,)  # the loss: a sum over ranks, replicated


# ----------------------------------------------------------------------------- transformers' Llama
HF_CASES = [("flex_attention", 256, True, FAST), ("sdpa", 200, True, LIGHT), ("sdpa", 256, False, LIGHT)]


def _hf_run() -> list[dict]:
    from client_cases import hf_data, hf_model, hf_step

    import ultraattn

    out = []
    for impl, S, packed, options in HF_CASES:
        since = _fresh()
        model = hf_model(impl)
        ultraattn.compile_blocks(model.model.layers, options=options)
        ids, pos = hf_data(S, packed)
        with CommSpy() as spy:
            res = hf_step(model, ids, pos, use_cache=False)
        res.update(gathers=spy.count(*GATHERS)[0], graphs=records(since),
                   sites=[(s.name, s.rewritten) for g in side_table().graphs[since:] for s in g.sites])
        out.append(res)
    return out


def test_transformers_llama_decoder_layers_compiled_block_by_block(two_ranks):
    """transformers' LlamaForCausalLM (tiny random config), its decoder layers compiled one by one, flex and SDPA,
    packed documents and plain (use_cache=False: transformers detects packing only then): exact on every rank,
    every site rewritten, the second layer takes the first one's shard, no op of a layer on gathered data, two
    all-gathers per step (the eager final norm's input, the eager embedding's gradient)."""
    from client_cases import hf_reference

    for i, (impl, S, packed, options) in enumerate(HF_CASES):
        ref64, ref32 = hf_reference(S, packed, False)
        for got in (r["hf"][i] for r in two_ranks):
            label = f"{impl} S={S} packed={packed} {options.get('compiler', 'inductor')}"
            assert not check_step(got, ref64, ref32), (label, check_step(got, ref64, ref32))
            assert len(got["sites"]) == 2 and all(ok for _, ok in got["sites"]), (label, got["sites"])
            first, second = got["graphs"]
            assert first["carried"] == () and len(second["carried"]) == 1, (label, got["graphs"])
            assert not first["fallbacks"] and not second["fallbacks"], (label, got["graphs"])
            assert got["gathers"] == 2, (label, got["gathers"])
