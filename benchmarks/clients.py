"""A client's model under the backend: torchtitan's Llama 3 on N gloo ranks, checked against one eager process.

torchtitan 0.3.0's Llama 3 (its debug configuration, smaller: 2 layers, dim 128, 8 heads / 4 KV heads, vocab
2048, ComplexRoPE, fused QKV) trains one step with ``torch.compile(model, backend="ultraattn")`` on ``--nproc``
gloo ranks, in four cases: torchtitan's two attention backends (``sdpa``: causal ``scaled_dot_product_attention``;
``flex``: its ``FlexAttention`` with the block-causal document mask ``model.get_attention_masks(positions)``
builds from per-document positions) times two ways of compiling (``whole``: the whole model; ``regional``:
``block.compile(backend="ultraattn")`` per TransformerBlock, as torchtitan's ``apply_compile`` does, which
refuses this backend itself). Every rank's loss and parameter gradients are checked against the eager
single-process model in fp64 and fp32 by the rule of ``tests/numerics.py``: error against fp64
<= 2 x (eager fp32's error against fp64) + 16 fp32 ulps of the tensor's scale. Reported per case: exact
(the worst error / tolerance ratio), the backend's graphs, sites, sharded ops, ops left replicated (every
rank runs them on all tokens) and ops run on gathered data (its records), Dynamo graphs and graph breaks,
compile time (the first step), the median of the later steps, and the eager single-process step. One thread
per process; the same weights (seeded) and tokens on every rank.

    pip install --no-deps torchtitan==0.3.0 && pip install spmd_types==0.2.3 tyro einops   # first
    python benchmarks/clients.py                      # 2 ranks, S = 512, all four cases (minutes on 2 cores)
    python benchmarks/clients.py --attn flex --modes regional --seqlen 1024 --nproc 4
    -> a table on stdout, benchmarks/results/clients.{json,png}

Not part of CI (torchtitan is not a dependency of the project).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from _results import pyplot, save

from ultraattn.testing import run_ranks

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import torchtitan_cp  # noqa: E402

EPS = torch.finfo(torch.float32).eps


# ---------------------------------------------------------------- the model, its data, one step
# (the model, its batches and the eager reference's CPU flex come from the example, examples/torchtitan_cp.py)
def build(args, attn: str, dtype: torch.dtype) -> torch.nn.Module:
    return torchtitan_cp.build(argparse.Namespace(**{**vars(args), "attn": attn}), dtype)


def make_batch(args, model, attn: str) -> tuple:
    return torchtitan_cp.make_batch(argparse.Namespace(**{**vars(args), "attn": attn}), model)


def run_steps(run, model, batch, steps: int) -> tuple[dict, list[float]]:
    """``1 + steps`` training steps (forward, loss, backward; no optimizer, so all alike): the first one's loss
    and gradients, and every step's seconds."""
    inputs, labels, extra = batch
    first, seconds = None, []
    for _ in range(1 + steps):
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        loss = F.cross_entropy(run(inputs, *extra).flatten(0, 1), labels.flatten())
        loss.backward()
        seconds.append(time.perf_counter() - t0)
        if first is None:
            first = {"loss": loss.detach().double(),
                     "grads": {n: p.grad.detach().double().clone() for n, p in model.named_parameters()}}
    return first, seconds


# ---------------------------------------------------------------- the processes
def reference(rank: int, world: int, args, attn: str) -> dict:
    """The eager single-process model in fp64 and fp32 (one process, no group), and its fp32 step time."""
    torchtitan_cp.eager_reference_mode()
    out = {}
    for name, dtype in (("ref64", torch.float64), ("ref32", torch.float32)):
        model = build(args, attn, dtype)
        first, seconds = run_steps(model, model, make_batch(args, model, attn), args.steps if name == "ref32" else 0)
        out[name], out["eager_s"] = first, statistics.median(seconds)
    return out


