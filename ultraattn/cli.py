"""``ultraattn`` command line: ``plan``, ``calibrate``, ``report`` and ``masks`` (mask names and parameters).

    ultraattn plan --mask strided --seqlen 512k --cp 8x8 --heads 32 --head-dim 128 \\
                   [--kv-heads N] [--batch B] [--backward] [--cost-profile FILE] [--json FILE] [--png FILE]
    ultraattn calibrate [--nproc N] [--out FILE]     # or under torchrun: every launched rank measures

Bad input exits with status 2 and ONE line naming the argument and the fix.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys

from rich.console import Console

from ultraattn.masks.convert import pattern_from_mask_mod
from ultraattn.masks.spec import MaskKind, describe_masks, parse_mask_spec
from ultraattn.planner.api import choose_planner, evaluate, method_summaries, overall_ilp_status, plan
from ultraattn.planner.baselines import BASELINES, REGISTRY, HeadsIndivisible, NotApplicable
from ultraattn.planner.cost import DEFAULT_COST, CostModel
from ultraattn.planner.plan import AttnShape, Mesh
from ultraattn.planner.profile import CostProfile, ProfileError
from ultraattn.planner.tiling import PlannerOptions
from ultraattn.report.compile_report import render_saved
from ultraattn.report.plan_report import print_plan_result
from ultraattn.report.png import draw_plan_png
from ultraattn.report.style import compare_words, format_ms, print_line, report_console

SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmM]?)\s*$")


class CliError(ValueError):
    """Bad command-line input: printed as one line, exit status 2."""


def parse_size(text: str, *, arg: str) -> int:
    m = SIZE_RE.match(text)
    if not m:
        raise CliError(f"{arg} must be a token count like 65536, 64k or 2m, got {text!r}")
    mult = {"": 1, "k": 1024, "m": 1024 * 1024}[m.group(2).lower()]
    value = float(m.group(1)) * mult
    if value < 1 or value != int(value):
        raise CliError(f"{arg} must be a positive whole number of tokens, got {text!r}")
    return int(value)


def parse_cp(text: str):

    m = re.fullmatch(r"\s*(\d+)\s*(?:[xX*]\s*(\d+))?\s*", text)
    if not m:
        raise CliError(f"--cp must be DEVICES or NODESxDEVICES (e.g. 8 or 8x8), got {text!r}")
    a, b = int(m.group(1)), m.group(2)
    # "8x8" = nodes x devices (UltraAttn writes intra x inter; both are 8 in its configs)
    nodes, devices = (a, int(b)) if b is not None else (1, a)
    if nodes < 1 or devices < 1:
        raise CliError(f"--cp must have at least one node and one device, got {text!r}")
    return Mesh(nodes=nodes, devices=devices)


def parse_cost(items: list[str], base: CostModel = DEFAULT_COST):

    changes = {}
    names = CostModel.field_names()
    for it in items:
        key, sep, val = it.partition("=")
        if not sep or key not in names:
            raise CliError(f"--cost must be KEY=VALUE with KEY one of {', '.join(names)}, got {it!r}")
        try:
            changes[key] = float(val)
        except ValueError:
            raise CliError(f"--cost {key} must be a number, got {val!r}") from None
    try:
        return dataclasses.replace(base, **changes)
    except ValueError as exc:
        raise CliError(f"--cost: {exc}") from None


def default_block(seq_len: int) -> int:
    """Pattern block: FlexAttention's 128, coarser for very long sequences (a grid of <= 1024^2 cells)."""
    b = 128
    while seq_len / b > 1024:
        b *= 2
    return b


