"""The ``ultraattn`` torch.compile backend: registration, options, capture, rewrite, numerics across ranks.

Numerics: tests/numerics.py (the 2x rule against the fp64 eager single-device model; flex models'
reference is SDPA with the same dense mask).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from backend_models import Tiny, build, comm_chain_breaks, compiled_worker, inputs, make_masks, oracle, step
from numerics import check_step, fresh_dynamo  # noqa: F401 - fresh_dynamo: an autouse fixture
from torch._dynamo.utils import counters

import ultraattn
from ultraattn.masks.convert import block_table_kinds
from ultraattn.passes import side_table
from ultraattn.testing import free_port, run_ranks

FAST = {"ilp_time_limit": 1.0, "time_budget": 2.0, "timeout": 60.0}


def check_against_oracle(spec: dict, got: dict) -> list[str]:
    return check_step(got, *oracle(spec))


# ----------------------------------------------------------------------------- registration, options
def test_entry_point_finds_the_backend_without_importing_ultraattn():
    code = (
        "import torch, torch.nn.functional as F\n"
        "f = torch.compile(lambda q: F.scaled_dot_product_attention(q, q, q, is_causal=True), backend='ultraattn')\n"
        "q = torch.randn(1, 2, 64, 16)\n"
        "print(float((f(q) - F.scaled_dot_product_attention(q, q, q, is_causal=True)).abs().max()))\n"
        "import sys; print('ultraattn.compiler' in sys.modules)\n"
    )
    env = dict(os.environ, ULTRAATTN_KERNELS="reference")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    err, loaded = out.stdout.split()
    assert float(err) < 1e-5 and loaded == "True"


def test_backend_is_importable_as_a_callable():
    import ultraattn

    f = torch.compile(lambda q: F.scaled_dot_product_attention(q, q, q), backend=ultraattn.backend)
    q = torch.randn(1, 2, 64, 16)
    torch.testing.assert_close(f(q), F.scaled_dot_product_attention(q, q, q), rtol=0, atol=1e-5)
    assert counters["ultraattn"]["rewritten"] == 1


def test_unknown_and_bad_options_are_errors():
    q = torch.randn(1, 2, 64, 16)

    def f(q):
        return F.scaled_dot_product_attention(q, q, q)

    with pytest.raises(ultraattn.BackendError,
                       match=r"unknown ultraattn backend option\(s\) \['colour'\]; valid options: mesh"):
        torch.compile(f, backend="ultraattn", options={"colour": 1})(q)
    torch._dynamo.reset()
    with pytest.raises(ultraattn.BackendError, match=r"\['compilr'\] \(did you mean 'compiler'\?\)"):
        torch.compile(f, backend="ultraattn", options={"compilr": "eager"})(q)
    torch._dynamo.reset()
    with pytest.raises(ultraattn.BackendError,
                       match=r"options\['mesh'\]='3x5': expected a torch.distributed DeviceMesh"):
        torch.compile(f, backend="ultraattn", options={"mesh": "3x5"})(q)
    torch._dynamo.reset()
    with pytest.raises(ultraattn.BackendError, match=r"options\['report'\]='loud'"):
        torch.compile(f, backend="ultraattn", options={"report": "loud"})(q)
    torch._dynamo.reset()
    with pytest.raises(ultraattn.BackendError, match=r"options\['cost'\] has unknown field"):
        torch.compile(f, backend="ultraattn", options={"cost": {"speed": 1}})(q)
    torch._dynamo.reset()
    with pytest.raises(ultraattn.BackendError, match=r"options\['planner'\]='greedy': expected one of auto, fast, ilp"):
        torch.compile(f, backend="ultraattn", options={"planner": "greedy"})(q)
    torch._dynamo.reset()
    with pytest.raises(ultraattn.BackendError, match="needs an initialised process group") as err:
        torch.compile(f, backend="ultraattn", options={"world_size": 2})(q)
    # ultraattn's message first, not Dynamo's "backend='ultraattn' raised: ..." asking for a PyTorch bug report
    assert not isinstance(err.value, torch._dynamo.exc.BackendCompilerFailed)
    assert str(err.value).startswith("ultraattn: options['world_size']=2 needs an initialised process group")
    assert isinstance(err.value.inner, ValueError)


def test_a_compile_says_what_each_phase_does_and_waits_for(capsys, monkeypatch):
    """With a report on, rank 0 prints one line per phase (capture, plan, each Inductor compile) with the seconds since
    the graph arrived; ranks that outnumber the cores are named as the reason a compile is slow. Report off: quiet."""
    from ultraattn.passes.backend import crowded_cores

    def f(q):
        return F.scaled_dot_product_attention(q, q, q, is_causal=True).sum()

    q = torch.randn(1, 2, 128, 16, requires_grad=True)
    torch.compile(f, backend="ultraattn", options={"report": "summary"})(q).backward()
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("ultraattn [")]
    phases = ["graph 0: captured 1 attention sites, 1 rewritten", "graph 0: planning sdpa#0 for 1 rank",
              "graph 0: Inductor compiling the forward", "graph 0: Inductor compiled the forward in",
              "graph 0: ready; its backward compiles when it first runs", "graph 0: Inductor compiling the backward",
              "graph 0: Inductor compiled the backward in"]
    assert len(lines) == len(phases) and all(p in ln for p, ln in zip(phases, lines, strict=True)), lines
    seconds = [float(ln.split("[")[1].split("s]")[0]) for ln in lines]
    assert seconds == sorted(seconds), lines
    torch._dynamo.reset()
    torch.compile(f, backend="ultraattn")(q).backward()
    assert "ultraattn [" not in capsys.readouterr().out
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "64")
    assert "64 ranks compile at once on" in crowded_cores(64) and "CPU cores" in crowded_cores(64)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert crowded_cores(64) == ""


def _too_many_ranks(rank: int, world: int) -> str:
    try:
        torch.compile(lambda q: F.scaled_dot_product_attention(q, q, q), backend="ultraattn",
                      options={"world_size": 4})(torch.randn(1, 1, 32, 16))
    except Exception as exc:  # noqa: BLE001 - the message is what the test reads
        return str(exc)
    return "no error"


def test_a_world_size_larger_than_the_group_is_named():
    """``world_size=4`` on 2 ranks: ultraattn's error naming the option and the fix, not DeviceMesh's."""
    for msg in run_ranks(_too_many_ranks, 2, timeout=120):
        assert "options['world_size']=4, but the process group has 2 ranks" in msg, msg


def test_world_size_env_without_a_process_group_is_an_error(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ultraattn.BackendError, match="WORLD_SIZE=4 but torch.distributed is not initialised"):
        torch.compile(lambda q: F.scaled_dot_product_attention(q, q, q), backend="ultraattn")(torch.randn(1, 1, 32, 16))


# ----------------------------------------------------------------------------- capture: must fire / must not
def _compile_once(model, *args, **opts):
    cm = torch.compile(model, backend="ultraattn", options=opts or None)
    return cm(*args)


@pytest.mark.parametrize("attn", ["causal", "flex", "gqa", "bool_mask"])
def test_must_fire(attn):
    S = 128
    if attn == "bool_mask":
        _, dense = make_masks("sliding", S)
        m, mask = Tiny(attn="dense_mask", layers=1), dense
    elif attn == "flex":
        bm, _ = make_masks("document", S, lengths=[40, 88])
        m, mask = Tiny(attn="flex", layers=1), bm
    else:
        m, mask = Tiny(attn="causal", layers=1, kv_heads=1 if attn == "gqa" else 4), None
    _compile_once(m, torch.randint(0, 64, (1, S)), mask)
    rec = side_table().graphs[-1]
    assert counters["ultraattn"]["rewritten"] == 1 and rec.rewritten == 1, [s.why for s in rec.sites]
    assert "torch.ops.ultraattn.site_attention" in rec.code_after
    assert "scaled_dot_product_attention" not in rec.code_after and "flex_attention(" not in rec.code_after
    want = {"causal": sum(range(1, S + 1)) / S**2, "gqa": sum(range(1, S + 1)) / S**2,
            "bool_mask": float(dense.float().mean()) if attn == "bool_mask" else None,
            "flex": 3 / 4}[attn]  # 2 x 2 blocks of 64: doc [40, 88] blocks (0,0), (1,0), (1,1) non-empty
    assert abs(rec.sites[0].density - want) < 1e-9, (rec.sites[0].density, want)


@pytest.mark.parametrize("attn,why", [("float_mask", "additive float mask"), ("dropout", "dropout_p=0.5"),
                                      ("flex_score_mod", "score_mod")])
def test_must_not_fire(attn, why):
    S = 128
    m = Tiny(attn=attn, layers=1)
    tokens = torch.randint(0, 64, (1, S))
    if attn == "float_mask":
        mask = torch.zeros(S, S).masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
    elif attn == "flex_score_mod":
        mask, _ = make_masks("document", S, lengths=[40, 88])
    else:
        mask = None
    # (Inductor's CPU flex template itself fails on this score_mod, ultraattn or not: the graph runs eagerly)
    opts = {"compiler": "eager"} if attn == "flex_score_mod" else {}
    with torch.no_grad():  # flex with a score_mod cannot train on CPU at all: check the forward only
        got = _compile_once(m, tokens, mask, **opts)
        want = m(tokens, mask) if attn != "dropout" else None
    rec = side_table().graphs[-1]
    assert counters["ultraattn"]["rewritten"] == 0 and rec.sites and not rec.sites[0].rewritten
    assert why in rec.sites[0].why, rec.sites[0].why
    assert "ultraattn.site_attention" not in rec.code_after
    if want is not None:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- numerics, world size 1
MODELS = {
    "causal": {"attn": "causal", "seqlen": 160, "batch": 2},
    "gqa": {"attn": "causal", "seqlen": 160, "kv_heads": 2},
    "document": {"attn": "flex", "mask": "document", "lengths": [50, 70, 40], "seqlen": 160},
    "sliding": {"attn": "flex", "mask": "sliding", "window": 40, "seqlen": 192, "kv_heads": 1},
}


@pytest.mark.parametrize("name", list(MODELS))
def test_world1_compiled_matches_eager(name):
    spec = MODELS[name]
    got = compiled_worker(0, 1, spec, FAST)
    assert got["rewritten"] == spec.get("layers", 2)
    assert not check_against_oracle(spec, got)
    assert got["host_scalars"] == []   # tokens and tickets come from ops (backend_models.host_scalars_spliced)


def test_world1_checkpointing_fullgraph():
    spec = dict(MODELS["document"], checkpoint=True, fullgraph=True)
    got = compiled_worker(0, 1, spec, FAST)
    assert got["rewritten"] == 2
    assert not check_against_oracle(spec, got)


def test_new_mask_content_does_not_recompile_and_is_planned_again():
    """A new mask runs without recompiling. Its block lists are keyed by its block table (64-token blocks here):
    [130, 30] has other blocks than [50, 70, 40] and gets its own; [40, 80, 40] has the same blocks with other
    elements and reuses those block lists with its own bit tiles. Every step exact."""
    S = 160
    model = build({"attn": "flex"})
    cm = torch.compile(model, backend="ultraattn")
    tokens = torch.randint(0, 64, (1, S))
    for lengths in ([50, 70, 40], [130, 30], [40, 80, 40], [50, 70, 40]):
        bm, dense = make_masks("document", S, lengths=lengths)
        got = step(cm, tokens, bm)
        ref64, ref32 = (step(build({"attn": "dense_mask"}, dt), tokens, dense) for dt in (torch.float64, torch.float32))
        assert not check_step(got, ref64, ref32), (lengths, check_step(got, ref64, ref32))
    assert counters["ultraattn"]["graphs"] == 1, "a new mask content must not recompile"
    stats = [st.stats() for st in side_table().sites_of(side_table().graphs[-1])]
    assert len(stats) == 2 and all(s.plans == 2 and s.cache_hits == 2 for s in stats), stats


# ----------------------------------------------------------------------------- across ranks
@pytest.mark.parametrize("world,name", [(2, "causal"), (2, "document"), (4, "document")])
def test_ranks_match_single_device(world, name):
    """(causal at 4 ranks: test_explicit_graphs_show_every_stage_forward_and_backward)"""
    spec = MODELS[name]
    res = run_ranks(compiled_worker, world, args=(spec, FAST), timeout=600)
    for r, got in enumerate(res):
        assert got["rewritten"] == 2, r
        # a mask known at compile time: the ILP planner; one met at run time: only the exchange plans of its
        # explicit program, each step (the graph's token layout is head-tail stripes, planned from no mask)
        assert got["planners"] == (["exchange"] if spec["attn"] == "flex" else ["ilp"]), (r, got["planners"])
        problems = check_against_oracle(spec, got)
        assert not problems, f"rank {r}: {problems}"
        assert got["host_scalars"] == [], (r, got["host_scalars"])


@pytest.mark.parametrize("shard", [True, False])
def test_mismatched_inputs_across_ranks_are_named_in_debug_mode(shard):
    """Sharded graphs check each global input where it is sliced; attention-only CP checks each site's q/k/v."""
    from backend_models import mismatch_worker

    msgs = run_ranks(mismatch_worker, 2, args=(shard,), timeout=300)
    want = "rank(s) [1] got a different `tokens` than rank 0" if shard else \
        "rank(s) [1] got different q/k/v or mask than rank 0"
    for m in msgs:
        assert want in m, m


