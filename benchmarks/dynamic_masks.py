"""Explicit run-time programs against the opaque op, end to end on CPU: the example's model, document masks.

The model of ``examples/train_cp.py`` (Llama-style, GQA, RoPE) compiled with the ultraattn backend on 4 gloo
ranks; every step packs new random documents (a new BlockMask). Configurations, side by side in ONE run
(same processes, same data; each compiled once, then timed round-robin so drift hits all alike):

* ``explicit``: the default: the sites are explicit programs (``passes/explicit/per_mask.py``);
* ``opaque``: ``options={"explicit": False}``: one op per site, planned by the fast planner each step;
* with ``--attention-only`` (the global view, where owners may follow each mask) also ``explicit-fixed``:
  explicit programs with owners fixed per graph (head-tail) instead of chosen per batch.

Each timed step is forward + backward + an optimizer step with a barrier before and after; the figure is the
median over ``--steps`` steps (after ``--warmup``), ``spread`` = (max - min) / median. Ratios are against
``opaque`` in the same run.

    python benchmarks/dynamic_masks.py                     # sequence-sharded model (the example's default)
    python benchmarks/dynamic_masks.py --attention-only    # + fixed vs per-batch owners
    -> benchmarks/results/dynamic_masks[_attention_only].json and .png
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from _results import pyplot, save

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "examples"))


def worker(rank: int, world: int, args: dict) -> dict:
    import torch.distributed as dist
    from train_cp import Llama, batches, document_masks

    import ultraattn.passes.explicit.per_mask as rt

    ns = argparse.Namespace(seed=0, steps=args["warmup"] + args["steps"], seqlen=args["seqlen"], same_mask=False)
    data = batches(ns)
    masks = [document_masks(lengths, torch.device("cpu"))[0] for _, lengths in data]
    runs = {}
    for name in args["configs"]:
        torch.manual_seed(0)
        model = Llama(args["dim"], args["layers"], args["heads"], args["kv_heads"])
        opts = {"ilp_time_limit": 1.0, "time_budget": 2.0, "explicit": name != "opaque",
                "shard": not args["attention_only"], "report": "off"}
        rt.OWNERS_PER_BATCH = name != "explicit-fixed"  # read when the graph is compiled
        fn = torch.compile(model, backend="ultraattn", options=opts)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        runs[name] = (model, fn, opt)
    rt.OWNERS_PER_BATCH = True
    times = {name: [] for name in runs}
    losses = {name: [] for name in runs}
    for step, (tokens, _) in enumerate(data):
        for name, (_model, fn, opt) in runs.items():
            dist.barrier()
            t0 = time.perf_counter()
            loss = fn(tokens, masks[step])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            dist.barrier()
            if step >= args["warmup"]:
                times[name].append(time.perf_counter() - t0)
            losses[name].append(loss.item())
    return {"times": times, "losses": losses}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqlen", type=int, default=4096)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--attention-only", action="store_true")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    from ultraattn.testing import run_ranks

    configs = ["explicit", "opaque"] + (["explicit-fixed"] if a.attention_only else [])
    args = {"seqlen": a.seqlen, "layers": a.layers, "dim": a.dim, "heads": a.heads, "kv_heads": a.kv_heads,
            "steps": a.steps, "warmup": a.warmup, "attention_only": a.attention_only, "configs": configs}
    print(f"{a.nproc} gloo ranks, seqlen {a.seqlen}, {a.layers} layers, dim {a.dim}, {a.heads}/{a.kv_heads} heads, "
          f"{'attention-only' if a.attention_only else 'sequence-sharded'}; {a.steps} timed steps after {a.warmup}")
    t0 = time.time()
    res = run_ranks(worker, a.nproc, args=(args,), timeout=3600, pg_timeout=600)
    rows = {}
    for name in configs:
        per_step = [max(r["times"][name][i] for r in res) for i in range(a.steps)]  # the slowest rank's step
        med = statistics.median(per_step)
        rows[name] = {"median_s": med, "spread": (max(per_step) - min(per_step)) / med, "steps_s": per_step}
    base = rows["opaque"]["median_s"]
    for name, row in rows.items():
        row["over_opaque"] = row["median_s"] / base
        # paired: the same step's mask, timed back to back (drift and the mask's own cost cancel)
        paired = [a / b for a, b in zip(row["steps_s"], rows["opaque"]["steps_s"])]
        row["paired_over_opaque"] = {"median": statistics.median(paired), "min": min(paired), "max": max(paired)}
        print(f"{name:>15}: median {row['median_s']:.3f} s/step (spread {row['spread']:.0%}), "
              f"{row['over_opaque']:.3f}x opaque; paired per step: median {statistics.median(paired):.3f}x "
              f"({min(paired):.2f}-{max(paired):.2f})")
    same = all(abs(x - y) <= 1e-4 for r in res for name in configs
               for x, y in zip(r["losses"][name], r["losses"]["opaque"]))
    print(f"losses of every configuration equal opaque's within 1e-4: {same}  ({time.time() - t0:.0f} s)")
    out = Path(a.out) if a.out else HERE / "results" / ("dynamic_masks" + ("_attention_only" if a.attention_only
                                                                               else "") + ".json")
    save(out, {"torch": torch.__version__, "threads": torch.get_num_threads(), **args, "nproc": a.nproc,
               "losses_match": same}, rows)
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    names = list(rows)
    for i, n in enumerate(names):
        ax.scatter([i] * len(rows[n]["steps_s"]), rows[n]["steps_s"], s=10, color="grey", zorder=2)
    ax.bar(range(len(names)), [rows[n]["median_s"] for n in names], color=["tab:blue", "tab:grey", "tab:cyan"][
        :len(names)], zorder=1)
    ax.set_xticks(range(len(names)), [f"{n}\n{rows[n]['over_opaque']:.2f}x" for n in names])
    ax.set_ylabel("s / step (slowest rank; dots: steps)")
    ax.set_title(f"document masks, {a.nproc} CPU ranks, S={a.seqlen}" + (", attention-only" if a.attention_only
                                                                       else ""), fontsize=9)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
