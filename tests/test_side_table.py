"""The backend's house rules: all state in the side table, records as its output, FX hygiene, frozen options.

World size 1 throughout (the multi-rank behaviour is in test_backend.py and test_shard.py).
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import io
import json

import pytest
import torch
import torch.nn.functional as F
from backend_models import build, inputs, make_masks, step
from numerics import fresh_dynamo  # noqa: F401 - an autouse fixture
from rich.console import Console
from torch._dynamo.utils import counters

import ultraattn
from ultraattn.cache import LRU
from ultraattn.passes import find_sites, parse_options, side_table
from ultraattn.passes.records import REPORT_VERSION, CompileReport
from ultraattn.passes.rewrite import rewrite_sites
from ultraattn.passes.state import SideTable
from ultraattn.planner.cost import DEFAULT_COST
from ultraattn.report.compile_report import load_report


def _sdpa(q):
    return F.scaled_dot_product_attention(q, q, q, is_causal=True)


def test_a_compiled_graph_owns_its_sites_until_dynamo_drops_it():
    table = side_table()
    f = torch.compile(_sdpa, backend="ultraattn")
    f(torch.randn(1, 2, 64, 16))
    (rec,) = table.graphs
    assert len(rec.site_keys) == 1 and set(table.sites) == set(rec.site_keys)
    assert counters["ultraattn"]["graphs"] == 1 and counters["ultraattn"]["rewritten"] == 1
    assert table.site(rec.site_keys[0]).program is not None  # expanded: the static site's compile-time plan
    del f
    torch._dynamo.reset()
    gc.collect()
    assert table.sites == {}, "recompiles must not grow the side table"
    assert len(table.graphs) == 1  # the records stay (reports), the run-time state goes


def test_reset_forgets_everything_and_a_stale_graph_says_what_to_do():
    f = torch.compile(_sdpa, backend="ultraattn", options={"explicit": False})
    q = torch.randn(1, 2, 64, 16)
    f(q)
    table = side_table()
    assert table.sites and table.graphs and counters["ultraattn"]["rewritten"] == 1
    table.reset()
    assert not table.sites and not table.graphs and not table.plan_events and counters["ultraattn"]["rewritten"] == 0
    with pytest.raises(RuntimeError, match=r"side table was reset.*call torch._dynamo.reset\(\)"):
        f(q)


def test_explain_runs_on_a_private_table():
    spec = {"attn": "flex", "mask": "document", "lengths": [100, 156], "seqlen": 256}
    tokens, bm, _ = inputs(spec)
    res = ultraattn.explain(build(spec), tokens, bm, world_size=2, options={"ilp_time_limit": 1.0},
                            console=Console(file=io.StringIO(), width=120))
    assert res.records and len(res.stats) == 2
    table = side_table()
    assert not table.graphs and not table.sites and not counters["ultraattn"], "explain touched process state"


def test_every_node_the_rewrite_inserts_carries_its_fake_value():
    """meta["val"] (and Dynamo's example_value) on every inserted node, matching what the node computes."""
    got = {}

    def backend(gm, example_inputs):
        before = set(gm.graph.nodes)
        states = rewrite_sites(gm, find_sites(gm, 1), parse_options({}), graph_index=0, table=side_table())
        got["n"] = len(states)
        got["new"] = [n for n in gm.graph.nodes if n not in before and n.op == "call_function"]
        return gm.forward

    model = build({"attn": "flex"})
    tokens = torch.randint(0, 64, (1, 128))
    with torch.no_grad():
        torch.compile(model, backend=backend)(tokens, make_masks("document", 128, lengths=[40, 88])[0])
    assert got["n"] == 2 and got["new"], got
    for n in got["new"]:
        val = n.meta.get("val")
        assert val is not None and n.meta.get("example_value") is val, n.format_node()
        if n.target is torch.ops.ultraattn.site_attention.default:
            q = n.args[0].meta["example_value"]
            assert val[0].shape == q.shape and val[1].shape == q.shape[:3] and val[1].dtype == torch.float32
        else:  # getitem and the log2 conversion of the lse
            assert isinstance(val, torch.Tensor), n.format_node()


def test_records_round_trip_through_a_saved_report(tmp_path):
    path = tmp_path / "report.json"
    spec = {"attn": "flex", "seqlen": 160}
    tokens, _, _ = inputs({"attn": "causal", "seqlen": 160})
    cm = torch.compile(build(spec), backend="ultraattn", options={"report_file": str(path)})
    for lengths in ([50, 70, 40], [130, 30]):  # (two block tables: each laid out once)
        step(cm, tokens, make_masks("document", 160, lengths=lengths)[0])
    snap = side_table().snapshot(str(path))
    assert snap.graphs and len(snap.plans) == 2 and {s.plans for s in snap.stats} == {2}
    assert CompileReport.from_json(json.loads(json.dumps(snap.to_json()))) == snap
    loaded = load_report(path)  # written at the last plan event: the graphs and both sites' latest plans
    assert loaded.graphs == snap.graphs and {p.site for p in loaded.plans} == {"flex#0", "flex#1"}
    # the history: every plan made, by site and call (the step), planner and time, without comparisons
    assert [(ev.site, ev.call) for ev in loaded.history] == [("flex#0", 1), ("flex#1", 1), ("flex#0", 2),
                                                             ("flex#1", 2)], loaded.history
    assert all(ev.planner == "kernels" and ev.seconds > 0 and ev.comparison is None for ev in loaded.history)
    path.write_text(json.dumps({"version": 1, "graphs": []}))
    with pytest.raises(ValueError, match=f"report version 1 is not {REPORT_VERSION}: save the report again"):
        load_report(path)


def test_options_are_frozen_and_parsing_returns_a_new_object():
    opts = parse_options({"report": "summary", "cost": {"intra_bw_GBps": 10.0}})
    assert opts.world_size == 1 and opts.report == "summary"
    assert opts.cost == dataclasses.replace(DEFAULT_COST, intra_bw_GBps=10.0)   # the overrides, resolved to a model
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.report = "full"
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.cost.intra_bw_GBps = 1.0
    assert opts.cost_model().intra_bw_GBps == 10.0
    with pytest.raises(ValueError, match=r"options\['compiler'\]='tvm': expected one of inductor, aot_eager, eager"):
        parse_options({"compiler": "tvm"})
    with pytest.raises(ValueError, match=r"options\['world_size'\]=0: expected a positive int"):
        parse_options({"world_size": 0})


def test_lru_keeps_the_most_recent():
    lru = LRU(2)
    lru.put("a", 1)
    lru.put("b", 2)
    assert lru.get("a") == 1  # a is now the most recent
    lru.put("c", 3)
    assert "b" not in lru and list(lru) == ["a", "c"] and lru.pop("a") == 1 and len(lru) == 1
    with pytest.raises(ValueError, match="`capacity` must be a positive int, got 0"):
        LRU(0)


def test_a_graph_without_attention_gets_no_site():
    """Must not fire: a graph without attention gets no site, no state, no counter but ``graphs``."""
    f = torch.compile(lambda x: (x * 2).sin(), backend="ultraattn")
    f(torch.randn(4))
    (rec,) = side_table().graphs
    assert rec.sites == () and rec.site_keys == () and not side_table().sites
    assert counters["ultraattn"]["graphs"] == 1 and counters["ultraattn"]["rewritten"] == 0


def test_site_keys_are_derived_from_the_graph_so_a_restart_compiles_the_same_text():
    """The same function compiled after a reset carries the same keys (so Inductor's FX graph cache can hit on a
    restart); a second identical graph in one process gets its own numbered key; another graph another key."""
    table = side_table()

    def keys_of(fn, *args):
        before = set(table.sites)
        torch.compile(fn, backend="ultraattn", options={"compiler": "aot_eager"})(*args)
        return sorted(set(table.sites) - before)

    def twin(q):
        return F.scaled_dot_product_attention(q, q, q, is_causal=True)

    def other(q):
        return F.scaled_dot_product_attention(q, q, q, is_causal=True) * 2

    q = torch.randn(1, 2, 64, 16)
    first = keys_of(_sdpa, q)
    ultraattn.reset()
    assert keys_of(_sdpa, q) == first and len(first) == 1
    (numbered,) = keys_of(twin, q)
    assert numbered == first[0] + ".1"
    (apart,) = keys_of(other, q)
    assert apart.split("-")[0] == first[0].split("-")[0] and apart not in (first[0], numbered)


def test_ultraattn_reset_clears_every_place_process_state_lives():
    """The side table, the online planner of run-time masks, the kernels' block-list cache and the score_mods'
    generated functions (``cache.held_state()``: the one home of process state): all empty after
    ``ultraattn.reset()``, and a graph compiled before it recompiles instead of failing."""
    from torch.nn.attention.flex_attention import create_block_mask

    from ultraattn.kernels import block_sparse_attention
    from ultraattn.kernels import ops as kernel_ops
    from ultraattn.runtime.online import ONLINE

    f = torch.compile(_sdpa, backend="ultraattn")
    q = torch.randn(1, 2, 64, 16)
    f(q)
    block_sparse_attention(q, q, q, "causal", block_size=32)
    bm = create_block_mask(lambda b, h, i, j: i >= j, None, None, 64, 64, device="cpu", BLOCK_SIZE=32)
    plan = ultraattn.plan_attention(bm, seqlen=64, num_heads=2, head_dim=16, dtype=torch.float32)
    assert plan.planner == "fast"
    from ultraattn.runtime import tile_kernels as tiles

    tiles._SCORE_KERNELS.put("a score_mod's code", object())  # (generating one needs Triton's interpreter: a stand-in)
    table = side_table()
    assert table.sites and table.graphs and len(kernel_ops._BLOCK_LISTS) and len(ONLINE._planners)
    ultraattn.reset()
    assert not table.sites and not table.graphs and not counters["ultraattn"]
    assert not len(kernel_ops._BLOCK_LISTS) and not len(ONLINE._planners) and not len(tiles._SCORE_KERNELS)
    # one home holds all of it: these four, and nothing else unnamed
    from ultraattn.cache import held_state

    held = held_state()
    assert set(held) == {"passes: the side table", "runtime: the online planner",
                         "kernels: block_sparse_attention's block lists",
                         "runtime: the score_mods' generated Triton functions",
                         "planner: the native schedule simulator (a loaded C library)"}
    assert held["passes: the side table"] is table and held["runtime: the online planner"] is ONLINE
    assert held["kernels: block_sparse_attention's block lists"] is kernel_ops._BLOCK_LISTS
    torch.testing.assert_close(f(q), _sdpa(q))  # Dynamo forgot the graph too: it compiles again
    assert len(table.graphs) == 1


def test_site_keys_change_with_the_ops_so_an_upgrade_misses_the_on_disk_caches(monkeypatch):
    """The key digests the ops' schemas and sources (``opinfo.ops_digest``): a graph compiled by a version of
    ultraattn whose ops differ can never be served from Inductor's or AOTAutograd's cache to this one."""
    from ultraattn.passes import opinfo, state

    table = SideTable()
    before = table.site_key("sdpa", "code", (1, 2), "bf16")
    assert before == SideTable().site_key("sdpa", "code", (1, 2), "bf16")
    digest = opinfo.ops_digest()
    assert len(digest) == 12 and digest == opinfo.ops_digest()
    monkeypatch.setattr(state, "ops_digest", lambda: "0" * 12)
    after = SideTable().site_key("sdpa", "code", (1, 2), "bf16")
    assert after != before and after.startswith("sdpa-")


# ----------------------------------------------------------------------------- site identity
def _flex_specs(score_mods: list, mask_mods: list) -> list:
    """The ``SiteSpec`` of one flex site per (score_mod, mask_mod), each compiled as a fresh model, rewritten for 2
    ranks into one private table (no process group is needed to rewrite)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    table, specs = SideTable(), []
    opts = parse_options({"world_size": 2}, require_group=False)

    def backend(gm, example_inputs):
        run = copy.deepcopy(gm).forward   # (the rewritten graph would need the ranks to run)
        specs.extend(s.spec for s in rewrite_sites(gm, find_sites(gm, 2), opts, graph_index=0, table=table))
        return run

    q = torch.randn(1, 2, 256, 16)
    for score_mod, mask_mod in zip(score_mods, mask_mods, strict=True):
        torch._dynamo.reset()
        bm = create_block_mask(mask_mod, None, None, 256, 256, device="cpu")
        torch.compile(lambda q, bm=bm, sm=score_mod: flex_attention(q, q, q, score_mod=sm, block_mask=bm),
                      backend=backend)(q)
    return specs


def _softcap(cap):
    def score_mod(score, b, h, q_idx, kv_idx):
        return torch.tanh(score / cap) * cap
    return score_mod


def _window(w):
    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < w)
    return mask_mod


def test_a_site_key_covers_its_score_mod_and_mask_mod_constants():
    """Sites whose graph code is the same but whose score_mod or mask_mod differs in a constant (a soft-cap, a
    window) get different identities and keys; the same site compiled again gets the same identity and key."""
    specs = _flex_specs([_softcap(20), _softcap(5), _softcap(20), _softcap(20)],
                        [_window(64), _window(64), _window(128), _window(64)])
    ids = [s.identity for s in specs]
    keys = [s.key.split(".")[0] for s in specs]   # (a repeat in one table is numbered: key.1)
    assert len(set(ids[:3])) == 3 and len(set(keys[:3])) == 3, keys
    assert ids[3] == ids[0] and keys[3] == keys[0] and specs[3].key == specs[0].key + ".1"


def test_module_digest_reads_the_constants_a_graph_holds():
    """A tensor a graph reads as an attribute is part of its digest: two graphs with one code and another table
    differ; equal tables agree."""
    from ultraattn.passes.fx_util import module_digest

    class Table(torch.nn.Module):
        def __init__(self, t):
            super().__init__()
            self.register_buffer("t", t)

        def forward(self, x):
            return x + self.t

    a, b, c = (torch.fx.symbolic_trace(Table(t)) for t in (torch.ones(3), torch.ones(3) * 2, torch.ones(3)))
    assert a.code == b.code
    assert module_digest(a) != module_digest(b) and module_digest(a) == module_digest(c)


def test_a_key_collision_is_an_error_never_a_reuse():
    """Forced: a spec arriving under a key held by a site that computes something else (another score_mod
    constant) raises ultraattn's error naming both sites; the same spec again is no collision. Kept flex sites
    likewise."""
    from ultraattn.passes.kept import KeptFlex
    from ultraattn.passes.records import NullObserver
    from ultraattn.passes.state import KeyCollision

    a, b = _flex_specs([_softcap(20), _softcap(5)], [_window(64), _window(64)])
    table = SideTable()
    table.add_site(a, NullObserver())
    table.add_site(a, NullObserver())
    forced = dataclasses.replace(b, key=a.key, name="flex#7")
    with pytest.raises(KeyCollision, match=r"ultraattn: the site key .* flex#0 .* flex#7 .* report it"):
        table.add_site(forced, NullObserver())
    assert table.site(a.key).spec is a   # the held site is untouched

    def kept(cap):
        return KeptFlex(score_mod=torch.fx.symbolic_trace(_softcap(cap)), block_mask=(), scale=0.25,
                        kernel_options={}, score_slots=(), mask_slots=(), grad_slots=())

    table.add_kept("k", kept(20))
    table.add_kept("k", kept(20))
    with pytest.raises(KeyCollision, match="kept flex site"):
        table.add_kept("k", kept(5))
