"""End to end: a new document mask every step costs a training step no more than the same mask every step.

A sequence-sharded Llama-style model (``examples/train_cp.py``) trains on 4 gloo ranks at S = 16K
with ``flex_attention`` and a document-causal BlockMask, in three modes, one after the other in one
run with the same model, tokens and threads:

* ``same``: the first step's documents every step (planned once, then the plan cache hits);
* ``new``: new random document lengths every step, planned at the first attention of the step by
  the fast planner (every rank for itself);
* ``new+ahead``: new lengths, each step's mask handed to ``ultraattn.plan_ahead`` one step early.

``same`` against ``new`` compares different workloads: the first mask is one draw, and the
attention work of a document mask varies with its lengths (here the first mask has 0.22 of causal
attention's cells, the others 0.21-0.60). So ``new`` and ``new+ahead`` run their ``--steps`` masks
twice: the first pass meets each mask for the first time (planned, its executor and tiles built),
the second pass runs the very same masks again with every plan cached (the site's plan cache holds
16). The figure of merit is the paired ratio: the median over steps (after ``--warmup``) of the
first pass's step time over the second pass's for the same mask, i.e. what a new mask costs a step
with the work held equal. Also recorded: step times of rank 0, planning milliseconds inside the
step, and the backend's and Dynamo's counters (graphs compiled, recompiles: a recompile after the
first step would show). Exactness against one process is the example's own check
(``tests/test_backend.py::test_main_example_runs_and_matches_a_single_process``), not repeated
here. On CPU the 4 ranks share the machine's cores, so step times show overhead, not speed-up.

    python benchmarks/replan_e2e.py                 # ~10 min on 2 cores; writes results/replan_e2e.{json,png}
    python benchmarks/replan_e2e.py --seqlen 4096 --steps 4   # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
from pathlib import Path

import torch
from _results import pyplot, write_json

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))

import train_cp  # noqa: E402

from ultraattn.testing import run_ranks  # noqa: E402

MODES = {"same": {"same_mask": True, "plan_ahead": False}, "new": {"same_mask": False, "plan_ahead": False},
         "new+ahead": {"same_mask": False, "plan_ahead": True}}


def rank_run(rank: int, world: int, args: argparse.Namespace) -> dict:
    """One rank: ``train_cp.train`` through the backend, then Dynamo's and the backend's counters."""
    from torch._dynamo.utils import counters

    if args.replay:  # each mask twice: steps 1..N new, N+1..2N seen (train_cp.train draws its data here)
        draw = train_cp.batches
        train_cp.batches = lambda a: draw(argparse.Namespace(**{**vars(a), "steps": a.steps // 2})) * 2
    res = train_cp.train(args, torch.device("cpu"), compiled=True, rank=rank)
    res["graphs"] = counters["ultraattn"]["graphs"]
    res["unique_graphs"] = counters["stats"]["unique_graphs"]
    res["recompiles"] = sum(counters["recompiles"].values())
    return res


def run_mode(name: str, base: argparse.Namespace) -> dict:
    replay = name != "same"
    args = argparse.Namespace(**{**vars(base), **MODES[name], "mask": "document", "opaque": False,
                                 "attention_only": False, "cost": "default", "replay": replay,
                                 "steps": 2 * base.steps if replay else base.steps})
    res = run_ranks(rank_run, base.nproc, args=(args,), timeout=3600)
    r0 = res[0]
    n, w = base.steps, base.warmup
    steady = r0["seconds"][w:n]
    paired = {}
    if replay:
        first, second = r0["seconds"][w:n], r0["seconds"][n + w:]
        ratios = [a / b for a, b in zip(first, second, strict=True)]
        paired = {"seen_median_s": statistics.median(second), "paired_ratio_median": statistics.median(ratios),
                  "paired_ratio_min": min(ratios), "paired_ratio_max": max(ratios),
                  "seen_plan_ms_median": statistics.median(r0["plan_ms"][n + w:])}
    return {**paired, "mode": name, "seconds": r0["seconds"], "plan_ms": r0["plan_ms"],
            "steady_median_s": statistics.median(steady), "steady_min_s": min(steady), "steady_max_s": max(steady),
            "steady_plan_ms_median": statistics.median(r0["plan_ms"][w:n]),
            "graphs": [r["graphs"] for r in res], "unique_graphs": [r["unique_graphs"] for r in res],
            "recompiles": [r["recompiles"] for r in res], "planned_ahead": [r["planned_ahead"] for r in res],
            "losses": r0["losses"]}


def plot(out: dict, path: str) -> bool:
    """Step time and planning time per step, per mode; False (no PNG) without matplotlib."""
    plt = pyplot()
    if plt is None:
        return False
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for m in out["modes"]:
        steps = range(1, len(m["seconds"]) + 1)
        a.plot(steps, m["seconds"], marker="o", label=m["mode"])
        b.plot(steps, m["plan_ms"], marker="o", label=m["mode"])
    a.set(xlabel="step", ylabel="s / step (rank 0)", yscale="log",
          title=f"S={out['seqlen']}, {out['nproc']} gloo ranks: step time (step 1 compiles)")
    b.set(xlabel="step", ylabel="planning ms inside the step", title="planning on the step's path")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend()
    ratios = ", ".join(f"{m['mode']} {m['paired_ratio_median']:.3f}x" for m in out["modes"]
                       if "paired_ratio_median" in m)
    fig.suptitle(f"a mask's first use over its reuse (paired, median): {ratios}; steps {out['steps'] + 1}.. rerun "
                 f"the first {out['steps']} masks", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--seqlen", type=int, default=16384)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the steady figures (compiling)")
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated, from " + ", ".join(MODES))
    p.add_argument("--out", default=os.path.join(HERE, "results", "replan_e2e"))
    base = p.parse_args()
    if base.steps <= base.warmup:
        p.error(f"--steps ({base.steps}) must exceed --warmup ({base.warmup})")
    modes = base.modes.split(",")
    bad = [m for m in modes if m not in MODES]
    if bad:
        p.error(f"--modes: unknown {bad}; choose from {', '.join(MODES)}")
    out = {"machine": platform.platform(), "cpu_count": os.cpu_count(), "torch": torch.__version__,
           "seqlen": base.seqlen, "nproc": base.nproc, "steps": base.steps, "warmup": base.warmup,
           "model": {"layers": base.layers, "dim": base.dim, "heads": base.heads, "kv_heads": base.kv_heads},
           "command": "python " + " ".join(sys.argv), "modes": []}
    for m in modes:
        print(f"--- {m}", flush=True)
        r = run_mode(m, base)
        out["modes"].append(r)
        print(f"{m}: steady median {r['steady_median_s']:.2f} s/step (min {r['steady_min_s']:.2f}, max "
              f"{r['steady_max_s']:.2f}), planning {r['steady_plan_ms_median']:.1f} ms/step, graphs {r['graphs']}, "
              f"recompiles {r['recompiles']}", flush=True)
        if "paired_ratio_median" in r:
            print(f"{m}: the same masks again, plans cached: {r['seen_median_s']:.2f} s/step; first use over reuse, "
                  f"paired per mask: median {r['paired_ratio_median']:.3f}x (min {r['paired_ratio_min']:.3f}, "
                  f"max {r['paired_ratio_max']:.3f})", flush=True)
    by = {m["mode"]: m for m in out["modes"]}
    if "same" in by:
        out["steady_ratio_vs_same"] = {k: v["steady_median_s"] / by["same"]["steady_median_s"] for k, v in by.items()
                                       if k != "same"}
        print("steady median step time vs same mask:", json.dumps(out["steady_ratio_vs_same"]))
    write_json(Path(base.out + ".json"), out)
    png = plot(out, base.out + ".png")
    print(f"wrote {base.out}.json" + (" and .png" if png else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
