"""Block-sparse kernel benchmark: ultraattn's kernels vs FlexAttention (same BlockMask) vs SDPA.

TFLOP/s count only unmasked work: forward 4 * D FLOPs per attended (q, kv) pair (QK^T and PV),
backward 2.5x that (the FlashAttention convention: 5 matmuls vs 2). Every method runs on the
same inputs in the same process; ratios are taken within the run.

    # the issue's configuration (GPU: bf16, D=128, 16 heads, S = 8K and 32K)
    python benchmarks/kernels.py
    # CPU smoke run (the eager reference op vs eager flex_attention and SDPA; not a GPU figure)
    python benchmarks/kernels.py --device cpu --seqlens 1024 --heads 4 --dtype fp32 --reps 2

Writes JSON (every time, every ratio, the device name) and, with matplotlib, a PNG (TFLOP/s bars per
mask).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from _results import pyplot, write_json
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ultraattn.kernels as K  # noqa: E402
from ultraattn import masks  # noqa: E402

_DT = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def mask_mod_for(name: str, S: int, device: str = "cpu"):
    """The benchmark's mask ``name`` at length ``S``; tables a mask_mod reads live on ``device`` (where
    ``create_block_mask`` evaluates it)."""
    if name == "causal":
        return masks.generate_causal()
    if name == "full":
        return masks.generate_full()
    if name == "sliding_window":
        return masks.generate_sliding_window(window=max(256, S // 16))
    if name == "strided":
        return masks.generate_strided(block=128, stride=4, band=2, causal=True)
    if name == "global_local":
        return masks.generate_global_local(num_global=256, window=max(256, S // 16))
    if name == "document":
        g = torch.Generator().manual_seed(0)
        cuts = sorted(torch.randperm(S // 128 - 1, generator=g)[: max(1, S // 2048)].add(1).mul(128).tolist())
        bounds = [0, *cuts, S]
        return masks.generate_document([b - a for a, b in zip(bounds, bounds[1:])], device=device)
    raise ValueError(f"unknown mask {name!r}")


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_once(fn, device: str) -> float:
    """Seconds of one call of ``fn`` (CUDA events on GPU, wall clock on CPU)."""
    if device == "cuda":
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        return a.elapsed_time(b) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _median(times: list[float]) -> float:
    times = sorted(times)
    return times[len(times) // 2]


def timeit(fn, device: str, reps: int, warmup: int = 2) -> list[float]:
    """Seconds of each of ``reps`` calls, after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    _sync(device)
    return [time_once(fn, device) for _ in range(reps)]


def fwd_time(attn, q, k, v, device: str, reps: int) -> list[float]:
    """Seconds of each forward alone (no autograd graph)."""

    qd, kd, vd = (x.detach() for x in (q, k, v))  # (flex checks requires_grad even under no_grad)

    def fwd():
        with torch.no_grad():
            attn(qd, kd, vd)

    return timeit(fwd, device, reps)


def bwd_time(attn, q, k, v, device: str, reps: int) -> list[float]:
    """Seconds of each backward alone (the forward that builds its graph is not timed; the first
    backward is a warm-up)."""
    go = torch.randn_like(q)
    times = []
    for _ in range(reps + 1):
        out = attn(q, k, v)
        _sync(device)
        times.append(time_once(lambda: out.backward(go), device))  # noqa: B023 - called at once
        q.grad = k.grad = v.grad = None
    return times[1:]


def phase_time(attn, q, k, v, device: str, reps: int, phase: str, flops_fwd: float) -> tuple[float, float, float]:
    """(median seconds, TFLOP/s, spread: (max - min) / median) of ``reps`` forwards (``phase`` "fwd") or backwards
    ("bwd", counted as 2.5 forwards' FLOPs)."""
    ts = fwd_time(attn, q, k, v, device, reps) if phase == "fwd" else bwd_time(attn, q, k, v, device, reps)
    t = _median(ts)
    flops = flops_fwd * (2.5 if phase == "bwd" else 1.0)
    return t, flops / t / 1e12, (max(ts) - min(ts)) / t