def test_local_world_size_gives_a_two_level_mesh():
    from backend_models import local_world_worker

    spec = {"attn": "causal", "seqlen": 128}
    res = run_ranks(local_world_worker, 4, timeout=600)
    for r, got in enumerate(res):
        assert got["meshes"] == [(2, 2)], got["meshes"]
        assert not check_against_oracle(spec, got), r


def test_graph_break_between_two_attention_regions():
    spec = {"attn": "causal", "seqlen": 128}
    tokens, _, _ = inputs(spec)
    model = build(spec)

    def forward(tokens):
        x = model.emb(tokens)
        x = model.blocks[0](x)
        torch._dynamo.graph_break()
        x = model.blocks[1](x)
        logits = model.head(x)
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())

    loss = torch.compile(forward, backend="ultraattn")(tokens)
    loss.backward()
    got = {"loss": loss.detach().double(), "grads": {n: p.grad.double() for n, p in model.named_parameters()}}
    assert counters["ultraattn"]["graphs"] == 2 and counters["ultraattn"]["rewritten"] == 2
    assert not check_against_oracle(spec, got)


def test_explain_plans_and_prints_without_running(capsys):
    import io

    from rich.console import Console

    import ultraattn

    spec = {"attn": "flex", "mask": "document", "lengths": [300, 500, 224], "seqlen": 1024}
    tokens, bm, _ = inputs(spec)
    model = build(spec)
    buf = io.StringIO()
    res = ultraattn.explain(model, tokens, bm, world_size=4, options=FAST, console=Console(file=buf, width=120))
    text = buf.getvalue()
    assert set(res.plans) == {"graph0/flex#0", "graph0/flex#1"}
    assert len(res.stats) == 2 and all(s.calls == 0 for s in res.stats)  # planned, never run
    assert res.plans["graph0/flex#0"].plan.world == 4
    # the summary: what each site runs as, one line per distinct plan (the two layers share one), no graph code
    assert res.plans["graph0/flex#1"] is res.plans["graph0/flex#0"]
    assert [s.form for s in res.records[0].sites] == ["program, planned per mask"] * 2  # the BlockMask is an input
    assert "graph 0: plans for 4 ranks" in text and "best baseline" in text
    assert "torch.ops.ultraattn.site_attention" not in text and "modeled time against the baselines" not in text
    assert len(text.splitlines()) < 40, text
    buf = io.StringIO()
    ultraattn.explain(model, tokens, bm, world_size=4, options=FAST, console=Console(file=buf, width=120),
                      detail="all")
    text = buf.getvalue()
    assert "torch.ops.ultraattn.site_attention" in text
    assert text.count("modeled time against the baselines") == 1  # the shared plan's full report, once
    with pytest.raises(ValueError, match="ultraattn.explain: detail='everything' is not one of summary, plans, all"):
        ultraattn.explain(model, tokens, bm, world_size=4, detail="everything")
    one = ultraattn.explain(model, tokens, bm, world_size=1, console=Console(file=io.StringIO()))
    assert one.plans["graph0/flex#0"].attended_pairs() == int(inputs(spec)[2].sum()) * 4  # 4 heads, batch 1