def _build_parser() -> argparse.ArgumentParser:

    p = argparse.ArgumentParser(prog="ultraattn", description="Context-parallel attention planner (UltraAttn-style).")
    sub = p.add_subparsers(dest="cmd", required=True)
    pl = sub.add_parser("plan", help="plan one attention and compare with the baselines",
                        description="Plan one attention over a nodes x devices mesh; print a report.")
    pl.add_argument("--mask", default=MaskKind.STRIDED,
                    help=f"mask spec NAME[:key=value,...] (see `ultraattn masks`; default: {MaskKind.STRIDED})")
    pl.add_argument("--seqlen", default="512k", help="sequence length, e.g. 65536, 64k, 2m (default 512k)")
    pl.add_argument("--cp", default="8x8", help="mesh NODESxDEVICES or DEVICES (default 8x8)")
    pl.add_argument("--heads", type=int, default=32)
    pl.add_argument("--head-dim", type=int, default=128)
    pl.add_argument("--kv-heads", type=int, default=None, help="GQA key/value heads (default: --heads)")
    pl.add_argument("--batch", type=int, default=1)
    pl.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    pl.add_argument("--backward", action="store_true", help="plan forward + backward (default: forward only)")
    pl.add_argument("--block", type=int, default=None, help="pattern block size (default: 128, coarser past 128K)")
    pl.add_argument("--chunks-per-rank", type=int, default=2)
    pl.add_argument("--balance-tol", type=float, default=0.05)
    pl.add_argument("--ilp-time-limit", type=float, default=4.0)
    pl.add_argument("--time-budget", type=float, default=10.0, help="seconds for all partition work")
    pl.add_argument("--baselines", default="all",
                    help=f"comma list of {', '.join(BASELINES)} or 'all' or 'none' (default all)")
    pl.add_argument("--cost", action="append", default=[], metavar="KEY=VALUE", help="override a cost-model field")
    pl.add_argument("--cost-profile", metavar="FILE",
                    help="plan with a calibrated profile (`ultraattn calibrate --out FILE`) instead of the H100 "
                         "defaults; --cost overrides apply on top")
    pl.add_argument("--planner", choices=("auto", "ilp", "fast"), default="auto",
                    help="ilp: hierarchical ILPs (seconds); fast: the run-time planner (milliseconds, no ILP); "
                         "auto: ilp, since a mask given here is known up front, or fast where PuLP is not installed "
                         "(default)")
    pl.add_argument("--json", metavar="FILE", help="write the summary JSON here")
    pl.add_argument("--png", metavar="FILE", help="draw the tile assignment and schedule (needs matplotlib)")
    pl.add_argument("--quiet", action="store_true", help="no report, only the JSON (if asked) and one line")
    sub.add_parser("masks", help="list mask names, parameters and defaults")
    cb = sub.add_parser("calibrate", help="measure this machine and fit the planner's cost model to it",
                        description="Time the runtime's tile calls, messages and merges on this machine (all ranks "
                                    "at once) and fit the cost model; write the profile (JSON). Under torchrun "
                                    "every launched rank takes part; otherwise --nproc local gloo ranks are spawned. "
                                    "By default the profile goes where cost='auto' looks for it.")
    cb.add_argument("--nproc", type=int, default=1,
                    help="local ranks to spawn (gloo on 127.0.0.1) when not launched by torchrun (default 1: no "
                         "messages are measured)")
    cb.add_argument("--devices-per-node", type=int, default=None,
                    help="ranks per node of the mesh (default: LOCAL_WORLD_SIZE, else all ranks on one node)")
    cb.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                    help="where tiles run (default: cuda when available)")
    cb.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default=None,
                    help="input dtype of the tiles (default: bf16 on GPU, fp32 on CPU)")
    cb.add_argument("--threads", type=int, default=1, help="torch threads per spawned rank (default 1)")
    cb.add_argument("--quick", action="store_true", help="a tiny grid in seconds (a smoke test, not a profile)")
    cb.add_argument("--out", metavar="FILE", help="write the profile here (default: the cache cost='auto' reads)")
    cb.add_argument("--timeout", type=float, default=300.0, help="seconds any rank waits for a peer (default 300)")
    rp = sub.add_parser("report", help="render a report saved by the backend (options={'report_file': FILE})",
                        description="Render the JSON report that torch.compile(..., backend='ultraattn', "
                                    "options={'report_file': FILE}) wrote: attention sites, why each was or was not "
                                    "rewritten, the rewritten graph, and the plans made at run time.")
    rp.add_argument("file", help="the report JSON")
    return p