def _row(args, S: int, name: str, flex, dt, kv_heads: int) -> dict:
    """One (seqlen, mask) row: every method's times, the ratios to ours, and our output against flex's."""
    device, gqa = args.device, kv_heads != args.heads
    mm = mask_mod_for(name, S, device)
    bm = create_block_mask(mm, None, None, S, S, device=device, BLOCK_SIZE=128)
    lay = K.get_block_lists(bm, q_len=S, kv_len=S, batch=args.batch, num_heads=args.heads, device=torch.device(device))
    pairs = lay.attended_pairs()
    flops_fwd = 4.0 * pairs * args.head_dim
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(args.batch, args.heads, S, args.head_dim, device=device, dtype=dt, generator=g)
    k, v = (torch.randn(args.batch, kv_heads, S, args.head_dim, device=device, dtype=dt, generator=g)
            for _ in range(2))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    methods = {
        "ultraattn": lambda q, k, v, lay=lay: K.block_sparse_attention(q, k, v, lay),
        "flex": lambda q, k, v, bm=bm: flex(q, k, v, block_mask=bm, enable_gqa=gqa),
    }
    if name in ("causal", "full"):
        methods["sdpa"] = lambda q, k, v, c=(name == "causal"): F.scaled_dot_product_attention(
            q, k, v, is_causal=c, enable_gqa=gqa)
    row = {"seqlen": S, "mask": name, "density": pairs / (args.batch * args.heads * S * S), "methods": {}}
    for mname, fn in methods.items():
        res = row["methods"][mname] = {}
        for phase in ("fwd", "bwd"):
            try:
                t, tflops, spread = phase_time(fn, q, k, v, device, args.reps, phase, flops_fwd)
            except Exception as exc:  # noqa: BLE001 - a baseline that can't run is reported, not fatal
                res[f"{phase}_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
                print(f"  S={S} {name:15s} {mname:10s} {phase} failed: {res[f'{phase}_error']}", flush=True)
                continue
            res[f"{phase}_s"], res[f"{phase}_tflops"], res[f"{phase}_spread"] = t, tflops, spread
            print(f"  S={S} {name:15s} {mname:10s} {phase} {t * 1e3:9.3f} ms ({tflops:7.3f} TFLOP/s)", flush=True)
    ua = row["methods"].get("ultraattn", {})
    for base in ("flex", "sdpa"):
        b = row["methods"].get(base, {})
        for phase in ("fwd", "bwd"):
            if f"{phase}_s" in ua and f"{phase}_s" in b:
                row[f"{phase}_vs_{base}"] = b[f"{phase}_s"] / ua[f"{phase}_s"]
    if "fwd_s" in row["methods"]["flex"]:  # the outputs agree (a fast wrong kernel is no result)
        qd, kd, vd = (x.detach() for x in (q, k, v))
        with torch.no_grad():
            a, b = methods["ultraattn"](qd, kd, vd).float(), methods["flex"](qd, kd, vd).float()
        row["max_abs_diff_vs_flex"] = float((a - b).abs().max())
    return row


def run(args, on_row=None, time_left=None) -> dict:
    """Every (seqlen, mask) row of ``args``; ``on_row(row)`` after each, and no new row once ``time_left()`` is
    under a minute (``benchmarks/gpu_check.py`` keeps the rows measured before its deadline)."""
    device = args.device
    kv_heads = getattr(args, "kv_heads", None) or args.heads
    flex = torch.compile(flex_attention, dynamic=False) if device == "cuda" else flex_attention
    rows = []
    # Each mask is a new mask_mod, so compiled flex recompiles per row (forward without and with grad): past Dynamo's
    # recompile limit (8) it silently ran eagerly, unfused (session 3 measured that as flex: 1.8 TFLOP/s at 8K and an
    # out-of-memory at 32K). Dynamo starts afresh at each row, and a limit hit raises instead.
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        for S in args.seqlens:
            for name in args.masks:
                if time_left is not None and time_left() < 60:
                    print(f"  S={S} {name}: not run (the deadline is near)", flush=True)
                    continue
                torch._dynamo.reset()
                rows.append(_row(args, S, name, flex, _DT[args.dtype], kv_heads))
                if on_row is not None:
                    on_row(rows[-1])
    return {
        "device": torch.cuda.get_device_name() if device == "cuda" else f"cpu ({os.cpu_count()} cores)",
        "torch": torch.__version__,
        "config": {k: v for k, v in vars(args).items() if k not in ("out", "replot")},
        "command": "python benchmarks/kernels.py " + " ".join(sys.argv[1:]),
        "rows": rows,
    }


def plot(result: dict, path: Path) -> bool:
    """TFLOP/s bars per mask, fwd and bwd, one row per sequence length; False (no PNG) without matplotlib."""
    plt = pyplot()
    if plt is None:
        return False
    rows = result["rows"]
    seqlens = sorted({r["seqlen"] for r in rows})
    fig, axes = plt.subplots(len(seqlens), 2, figsize=(12, 3.6 * len(seqlens)), squeeze=False)
    colors = {"ultraattn": "#1f77b4", "flex": "#ff7f0e", "sdpa": "#2ca02c"}
    for si, S in enumerate(seqlens):
        rs = [r for r in rows if r["seqlen"] == S]
        for ci, phase in enumerate(("fwd", "bwd")):
            ax = axes[si][ci]
            width = 0.27
            for mi, m in enumerate(("ultraattn", "flex", "sdpa")):
                xs, ys = [], []
                for xi, r in enumerate(rs):
                    v = r["methods"].get(m, {}).get(f"{phase}_tflops")
                    if v is not None:
                        xs.append(xi + (mi - 1) * width)
                        ys.append(v)
                if xs:
                    ax.bar(xs, ys, width, label=m, color=colors[m])
            ax.set_xticks(range(len(rs)), [r["mask"] for r in rs], rotation=20)
            ax.set_ylabel("TFLOP/s (unmasked work)")
            ax.set_title(f"{phase}, S={S}")
            ax.legend(fontsize=8)
    fig.suptitle(f"block-sparse attention kernels on {result['device']} ({result['config']['dtype']}, "
                 f"D={result['config']['head_dim']}, H={result['config']['heads']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    p.add_argument("--seqlens", type=int, nargs="+", default=[8192, 32768])
    p.add_argument("--masks", nargs="+", default=["full", "causal", "sliding_window", "strided", "global_local",
                                                  "document"])
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=None, help="K/V heads (GQA; default: --heads)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", default="bf16", choices=tuple(_DT))
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--out", type=Path, default=None,
                   help="JSON path (default benchmarks/results/kernels_<device>.json)")
    p.add_argument("--replot", type=Path, default=None, help="only redraw the PNG of an existing JSON")
    args = p.parse_args(argv)
    if args.replot:
        res = json.loads(args.replot.read_text())
        plot(res, args.replot.with_suffix(".png"))
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here; pass --device cpu for the CPU smoke run")
    for S in args.seqlens:
        if S % 128:
            p.error(f"--seqlens {S}: must be a multiple of 128 (the BlockMask block)")
    out = args.out or Path(__file__).parent / "results" / f"kernels_{args.device}.json"
    res = run(args)
    write_json(out, {**res, "meta": {"command": res["command"]}})  # its command line, argv given or not
    png = plot(res, out.with_suffix(".png"))
    for r in res["rows"]:
        ratios = ", ".join(f"{k} {v:.2f}x" for k, v in r.items() if k.startswith(("fwd_vs", "bwd_vs")))
        print(f"S={r['seqlen']} {r['mask']:15s} density {r['density']:.3f}: {ratios}")
    print(f"wrote {out}" + (f" and {out.with_suffix('.png')}" if png else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