def test_explain_reaches_the_graphs_after_a_break():
    import io

    from rich.console import Console

    import ultraattn

    model = build({"attn": "causal"})

    def forward(tokens):
        x = model.blocks[0](model.emb(tokens))
        torch._dynamo.graph_break()
        return model.head(model.blocks[1](x)).sum()

    res = ultraattn.explain(forward, torch.randint(0, 64, (1, 256)), world_size=2, options=FAST,
                            console=Console(file=io.StringIO(), width=120))
    assert len(res.records) == 2 and set(res.plans) == {"graph0/sdpa#0", "graph1/sdpa#0"}
    assert all(p.plan.world == 2 for p in res.plans.values())


def test_report_file_and_cli(tmp_path):
    from ultraattn.cli import main

    path = tmp_path / "report.json"
    spec = {"attn": "causal", "seqlen": 128}
    tokens, _, _ = inputs(spec)
    step(torch.compile(build(spec), backend="ultraattn", options={"report_file": str(path)}), tokens)
    assert path.exists()
    out = subprocess.run([sys.executable, "-m", "ultraattn.cli", "report", str(path)], capture_output=True,
                         text=True, timeout=120, env=dict(os.environ, COLUMNS="200"))
    assert out.returncode == 0, out.stderr
    assert "sdpa#0" in out.stdout and "rewritten (causal)" in out.stdout and "planned in" in out.stdout
    assert "planning per step" in out.stdout and "kernels" in out.stdout, out.stdout
    assert main(["report", str(tmp_path / "missing.json")]) == 2


