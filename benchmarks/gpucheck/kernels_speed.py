"""Part 4 (in the runner's order): kernel speed, ``benchmarks/kernels.py`` in a short configuration.

TFLOP/s of the forward and the backward (unmasked work only) of ultraattn's kernels against
``torch.compile(flex_attention)`` with the same BlockMask and against SDPA (flash) where the mask allows: causal,
document-causal, sliding window, strided and global+local at S = 8K and 32K, 32 query and 8 K/V heads, head dim 128,
bf16. Rows are written as they are measured (``kernels_<gpu>.json``, with the ratios ``fwd_vs_flex``,
``bwd_vs_flex``, ``fwd_vs_sdpa`` per row, and a PNG); each row also records the largest difference between our
output and flex's, and a difference past ``MAX_DIFF`` fails the part (a fast wrong kernel is no result). The dry
run times the eager reference ops on the CPU at S = 256: a rehearsal of the code, not a figure.
"""

from __future__ import annotations

import argparse
import os
import statistics

import kernels as bench

from .common import Ctx

NAME = "kernels_speed"
TITLE = "kernel speed"
CORRECTNESS = False
MAX_DIFF = 0.1
"""Largest |ours - flex| accepted in a row's forward output (bf16 outputs of unit scale differ by ~1e-2)."""


def run(ctx: Ctx) -> None:
    if ctx.dry_run:
        os.environ["ULTRAATTN_KERNELS"] = "reference"  # the interpreter is far too slow to time
    args = argparse.Namespace(
        device=ctx.device.type, seqlens=ctx.pick([8192, 32768], [256]),
        masks=["causal", "document", "sliding_window", "strided", "global_local"], heads=ctx.pick(32, 4),
        kv_heads=ctx.pick(8, 1), head_dim=ctx.pick(128, 32), batch=1, dtype=ctx.pick("bf16", "fp32"),
        reps=ctx.pick(10, 2), out=None, replot=None)
    out = ctx.path(f"kernels_{ctx.slug}")
    header = {"device": ctx.record["device"], "torch": ctx.record["torch"], "triton": ctx.record["triton"],
              "config": {k: v for k, v in vars(args).items() if k not in ("out", "replot")},
              "command": "python benchmarks/gpu_check.py" + (" --dry-run" if ctx.dry_run else ""), "rows": []}

    def on_row(row: dict) -> None:
        header["rows"].append(row)
        bench.write_json(out, header)
        diff = row.get("max_abs_diff_vs_flex")
        if diff is not None and not diff <= MAX_DIFF:
            ctx.fail(f"S={row['seqlen']} {row['mask']}: |ours - flex| = {diff:.3g} > {MAX_DIFF}")

    bench.run(args, on_row=on_row, time_left=ctx.time_left)
    png = bench.plot(header, out.with_suffix(".png"))
    rows = header["rows"]
    planned = len(args.seqlens) * len(args.masks)
    ratios = {k: [r[k] for r in rows if k in r] for k in ("fwd_vs_flex", "bwd_vs_flex", "fwd_vs_sdpa", "bwd_vs_sdpa")}
    medians = {k: statistics.median(v) for k, v in ratios.items() if v}
    if len(rows) < planned:
        ctx.note(f"{planned - len(rows)} of {planned} rows not run before the deadline")
    ctx.save(file=out.name, png=out.with_suffix(".png").name if png else None, rows=len(rows), planned=planned,
             median_ratios=medians,
             summary=f"{len(rows)}/{planned} rows; median " + ", ".join(f"{k} {v:.2f}x" for k, v in medians.items()))
