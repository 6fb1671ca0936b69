"""Cost profiles and calibration: fits recover known models, profiles round-trip, bad files are named, the planner
predicts what a profile says, and ``calibrate`` on 2 gloo ranks measures positive, finite, monotone figures within
its budget (``cost="auto"`` caches them)."""

from __future__ import annotations

import dataclasses
import io
import json
import math
import time

import pytest
import torch
from rich.console import Console

from ultraattn.cli import _print_profile
from ultraattn.cli import main as cli_main
from ultraattn.masks.convert import pattern_from_mask_mod
from ultraattn.masks.factories import generate_causal, generate_full
from ultraattn.planner.api import baseline_plan, evaluate, workload
from ultraattn.planner.cost import DEFAULT_COST, CostModel, block_flops
from ultraattn.planner.plan import AttnShape, Mesh
from ultraattn.planner.profile import (
    CostProfile,
    ProfileError,
    fit_cost,
    fit_kernels,
    fit_merges,
    fit_messages,
    fit_step_scale,
    kernel_sample_seconds,
    scale_kernels,
)
from ultraattn.planner.schedule import Graph, SharedCompute, Task, simulate
from ultraattn.runtime.calibrate import calibrate
from ultraattn.testing import run_ranks

#: a machine unlike the H100 defaults in every field (the fits must find it, not the defaults)
TRUE = dataclasses.replace(DEFAULT_COST, fwd_tflops=0.02, bwd_tflops=0.03, eff_half_tokens=DEFAULT_COST.eff_half_tokens,
                           partial_block_overhead=0.35, launch_us=150.0, intra_bw_GBps=1.7, intra_latency_us=90.0,
                           inter_bw_GBps=0.4, inter_latency_us=400.0, hbm_GBps=20.0, lse_merge_GBps=3.0,
                           alone_speedup=1.8)


