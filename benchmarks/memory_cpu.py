"""Memory benchmark on CPU: peak activation memory per rank with sequence sharding, against one process.

One run, the same Llama-style model (examples/train_cp.py: RMSNorm, RoPE, SwiGLU, GQA, the loss
inside forward), the same tokens and the same torch thread count per process:

* ``single``:  one process, ``torch.compile(model)`` (Inductor; SDPA's flash attention on CPU);
* ``attn_cp``: ``--world`` gloo ranks, ``backend="ultraattn"`` with ``options={"shard": False}``:
  attention-only context parallelism (every other activation replicated on every rank);
* ``sharded``: ``--world`` gloo ranks, ``backend="ultraattn"`` (the default: every activation that
  carries the sequence lives on this rank's tokens);
* ``blocks``: ``--world`` gloo ranks, the model compiled block by block (``ultraattn.compile_blocks(model.layers)``,
  regional compilation as torchtitan does it): the blocks hand this rank's tokens to each other, and the model's
  own eager code (embedding, final norm, head and loss) runs on the global values.

Each configuration takes one warm-up step (it compiles), then ``--reps`` measured steps (forward and
backward, no optimizer). Peak activation memory of a step: the peak resident set during it minus the
resident set before it (Linux: VmHWM reset through /proc/self/clear_refs; glibc's mmap threshold is
pinned at 64 KiB, so freed tensors go back to the OS and the resident set follows the live tensors).
For the ranks, the largest over the ranks. Step time: the slowest rank's. The CP runs' loss and
gradients are compared with the single process's (fp32; the tests check the numerics policy against
fp64 at sizes where an fp64 reference fits).

    python benchmarks/memory_cpu.py                       # S = 16K, 4 layers, 4 ranks (~15 min on 2 cores)
    python benchmarks/memory_cpu.py --seqlen 4096 --out /tmp/mem.json   # a quick look
    python benchmarks/memory_cpu.py --replot benchmarks/results/memory_cpu.json
    -> benchmarks/results/memory_cpu.json and .png
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import re
import sys
import time
from pathlib import Path

import torch
from _results import pyplot, write_json

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "examples"))

MODES = ("single", "attn_cp", "sharded", "blocks")
COLORS = {"single": "#777", "attn_cp": "#d88", "sharded": "#4a8", "blocks": "#48a"}
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "65536"}


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"{field}:\s+(\d+) kB", f.read()).group(1)) * 1024


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _model(args):
    from train_cp import Llama

    torch.manual_seed(args.seed)
    return Llama(args.dim, args.layers, args.heads, args.kv_heads, vocab=args.vocab)


def _tokens(args) -> torch.Tensor:
    return torch.randint(0, args.vocab, (1, args.seqlen), generator=torch.Generator().manual_seed(args.seed))


def run_mode(rank: int, world: int, mode: str, args) -> dict:
    """Warm up, then measure ``args.reps`` steps on this process; the last step's loss and gradients."""
    torch.set_num_threads(args.threads)
    model = _model(args)
    opts = {"ilp_time_limit": 1.0, "time_budget": 2.0, "timeout": 1800.0, "shard": mode != "attn_cp"}
    if mode == "single":
        run = torch.compile(model)
    elif mode == "blocks":
        import ultraattn

        ultraattn.compile_blocks(model.layers, options=opts)
        if args.head:  # the head (final norm, output projection, loss) a region too: it takes the last shard
            model.loss = torch.compile(model.loss, backend="ultraattn", options=opts)
        run = model
    else:
        run = torch.compile(model, backend="ultraattn", options=opts)
    tokens = _tokens(args)
    barrier = torch.distributed.barrier if world > 0 else (lambda: None)

    def step():
        model.zero_grad(set_to_none=True)
        loss = run(tokens)
        loss.backward()
        return loss

    t0 = time.perf_counter()
    step()
    compile_s = time.perf_counter() - t0
    peaks, seconds = [], []
    for _ in range(args.reps):
        gc.collect()
        barrier()
        base = _status("VmRSS")
        _reset_peak()
        t0 = time.perf_counter()
        loss = step()
        seconds.append(time.perf_counter() - t0)
        peaks.append(_status("VmHWM") - base)
        barrier()
    out = {"peak_bytes": max(peaks), "seconds": min(seconds), "first_step_seconds": compile_s,
           "loss": loss.item(), "grads": {n.removeprefix("_orig_mod."): p.grad.detach().clone()
                                          for n, p in model.named_parameters()}}
    if mode != "single":
        from ultraattn.passes import side_table

        sh = side_table().graphs[-1].shard
        out["shard"] = sh.to_json() if sh is not None else None
    return out


def compare(got: dict, ref: dict) -> dict:
    scale = max(float(g.abs().max()) for g in ref["grads"].values())
    gerr = max(float((got["grads"][n] - g).abs().max()) for n, g in ref["grads"].items())
    return {"loss_abs_diff": abs(got["loss"] - ref["loss"]), "grad_max_abs_diff": gerr,
            "grad_max_rel_diff": gerr / scale}


