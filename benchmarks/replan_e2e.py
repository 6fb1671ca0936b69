"""End to end: a new document mask every step costs a training step no more than the same mask every step.

A sequence-sharded Llama-style model (``examples/train_cp.py``) trains on 4 gloo ranks at S = 16K
with ``flex_attention`` and a document-causal BlockMask, in three modes, one after the other in one
run with the same model, tokens and threads:

* ``same``: the first step's documents every step (planned once, then the plan cache hits);
* ``new``: new random document lengths every step, planned at the first attention of the step by
  the fast planner (every rank for itself);
* ``new+ahead``: new lengths, each step's mask handed to ``ultraattn.plan_ahead`` one step early.

Per mode: step times of rank 0 (the first ``--warmup`` steps compile and are left out of the steady
figure), planning milliseconds inside the step, and the backend's counters (graphs compiled, so a
recompile after the first step shows). The figure of merit is the steady median step time of
``new`` (and ``new+ahead``) over ``same``. Exactness against one process is the example's own
check (``tests/test_backend.py::test_main_example_runs_and_matches_a_single_process``), not
repeated here. On CPU the 4 ranks share the machine's cores, so step times show overhead, not
speed-up.

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

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))

import train_cp  # noqa: E402

from ultraattn.testing import run_ranks  # noqa: E402

MODES = {"same": {"same_mask": True, "plan_ahead": False}, "new": {"same_mask": False, "plan_ahead": False},
         "new+ahead": {"same_mask": False, "plan_ahead": True}}


def rank_run(rank: int, world: int, args: argparse.Namespace) -> dict:
    """One rank: ``train_cp.train`` through the backend, then Dynamo's and the backend's counters."""
    from torch._dynamo.utils import counters

    res = train_cp.train(args, torch.device("cpu"), compiled=True, rank=rank)
    res["graphs"] = counters["ultraattn"]["graphs"]
    res["unique_graphs"] = counters["stats"]["unique_graphs"]
    res["recompiles"] = sum(counters["recompiles"].values())
    return res


def run_mode(name: str, base: argparse.Namespace) -> dict:
    args = argparse.Namespace(**{**vars(base), **MODES[name], "mask": "document", "opaque": False,
                                 "attention_only": False})
    res = run_ranks(rank_run, base.nproc, args=(args,), timeout=3600)
    r0 = res[0]
    steady = r0["seconds"][base.warmup:]
    return {"mode": name, "seconds": r0["seconds"], "plan_ms": r0["plan_ms"],
            "steady_median_s": statistics.median(steady), "steady_min_s": min(steady), "steady_max_s": max(steady),
            "steady_plan_ms_median": statistics.median(r0["plan_ms"][base.warmup:]),
            "graphs": [r["graphs"] for r in res], "unique_graphs": [r["unique_graphs"] for r in res],
            "recompiles": [r["recompiles"] for r in res], "planned_ahead": [r["planned_ahead"] for r in res],
            "losses": r0["losses"]}


def plot(out: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    ratios = ", ".join(f"{k} {v:.3f}x" for k, v in out["steady_ratio_vs_same"].items())
    fig.suptitle(f"steady median step time vs the same mask every step: {ratios}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


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
    by = {m["mode"]: m for m in out["modes"]}
    if "same" in by:
        out["steady_ratio_vs_same"] = {k: v["steady_median_s"] / by["same"]["steady_median_s"] for k, v in by.items()
                                       if k != "same"}
        print("steady median step time vs same mask:", json.dumps(out["steady_ratio_vs_same"]))
    os.makedirs(os.path.dirname(base.out), exist_ok=True)
    with open(base.out + ".json", "w") as fh:
        json.dump(out, fh, indent=1)
    if "same" in by:
        plot(out, base.out + ".png")
    print(f"wrote {base.out}.json" + (" and .png" if "same" in by else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