def test_main_example_runs_and_matches_a_single_process():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, os.path.join(root, "examples", "train_cp.py"), "--nproc", "2", "--steps", "2",
                          "--seqlen", "256", "--layers", "1", "--mask", "document", "--softcap", "20"],
                         capture_output=True, text=True, timeout=600, env=dict(os.environ, COLUMNS="200"))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "(tolerance 0.0001): OK" in out.stdout and "per rank: 1/1, 1/1" in out.stdout, out.stdout[-2000:]
    # its flex site (soft-capped: a score_mod) is an explicit program whose masks are planned inside the step (the
    # "plan ms" column): the first step's; the second mask (new lengths) is planned again only if its block table
    # differs (at 256 tokens in 128-token blocks both masks may have the same blocks: then its plan is reused)
    assert " program, planned per mask " in out.stdout, out.stdout[-3000:]
    steps = [ln for ln in out.stdout.splitlines() if ln.split()[:1] in (["1"], ["2"])]
    assert len(steps) == 2 and float(steps[0].split()[6]) > 0, steps
    tables = []
    for ln in steps:  # the step's document lengths, its last column
        bm, _ = make_masks("document", 256, json.loads(ln[ln.index("["):]), block=128)
        tables.append(block_table_kinds(bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices,
                                        2, 2))
    assert (float(steps[1].split()[6]) > 0) == (not torch.equal(*tables)), steps