def _validate(args):

    seq = parse_size(args.seqlen, arg="--seqlen")
    mesh = parse_cp(args.cp)
    for nm in ("heads", "head_dim", "batch", "chunks_per_rank"):
        if getattr(args, nm) < 1:
            raise CliError(f"--{nm.replace('_', '-')} must be positive, got {getattr(args, nm)}")
    if args.kv_heads is not None and (args.kv_heads < 1 or args.heads % args.kv_heads):
        raise CliError(f"--kv-heads must divide --heads={args.heads}, got {args.kv_heads}")
    if not 0 <= args.balance_tol < 1:
        raise CliError(f"--balance-tol must lie in [0, 1), got {args.balance_tol}")
    block = args.block or default_block(seq)
    if block < 16 or block & (block - 1):
        raise CliError(f"--block must be a power of two >= 16, got {block}")
    need = mesh.world * args.chunks_per_rank * block
    if seq < need // 2:
        raise CliError(
            f"--cp {args.cp} gives {mesh.world} ranks x {args.chunks_per_rank} chunks of >= {block} tokens: "
            f"--seqlen must be at least {need // 2} (got {seq}); use a smaller --cp, --chunks-per-rank or --block"
        )
    if args.baselines in ("all", ""):
        baselines = BASELINES
    elif args.baselines == "none":
        baselines = ()
    else:
        baselines = tuple(b.strip() for b in args.baselines.split(","))
        bad = [b for b in baselines if b not in REGISTRY]
        if bad:
            raise CliError(f"--baselines must be a comma list of {', '.join(BASELINES)}, got {bad[0]!r}")
    shape = AttnShape(seq_len=seq, num_heads=args.heads, head_dim=args.head_dim, num_kv_heads=args.kv_heads,
                      batch=args.batch, dtype=args.dtype)
    named = baselines if args.baselines not in ("all", "") else ()  # named ones must run ('all' reports why not)
    for name in named:
        try:
            REGISTRY[name].check(mesh, shape)
        except HeadsIndivisible:
            raise CliError(f"--baselines {name} needs --heads={args.heads} and --kv-heads={shape.kv_heads} to be "
                           f"multiples of the world size {mesh.world}; drop it or use --baselines all") from None
        except NotApplicable as exc:
            raise CliError(f"--baselines {name} cannot run here: {exc}; drop it or use --baselines all") from None
    return seq, mesh, shape, block, baselines


def _summary_json(args, res, shape, mesh, cost: CostModel) -> dict:

    status, gap = overall_ilp_status(res)
    methods = method_summaries(res)
    best = res.best_baseline(args.backward)
    ours = res.ours
    out = {
        "mask": res.pattern.name, "seqlen": shape.seq_len, "cp": [mesh.nodes, mesh.devices],
        "heads": shape.num_heads, "kv_heads": shape.kv_heads, "head_dim": shape.head_dim, "batch": shape.batch,
        "backward": bool(args.backward),
        "planner": {"name": res.solver["planner"], "seconds": res.seconds, "ilp_status": status, "ilp_gap": gap,
                    "structure": res.plan.meta.get("structure"), "plan_hash": res.plan.content_hash(),
                    "levels": res.solver["levels"], "schedule": res.solver["schedule"], "notes": res.notes,
                    # the fast planner's robust choice (planner/robust.py): the chosen plan's worst-case regret over
                    # the cost-model band against its finalists, each finalist's, and the band
                    "regret": res.plan.meta.get("regret"), "regrets": res.plan.meta.get("regrets"),
                    "band": res.plan.meta.get("band")},
        "methods": methods,
    }
    t = (lambda e: e.total_ms()) if args.backward else (lambda e: e.fwd_ms)
    # the plan replayed as the executor runs it: each rank's program (docs/planner.md, "As the executor runs it")
    out["executed_ms"] = t(evaluate(res.plan, res.pattern, cost=cost, backward=args.backward, executed=True))
    if res.compute_bound_ms:
        out["compute_bound_ms"] = res.compute_bound_ms
        out["vs_compute_bound"] = t(ours) / res.compute_bound_ms
        out["executed_vs_compute_bound"] = out["executed_ms"] / res.compute_bound_ms
    if best:
        name, ev = best
        out["best_baseline"] = name
        out["speedup_vs_best_baseline"] = t(ev) / t(ours)
    return out