def synthetic_samples(cost: CostModel) -> dict:
    kernel = []
    for phase in ("fwd", "bwd"):
        for heads in (2, 8):
            for kv in (128, 512, 2048, 8192):
                for partial in (False, True):
                    f = 8 * (kv // 128) * heads * block_flops(128, 128, 64, 1, 1)
                    s = {"phase": phase, "flops_full": 0.0 if partial else f, "flops_partial": f if partial else 0.0,
                         "kv_tokens_per_row": float(kv), "launches": 1 + (kv == 512)}
                    kernel.append({**s, "seconds": kernel_sample_seconds(cost, s)})
    message = [{"link": link, "nbytes": n, "seconds": cost.message_seconds(n, inter_node=link == "inter")}
               for link in ("intra", "inter") for n in (1 << 14, 1 << 18, 1 << 22, 1 << 24)]
    merge = [{"what": what, "nbytes": n, "seconds": cost.merge_seconds(n, lse=what == "o")}
             for what in ("o", "dq") for n in (1 << 20, 1 << 24)]
    sharing = [{"seconds_all": t, "seconds_alone": t / cost.alone_speedup} for t in (0.1, 0.5)]
    return {"kernel": kernel, "message": message, "merge": merge, "sharing": sharing}


def test_fits_recover_the_model_that_made_the_samples():
    samples = synthetic_samples(TRUE)
    fitted, fit, notes = fit_cost(samples)
    assert notes == []
    for name in CostModel.field_names():
        want, got = getattr(TRUE, name), getattr(fitted, name)
        assert got == pytest.approx(want, rel=0.03), name   # the eff_half grid is geometric: within its step
    assert fit["kernel"]["max_rel_err"] < 0.01 and fit["merge"]["hbm_GBps"]["max_rel_err"] < 1e-9
    assert fit["merge"]["lse_merge_GBps"]["max_rel_err"] < 1e-9
    assert fit["message"]["intra"]["max_rel_err"] < 1e-9 and fit["message"]["inter"]["max_rel_err"] < 1e-9
    # a missing link takes the measured one's figures, and says so
    one_link = {**samples, "message": [s for s in samples["message"] if s["link"] == "intra"]}
    fitted, _, notes = fit_cost(one_link)
    assert fitted.inter_bw_GBps == pytest.approx(TRUE.intra_bw_GBps) and "no inter-node pair" in notes[0]
    # nothing measured: the base model stands, field by field, with a note each
    fitted, fit, notes = fit_cost({}, base=TRUE)
    assert fitted == TRUE and fit == {} and len(notes) == 4


def test_step_scale_makes_the_model_replay_the_steps():
    k, st = fit_step_scale([2.0, 5.0], lambda k: [1.0 * k, 2.5 * k])
    assert k == pytest.approx(2.0) and st["predicted_over_measured_after"] == pytest.approx([1.0, 1.0])
    assert st["predicted_over_measured_before"] == pytest.approx([0.5, 0.5])
    assert scale_kernels(TRUE, 2.0).fwd_tflops == pytest.approx(TRUE.fwd_tflops / 2)
    with pytest.raises(ValueError, match="positive timings"):
        fit_step_scale([0.0], lambda k: [1.0])


def test_fits_refuse_samples_that_cannot_make_a_model():
    good = synthetic_samples(TRUE)
    with pytest.raises(ValueError, match="both phases"):
        fit_kernels([s for s in good["kernel"] if s["phase"] == "fwd"])
    with pytest.raises(ValueError, match=r"kernel sample #0 lacks \['seconds'\]"):
        fit_kernels([{k: v for k, v in good["kernel"][0].items() if k != "seconds"}])
    with pytest.raises(ValueError, match="seconds=-1.0"):
        fit_merges([{"nbytes": 10, "seconds": -1.0}])
    with pytest.raises(ValueError, match="do not grow with the size"):
        fit_messages([{"link": "intra", "nbytes": n, "seconds": 1.0 / n} for n in (10, 100, 1000)])
    with pytest.raises(ValueError, match="link must be 'intra' or 'inter'"):
        fit_messages([{"link": "pcie", "nbytes": 10, "seconds": 1.0}])


@pytest.mark.parametrize(("durations", "ranks", "speedup", "makespan"), [
    ((1.0, 3.0), 2, 2.0, 2.0),            # both at the all-busy rate until 1 s, then the last one twice as fast
    ((1.0, 1.0, 1.0, 4.0), 4, 2.0, 2.5),  # 4 ranks on 2 cores' worth: alone, a rank gets one core (2x), not 4x
    ((1.0, 3.0), 2, 1.0, 3.0),            # own devices: no sharing
    ((2.0, 2.0), 2, 2.0, 2.0),
])
def test_ranks_sharing_compute_share_it(durations, ranks, speedup, makespan):
    graph = Graph(tasks=[Task(id=r, kind="attn", rank=r, streams=((r, "compute"),), duration=d)
                         for r, d in enumerate(durations)], phase="fwd",
                  shared=SharedCompute(node_of=(0,) * ranks, ranks=ranks, speedup=speedup) if speedup > 1 else None)
    sched = simulate(graph)
    sched.check()
    assert sched.makespan == pytest.approx(makespan)
    if speedup > 1:
        # a message inside the node copies on the same cores: alone with a compute task, both share the node
        graph = Graph(tasks=[Task(id=0, kind="attn", rank=0, streams=((0, "compute"),), duration=1.0),
                             Task(id=1, kind="kv", rank=0, dst=1, streams=((0, "send_intra"), (1, "recv_intra")),
                                  duration=1.0)], phase="fwd",
                      shared=SharedCompute(node_of=(0, 0), ranks=2, speedup=speedup))
        sched = simulate(graph)
        assert sched.end == pytest.approx([1.0, 1.0])   # without the message the kernel would end at 1 / speedup
    # a plan replayed with a profile whose ranks share cores: never slower than with dedicated devices
    cost = profile_of(TRUE).cost
    s, h = 2048, 4
    causal = pattern_from_mask_mod(generate_causal(), s, block_size=128, num_heads=h)
    ring = baseline_plan("ring", causal, AttnShape(seq_len=s, num_heads=h, head_dim=64, dtype="fp32"),
                         Mesh(nodes=1, devices=4))
    shared = evaluate(ring, causal, cost=cost).total_ms()
    alone = evaluate(ring, causal, cost=dataclasses.replace(cost, alone_speedup=1.0)).total_ms()
    assert shared < alone   # the causal ring is unbalanced: its busiest rank runs faster once the others finish


def profile_of(cost: CostModel) -> CostProfile:
    fitted, fit, notes = fit_cost(synthetic_samples(cost))
    return CostProfile(cost=fitted, machine={"key": "test", "device": "synthetic"}, created="2026-11-25T00:00:00+00:00",
                       fit=fit, samples=synthetic_samples(cost), notes=tuple(notes))


def test_profile_round_trips(tmp_path):
    prof = profile_of(TRUE)
    path = prof.save(tmp_path / "sub" / "p.json")
    back = CostProfile.load(path)
    assert back.cost == prof.cost and back.to_json() == prof.to_json()
    assert CostProfile.from_json(json.loads(json.dumps(prof.to_json()))).cost == prof.cost
    assert "test" in repr(back) and "kernel" in repr(back)


def test_a_profile_without_async_kernels_reads_it_from_its_device():
    """Profiles written before ``CostModel.async_kernels`` existed: a CPU machine's runs its kernels on the host
    thread (0), any other keeps the default (1); a value other than 0 or 1 is refused, naming the field."""
    data = profile_of(TRUE).to_json()
    data["cost"].pop("async_kernels")
    for device, want in (("cpu", 0.0), ("cuda", 1.0), (None, 1.0)):
        data["machine"] = {"key": "test"} | ({"device_type": device} if device else {})
        assert CostProfile.from_json(data).cost.async_kernels == want
    data["cost"]["async_kernels"] = 0.5
    with pytest.raises(ProfileError, match="async_kernels must be 0 .* or 1 .*, got 0.5"):
        CostProfile.from_json(data)


@pytest.mark.parametrize(("edit", "match"), [
    (lambda d: d.update(format="something"), "field 'format' must be 'ultraattn-cost-profile'"),
    (lambda d: d.update(version=99), "field 'version' must be 1, got 99"),
    (lambda d: d.pop("cost"), "field 'cost' must be an object"),
    (lambda d: d["cost"].update(warp_speed=9.0), r"unknown field\(s\) \['warp_speed'\]"),
    (lambda d: d["cost"].update(fwd_tflops="fast"), "field 'cost.fwd_tflops' must be a finite number, got 'fast'"),
    (lambda d: d["cost"].update(intra_bw_GBps=-1.0), "intra_bw_GBps must be positive, got -1.0"),
    (lambda d: d["cost"].update(hbm_GBps=float("nan")), "field 'cost.hbm_GBps' must be a finite number"),
    (lambda d: d.update(notes="none"), "field 'notes' must be a list, got str"),
])
def test_bad_profiles_name_the_file_and_field(tmp_path, edit, match):
    data = profile_of(TRUE).to_json()
    edit(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match=match) as err:
        CostProfile.load(path)
    assert str(path) in str(err.value)


def test_unreadable_profiles(tmp_path):
    with pytest.raises(ProfileError, match="does not exist; write one with `ultraattn calibrate --out"):
        CostProfile.load(tmp_path / "missing.json")
    (tmp_path / "x.json").write_text("{not json")
    with pytest.raises(ProfileError, match="is not JSON"):
        CostProfile.load(tmp_path / "x.json")


def test_the_planner_predicts_what_the_profile_says():
    """One rank, one kernel: the replayed makespan is the profile's kernel formula; two ranks on a ring: every
    message task lasts the profile's latency + bytes / bandwidth, and kernels charge one launch per query row."""
    cost = profile_of(TRUE).cost
    s, h, d = 1024, 4, 64
    shape = AttnShape(seq_len=s, num_heads=h, head_dim=d, dtype="fp32")
    full = pattern_from_mask_mod(generate_full(), s, block_size=128, num_heads=h)
    one = baseline_plan("ring", full, shape, Mesh(nodes=1, devices=1))
    ev = evaluate(one, full, cost=cost)
    flops = (s // 128) ** 2 * h * block_flops(128, 128, d, 1, 1)
    rows = {i for k in one.kernels for i, _ in k.cells}
    want_f = cost.kernel_seconds(flops=flops, kv_tokens_per_row=s, phase="fwd", launches=len(rows))
    assert ev.fwd_ms == pytest.approx(want_f * 1e3, rel=1e-9)
    assert ev.bwd_ms == pytest.approx(cost.kernel_seconds(flops=flops, kv_tokens_per_row=s, phase="bwd",
                                                          launches=len(rows)) * 1e3, rel=1e-9)
    causal = pattern_from_mask_mod(generate_causal(), s, block_size=128, num_heads=h)
    ring = baseline_plan("ring", causal, shape, Mesh(nodes=2, devices=1))
    ev = evaluate(ring, causal, cost=cost)
    msgs = [t for t in ev.fwd.graph.tasks if t.kind not in ("attn", "merge")]
    assert msgs
    for t in msgs:
        assert t.duration == pytest.approx(cost.inter_latency_us * 1e-6 + t.nbytes / (cost.inter_bw_GBps * 1e9))
    work = workload(causal, shape, num_chunks=ring.num_chunks, chunk=ring.chunk_size)
    for t, k in zip(ev.fwd.graph.tasks, ring.kernels):
        assert t.duration == pytest.approx(work.kernel_seconds(k.head_group, k.cells, cost, "fwd"))
    # a kernel over cells of 3 query rows is 3 launches (the runtime calls the tile once per row)
    w4 = workload(causal, shape, num_chunks=4)
    cells = [(2, 0), (2, 1), (3, 0), (3, 3), (1, 1)]
    blocks = sum(float(w4.full_GPP[0, i, j] + w4.partial_GPP[0, i, j] * (1 + cost.partial_block_overhead))
                 for i, j in cells)
    nonempty = sum(float(w4.full_GPP[0, i, j] + w4.partial_GPP[0, i, j]) for i, j in cells)
    assert w4.kernel_seconds(0, cells, cost, "fwd") == pytest.approx(cost.kernel_seconds(
        flops=blocks * block_flops(128, 128, d, 1, 1), kv_tokens_per_row=nonempty * 128 / (3 * w4.rows_per_chunk),
        phase="fwd", launches=3))
    # a faster machine in the profile is a faster predicted step, term by term
    fast = dataclasses.replace(cost, fwd_tflops=cost.fwd_tflops * 2, bwd_tflops=cost.bwd_tflops * 2,
                               launch_us=cost.launch_us / 2)
    assert evaluate(one, full, cost=fast).fwd_ms == pytest.approx(want_f * 1e3 / 2)


def _calibrate_rank(rank: int, world: int, cache: str):
    import os

    import torch.distributed as dist

    import ultraattn
    from ultraattn.runtime.calibrate import auto_profile, cached_profile_path, calibrate, reference_steps

    os.environ["ULTRAATTN_CACHE_DIR"] = cache
    t0 = time.perf_counter()
    prof = calibrate(dist.group.WORLD, quick=True, progress=False, timeout=60)
    took = time.perf_counter() - t0
    steps = reference_steps(dist.group.WORLD, quick=True, timeout=60)   # the profile's step probes, timed again
    first = auto_profile(quick=True, progress=False, timeout=60)    # nothing cached yet: measured, then saved
    again = auto_profile(quick=True, progress=False, timeout=60)    # loaded: the same profile
    path = cached_profile_path(torch.device("cpu"), Mesh(nodes=1, devices=world))
    stamp = os.stat(path).st_mtime_ns
    # plan_attention(cost="auto" | a path | a profile): the same model, hence the same plan; nothing measured again
    kw = {"seqlen": 1024, "num_heads": 4, "head_dim": 32, "dtype": torch.float32, "block_size": 64,
          "planner": "fast"}
    hashes = [ultraattn.plan_attention("causal", cost=c, **kw).tile_plan.content_hash()
              for c in ("auto", str(path), first)]
    # two nodes of one rank: the messages between them are the inter-node link's
    from torch.distributed.device_mesh import init_device_mesh

    nodes = calibrate(None, mesh=init_device_mesh("cpu", (2, 1), mesh_dim_names=("node", "device")), quick=True,
                      progress=False, timeout=60)
    return {"profile": prof.to_json(), "seconds": took, "steps": steps, "first": first.to_json(),
            "again": again.to_json(), "path": str(path), "hashes": hashes,
            "remeasured": os.stat(path).st_mtime_ns != stamp, "nodes": nodes.to_json()}


def test_calibrate_on_two_ranks(tmp_path):
    res = run_ranks(_calibrate_rank, 2, args=(str(tmp_path),), timeout=240)
    a, b = res
    assert a["profile"]["cost"] == b["profile"]["cost"]            # every rank fits the same medians
    assert a["seconds"] < 30, a["seconds"]                       # the quick grid's budget
    prof = CostProfile.from_json(a["profile"])
    for name in CostModel.field_names():
        v = getattr(prof.cost, name)
        assert math.isfinite(v) and (v > 0 or name in ("partial_block_overhead", "async_kernels")), (name, v)
    assert prof.cost.async_kernels == 0.0   # CPU ranks: the host thread runs each kernel
    samples = prof.samples
    assert {s["phase"] for s in samples["kernel"]} == {"fwd", "bwd"}
    assert all(s["seconds"] > 0 and math.isfinite(s["seconds"]) for k in ("kernel", "message", "merge")
               for s in samples[k])
    assert samples["sharing"] and all(s["seconds_all"] > 0 and s["seconds_alone"] > 0 for s in samples["sharing"])
    assert prof.cost.alone_speedup >= 1.0
    # monotone where expected: 8x the keys per row is slower; a 16 MiB message is slower than a 4 KiB one
    by = {(s["phase"], s["heads"], s["kind"], s["q_tokens"], s["kv_tokens_per_row"]): s["seconds"]
          for s in samples["kernel"]}
    for (phase, heads, kind, q, kv), sec in by.items():
        if kv == 64 and q == 128:
            assert by[(phase, heads, kind, q, 512.0)] > sec, (phase, heads, kind)
    # and the tiny calls that pin the launch cost: one query block of one head
    assert {(s["q_tokens"], s["heads"]) for s in samples["kernel"]} >= {(64, 1), (128, 1), (128, 2)}
    msg = sorted(samples["message"], key=lambda s: s["nbytes"])
    assert {s["link"] for s in msg} == {"intra"} and msg[-1]["seconds"] > msg[0]["seconds"]
    assert any("no inter-node pair" in n for n in prof.notes)
    assert prof.machine["world"] == 2 and prof.machine["devices_per_node"] == 2 and prof.machine["torch"]
    # what `ultraattn calibrate` prints of it: every fitted field, each fit's errors, the sharing ratios
    buf = io.StringIO()
    _print_profile(Console(file=buf, width=200), a["profile"], "where.json")
    shown = buf.getvalue()
    assert all(name in shown for name in CostModel.field_names())
    assert "fit kernel:" in shown and "fit intra:" in shown and "sharing: all ranks busy / one alone" in shown
    assert "steps: kernels" in shown
    # the step probes: real ring and all-gather steps, replayed by the fitted model in about their measured time
    step = prof.fit["step"]
    assert [s["method"] for s in samples["step"]] == ["ring", "allgather"] and step["scale"] > 0
    def miss(ratios):
        return sum(math.log(r) ** 2 for r in ratios)

    assert miss(step["predicted_over_measured_after"]) <= miss(step["predicted_over_measured_before"]) + 1e-9
    # reference_steps: the same probes again, on their own (what benchmarks/runtime_cpu.py reads the drift from)
    keys = ("method", "seqlen", "heads", "head_dim")
    assert [tuple(s[k] for k in keys) for s in a["steps"]] == [tuple(s[k] for k in keys) for s in samples["step"]]
    assert a["steps"] == b["steps"] and all(s["seconds"] > 0 and math.isfinite(s["seconds"]) for s in a["steps"])
    # cost="auto": measured once, saved where the key says, then loaded (same creation time), on every rank
    assert a["first"] == a["again"] == b["again"]
    assert CostProfile.load(a["path"]).to_json() == a["first"]
    assert len(set(a["hashes"])) == 1 and a["hashes"] == b["hashes"] and not a["remeasured"]
    two = CostProfile.from_json(a["nodes"])
    assert {m["link"] for m in two.samples["message"]} == {"inter"} and two.machine["nodes"] == 2
    assert two.cost.intra_bw_GBps == two.cost.inter_bw_GBps and "no intra-node pair" in " ".join(two.notes)


def test_cli_calibrate_then_plan_with_the_profile(tmp_path, capsys):
    out = tmp_path / "prof.json"
    assert cli_main(["calibrate", "--quick", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "fwd_tflops" in printed and str(out) in printed
    prof = CostProfile.load(out)
    assert prof.machine["world"] == 1 and prof.samples["message"] == []
    assert prof.notes == ("messages not measured (one rank): message fields are the base model's",
                          "sharing not measured (one rank): alone_speedup is the base model's",
                          "steps not measured (one rank): kernel rates are the isolated calls'")
    js = tmp_path / "plan.json"
    args = ["plan", "--mask", "causal", "--seqlen", "8k", "--cp", "4", "--heads", "8", "--head-dim", "64",
            "--planner", "fast", "--backward", "--quiet", "--json", str(js)]
    assert cli_main([*args, "--cost-profile", str(out)]) == 0
    with_profile = json.loads(js.read_text())["methods"]["ring"]["fwd_ms"]
    assert cli_main(args) == 0
    assert json.loads(js.read_text())["methods"]["ring"]["fwd_ms"] != pytest.approx(with_profile)
    capsys.readouterr()
    assert cli_main([*args, "--cost-profile", str(tmp_path / "nope.json")]) == 2
    assert "--cost-profile: cost profile" in capsys.readouterr().err
    assert cli_main(["calibrate", "--nproc", "0"]) == 2
    assert "--nproc must be >= 1, got 0" in capsys.readouterr().err


def test_progress_outside_a_terminal_is_a_line_per_measurement(capsys):
    """Where stderr is not a terminal (a log, a pipe, pytest's capture), rich would draw nothing until the end: the
    calibration prints one line per measurement instead, as they come, up to all of them."""
    calibrate(None, quick=True, progress=True, timeout=60)
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("ultraattn calibrate: ")]
    counts = [tuple(map(int, ln.split()[2].split("/"))) for ln in lines]
    assert counts and [c[0] for c in counts] == list(range(1, len(counts) + 1)) and counts[-1][0] == counts[-1][1]


def test_backend_options_take_a_profile(tmp_path, monkeypatch):
    from ultraattn.passes import parse_options

    monkeypatch.setenv("ULTRAATTN_CACHE_DIR", str(tmp_path / "cache"))
    path = profile_of(TRUE).save(tmp_path / "p.json")
    assert parse_options({"cost": str(path)}).cost_model() == CostProfile.load(path).cost
    assert parse_options({"cost": profile_of(TRUE)}).cost_model() == profile_of(TRUE).cost
    assert parse_options({"cost": "auto"}).cost == DEFAULT_COST      # one rank plans nothing: nothing measured
    # the profile stays whole: its fits' worst errors are the fast planner's band (planner/robust.py)
    from ultraattn.planner.robust import DEFAULT_BAND, Band
    from ultraattn.runtime.costs import band_of

    band = band_of(parse_options({"cost": str(path)}).cost)
    assert band == Band.of_profile(profile_of(TRUE).fit) and band != DEFAULT_BAND and band.rate < DEFAULT_BAND.rate
    assert band_of(parse_options({}).cost) == DEFAULT_BAND
    with pytest.raises(ValueError, match=r"options\['cost'\]: cost profile .*does not exist"):
        parse_options({"cost": str(tmp_path / "missing.json")})
    with pytest.raises(ValueError, match=r"options\['cost'\]='auto' needs this machine's profile for 4 ranks"):
        parse_options({"cost": "auto", "world_size": 4}, require_group=False)
    with pytest.raises(ValueError, match=r"options\['cost'\]: `cost` must be a CostModel"):
        parse_options({"cost": 3})