def test_the_readme_quickstart_runs_on_two_ranks_and_matches_one_process():
    """README's quickstart, as a user runs it (torchrun, 2 gloo ranks): the losses it prints are one eager process's."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.path.join(root, "examples", "quickstart.py")
    readme = open(os.path.join(root, "README.md")).read()
    assert "examples/quickstart.py" in readme and "torchrun --nproc-per-node 2 examples/quickstart.py" in readme
    spec = importlib.util.spec_from_file_location("quickstart", path)
    qs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(qs)

    def eager_losses(dtype) -> list[float]:
        torch.manual_seed(0)
        model = qs.Model().to(dtype)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses = []
        for i in range(3):
            loss = model(qs.batch(i, "cpu"))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    ref64, ref32 = eager_losses(torch.float64), eager_losses(torch.float32)
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                          str(free_port()), path], capture_output=True, text=True, timeout=600, cwd=root)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    got = [float(ln.split("loss ")[1]) for ln in out.stdout.splitlines() if ln.startswith("step ")]
    assert len(got) == 3, out.stdout
    for g, l64, l32 in zip(got, ref64, ref32, strict=True):  # the 2x rule (docs/numerics.md), + the print's rounding
        assert abs(g - l64) <= 2 * abs(l32 - l64) + 16 * torch.finfo(torch.float32).eps * abs(l64) + 5e-7, \
            (got, ref64, ref32)


def test_flex_cpu_backward_shim_is_narrow():
    """Loading the backend lets Dynamo trace CPU flex training, but eager flex backward on CPU is still refused."""
    from torch.nn.attention.flex_attention import flex_attention

    import ultraattn.compiler as C

    assert C.SHIM_INSTALLED or getattr(torch.nn.attention.flex_attention._validate_device, "_ultraattn_shim", False)
    q = torch.randn(1, 2, 128, 16, requires_grad=True)
    with pytest.raises(NotImplementedError, match="does not support backward on CPU"):
        flex_attention(q, q, q)


def test_guards_are_dynamos_own_and_masks_do_not_add_cache_entries():
    """Two document masks, one cache entry; ultraattn adds no guards beyond what the eager backend has."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    tokens = torch.randint(0, 64, (1, 160))
    lines = {}
    for be in ("ultraattn", "eager"):
        torch._dynamo.reset()
        model = build({"attn": "flex"})
        cm = torch.compile(model, backend=be)
        for lengths in ([50, 70, 40], [100, 60]):
            step(cm, tokens, make_masks("document", 160, lengths=lengths)[0])
        entries = _debug_get_cache_entry_list(model.forward.__code__)
        assert len(entries) == 1, be
        lines[be] = len(str(entries[0].guard_manager).splitlines())
    assert abs(lines["ultraattn"] - lines["eager"]) <= 2, lines


