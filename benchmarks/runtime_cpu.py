"""Runtime benchmark on CPU: 4 gloo ranks, forward + backward wall time per step.

For each mask, side by side in ONE run (same processes, same inputs, same thread count):

* ``ultraattn``: the planned plan, executed by ultraattn's runtime, planned with the cost model of THIS machine:
  the ranks calibrate it first (``ultraattn.calibrate`` on the same 4 ranks, ~40 s; the profile is saved next to
  the results) unless ``--cost-profile FILE`` gives one;
* ``ring``, ``zigzag``, ``allgather``: the baselines' plans executed by the same runtime;
* ``flex_cp``: PyTorch's own FlexAttention context parallel (all-gather K/V, head-tail load
  balancing; private API, see benchmarks/_flex_cp_peer.py). On CPU it runs EAGER, unfused flex_attention (a
  dense reference implementation: torch.compile on CPU refuses its backward), so its figure is a peer's
  end-to-end time here, not a kernel comparison.

Every runtime method's row also has ``predicted_seconds``: the calibrated model's replay of its plan
(``planner.api.evaluate``: forward + backward makespans), and ``executed_predicted_seconds``: the same replay as
the executor runs the plan, each rank's program (``evaluate(executed=True)``). The summary gives each prediction's
error and, per mask, the rank correlation between predicted and measured times over the methods.

Then the CP overhead: ultraattn with one rank (no process group) against plain single-process
attention on the same mask (SDPA with the dense boolean mask, the best plain CPU path for an
arbitrary mask; eager ``flex_attention`` on CPU is a dense reference implementation and slower).

Every timed step is a full forward + backward with a barrier before and after; the figure is
the median over ``--reps`` steps after one warm-up step (``spread``: (max - min) / median of the
steps, how noisy the run was). Ratios are against the fastest other method measured in the same run.
``compute_bound_seconds`` is a plan's kernels alone with every rank busy all the time: no plan on
this runtime and machine beats it, so ``best_other_over_bound`` is the most any plan could gain over
the best baseline.

``drift``: the calibration's two reference steps timed again at the end of the run. A shared machine's speed moves
by several per cent within minutes, and every prediction scales with the rates calibrated at the start: a mask
measured while the machine runs x % slower than at calibration looks x % mispredicted for every method alike.

    python benchmarks/runtime_cpu.py --seqlens 8192                   # all methods (~20 min on 2 cores)
    python benchmarks/runtime_cpu.py --seqlens 16384 --reps 3 --methods ultraattn ring zigzag allgather \
        --no-overhead --out benchmarks/results/runtime_cpu_16k.json
    (flex_cp needs ~18 GB at S=8K on 4 ranks and runs out of memory at 16K on a 24 GB machine)
    -> benchmarks/results/runtime_cpu.json and .png
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from _results import pyplot, write_json

from ultraattn.planner.baselines import METHODS as ALL_METHODS

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

MASKS = ("causal", "strided", "global_local", "document", "sliding_window")
METHODS = ("ultraattn", "ring", "zigzag", "allgather")  # the default selection; --methods takes any registered one


def mask_spec(name: str, seqlen: int) -> str:
    if name == "document":  # uneven packed documents
        fr = (0.37, 0.12, 0.30)
        lens = [int(seqlen * f) for f in fr]
        lens.append(seqlen - sum(lens))
        return "document:lengths=" + "+".join(map(str, lens))
    return name


def _step(fn, reps: int, barrier) -> list[float]:
    times = []
    for n in range(reps + 1):
        barrier()
        t0 = time.perf_counter()
        fn()
        barrier()
        if n:  # the first step is a warm-up
            times.append(time.perf_counter() - t0)
    return times


def rank_worker(rank: int, world: int, cfg: dict) -> dict:
    """Per mask: plan every runtime method, warm each up once, then time them ROUND-ROBIN (the
    order rotates every repetition) so that drifts of a shared 2-core machine hit all methods alike;
    the FlexAttention CP peer runs after them (its own timing, see _flex_cp_peer.py)."""
    import torch.distributed as dist

    import ultraattn
    from ultraattn.masks import parse_mask_spec
    from ultraattn.planner.api import evaluate
    from ultraattn.planner.profile import CostProfile
    from ultraattn.planner.tiling import PlannerOptions
    from ultraattn.runtime.calibrate import calibrate

    if cfg["cost_profile"]:
        profile = CostProfile.load(cfg["cost_profile"])
    else:
        profile = calibrate(dist.group.WORLD, progress=rank == 0, out=cfg["profile_out"])
    cost = profile.cost
    torch.manual_seed(0)
    rows = []
    h, d, reps = cfg["heads"], cfg["head_dim"], cfg["reps"]
    for s in cfg["seqlens"]:
        for mask in cfg["masks"]:
            spec = mask_spec(mask, s)
            mm = parse_mask_spec(spec, s)
            q, k, v = (torch.randn(1, h, s, d) for _ in range(3))
            runs: dict[str, dict] = {}
            fns = {}
            for method in cfg["methods"]:
                row = runs[method] = {"seqlen": s, "mask": mask, "spec": spec, "method": method, "all_seconds": []}
                if method == "flex_cp":
                    continue
                try:
                    t0 = time.perf_counter()
                    plan = ultraattn.plan_attention(mm, seqlen=s, num_heads=h, head_dim=d, dtype=torch.float32,
                                                    method=method, options=PlannerOptions(time_budget=10),
                                                    cost=cost, timeout=600)
                    row["plan_seconds"] = time.perf_counter() - t0
                    row["structure"] = plan.tile_plan.meta.get("structure", method)
                    ev = evaluate(plan.tile_plan, plan.pattern, cost=cost)
                    row["predicted_seconds"] = ev.total_ms() / 1e3
                    # the same plan replayed as the executor runs it: each rank's program (program.executed_graph)
                    row["executed_predicted_seconds"] = evaluate(plan.tile_plan, plan.pattern, cost=cost,
                                                                 executed=True).total_ms() / 1e3
                    # the node doing nothing but this plan's kernels, all ranks busy all the time: no plan on this
                    # runtime and machine can beat it (kernel seconds are at the all-busy rate)
                    row["compute_bound_seconds"] = sum(t.duration for g in (ev.fwd.graph, ev.bwd.graph)
                                                       for t in g.tasks if t.kind == "attn") / world
                    ql, kl, vl = (ultraattn.dispatch(x, plan).requires_grad_() for x in (q, k, v))
                    go = torch.randn(1, h, plan.local_len, d)

                    def fn(plan=plan, ql=ql, kl=kl, vl=vl, go=go):
                        out, _lse = ultraattn.dist_attention(ql, kl, vl, plan)
                        out.backward(go)
                        return plan

                    fns[method] = fn
                except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
                    row["error"] = f"{type(exc).__name__}: {exc}"[:500]
            order = list(fns)
            for rep in range(reps + 1):  # repetition 0 is the warm-up
                for method in order[rep % len(order):] + order[: rep % len(order)] if order else []:
                    dist.barrier()
                    t0 = time.perf_counter()
                    plan = fns[method]()
                    dist.barrier()
                    if rep:
                        runs[method]["all_seconds"].append(time.perf_counter() - t0)
                    tot = plan.comm_log
                    runs[method]["bytes_sent"] = sum(v["sent"] for ph in tot.values() for v in ph.totals().values())
            fns.clear()
            if "flex_cp" in runs:
                try:
                    from _flex_cp_peer import flex_cp_step

                    # the peer times its own forward+backward between barriers (max over ranks),
                    # excluding its BlockMask build/sharding and the unshard of the results
                    runs["flex_cp"]["all_seconds"] = [
                        flex_cp_step(q, k, v, mm, seq_len=s, rank=rank, world=world)["seconds"]
                        for _ in range(cfg["peer_reps"] + 1)][1:]
                    runs["flex_cp"]["bytes_sent"] = None
                except Exception as exc:  # noqa: BLE001
                    runs["flex_cp"]["error"] = f"{type(exc).__name__}: {exc}"[:500]
            for method, row in runs.items():
                if row["all_seconds"]:
                    row["seconds"] = statistics.median(row["all_seconds"])
                    # how noisy: the spread of this rank's steps around their median
                    row["spread"] = (max(row["all_seconds"]) - min(row["all_seconds"])) / row["seconds"]
                # the step time is the slowest rank's (barriers); bytes are summed over ranks
                gathered = [None] * world
                dist.all_gather_object(gathered, row)
                if rank == 0:
                    merged = dict(row)
                    if "seconds" in row:
                        merged["seconds"] = max(g.get("seconds", math.inf) for g in gathered)
                        merged["spread"] = max(g.get("spread", 0.0) for g in gathered)
                        if row.get("bytes_sent") is not None:
                            merged["bytes_sent"] = sum(g.get("bytes_sent") or 0 for g in gathered)
                    rows.append(merged)
                    print(f"  S={s} {mask:15s} {method:10s} "
                          + (f"{merged['seconds']:.3f} s" if "seconds" in merged else merged.get("error", "")),
                          flush=True)
    return {"rows": rows, "drift": drift(profile, cost, rank)}


def drift(profile, cost, rank: int) -> list[dict]:
    """The calibration's reference steps (``calibrate.reference_steps``: the ring and all-gather plans of a causal
    mask, timed as the calibration times them) again after the run: how much faster or slower the machine ran at the
    end than when the profile was made. Every prediction scales with the kernel rates those steps fixed, so a drift of
    x % shifts every mask measured late by about x % against the model (nothing is corrected: this is read, not
    used)."""
    import torch.distributed as dist

    from ultraattn.runtime.calibrate import reference_steps

    then = {p["method"]: p for p in profile.samples.get("step", [])}
    out = []
    for now in reference_steps(dist.group.WORLD, cost=cost) if then else []:
        probe = then[now["method"]]
        if (probe["seqlen"], probe["heads"]) != (now["seqlen"], now["heads"]):   # a profile made on another grid
            continue
        ratio = now["seconds"] / probe["seconds"]
        out.append({"method": now["method"], "seqlen": now["seqlen"], "calibration_seconds": probe["seconds"],
                    "end_seconds": now["seconds"], "end_over_calibration": ratio})
        if rank == 0:
            print(f"  drift: the {now['method']} reference step took {now['seconds']:.3f} s at the end, "
                  f"{ratio:.2f}x its {probe['seconds']:.3f} s at calibration", flush=True)
    return out


def overhead(cfg: dict) -> list[dict]:
    """ultraattn at one rank vs plain single-process SDPA with the dense mask (same threads)."""
    import ultraattn
    from ultraattn.masks import convert, parse_mask_spec

    torch.set_num_threads(cfg["threads_single"])
    rows = []
    h, d, reps = cfg["heads"], cfg["head_dim"], cfg["reps"]
    s = min(cfg["seqlens"])
    for mask in cfg["masks"]:
        mm = parse_mask_spec(mask_spec(mask, s), s)
        q, k, v = (torch.randn(1, h, s, d, requires_grad=True) for _ in range(3))
        go = torch.randn(1, h, s, d)
        zero = torch.zeros(1, 1, 1, 1, dtype=torch.long)
        dense = convert.eval_mask(mm, zero, zero, torch.arange(s).view(1, 1, -1, 1), torch.arange(s).view(1, 1, 1, -1))
        plan = ultraattn.plan_attention(mm, seqlen=s, num_heads=h, head_dim=d, dtype=torch.float32)

        def ours(plan=plan, q=q, k=k, v=v, go=go):
            out, _ = ultraattn.dist_attention(*(ultraattn.dispatch(x, plan) for x in (q, k, v)), plan)
            out.backward(ultraattn.dispatch(go, plan))

        def plain(q=q, k=k, v=v, go=go, dense=dense):
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense)
            out.backward(go)

        t_ours = statistics.median(_step(ours, reps, lambda: None))
        t_plain = statistics.median(_step(plain, reps, lambda: None))
        rows.append({"seqlen": s, "mask": mask, "ultraattn_1rank_s": t_ours, "sdpa_dense_mask_s": t_plain,
                     "overhead": t_ours / t_plain})
        print(f"  1 rank S={s} {mask:15s} ultraattn {t_ours:.3f} s  sdpa(dense mask) {t_plain:.3f} s", flush=True)
    return rows


def summarize(rows: list[dict]) -> list[dict]:
    out = []
    for s in sorted({r["seqlen"] for r in rows}):
        for mask in dict.fromkeys(r["mask"] for r in rows):
            sub = {r["method"]: r for r in rows if r["seqlen"] == s and r["mask"] == mask and "seconds" in r}
            if "ultraattn" not in sub:
                continue
            ours = sub["ultraattn"]["seconds"]
            others = {m: r["seconds"] for m, r in sub.items() if m != "ultraattn"}
            best = min(others, key=others.get) if others else None
            pred = {m: r["predicted_seconds"] for m, r in sub.items() if r.get("predicted_seconds")}
            meas = {m: sub[m]["seconds"] for m in pred}
            bound = sub["ultraattn"].get("compute_bound_seconds")
            out.append({"seqlen": s, "mask": mask, "ultraattn_s": ours,
                        "speedup_vs": {m: t / ours for m, t in others.items()},
                        "best_other": best, "speedup_vs_best": (others[best] / ours) if best else None,
                        "compute_bound_s": bound,
                        "best_other_over_bound": others[best] / bound if best and bound else None,
                        "predicted_over_measured": {m: pred[m] / meas[m] for m in pred},
                        "rank_correlation": spearman([pred[m] for m in pred], [meas[m] for m in pred])})
    return out


def fidelity(rows: list[dict], key: str = "predicted_seconds") -> dict:
    """Per sequence length, over every (mask, method) measured and predicted (``key``: the plain replay's prediction,
    or ``executed_predicted_seconds``, the replay as executed): the share within +-20%, the median and worst
    |predicted / measured - 1|, the median signed error, and the rank correlation of predicted and measured times."""
    out = {}
    for s in sorted({r["seqlen"] for r in rows}):
        sub = [r for r in rows if r["seqlen"] == s and r.get("seconds") and r.get(key)]
        if not sub:
            continue
        signed = [r[key] / r["seconds"] - 1 for r in sub]
        err = [abs(e) for e in signed]
        out[str(s)] = {"pairs": len(sub), "within_20pct": sum(e <= 0.2 for e in err) / len(err),
                       "median_abs_err": statistics.median(err), "worst_abs_err": max(err),
                       "median_err": statistics.median(signed),
                       "rank_correlation": spearman([r[key] for r in sub], [r["seconds"] for r in sub])}
    return out


def spearman(a: list[float], b: list[float]) -> float | None:
    """Spearman's rank correlation (ties share their mean rank); None below 3 values."""
    if len(a) < 3:
        return None

    def ranks(x):
        order = sorted(range(len(x)), key=x.__getitem__)
        r = [0.0] * len(x)
        i = 0
        while i < len(x):
            j = i
            while j + 1 < len(x) and x[order[j + 1]] == x[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.mean(ra), statistics.mean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    sa = math.sqrt(sum((x - ma) ** 2 for x in ra))
    sb = math.sqrt(sum((y - mb) ** 2 for y in rb))
    return cov / (sa * sb) if sa and sb else None


def plot(result: dict, path: Path) -> bool:
    """Seconds per step per mask and method, the model's predictions as ticks; False (no PNG) without matplotlib."""
    plt = pyplot()
    if plt is None:
        return False
    rows = [r for r in result["rows"] if "seconds" in r]
    seqlens = sorted({r["seqlen"] for r in rows})
    methods = [m for m in result["config"]["methods"] if any(r["method"] == m for r in rows)]
    fig, axes = plt.subplots(1, len(seqlens), figsize=(6.5 * len(seqlens), 4.2), squeeze=False)
    for ax, s in zip(axes[0], seqlens):
        masks = list(dict.fromkeys(r["mask"] for r in rows if r["seqlen"] == s))
        w = 0.8 / max(len(methods), 1)
        for n, m in enumerate(methods):
            ys = []
            for mask in masks:
                hit = [r for r in rows if r["seqlen"] == s and r["mask"] == mask and r["method"] == m]
                ys.append(hit[0]["seconds"] if hit else float("nan"))
            bars = ax.bar([i + n * w for i in range(len(masks))], ys, width=w,
                          label="flex_cp (eager, unfused on CPU)" if m == "flex_cp" else m)
            preds = []
            for mask in masks:
                hit = [r for r in rows if r["seqlen"] == s and r["mask"] == mask and r["method"] == m]
                preds.append(hit[0].get("predicted_seconds") or float("nan") if hit else float("nan"))
            # the calibrated model's prediction: a black tick on each bar
            ax.scatter([b.get_x() + b.get_width() / 2 for b in bars], preds, marker="_", s=120, color="black",
                       zorder=3, label="predicted" if n == 0 else None)
        ax.set_xticks([i + 0.4 - w / 2 for i in range(len(masks))], masks, rotation=20)
        ax.set_yscale("log")
        ax.set_ylabel("fwd+bwd seconds per step (log; lower is better)")
        ax.set_title(f"4 gloo ranks on CPU, S={s}, {result['config']['heads']} heads, d={result['config']['head_dim']}")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def replot(json_path: Path) -> None:
    """Redraw the PNG next to a results JSON (``--replot FILE``)."""
    plot(json.loads(json_path.read_text()), json_path.with_suffix(".png"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[8192, 16384])
    ap.add_argument("--masks", nargs="+", default=list(MASKS), choices=MASKS)
    ap.add_argument("--methods", nargs="+", default=[*METHODS, "flex_cp"], choices=[*ALL_METHODS, "flex_cp"])
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--peer-reps", type=int, default=2,
                    help="timed steps of flex_cp (its eager CPU step takes ~20 s at S=8K; default 2)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--no-overhead", action="store_true")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "runtime_cpu.json")
    ap.add_argument("--cost-profile", type=Path, help="plan with this profile instead of calibrating first")
    ap.add_argument("--replot", type=Path, help="only redraw the PNG of an existing results JSON")
    args = ap.parse_args(argv)
    if args.replot:
        replot(args.replot)
        return 0
    from ultraattn.testing import run_ranks

    cfg = {"seqlens": args.seqlens, "masks": args.masks, "methods": args.methods, "heads": args.heads,
           "head_dim": args.head_dim, "reps": args.reps, "peer_reps": args.peer_reps, "world": args.world,
           "threads_per_rank": args.threads, "threads_single": os.cpu_count() or 1, "dtype": "fp32",
           "cost_profile": str(args.cost_profile) if args.cost_profile else None,
           "profile_out": None if args.cost_profile else str(args.out.with_name(args.out.stem + "_profile.json"))}
    print(f"runtime_cpu: {args.world} ranks, {cfg}", flush=True)
    t0 = time.time()
    got = run_ranks(rank_worker, args.world, args=(cfg,), timeout=6 * 3600, pg_timeout=3600,
                    threads=args.threads)[0]
    rows = got["rows"]
    over = [] if args.no_overhead else overhead(cfg)
    result = {
        "command": "python benchmarks/runtime_cpu.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__},
        "config": cfg, "rows": rows, "summary": summarize(rows), "fidelity": fidelity(rows),
        "fidelity_executed": fidelity(rows, "executed_predicted_seconds"), "overhead_1rank": over,
        "drift": got["drift"],
        "notes": ["flex_cp is PyTorch's FlexAttention context parallel run with EAGER (unfused) flex_attention: "
                  "torch.compile on CPU refuses flex_attention's backward, so this is an end-to-end peer figure on "
                  "CPU, not a kernel comparison"],
        "wall_seconds": time.time() - t0,
    }
    write_json(args.out, {**result, "meta": {"command": result["command"]}})  # its command line, argv given or not
    png = plot(result, args.out.with_suffix(".png"))
    for r in result["summary"]:
        vs = ", ".join(f"{m} {x:.2f}x" for m, x in r["speedup_vs"].items())
        pm = ", ".join(f"{m} {x:.2f}" for m, x in r["predicted_over_measured"].items())
        rc = r["rank_correlation"]
        print(f"S={r['seqlen']} {r['mask']:15s} ultraattn {r['ultraattn_s']:.3f} s; speedup vs {vs}; "
              f"predicted/measured {pm}; rank corr {'n/a' if rc is None else f'{rc:.2f}'}")
    for what, key in (("model fidelity", "fidelity"), ("as executed", "fidelity_executed")):
        for s, f in result[key].items():
            rc = f["rank_correlation"]   # (None below three plans)
            print(f"S={s} {what}: {f['within_20pct']:.0%} of {f['pairs']} within +-20%, median |error| "
                  f"{f['median_abs_err']:.1%}, worst {f['worst_abs_err']:.1%}, median error {f['median_err']:+.1%}, "
                  f"rank correlation {'n/a' if rc is None else f'{rc:.2f}'}")
    for d in result["drift"]:
        print(f"drift: the calibration's {d['method']} reference step ran {d['end_over_calibration']:.2f}x its "
              f"calibration time at the end (every prediction scales with it)")
    print("note: " + result["notes"][0])
    print(f"wrote {args.out}" + (f" and {args.out.with_suffix('.png')}" if png else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
