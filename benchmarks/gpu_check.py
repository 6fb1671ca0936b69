"""The GPU check: one command that proves or disproves ultraattn's GPU path, in one run of under 8 minutes.

    python benchmarks/gpu_check.py --out DIR              # on a CUDA machine (docs/gpu.md)
    python benchmarks/gpu_check.py --out DIR --dry-run    # the same code on CPU at tiny sizes (CI runs it)

Six parts, each in a process of its own (a CUDA error in one cannot take the others with it), each with a deadline
taken from ``--budget``, each writing ``DIR/<part>.json`` as it goes (a part stopped at its deadline keeps what it
measured):

1. ``kernels_correct``: the block-sparse Triton kernels against the fp64 oracle by the 2x rule, over the library
   masks, random BlockMasks, GQA 1/4/8, head dims 64/80/128, bf16/fp16, tails; and inside ``torch.compile``.
2. ``two_ranks``: two ranks on one GPU (gloo, messages staged through host memory: NCCL refuses two ranks on one
   device), the explicit per-rank programs with real Triton tiles compiled by Inductor, against one process.
3. ``backend_e2e``: the example model (``examples/train_cp.py``) with a flex document mask and with causal SDPA at
   world size 1, ``torch.compile(backend="ultraattn")`` against eager by the numerics policy, the Triton ops in
   the compiled graph; compile time and step time against plain ``torch.compile``.
4. ``kernels_speed``: TFLOP/s forward and backward against ``torch.compile(flex_attention)`` with the same BlockMask
   and SDPA where the mask allows (``DIR/kernels_<gpu>.json`` and ``.png``).
5. ``calibration``: ``ultraattn calibrate --device cuda`` at one rank; the fitted profile in the JSON.
6. ``tiles``: each kernel's tile configs, in its autotune space and outside it, timed one by one (``ULTRAATTN_TILES``).

Parts 1 and 2 run side by side (they time nothing); the rest run alone. At the end: ``DIR/summary.json`` and one
table. The exit status is 0 only if every part passed (a measurement part passes when it completed).

``--dry-run`` runs everything on the CPU at tiny sizes: Triton's interpreter for the kernels, the eager reference
ops for the speed part's ultraattn rows, ``aot_eager`` in place of Inductor for the compiled models. It writes every
file the GPU run writes (``kernels_cpu.json`` for the speed part). Its CPU times mean nothing, so its parts run
``DRY_JOBS`` at a time, in the order above, instead of in waves (each part uses about one core).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpucheck import PARTS, WAVES, WEIGHTS  # noqa: E402

# (``gpucheck.common`` imports torch and registers the backend: 4-5 s, so it is imported where a part has run, and a
# bad argument is answered at once)

CLIENT_ROWS = "ULTRAATTN_GPUCHECK_CLIENT_ROWS"
"""How ``--client-rows`` reaches the clients part's process."""
GRACE = 30.0
"""Seconds a part may run past its deadline (to write its last row) before it is stopped (at most half its time)."""
DRY_JOBS = 2
"""Parts a dry run runs at a time (CI's cores): on a 2-core machine the whole dry run took 300 s one part at a time,
165 s two at a time (2026-11-29)."""
INJECT = "ULTRAATTN_GPUCHECK_FAIL"
"""Name a part here and it raises at its start: how the tests check that one failing part stops nothing else."""


def _part_module(name: str):
    import importlib

    return importlib.import_module(f"gpucheck.{name}")


def child(name: str, out: Path, dry_run: bool, seconds: float) -> int:
    """Run one part in this process (the runner starts one process per part)."""
    from gpucheck.common import Ctx, error_text

    mod = _part_module(name)
    ctx = Ctx(name=name, out=out, dry_run=dry_run, deadline=time.monotonic() + seconds)
    ctx.save(title=mod.TITLE, correctness=mod.CORRECTNESS)
    t0 = time.perf_counter()
    try:
        if os.environ.get(INJECT) == name:
            raise RuntimeError(f"{INJECT}={name}: a failure injected to test the runner")
        mod.run(ctx)
        status = "fail" if ctx.record["failures"] else "pass"
    except Exception as exc:  # noqa: BLE001 - the part's error is its result
        ctx.record["error"] = error_text(exc)
        status = "error"
        print(ctx.record["error"], file=sys.stderr, flush=True)
    ctx.save(status=status, seconds=round(time.perf_counter() - t0, 2))
    return 0 if status == "pass" else 1


def _without_pulp(out: Path) -> str:
    """A folder whose ``pulp`` package fails to import: first on a dry run's PYTHONPATH (spawned ranks inherit
    it), so the rehearsal plans as the GPU machine does, which has no PuLP (the fast planner)."""
    folder = out / ".no_pulp" / "pulp"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "__init__.py").write_text('raise ImportError("pulp: hidden by benchmarks/gpu_check.py --dry-run, '
                                        'as the GPU machine has none")\n')
    return str(folder.parent)