# ----------------------------------------------------------------------------- explicit per-rank graphs
def _count(code: str, op: str) -> int:
    return code.count(f"torch.ops.ultraattn.{op}.default(")


@pytest.mark.parametrize("world,shard", [(2, True), (4, True), (2, False)])
def test_explicit_graphs_show_every_stage_forward_and_backward(world, shard, tmp_path):
    """Static-mask sites become this rank's program in the graphs Inductor compiles: one cp_start/cp_wait
    pair per schedule stage in each direction, tile nodes, no opaque site op; bytes moved equal the plan's;
    the saved report shows both schedules. Sequence-sharded graphs (the default) keep out/lse and dq/dk/dv on
    local tokens (no gather); attention-only CP gathers them (the global view)."""
    from backend_models import explicit_worker

    spec = dict(MODELS["gqa"], batch=2)
    path = tmp_path / "report.json"
    res = run_ranks(explicit_worker, world, args=(spec, dict(FAST, report_file=str(path), shard=shard)), timeout=600)
    for r, got in enumerate(res):
        assert not check_against_oracle(spec, got), f"rank {r}: {check_against_oracle(spec, got)}"
        assert got["host_scalars"] == [], (r, got["host_scalars"])
        kinds = {g["kind"]: g for g in got["aot"]}
        assert set(kinds) == {"forward", "backward"}, got["aot"]
        fwd, bwd = kinds["forward"]["code"], kinds["backward"]["code"]
        assert sorted(kinds["forward"]["expanded"]) == sorted(kinds["backward"]["expanded"]) == ["sdpa#0", "sdpa#1"]
        for code in (fwd, bwd):
            assert "site_attention" not in code
            assert comm_chain_breaks(code) == [], (r, comm_chain_breaks(code))
        sites = got["sites"]
        assert sorted(sites) == ["sdpa#0", "sdpa#1"]
        assert _count(fwd, "cp_start") == _count(fwd, "cp_wait") == sum(s["stages"]["fwd"] for s in sites.values())
        assert _count(bwd, "cp_start") == _count(bwd, "cp_wait") == sum(s["stages"]["bwd"] for s in sites.values())
        computes = sum(s["rows"] for s in sites.values()) > 0  # a rank may own only padding at this size
        assert (_count(fwd, "cp_tiles_fwd") > 0) == (_count(bwd, "cp_tiles_bwd") > 0) == computes, r
        gathers = (0, 0) if shard else (4, 6)  # out, lse / dq, dk, dv per site
        assert (_count(fwd, "cp_gather"), _count(bwd, "cp_gather")) == gathers
        for name, s in sites.items():
            for ph in ("fwd", "bwd"):
                moved = {k: s["moved"][ph][k] for k in ("sent", "recv")}
                assert moved == s["planned"][ph], (r, name, ph, s)
    assert all(got["sites"]["sdpa#0"]["rows"] for got in res[:2])
    out = subprocess.run([sys.executable, "-m", "ultraattn.cli", "report", str(path)], capture_output=True,
                         text=True, timeout=120, env=dict(os.environ, COLUMNS="200"))
    assert out.returncode == 0, out.stderr
    for kind in ("forward", "backward"):
        assert f"{kind} graph for Inductor: " in out.stdout
    assert "program" in out.stdout and "cp_tiles_bwd" in out.stdout
    assert sum(s["moved"][ph]["sent"] for got in res for s in got["sites"].values() for ph in ("fwd", "bwd")) > 0


def test_explicit_graphs_with_checkpointing_and_fullgraph():
    spec = dict(MODELS["causal"], checkpoint=True, fullgraph=True)
    res = run_ranks(compiled_worker, 2, args=(spec, FAST), timeout=600)
    for r, got in enumerate(res):
        assert got["rewritten"] == 2 and got["graphs"] == 1, r
        assert not check_against_oracle(spec, got), r


