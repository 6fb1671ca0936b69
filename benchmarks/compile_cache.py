"""Compile time of the example model, cold and warm: does a second run hit Inductor's FX graph cache?

The rewritten graphs carry each site's key as a string. The keys are derived from the graph and the site
(``SideTable.site_key``), not drawn at random, so a second process compiling the same model produces the same graph
text, and Inductor's FX graph cache (on disk, ``TORCHINDUCTOR_CACHE_DIR``) serves it instead of generating code again.

Each configuration runs twice in fresh processes sharing one fresh cache folder: "cold" (empty cache) then "warm".
The figure is the first training step's time (compile + run) on rank 0, as the example prints it, and the FX graph
cache hits and misses. The baseline is plain ``torch.compile`` (Inductor, one process, no ultraattn) of the same model
and step, measured in the same run.

    python benchmarks/compile_cache.py                        # 2 ranks, the example's defaults
    python benchmarks/compile_cache.py --nproc 4 --mask document --seqlen 16384 --before /tmp/old \
        --out benchmarks/results/compile_cache_document.json      # run-time-mask sites at 16K tokens
    python benchmarks/compile_cache.py --repeats 3 --before /tmp/old   # also an older checkout, same run

``--before DIR`` runs the same command from another checkout of the repository (its ``ultraattn`` first on the
path): the way to compare with the code before a change, in the same run.

Results: ``benchmarks/results/compile_cache.{json,png}``.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _results import pyplot, save

ROOT = Path(__file__).resolve().parents[1]

PLAIN = """
import sys, time, torch
sys.path.insert(0, {examples!r})
from torch._dynamo.utils import counters
import train_cp
args = train_cp.parse_args()
torch.manual_seed(args.seed)
model = train_cp.Llama(args.dim, args.layers, args.heads, args.kv_heads)
run = torch.compile(model)
tokens, _ = train_cp.batches(args)[0]
start = time.perf_counter()
run(tokens, None).backward()
print(f"FIRST {{time.perf_counter() - start:.3f}} HITS {{counters['inductor']['fxgraph_cache_hit']}} "
      f"MISSES {{counters['inductor']['fxgraph_cache_miss']}}")
"""


def run_once(cmd: list[str], cache: str, tree: Path = ROOT) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "PYTHONPATH": str(tree)}
    out = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True, timeout=1800)
    if out.returncode:
        sys.exit(f"{' '.join(cmd[:3])} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    text = out.stdout
    if "FIRST" in text:  # the plain torch.compile script
        m = re.search(r"FIRST (\S+) HITS (\d+) MISSES (\d+)", text)
        return {"first_step_s": float(m[1]), "hits": int(m[2]), "misses": int(m[3])}
    step = re.search(r"^\s+1\s+\S+\s+\S+\s+\S+\s+(\S+)", text, re.M)
    cache_line = re.search(r"FX graph cache, rank 0: (\d+) hits, (\d+) misses", text)
    if cache_line is None:  # an older example that does not print Inductor's cache counters
        return {"first_step_s": float(step[1]), "hits": None, "misses": None}
    return {"first_step_s": float(step[1]), "hits": int(cache_line[1]), "misses": int(cache_line[2])}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=2, help="ranks of the ultraattn run (default 2)")
    p.add_argument("--mask", choices=("causal", "document"), default="causal")
    p.add_argument("--seqlen", type=int, default=512, help="the example's sequence length (default 512)")
    p.add_argument("--repeats", type=int, default=1, help="cold/warm pairs per configuration (medians reported)")
    p.add_argument("--before", type=Path, default=None, help="another checkout to run the ultraattn case from too")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "compile_cache.json")
    args = p.parse_args()
    if args.repeats < 1:
        p.error(f"--repeats must be at least 1, got {args.repeats}")
    model_args = ["--steps", "1", "--mask", args.mask, "--seqlen", str(args.seqlen)]
    ours = [sys.executable, "examples/train_cp.py", "--nproc", str(args.nproc), *model_args]
    configs = {f"ultraattn, {args.nproc} ranks": (ours, ROOT)}
    if args.before is not None:
        configs[f"ultraattn, {args.nproc} ranks, {args.before.name}"] = (ours, args.before.resolve())
    configs["plain torch.compile, 1 process"] = (
        [sys.executable, "-c", PLAIN.format(examples=str(ROOT / "examples")), *model_args], ROOT)
    rows = []
    for rep in range(args.repeats):
        for name, (cmd, tree) in configs.items():
            with tempfile.TemporaryDirectory(prefix="ultraattn-cache-") as cache:
                for run in ("cold", "warm"):
                    r = run_once(cmd, cache, tree)
                    rows.append({"config": name, "run": run, "repeat": rep, **r})
                    print(f"{name:<40} {run:<5} first step {r['first_step_s']:7.2f} s   FX graph cache "
                          f"{r['hits']} hits, {r['misses']} misses", flush=True)
    medians = {f"{name} / {run}": statistics.median(r["first_step_s"] for r in rows
                                                     if r["config"] == name and r["run"] == run)
               for name in configs for run in ("cold", "warm")}
    for k, v in medians.items():
        print(f"median {k}: {v:.2f} s")
    save(args.out, {"nproc": args.nproc, "mask": args.mask, "repeats": args.repeats, "medians_s": medians,
                    "note": "first step = compile + run, rank 0; cold: an empty Inductor cache folder"}, rows)
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(6, 3.2))
        names = list(configs)
        for j, run in enumerate(("cold", "warm")):
            vals = [medians[f"{n} / {run}"] for n in names]
            ax.barh([i + 0.4 * j for i in range(len(names))], vals, height=0.4, label=run)
        ax.set_yticks([i + 0.2 for i in range(len(names))], names)
        ax.set_xlabel(f"first step (compile + run), s (median of {args.repeats})")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.out.with_suffix(".png"), dpi=120)
    return 0


if __name__ == "__main__":
    sys.exit(main())