def measure(args) -> dict:
    from ultraattn.testing import run_ranks

    runs = {}
    for mode in args.modes:
        print(f"[memory_cpu] {mode}: S={args.seqlen}, {args.layers} layers, "
              f"{1 if mode == 'single' else args.world} process(es) ...", flush=True)
        world = 0 if mode == "single" else args.world
        res = run_ranks(run_mode, world, args=(mode, args), timeout=args.timeout, pg_timeout=1800,
                        threads=args.threads, env=MALLOC_ENV)
        runs[mode] = res
        print(f"[memory_cpu]   peak activation memory (max over ranks) "
              f"{max(r['peak_bytes'] for r in res) / 2**30:.3f} GiB, step {max(r['seconds'] for r in res):.1f} s",
              flush=True)
    result = {"config": {k: v for k, v in vars(args).items() if k not in ("out", "replot", "modes")},
              "machine": {"platform": platform.platform(), "torch": torch.__version__,
                          "cores": torch.get_num_threads()},
              "modes": {}}
    for mode, res in runs.items():
        entry = {"peak_bytes_per_rank": [r["peak_bytes"] for r in res], "peak_bytes": max(r["peak_bytes"] for r in res),
                 "step_seconds": max(r["seconds"] for r in res),
                 "first_step_seconds": max(r["first_step_seconds"] for r in res), "loss": res[0]["loss"]}
        if "single" in runs and mode != "single":
            diffs = [compare(r, runs["single"][0]) for r in res]
            entry["vs_single"] = {k: max(d[k] for d in diffs) for k in diffs[0]}
        if res[0].get("shard") is not None:
            sh = res[0]["shard"]
            entry["shard"] = {k: sh[k] for k in ("layout", "local_len", "sharded_ops", "reductions", "entered",
                                                 "replicated_ops")}
            entry["shard"]["fallbacks"] = len(sh["fallbacks"])
        result["modes"][mode] = entry
    m = result["modes"]
    ratios = {}
    if "single" in m:
        for mode in ("attn_cp", "sharded", "blocks"):
            if mode in m:
                ratios[f"{mode}_peak_vs_single"] = m[mode]["peak_bytes"] / m["single"]["peak_bytes"]
                ratios[f"{mode}_time_vs_single"] = m[mode]["step_seconds"] / m["single"]["step_seconds"]
    if "attn_cp" in m and "sharded" in m:
        ratios["sharded_peak_vs_attn_cp"] = m["sharded"]["peak_bytes"] / m["attn_cp"]["peak_bytes"]
        ratios["sharded_time_vs_attn_cp"] = m["sharded"]["step_seconds"] / m["attn_cp"]["step_seconds"]
    result["ratios"] = ratios
    return result


def plot(result: dict, path: Path) -> bool:
    """Peak activation memory and step time per mode; False (no PNG) without matplotlib."""
    plt = pyplot()
    if plt is None:
        return False
    modes = [m for m in MODES if m in result["modes"]]
    c = result["config"]
    labels = {"single": "1 process", "attn_cp": f"attention-only\nCP ({c['world']} ranks)",
              "sharded": f"sequence-sharded\nCP ({c['world']} ranks)",
              "blocks": f"block by block{', head' if c.get('head', True) else ''}\n({c['world']} ranks)"}
    fig, (a, b) = plt.subplots(1, 2, figsize=(4 + 2.4 * len(modes), 4.2))
    peaks = [result["modes"][m]["peak_bytes"] / 2**30 for m in modes]
    bars = a.bar([labels[m] for m in modes], peaks, color=[COLORS[m] for m in modes])
    for bar, m in zip(bars, modes):
        ratio = result["modes"][m]["peak_bytes"] / result["modes"]["single"]["peak_bytes"] \
            if "single" in result["modes"] else None
        a.annotate(f"{bar.get_height():.2f} GiB" + (f"\n{ratio:.2f}x" if ratio is not None else ""),
                   (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=9)
    a.set_ylabel("peak activation memory per rank (GiB)")
    a.set_ylim(0, max(peaks) * 1.25)
    times = [result["modes"][m]["step_seconds"] for m in modes]
    bars = b.bar([labels[m] for m in modes], times, color=[COLORS[m] for m in modes])
    for bar in bars:
        b.annotate(f"{bar.get_height():.1f} s", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                   va="bottom", fontsize=9)
    b.set_ylabel("forward + backward step (s, slowest rank)")
    b.set_ylim(0, max(times) * 1.2)
    fig.suptitle(f"{c['layers']}-layer Llama (dim {c['dim']}, {c['heads']}/{c['kv_heads']} heads), S={c['seqlen']}, "
                 f"CPU, {c['threads']} thread(s) per process")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqlen", type=int, default=16384)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--no-head", dest="head", action="store_false",
                    help="blocks: leave the head (final norm, output projection, loss) eager, on the global values")
    ap.add_argument("--timeout", type=float, default=5400.0, help="seconds per configuration")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "memory_cpu.json")
    ap.add_argument("--replot", type=Path, help="only redraw the PNG of an existing results JSON")
    args = ap.parse_args()
    for name in ("seqlen", "layers", "dim", "heads", "kv_heads", "vocab", "world", "reps", "threads"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.replot:
        plot(json.loads(args.replot.read_text()), args.replot.with_suffix(".png"))
        return 0
    if not Path("/proc/self/clear_refs").exists():
        ap.error("this benchmark reads Linux's /proc/self/status and /proc/self/clear_refs")
    result = measure(args)
    write_json(args.out, result)
    png = plot(result, args.out.with_suffix(".png"))
    print(json.dumps(result["ratios"], indent=2))
    print(f"-> {args.out}" + (f" and {args.out.with_suffix('.png')}" if png else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