@pytest.mark.parametrize("shard", [True])
def test_explicit_false_keeps_one_opaque_op_per_site(shard):
    from backend_models import explicit_worker

    spec = MODELS["causal"]
    res = run_ranks(explicit_worker, 2, args=(spec, dict(FAST, explicit=False, shard=shard)), timeout=600)
    for got in res:
        assert not check_against_oracle(spec, got)
        assert got["sites"] == {}
        fwd = next(g["code"] for g in got["aot"] if g["kind"] == "forward")
        assert _count(fwd, "site_attention_local" if shard else "site_attention") == 2 and "cp_start" not in fwd


def test_world1_static_sites_are_the_kernel_ops_in_inductors_graphs():
    spec = dict(MODELS["gqa"])
    tokens, _, _ = inputs(spec)
    side_table().reset()
    got = step(torch.compile(build(spec), backend="ultraattn"), tokens)
    assert not check_against_oracle(spec, got)
    graphs = {g.kind: g for g in side_table().aot_graphs_of(side_table().graphs[-1].index)}
    fwd, bwd = graphs["forward"].code, graphs["backward"].code
    assert _count(fwd, "bsa_fwd") == 2 and _count(bwd, "bsa_bwd") == 2
    assert "site_attention" not in fwd + bwd and "cp_start" not in fwd + bwd


def test_explicit_tiles_are_the_triton_ops_where_the_kernels_run():
    """On GPUs the tile nodes are ultraattn::bsa_fwd/bsa_bwd; here the same path runs in Triton's interpreter
    (ULTRAATTN_KERNELS=triton, aot_eager: Inductor cannot launch Triton kernels on CPU)."""
    from backend_models import explicit_worker

    spec = dict(MODELS["causal"], seqlen=256, batch=1)
    res = run_ranks(explicit_worker, 2, args=(spec, dict(FAST, compiler="aot_eager")), timeout=600,
                    env={"ULTRAATTN_KERNELS": "triton", "TRITON_INTERPRET": "1"})
    for r, got in enumerate(res):
        assert not check_against_oracle(spec, got), r
        code = {g["kind"]: g["code"] for g in got["aot"]}
        assert _count(code["forward"], "bsa_fwd") > 0 and _count(code["backward"], "bsa_bwd") > 0, r
        assert "cp_tiles_fwd" not in code["forward"] and "cp_tiles_bwd" not in code["backward"]


class _Fallbacks(torch.nn.Module):
    """A causal float64 attention and a cross-attention (q 96 tokens, k/v 64): sites the backend cannot split."""

    def __init__(self):
        super().__init__()
        self.q = torch.nn.Linear(16, 16)

    def forward(self, x, ctx):
        q = self.q(x).view(1, -1, 2, 8).transpose(1, 2)
        c = ctx.view(1, -1, 2, 8).transpose(1, 2)
        a = F.scaled_dot_product_attention(q.double(), q.double(), q.double(), is_causal=True)
        b = F.scaled_dot_product_attention(q, c, c)
        return a.float().sum() + b.sum()


def _fallback_worker(rank: int, world: int) -> dict:
    import warnings

    torch.manual_seed(0)
    model = _Fallbacks()
    x, ctx = torch.randn(1, 96, 16), torch.randn(1, 64, 16)
    cm = torch.compile(model, backend="ultraattn", options={"compiler": "aot_eager"})
    out = {}
    for step_ in ("first", "second"):
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            cm(x, ctx).backward()
        out[step_] = [(w.category.__name__, str(w.message)) for w in got
                      if issubclass(w.category, ultraattn.FallbackWarning)]
    out["sites"] = [(s.mask, s.rewritten) for s in side_table().graphs[-1].sites]
    return out


def test_every_fallback_warns_once_with_its_reason():
    """At 2 ranks a float64 site and a cross-attention site run replicated: each says so once, as a
    ``ultraattn.FallbackWarning`` naming the site and the reason, when its graph compiles (not at every step); the
    float64 site called with ``is_causal=True`` is reported causal, not "full"."""
    res = run_ranks(_fallback_worker, 2, timeout=300)
    for got in res:
        msgs = [m for _, m in got["first"]]
        assert len([m for m in msgs if "attention site" in m]) == 2, msgs
        assert any("sdpa#0" in m and "float64" in m and "mask causal" in m for m in msgs), msgs
        assert any("sdpa#1" in m and "cross-attention" in m for m in msgs), msgs
        assert got["second"] == [], got["second"]
        assert got["sites"][0] == ("causal", False), got["sites"]
