"""What the Triton kernels cost a GPU, read without one: registers, spills, shared memory per build.

    python benchmarks/kernels_ptx.py [--targets sm90,sm80] [--dtypes bf16,fp16,fp32]
                                     [--head-dims 32,48,64,80,96,128,192,256] [--groups 1,4,8]
                                     [--scores softcap,relbias|none] [--jobs 2] [--out benchmarks/results]
                                     [--name kernels_ptx]

Every variant the autotuner may launch (``ultraattn.kernels.config.tile_configs``: each kernel's
space for the row class of a head dim and dtype) is compiled ahead of time for each target by
``ultraattn.kernels.aot`` (TTIR -> PTX -> cubin through the ptxas inside the triton wheel, no GPU)
and its ``ptxas -v`` line is read. Groups other than 1: dK/dV at every head dim, the forward and
dQ at 128 and 256 (``plan_variants``). ``--scores``: the kernels with each sample score_mod of
``aot.SCORES`` generated into them (bf16/fp16, group 1, on the score_mod spaces). Builds run in
``--jobs`` worker processes; a build Triton's cache serves is built again in an empty cache (the cache
skips ptxas, whose report is the point), so every run compiles cold.

Writes ``<name>.json`` (every build; ``summary``: worst registers, spilling builds, largest shared
memory per kernel and target) and, with matplotlib, ``<name>.png``; prints a table. Exit status 1
when a bf16/fp16 build of head dim <= 128 spills, or any build fails or exceeds its target's
shared memory: the promise ``tests/test_kernels_aot.py`` holds CI to on a subset.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

from _results import pyplot, write_json

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from ultraattn.kernels import aot, config  # noqa: E402


def _ints(text: str, arg: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x]
    except ValueError:
        raise SystemExit(f"{arg} must be a comma list of whole numbers, got {text!r}") from None
    if not out or min(out) < 1:
        raise SystemExit(f"{arg} must list positive numbers, got {text!r}")
    return out


def _names(text: str, arg: str, allowed) -> list[str]:
    out = [x for x in text.split(",") if x]
    bad = [x for x in out if x not in allowed]
    if bad or not out:
        raise SystemExit(f"{arg}: {bad or text!r} not among {', '.join(allowed)}")
    return out


def plan_variants(targets, dtypes, head_dims, groups, scores=()) -> list[aot.Variant]:
    """Every dtype and head dim at group 1; the other groups for dK/dV at every head dim (it loops
    over the group, which changes its register use) and for the forward and dQ at 128 and 256
    (there the group only changes index arithmetic); fp32 at group 1 only."""
    vs = aot.variants(targets=targets, dtypes=dtypes, head_dims=head_dims, groups=[1])
    extra = [g for g in groups if g != 1]
    half = [d for d in dtypes if d != "fp32"]
    if extra and half:
        vs += aot.variants(kernels=("dkv",), targets=targets, dtypes=half, head_dims=head_dims, groups=extra)
        big = [d for d in head_dims if d in (128, 256)]
        if big:
            vs += aot.variants(kernels=("fwd", "dq"), targets=targets, dtypes=half, head_dims=big, groups=extra)
    if scores and half:
        vs += aot.variants(targets=targets, dtypes=half, head_dims=head_dims, groups=[1], scores=scores)
    return vs


def promised(b: aot.Build) -> bool:
    """The builds held to no spills: what the autotuner may launch for bf16/fp16 at head dim <= 128."""
    return b.variant.dtype in ("bf16", "fp16") and b.variant.head_dim <= 128


def table_rows(builds: list[aot.Build]) -> list[dict]:
    """One row per (kernel, target, row class, dtype): ``aot.summary``'s figures (a kernel with a sample
    score_mod is its own row: ``dq+relbias``)."""
    def key(b: aot.Build) -> tuple:
        v = b.variant
        return (v.kernel + (f"+{v.score}" if v.score else ""), v.target, config.row_class(v.head_dim, v.dtype),
                v.dtype)

    return [{"kernel": k[0], "target": k[1], "rows": k[2], "dtype": k[3], **r}
            for k, r in aot.summary(builds, key).items()]


def _print_table(rows: list[dict], builds: list[aot.Build]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="Triton kernels built ahead of time (ptxas -v)")
    for col in ("kernel", "target", "rows", "dtype", "head dims", "builds", "max regs", "spilling",
                "max spill B", "max smem KiB", "limit KiB", "compile s"):
        t.add_column(col, justify="left" if col in ("kernel", "target", "rows", "dtype", "head dims") else "right")
    for r in rows:
        t.add_row(r["kernel"], r["target"], r["rows"], r["dtype"], ",".join(map(str, r["head_dims"])),
                  f"{r['builds']}" + (f" ({r['failed']} failed)" if r["failed"] else ""),
                  str(r["max_registers"]), f"[red]{r['spilling']}[/red]" if r["spilling"] else "0",
                  str(r["max_spill_stores"]), f"{r['max_shared'] / 1024:.0f}", f"{r['shared_limit'] / 1024:.0f}",
                  f"{r['median_compile_s']:.1f}" if r["median_compile_s"] else "-")
    console = Console(width=None if sys.stdout.isatty() else 150)
    console.print(t)
    for b in builds:
        if not b.ok:
            console.print(f"[red]failed[/red] {b.variant.label()}: {b.error}")
        elif b.spills or not b.fits:
            console.print(f"[yellow]{'spills' if b.spills else 'over shared memory'}[/yellow] {b.variant.label()}: "
                          f"{b.registers} regs, {b.spill_stores} B spill stores, {b.shared_bytes} B shared")


def _plot(builds: list[aot.Build], path: str) -> bool:
    """Registers against shared memory per build, one panel per target; False (no PNG) without matplotlib."""
    plt = pyplot()
    if plt is None:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    colors = {"fwd": "tab:blue", "dq": "tab:orange", "dkv": "tab:green"}
    for ax, target in zip(axes, aot.TARGETS):
        bs = [b for b in builds if b.ok and b.variant.target == target]
        for kernel, c in colors.items():
            clean = [b for b in bs if b.variant.kernel == kernel and not b.spills]
            dirty = [b for b in bs if b.variant.kernel == kernel and b.spills]
            ax.scatter([b.shared_bytes / 1024 for b in clean], [b.registers for b in clean], s=14, c=c,
                       alpha=0.6, label=f"{kernel} ({len(clean)} clean)")
            if dirty:
                ax.scatter([b.shared_bytes / 1024 for b in dirty], [b.registers for b in dirty], s=40, c=c,
                           marker="x", label=f"{kernel}: {len(dirty)} spill")
        limit = aot.TARGETS[target][1] / 1024
        ax.axvline(limit, color="red", lw=1, ls="--")
        ax.axhline(255, color="grey", lw=1, ls=":")
        ax.set_title(f"{target}: registers/thread vs shared memory (limit {limit:.0f} KiB)")
        ax.set_xlabel("shared memory per program (KiB)")
        ax.legend(fontsize=7)
    axes[0].set_ylabel("registers per thread")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--targets", default=",".join(aot.TARGETS))
    p.add_argument("--dtypes", default="bf16,fp16,fp32")
    p.add_argument("--head-dims", default="32,48,64,80,96,128,192,256")
    p.add_argument("--groups", default="1,4,8")
    p.add_argument("--scores", default=",".join(aot.SCORES), help="sample score_mods to build with, or 'none'")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="worker processes (default: all cores)")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    p.add_argument("--name", default="kernels_ptx")
    a = p.parse_args(argv)
    ok, why = aot.has_nvidia_backend()
    if not ok:
        print(f"cannot build for NVIDIA targets: {why}", file=sys.stderr)
        return 2
    vs = plan_variants(_names(a.targets, "--targets", aot.TARGETS), _names(a.dtypes, "--dtypes", aot.DTYPES),
                       _ints(a.head_dims, "--head-dims"), _ints(a.groups, "--groups"),
                       [] if a.scores == "none" else _names(a.scores, "--scores", aot.SCORES))
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    t0 = time.perf_counter()
    with Progress(TextColumn("building"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.description}")) as prog:
        task = prog.add_task("", total=len(vs))
        builds = aot.sweep(vs, jobs=max(1, a.jobs),
                           progress=lambda b: prog.update(task, advance=1, description=str(b.variant.kernel)))
    wall = time.perf_counter() - t0
    import triton

    rows = table_rows(builds)
    meta = {"triton": triton.__version__, "python": platform.python_version(), "machine": platform.machine(),
            "jobs": a.jobs, "wall_seconds": wall, "table": rows}  # write_json adds the command, host and date
    if argv is not None:  # called, not run: sys.argv is not this run's command line
        meta["command"] = " ".join(["python benchmarks/kernels_ptx.py", *argv])
    # aot.to_json lays out the file ({"meta", "summary", "builds"}); write_json stamps and writes it
    write_json(Path(a.out) / (a.name + ".json"), json.loads(aot.to_json(builds, **meta)))
    _print_table(rows, builds)
    png = os.path.join(a.out, a.name + ".png")
    print(f"{len(builds)} builds in {wall:.0f} s ({a.jobs} jobs); wrote {os.path.join(a.out, a.name + '.json')}"
          + (f" and {png}" if _plot(builds, png) else ""))
    broken = [b for b in builds if not b.ok or not b.fits or (b.spills and promised(b))]
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