def _start(name: str, out: Path, dry_run: bool, seconds: float) -> subprocess.Popen:
    cmd = [sys.executable, __file__, "--child", name, "--out", str(out), "--seconds", f"{seconds:.1f}"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if dry_run:
        cmd.append("--dry-run")
        # set before the child starts: Triton reads TRITON_INTERPRET when a kernel is decorated, at import
        env.setdefault("TRITON_INTERPRET", "1")
        env.setdefault("ULTRAATTN_KERNELS", "triton")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_without_pulp(out), env.get("PYTHONPATH")) if p)
    log = open(out / f".{name}.log", "w")  # noqa: SIM115 - closed by _finish
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    proc.log = log
    return proc


def _finish(name: str, proc: subprocess.Popen, out: Path, limit: float, started: float) -> dict:
    """Wait for a part's process (stopping it at ``limit``) and complete its record."""
    from gpucheck.common import write

    timed_out = False
    try:
        proc.wait(timeout=max(1.0, limit - time.monotonic()))
    except subprocess.TimeoutExpired:
        timed_out = True
        proc.kill()
        proc.wait()
    proc.log.close()
    log_path = out / f".{name}.log"
    tail = log_path.read_text(errors="replace")[-4000:]
    log_path.unlink(missing_ok=True)
    path = out / f"{name}.json"
    try:
        rec = json.loads(path.read_text())
    except (OSError, ValueError):
        rec = {"part": name, "failures": []}
    if timed_out:
        rec["status"] = "timeout"
        rec["error"] = f"stopped at its deadline ({limit - started:.0f} s); the rows above were measured before it"
    elif rec.get("status") in (None, "running"):
        rec["status"] = "error"
        rec["error"] = f"the part's process exited with code {proc.returncode} without finishing its record"
    rec["wall_seconds"] = round(time.monotonic() - started, 1)
    rec["log_tail"] = tail
    write(path, rec)
    return rec


def run_all(out: Path, dry_run: bool, budget: float, parts: tuple[str, ...],
            weights: dict[str, float] | None = None) -> list[dict]:
    """Every part in ``parts``, each in its own process with its share of ``budget``: in ``WAVES`` on a GPU,
    ``DRY_JOBS`` at a time on a dry run (``run_pool``); the records in ``PARTS`` order."""
    out.mkdir(parents=True, exist_ok=True)
    weights = {**WEIGHTS, **(weights or {})}
    run = run_pool if dry_run else run_waves
    records = run(out, budget, parts, weights)
    shutil.rmtree(out / ".no_pulp", ignore_errors=True)
    return records


def _seconds(budget: float, share: float) -> float:
    """A part's time: its share of what is left, at least 30 s (or the whole budget when that is shorter)."""
    return max(min(30.0, budget), share)


def _limit(started: float, seconds: float) -> float:
    """When a part started at ``started`` with ``seconds`` is stopped: past its deadline by ``GRACE`` or half its
    time, whichever is less."""
    return started + seconds + min(GRACE, seconds / 2)


def _said(name: str, rec: dict) -> None:
    print(f"== {name}: {rec['status']} in {rec['wall_seconds']} s: {rec.get('summary', rec.get('error', ''))}",
          flush=True)


def run_waves(out: Path, budget: float, parts: tuple[str, ...], weights: dict[str, float]) -> list[dict]:
    """The GPU run's runner: ``WAVES`` one after another (the parts of a wave side by side), each wave its largest
    weight's share of the time left."""
    t_end = time.monotonic() + budget
    waves = [tuple(p for p in w if p in parts) for w in WAVES]
    waves = [w for w in waves if w]
    records = []
    for i, wave in enumerate(waves):
        left = t_end - time.monotonic()
        share = max(weights[p] for p in wave) / sum(max(weights[p] for p in w) for w in waves[i:])
        seconds = _seconds(budget, left * share)
        started = time.monotonic()
        print(f"== {', '.join(wave)}: {seconds:.0f} s", flush=True)
        procs = {p: _start(p, out, False, seconds) for p in wave}
        for p, proc in procs.items():
            records.append(_finish(p, proc, out, _limit(started, seconds), started))
            _said(p, records[-1])
    return records


def run_pool(out: Path, budget: float, parts: tuple[str, ...], weights: dict[str, float],
             jobs: int = DRY_JOBS) -> list[dict]:
    """The dry run's runner: the parts in ``PARTS`` order, ``jobs`` processes at a time; a part's deadline is its
    weight's share of the time left, times ``jobs`` (the shares of the parts still to come and running)."""
    t_end = time.monotonic() + budget
    todo = [p for p in PARTS if p in parts]
    running: dict[str, tuple[subprocess.Popen, float, float]] = {}   # part -> (process, started, limit)
    records: dict[str, dict] = {}
    while todo or running:
        while todo and len(running) < jobs:
            name = todo.pop(0)
            now = time.monotonic()
            share = jobs * weights[name] / sum(weights[p] for p in (name, *todo, *running))
            seconds = _seconds(budget, (t_end - now) * min(share, 1.0))
            print(f"== {name}: {seconds:.0f} s", flush=True)
            running[name] = (_start(name, out, True, seconds), now, _limit(now, seconds))
        time.sleep(0.2)
        for name, (proc, started, limit) in list(running.items()):
            if proc.poll() is None and time.monotonic() < limit:
                continue
            records[name] = _finish(name, proc, out, limit, started)
            del running[name]
            _said(name, records[name])
    return [records[p] for p in PARTS if p in records]