def compiled(rank: int, world: int, args, attn: str, mode: str) -> dict:
    """One rank: the model through the backend, whole or per block; its step, times and the backend's records."""
    from torch._dynamo.utils import counters

    from ultraattn.passes import side_table

    model = build(args, attn, torch.float32)
    batch = make_batch(args, model, attn)  # before compiling: the mask's own compile is not the model's
    opts = {"report": "off", **json.loads(args.options)}
    if mode == "whole":
        run = torch.compile(model, backend="ultraattn", options=opts)
    else:  # torchtitan's apply_compile, by hand (it refuses this backend), with the same Dynamo settings
        torch._dynamo.config.capture_scalar_outputs = True
        for block in model.layers.values():
            block.compile(backend="ultraattn", fullgraph=True, options=opts)
        run = model
    graphs0 = counters["stats"]["unique_graphs"]
    first, seconds = run_steps(run, model, batch, args.steps)
    recs, keys = [], ("name", "mask", "rewritten", "why", "form")
    for g in side_table().graphs:
        sh = g.shard
        recs.append({"index": g.index, "sites": [{k: getattr(s, k) for k in keys} for s in g.sites],
                     "sharded": sh is not None, "sharded_ops": sh.sharded_ops if sh else 0,
                     "replicated_ops": sh.replicated_ops if sh else 0, "dispatched": list(sh.dispatched) if sh else [],
                     "fallbacks": [{"op": f.op, "why": f.why, "bytes": f.bytes} for f in sh.fallbacks] if sh else []})
    return {**first, "compile_s": seconds[0], "step_s": statistics.median(seconds[1:] or seconds),
            "dynamo_graphs": counters["stats"]["unique_graphs"] - graphs0,
            "graph_breaks": sum(counters["graph_break"].values()), "graphs": recs}


# ---------------------------------------------------------------- checks, table, main
def err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max())


def worst_ratio(got: dict, ref64: dict, ref32: dict) -> tuple[float, str]:
    """The largest error / tolerance over the loss and every gradient (``tests/numerics.py``'s rule): <= 1 is exact."""
    pairs = [("loss", got["loss"], ref64["loss"], ref32["loss"])]
    pairs += [(n, got["grads"][n], ref64["grads"][n], ref32["grads"][n]) for n in ref64["grads"]]
    worst = (0.0, "")
    for name, g, r64, r32 in pairs:
        tol = 2 * err(r32, r64) + 16 * EPS * (float(r64.abs().max()) or 1.0)
        ratio = err(g, r64) / tol
        worst = max(worst, (ratio if ratio == ratio else float("inf"), name))  # NaN counts as the worst
    return worst


def run_case(args, attn: str, mode: str, ref: dict | Exception) -> dict:
    row = {"attn": attn, "mode": mode, "nproc": args.nproc, "seqlen": args.seqlen, "error": None}
    try:
        if isinstance(ref, Exception):
            raise RuntimeError(f"reference failed: {_last_line(ref)}")
        t0 = time.perf_counter()
        ranks = run_ranks(compiled, args.nproc, args=(args, attn, mode), timeout=args.timeout, pg_timeout=600)
        row["wall_s"] = time.perf_counter() - t0
    except Exception as exc:  # noqa: BLE001 - a failing case is a result; the other cases still run
        print(f"\n=== {attn}/{mode} failed ===\n{exc}", flush=True)
        return {**row, "error": _last_line(exc), "traceback": str(exc).splitlines()[-60:]}
    ratios = [worst_ratio(r, ref["ref64"], ref["ref32"]) for r in ranks]
    worst = max(ratios)
    recs = ranks[0]["graphs"]
    falls = [f for g in recs for f in g["fallbacks"]]
    return {**row, "exact": worst[0] <= 1.0, "worst_ratio": worst[0], "worst_tensor": worst[1],
            "rank_ratios": [r for r, _ in ratios], "losses": [float(r["loss"]) for r in ranks],
            "ref_loss": float(ref["ref64"]["loss"]), "graphs": len(recs),
            "sharded_graphs": sum(g["sharded"] for g in recs), "dynamo_graphs": ranks[0]["dynamo_graphs"],
            "graph_breaks": ranks[0]["graph_breaks"], "sites": [s for g in recs for s in g["sites"]],
            "sharded_ops": sum(g["sharded_ops"] for g in recs), "fallbacks": falls,
            "replicated_ops": sum(g["replicated_ops"] for g in recs), "dispatched": [g["dispatched"] for g in recs],
            "gathered_bytes": sum(f["bytes"] for f in falls),
            "compile_s": max(r["compile_s"] for r in ranks), "step_s": max(r["step_s"] for r in ranks),
            "eager_step_s": ref["eager_s"]}