def _report(console, args, res, mesh):

    print_plan_result(console, res, mesh, backward=args.backward)


def cmd_plan(args) -> int:


    seq, mesh, shape, block, baselines = _validate(args)
    base = DEFAULT_COST
    if args.cost_profile:
        try:
            base = CostProfile.load(args.cost_profile).cost
        except ProfileError as exc:
            raise CliError(f"--cost-profile: {exc}") from None
    cost = parse_cost(args.cost, base)
    try:
        mask_mod = parse_mask_spec(args.mask, seq)
    except ValueError as exc:
        raise CliError(f"--mask: {exc}") from None
    try:
        opts = PlannerOptions(balance_tol=args.balance_tol, chunks_per_rank=args.chunks_per_rank,
                              ilp_time_limit=args.ilp_time_limit, time_budget=args.time_budget)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    console = report_console()
    batch_patterns = getattr(mask_mod, "num_batch", 1)
    if batch_patterns not in (1, shape.batch):
        raise CliError(f"--batch must be {batch_patterns} for this document mask (one length list per batch entry), "
                       f"got {shape.batch}")
    try:
        which = choose_planner(args.planner, known_up_front=True)
    except ModuleNotFoundError as exc:
        raise CliError(f"--planner {args.planner}: {exc}") from None
    with console.status("building the block pattern…") as status:
        pattern = pattern_from_mask_mod(mask_mod, seq, block_size=block, batch=shape.batch,
                                        num_heads=shape.num_heads, name=getattr(mask_mod, "__name__", args.mask))
        res = plan(pattern, shape, mesh, cost=cost, options=opts, backward=args.backward, baselines=baselines,
                   progress=lambda msg: status.update(f"planning: {msg}…"),
                   planner=which)
    summary = _summary_json(args, res, shape, mesh, cost)
    if not args.quiet:
        _report(console, args, res, mesh)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(summary, fh, indent=2)
    if args.png:

        try:
            draw_plan_png(args.png, assign_grid=res.plan.assign_GPP[0].tolist(), owner=list(res.plan.owner),
                          nodes=mesh.nodes, devices=mesh.devices,
                          tasks=res.ours.fwd.gantt_tasks(set(range(mesh.devices))),
                          title=f"{pattern.name} S={seq} CP {mesh}")
        except RuntimeError as exc:
            raise CliError(str(exc)) from None
    sp = summary.get("speedup_vs_best_baseline")
    took = f"{res.seconds * 1e3:.0f} ms" if res.seconds < 1 else f"{res.seconds:.1f} s"
    print_line(console, f"planned in {took} ({res.solver['planner']} planner); "
                  f"ultraattn {format_ms(res.ours.fwd_ms)} fwd"
                  + (f" + {format_ms(res.ours.bwd_ms)} bwd" if args.backward else "")
                  + (f"; {summary['vs_compute_bound']:.2f}x the compute bound" if "vs_compute_bound" in summary else "")
                  + f"; as the executor runs it {format_ms(summary['executed_ms'])}"
                  + (f", {summary['executed_vs_compute_bound']:.2f}x" if "executed_vs_compute_bound" in summary else "")
                  + (f"; {compare_words(1.0, sp)} the best baseline ({summary['best_baseline']}) as the planner "
                     f"replays both" if sp else ""))
    return 0


def cmd_report(args) -> int:

    try:
        render_saved(args.file)
    except FileNotFoundError:
        raise CliError(f"{args.file}: no such file (write one with options={{'report_file': ...}})") from None
    except ValueError as exc:
        raise CliError(str(exc)) from None
    return 0