def summarize(out: Path, records: list[dict], dry_run: bool, budget: float, seconds: float) -> bool:
    from gpucheck.common import write
    from rich.console import Console
    from rich.table import Table

    ok = all(r["status"] == "pass" for r in records)
    device = next((r.get("device") for r in records if r.get("device")), "?")
    write(out / "summary.json", {
        "command": " ".join(["python", *sys.argv]), "dry_run": dry_run, "device": device, "budget_s": budget,
        "seconds": round(seconds, 1), "ok": ok, "date": time.strftime("%Y-%m-%d %H:%M"),
        "parts": [{k: r.get(k) for k in ("part", "title", "correctness", "status", "wall_seconds", "summary",
                                         "failures", "error")} for r in records]})
    table = Table(title=f"ultraattn GPU check{' (dry run)' if dry_run else ''} on {device}: {seconds:.0f} s")
    for col in ("part", "status", "s", "result"):
        table.add_column(col, justify="right" if col == "s" else "left")
    colour = {"pass": "green", "fail": "red", "error": "red", "timeout": "yellow"}
    for r in records:
        what = r.get("summary") or (r.get("error") or "").split("\n")[0]
        if r.get("failures"):
            what += f" ({len(r['failures'])} failed: {r['failures'][0][:120]})"
        table.add_row(r.get("title", r["part"]), f"[{colour.get(r['status'], 'white')}]{r['status']}[/]",
                      f"{r.get('wall_seconds', 0):.0f}", what)
    Console(width=160).print(table)
    print(f"wrote {out}/summary.json and one JSON per part")
    return ok


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None, help="folder for the JSON and PNG files (made if missing)")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes: the same code paths, no GPU figures")
    p.add_argument("--replot", type=Path, default=None,
                   help="only redraw the PNG of a clients part's JSON (benchmarks/results/gpu_check_clients_*.json)")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {', '.join(PARTS)}")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds for the whole run, shared out among the parts (default 450 on a GPU, 540 dry)")
    p.add_argument("--share", action="append", default=[], metavar="PART=W",
                   help="a part's weight in the budget's split instead of its default (repeatable); defaults: "
                        + ", ".join(f"{k}={v:g}" for k, v in WEIGHTS.items()))
    p.add_argument("--client-rows", default=None, metavar="ROWS",
                   help="the clients part's rows, comma-separated: speed rows sdpa, flex, sdpa+pos and exact (its "
                        "three small exact rows); default all")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--seconds", type=float, default=60.0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.replot is not None:
        import json

        from gpucheck.clients import plot

        plot(json.loads(args.replot.read_text()), args.replot.with_suffix(".png"))
        return 0
    if args.out is None:
        p.error("--out FOLDER is required (where the parts write their JSON)")
    if args.child:
        return child(args.child, args.out, args.dry_run, args.seconds)
    parts = tuple(x.strip() for x in args.parts.split(",") if x.strip())
    unknown = [x for x in parts if x not in PARTS]
    if unknown or not parts:
        p.error(f"--parts {args.parts!r}: unknown {unknown or 'empty'}; choose from {', '.join(PARTS)}")
    budget = args.budget or (540.0 if args.dry_run else 450.0)
    if budget <= 0:
        p.error(f"--budget must be positive seconds, got {budget:g}")
    weights = {}
    for item in args.share:
        name, _, w = item.partition("=")
        try:
            weights[name] = float(w)
        except ValueError:
            weights[name] = -1.0
        if name not in PARTS or not weights[name] > 0:
            p.error(f"--share {item!r}: give PART=W with PART one of {', '.join(PARTS)} and W a positive number")
    if args.client_rows is not None:
        from gpucheck.clients import ROW_NAMES

        rows = [r.strip() for r in args.client_rows.split(",") if r.strip()]
        bad = [r for r in rows if r not in ROW_NAMES]
        if bad or not rows:
            p.error(f"--client-rows {args.client_rows!r}: unknown {bad or 'empty'}; choose from {', '.join(ROW_NAMES)}")
        os.environ[CLIENT_ROWS] = ",".join(rows)
    if not args.dry_run:
        import torch

        if not torch.cuda.is_available():
            p.error("no CUDA device here: run with --dry-run for the CPU rehearsal (no GPU figures)")
    t0 = time.monotonic()
    records = run_all(args.out, args.dry_run, budget, parts, weights)
    return 0 if summarize(args.out, records, args.dry_run, budget, time.monotonic() - t0) else 1


if __name__ == "__main__":
    raise SystemExit(main())