def _last_line(exc: BaseException) -> str:
    """The exception line of a (rank's) traceback: the last ``SomeError: ...`` line, past Dynamo's advice lines."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    errs = [ln for ln in lines if re.match(r"[\w.]*(Error|Exception|Failed|Failure|Exit)\b", ln)]
    return (errs or lines or [type(exc).__name__])[-1]


def print_table(rows: list[dict]) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    t = Table(title="torchtitan Llama 3 under backend='ultraattn' against one eager process")
    cols = ("case", "exact", "worst err/tol", "graphs (sharded)", "Dynamo graphs / breaks", "sites rewritten",
            "sharded ops", "replicated ops", "ops on gathered data", "gathered KiB", "compile s", "step s",
            "eager step s")
    for c in cols:
        t.add_column(c, justify="left" if c in ("case", "exact", "worst err/tol") else "right")
    for r in rows:
        case = f"{r['attn']} / {r['mode']}"
        if r["error"]:
            t.add_row(case, "[red]failed[/red]", escape(r["error"][:100]), *["-"] * (len(cols) - 3))
            continue
        sites = r["sites"]
        t.add_row(case, "[green]yes[/]" if r["exact"] else "[red]no[/]",
                  f"{r['worst_ratio']:.3g} ({r['worst_tensor']})",
                  f"{r['graphs']} ({r['sharded_graphs']})", f"{r['dynamo_graphs']} / {r['graph_breaks']}",
                  f"{sum(s['rewritten'] for s in sites)}/{len(sites)}", str(r["sharded_ops"]), str(r["replicated_ops"]),
                  str(len(r["fallbacks"])), f"{r['gathered_bytes'] / 1024:.0f}", f"{r['compile_s']:.1f}",
                  f"{r['step_s']:.3f}", f"{r['eager_step_s']:.3f}")
    console = Console(width=240)
    console.print(t)
    for r in rows:
        case = f"  {r['attn']}/{r['mode']}:"
        for f in r.get("fallbacks", []):
            console.print(f"{case} gathered for [bold]{f['op']}[/] ({f['bytes']} B): {escape(f['why'])}")
        for s in r.get("sites", []):
            if not s["rewritten"]:
                console.print(f"{case} site {s['name']} ({s['mask']}) not rewritten: {escape(s['why'])}")


def plot(rows: list[dict], out: Path) -> None:
    """Exactness (worst error / tolerance: at most 1 is exact) and step times per case, as a PNG beside the JSON."""
    plt = pyplot()
    ok = [r for r in rows if not r["error"]]
    if plt is None or not ok:
        return
    names = [f"{r['attn']}/{r['mode']}" for r in ok]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.6))
    a.bar(names, [r["worst_ratio"] for r in ok], color="tab:green")
    a.axhline(1.0, color="tab:red", ls="--", lw=1, label="tolerance (2x fp32 eager's error)")
    a.set_ylabel("worst error / tolerance")
    a.legend(fontsize=8)
    x = range(len(ok))
    b.bar([i - 0.2 for i in x], [r["step_s"] for r in ok], 0.4, label=f"ultraattn, {ok[0]['nproc']} gloo ranks")
    b.bar([i + 0.2 for i in x], [r["eager_step_s"] for r in ok], 0.4, label="eager, one process")
    b.set_xticks(list(x), names)
    b.set_ylabel("step s (median)")
    b.legend(fontsize=8)
    fig.suptitle(f"torchtitan Llama 3, S={ok[0]['seqlen']}, CPU (ranks share 2 cores: overhead, not speed-up)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    torchtitan_cp.add_model_args(p)
    p.add_argument("--attn", default="sdpa,flex", help="comma-separated: sdpa, flex")
    p.add_argument("--modes", default="whole,regional", help="comma-separated: whole, regional")
    p.add_argument("--steps", type=int, default=3, help="timed steps after the first (compile) step")
    p.add_argument("--options", default="{}", help="JSON: more backend options")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per case")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "clients.json")
    args = p.parse_args()
    rows = []
    for attn in args.attn.split(","):
        try:
            ref = run_ranks(reference, 0, args=(args, attn), timeout=args.timeout)[0]
        except Exception as exc:  # noqa: BLE001 - recorded in every case of this backend
            print(f"\n=== {attn} reference failed ===\n{exc}", flush=True)
            ref = exc
        for mode in args.modes.split(","):
            rows.append(run_case(args, attn, mode, ref))
            print(f"{attn}/{mode}: " + (f"failed: {rows[-1]['error']}" if rows[-1]["error"] else
                                        f"exact={rows[-1]['exact']} worst={rows[-1]['worst_ratio']:.3g}"), flush=True)
    print_table(rows)
    save(args.out, {k: v for k, v in vars(args).items() if k != "out"}, rows)
    print(f"wrote {args.out}")
    plot(rows, args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