def _calibrate_rank(rank: int, world: int, args) -> dict:
    """One rank of ``ultraattn calibrate`` (spawned, or launched by torchrun): measure, fit, save on rank 0."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from ultraattn.runtime.calibrate import calibrate, default_device, profile_path

    device = default_device() if args.device == "auto" else torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    mesh = None
    per_node = args.devices_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0) or max(world, 1)
    if world > 1 and per_node < world:   # several nodes (of one rank each, or more)
        mesh = init_device_mesh(device.type, (world // per_node, per_node), mesh_dim_names=("node", "device"))
    group = dist.group.WORLD if world > 1 and mesh is None else None
    profile = calibrate(group, device, mesh=mesh, quick=args.quick, dtype=args.dtype, progress=rank == 0,
                        timeout=args.timeout)
    if rank == 0:
        path = args.out or profile_path(profile.machine["key"])   # the key names this device, mesh and threads
        profile.save(path)
        return {"profile": profile.to_json(), "path": str(path)}
    return {}


def _print_profile(console: Console, data: dict, path: str) -> None:
    from rich.table import Table

    m = data["machine"]
    t = Table(title=f"cost profile: {m['device']} ({m['device_type']}), {m['nodes']}x{m['devices_per_node']} ranks, "
                    f"{m['calibration_seconds']:.0f} s")
    t.add_column("field")
    t.add_column("fitted", justify="right")
    t.add_column("H100 default", justify="right")
    for k, v in data["cost"].items():
        t.add_row(k, f"{v:.4g}", f"{getattr(DEFAULT_COST, k):.4g}")
    console.print(t)
    for term, st in data["fit"].items():
        if term == "sharing":
            console.print(f"sharing: all ranks busy / one alone = {', '.join(f'{r:.2f}' for r in st['ratios'])}")
            continue
        if term == "step":
            before = ", ".join(f"{r:.2f}" for r in st["predicted_over_measured_before"])
            console.print(f"steps: kernels {st['scale']:.2f}x slower inside a step; predicted/measured "
                          f"{before} -> {', '.join(f'{r:.2f}' for r in st['predicted_over_measured_after'])}")
            continue
        for part, f in ({term: st}.items() if "samples" in st else st.items()):
            console.print(f"fit {part}: {f['samples']} samples, median error {f['median_rel_err']:.1%}, "
                          f"worst {f['max_rel_err']:.1%}")
    for n in data["notes"]:
        console.print(f"note: {n}")
    console.print(f"wrote {path}")


def cmd_calibrate(args) -> int:
    if args.nproc < 1:
        raise CliError(f"--nproc must be >= 1, got {args.nproc}")
    if args.threads < 1:
        raise CliError(f"--threads must be >= 1, got {args.threads}")
    if args.timeout <= 0:
        raise CliError(f"--timeout must be positive seconds, got {args.timeout}")
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise CliError("--device cuda: no CUDA device here; use --device cpu")
    launched = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if launched > 1:   # torchrun: this process is one rank
        import torch.distributed as dist

        if args.nproc != 1:
            raise CliError("--nproc spawns local ranks; under torchrun the launched ranks measure: drop --nproc")
        if not dist.is_initialized():
            dist.init_process_group("nccl" if args.device != "cpu" and torch.cuda.is_available() else "gloo")
        try:
            res = _calibrate_rank(dist.get_rank(), dist.get_world_size(), args)
        finally:
            dist.destroy_process_group()
    else:
        from ultraattn.testing import run_ranks

        world = args.nproc if args.nproc > 1 else 0
        if args.devices_per_node and (args.nproc % args.devices_per_node):
            raise CliError(f"--devices-per-node must divide --nproc={args.nproc}, got {args.devices_per_node}")
        res = run_ranks(_calibrate_rank, world, args=(args,), timeout=args.timeout + 600, pg_timeout=args.timeout,
                        threads=args.threads)[0]
    if res:
        _print_profile(Console(), res["profile"], res["path"])
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    try:
        if args.cmd == "masks":
            print(describe_masks())
            return 0
        if args.cmd == "report":
            return cmd_report(args)
        if args.cmd == "calibrate":
            return cmd_calibrate(args)
        return cmd_plan(args)
    except CliError as exc:
        print(f"ultraattn {args.cmd}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
