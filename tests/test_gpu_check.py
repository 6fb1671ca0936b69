"""The GPU check (``benchmarks/gpu_check.py``) rehearsed on the CPU, so that it works the day a GPU is available.

One full ``--dry-run`` (every part, the same code as the GPU run at tiny sizes, PuLP hidden as on the GPU machine)
must pass and write every file the GPU run writes; a part that fails, or overruns its deadline, must be recorded
without stopping the others, and the exit status must say so.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"
PARTS = ("clients", "kernels_correct", "two_ranks", "backend_e2e", "kernels_speed", "calibration", "tiles",
         "flex_tiles")


def _run(out: Path, *args: str, env: dict | None = None, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(out), *args], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})


def _load(out: Path, name: str) -> dict:
    return json.loads((out / f"{name}.json").read_text())


DRY_BUDGET = "1500"
"""Seconds for the whole dry run: far past its ~5 minutes of work even on a slow 2-core machine, so that no part meets
its deadline (a 540 s budget cut one case of 25 on CI); the deadlines have a test of their own below."""


def test_the_dry_run_passes_every_part_and_writes_every_file(tmp_path):
    r = _run(tmp_path, "--budget", DRY_BUDGET, timeout=1800)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == sorted([f"{p}.json" for p in PARTS] + ["clients.png", "kernels_cpu.json", "kernels_cpu.png",
                                                            "summary.json"])
    summary = _load(tmp_path, "summary")
    assert summary["ok"] and summary["dry_run"] and [p["part"] for p in summary["parts"]] == list(PARTS)
    assert all(p["status"] == "pass" for p in summary["parts"]), summary["parts"]
    assert "ultraattn GPU check (dry run)" in r.stdout  # the table
    for name in PARTS:
        rec = _load(tmp_path, name)
        assert rec["status"] == "pass" and rec["failures"] == [] and rec["pulp"] is False, (name, rec.get("error"))
    # 0: real clients: every exact row within the policy, the speed row's three ways each in its own process
    cl = _load(tmp_path, "clients")
    assert [(r["impl"], r["position_ids"]) for r in cl["exact"]] == [("sdpa", False), ("sdpa", True),
                                                                     ("flex_attention", True)]
    assert all(not r["problems"] for r in cl["exact"]), cl["exact"]
    (row,) = cl["speed"]
    assert set(row["step_ms"]) == set(row["first_step_s"]) == {"eager", "plain", "ultraattn"}, row
    assert row["step_vs_plain"] > 0 and row["sites"] and all(s["rewritten"] for s in row["sites"]), row
    # 1: every planned case ran and passed the 2x rule, and the op reached the compiled graph
    kc = _load(tmp_path, "kernels_correct")
    assert len(kc["rows"]) == kc["cases_planned"] >= 20 and all(row["ok"] and not row["problems"] for row in kc["rows"])
    cases = {(row["mask"], row["head_dim"], row["dtype"], row["heads"] // row["kv_heads"]) for row in kc["rows"]}
    assert {m for m, *_ in cases} >= {"causal", "document", "random", "block_select", "strided", "global_local"}
    assert {d for _, d, _, _ in cases} == {16, 24, 32} and {g for *_, g in cases} == {1, 4, 8}
    assert {t for _, _, t, _ in cases} == {"bf16", "fp16", "fp32"} and any(row["tune"] == "full" for row in kc["rows"])
    assert all(row["seqlen"] % row["block"] for row in kc["rows"])  # every case has a tail
    assert kc["compiled"]["ok"] and kc["compiled"]["op_called_from_inductor_code"]
    assert kc["score_mod"]["ok"] and kc["score_mod"]["generated"] and not kc["score_mod"]["problems"]
    # 2: two ranks over the host-staged transport, every rank exact, tiles in the graphs
    tr = _load(tmp_path, "two_ranks")
    assert len(tr["rows"]) == 8 and all(row["ok"] and row["transport"] == "StagedTransport" for row in tr["rows"])
    assert {row["kind"] for row in tr["rows"]} == {"causal", "document", "softcap", "document_flex"}
    assert all((row["flex_rows"] > 0) == (row["kind"] == "document_flex") for row in tr["rows"])
    assert all(row["plain_error"] is None and row["problems_vs_eager"] == [] for row in tr["rows"])
    # 3: world 1, both attention kinds exact at the first and last step; the kernel ops ran
    e2e = _load(tmp_path, "backend_e2e")
    for row in e2e["rows"]:
        assert row["ok"] and len(row["steps"]) == 2 and all(not s["problems"] for s in row["steps"]), row
        assert row["kernels_ran"]["bsa_fwd"] > 0 and row["kernels_ran"]["bsa_bwd"] > 0
        assert row["ultraattn_first_step_s"] > 0 and row["plain_step_s"] > 0 and row["step_vs_plain"] > 0
        # the diagnoses a GPU run needs: where the first step's compile went, both compiled steps against eager's
        # error alone (aot_eager on CPU moves nothing), and Inductor's rotary tables against eager's
        assert row["compile_times"] and all(v >= 0 for v in row["compile_times"].values()), row["compile_times"]
        assert row["problems_vs_eager"] == [] and row["plain_problems_vs_eager"] == []
        sampled = row["first_step_sampled_s"]
        assert max(sampled["inclusive"].values()) >= max(sampled["leaf"].values()) > 0, sampled
    assert e2e["rope_tables_compiled_vs_eager"] == {"cos": 0.0, "sin": 0.0}
    # 4: the speed rows, with the ratios the GPU run reports and a check against flex's output
    speed = json.loads((tmp_path / "kernels_cpu.json").read_text())
    assert len(speed["rows"]) == 5 and speed["device"].startswith("cpu")
    for row in speed["rows"]:
        assert row["fwd_vs_flex"] > 0 and row["max_abs_diff_vs_flex"] < 1e-4  # fp32 on both sides
        assert row["methods"]["ultraattn"]["fwd_tflops"] > 0 and row["methods"]["ultraattn"]["bwd_tflops"] > 0
    assert "fwd_vs_sdpa" in next(row for row in speed["rows"] if row["mask"] == "causal")
    # 5: a fitted profile
    cal = _load(tmp_path, "calibration")
    assert cal["profile"]["cost"]["fwd_tflops"] > 0 and cal["versus_default"]["fwd_tflops"]["ratio"] > 0
    # 6: every candidate tile config of each kernel ran (the eager reference kernels here: no difference at all)
    tiles = _load(tmp_path, "tiles")
    sys.path.insert(0, str(SCRIPT.parent))
    from gpucheck.tiles import candidates

    want = [(k, list(c)) for k in ("dkv", "dq", "fwd") for c in candidates(k, "d32")]
    assert [(r["kernel"], r["config"]) for r in tiles["rows"]] == want + [("autotuned", None)] and len(want) > 20
    assert all(r["max_diff"] == 0 and ("fwd_ms" if r["kernel"] == "fwd" else "bwd_ms") in r for r in tiles["rows"])
    assert "fwd_ms" in tiles["rows"][-1] and "bwd_ms" in tiles["rows"][-1]   # the autotuned row: both phases
    assert set(tiles["best"]) == {"dkv", "dq", "fwd"} and any(not r["in_space"] for r in tiles["rows"])
    assert all(b["vs_autotuned"] > 0 and b["vs_first"] > 0 for b in tiles["best"].values())
    # 7: tiles on flex's kernels: split into KV tiles, merged and differentiated with the merged output and LSE,
    # exact by the 2x rule; every mask timed, the flex tile's output equal to flex's
    ft = _load(tmp_path, "flex_tiles")
    assert [r["case"].split(" S=")[0] for r in ft["exact"]] == ["flex causal", "flex document",
                                                              "flex bits document"]
    assert all(r["problems"] == [] for r in ft["exact"]), ft["exact"]
    assert [r["mask"] for r in ft["rows"]] == ["causal", "document", "sliding_window", "strided", "global_local"]
    for row in ft["rows"]:
        for method in ("flex_tile", "flex_tile_bits"):
            assert row["max_abs_diff_vs_flex"][method] < 1e-4, row
            tile = row["methods"][method]
            assert tile["fwd_tflops"] > 0 and tile["bwd_tflops"] > 0 and tile["fwd_vs_flex"] > 0


def test_a_failing_part_or_one_past_its_deadline_stops_nothing_else(tmp_path):
    r = _run(tmp_path / "fail", "--parts", "kernels_speed,calibration", env={"ULTRAATTN_GPUCHECK_FAIL": "calibration"})
    assert r.returncode == 1, r.stdout[-3000:]
    parts = {p["part"]: p for p in _load(tmp_path / "fail", "summary")["parts"]}
    assert parts["calibration"]["status"] == "error" and "injected" in parts["calibration"]["error"]
    assert parts["kernels_speed"]["status"] == "pass"
    # a budget far too short: the part is stopped, recorded as such, and the run says so
    r = _run(tmp_path / "late", "--parts", "kernels_correct", "--budget", "3")
    assert r.returncode == 1
    rec = _load(tmp_path / "late", "kernels_correct")
    assert rec["status"] == "timeout" and "deadline" in rec["error"]
    # bad arguments name the fix
    r = _run(tmp_path, "--parts", "kernels,calibration")
    assert r.returncode == 2 and "unknown ['kernels']" in r.stderr and "kernels_correct" in r.stderr
    r = _run(tmp_path, "--share", "clients=-1")
    assert r.returncode == 2 and "--share 'clients=-1'" in r.stderr and "PART=W" in r.stderr
    r = _run(tmp_path, "--client-rows", "sdpa,pos")
    assert r.returncode == 2 and "unknown ['pos']" in r.stderr and "sdpa+pos" in r.stderr
    r = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and "--dry-run" in r.stderr  # no GPU here
