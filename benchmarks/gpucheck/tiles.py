"""Part 6 (in the runner's order): tile configs, in the autotune spaces and outside them, timed one by one.

Our backward runs at about half of flex_attention's speed on an H200 (bf16, D = 128, 8K; session 3), and its
dK/dV kernel's space owns at most 64 keys per program, where flex's H100 default owns 128 (``FlexBwDConfig(64, 128,
128, 64, 3, 8)`` in torch 2.11). The spaces keep only configs that build without a register spill on sm_90 and
sm_80 (``kernels/config.py``); whether a larger tile that spills a little is faster was never measured. This part
measures it: for each kernel (dK/dV first, then dQ, then the forward) each candidate config runs alone
(``ULTRAATTN_TILES``, the other two kernels pinned to their spaces' first entries), on a causal mask at S = 8192,
32 query and 8 K/V heads, bf16: the median time of the forward or of the whole backward, and its largest
difference from the first entries' output and gradients (a wrong config fails the part); last, one row with every
kernel autotuned over its whole space, as a user's run has it. The rows go to
``tiles.json`` as they come; the deadline stops the sweep between configs. The dry run goes through the same loop
on the CPU with the eager reference kernels (which ignore tiles): a rehearsal of the code, not a figure.
"""

from __future__ import annotations

import os

import kernels as bench
import torch

from ultraattn.kernels import config

from .common import Ctx

NAME = "tiles"
TITLE = "tile configs"
CORRECTNESS = False
MAX_DIFF = 0.05
"""Largest |this config - the space's first entry| accepted in the forward output or a gradient (bf16 results of
unit scale differ by ~1e-2 between tile orders)."""

EXTRA = {
    "dkv": [(64, 128, 8, 3), (64, 128, 8, 2), (32, 128, 8, 3), (64, 128, 4, 3), (128, 128, 8, 2), (64, 64, 8, 3),
            (64, 64, 4, 3)],
    "dq": [(128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3), (128, 64, 4, 3)],
    "fwd": [(128, 128, 8, 3), (128, 128, 8, 2), (128, 64, 4, 3)],
}
"""Candidates outside the bf16 head-dim-128 spaces: flex's sm_90 tiles, the tiles the spaces left out for spills,
and 4-warp variants."""


def candidates(kernel: str, rows: str = "d128") -> list[tuple[int, int, int, int]]:
    """The space's entries first (its first entry is the reference), then ``EXTRA``'s, without repeats."""
    space = config.tile_configs(kernel, 128, 128, rows)
    return space + [c for c in EXTRA[kernel] if c not in space]


def _label(c: tuple[int, int, int, int]) -> str:
    return "x".join(map(str, c))


def run(ctx: Ctx) -> None:
    import ultraattn.kernels as K

    if ctx.dry_run:
        os.environ["ULTRAATTN_KERNELS"] = "reference"  # the interpreter is far too slow to time
    S, H, HK, D = ctx.pick(8192, 256), ctx.pick(32, 4), ctx.pick(8, 1), ctx.pick(128, 32)
    reps = ctx.pick(10, 2)
    dev = ctx.device.type
    rows_class = config.row_class(D, "bf16")
    bm = bench.create_block_mask(bench.mask_mod_for("causal", S, dev), None, None, S, S, device=dev,
                                 BLOCK_SIZE=128)
    lay = K.get_block_lists(bm, q_len=S, kv_len=S, batch=1, num_heads=H, device=ctx.device)
    flops_fwd = 4.0 * lay.attended_pairs() * D
    g = torch.Generator(device=dev).manual_seed(0)
    dt = torch.bfloat16 if not ctx.dry_run else torch.float32
    q = torch.randn(1, H, S, D, device=dev, dtype=dt, generator=g).requires_grad_()
    k, v = (torch.randn(1, HK, S, D, device=dev, dtype=dt, generator=g).requires_grad_() for _ in range(2))
    go = torch.randn_like(q)

    def attn(q, k, v):
        return K.block_sparse_attention(q, k, v, lay)

    def results():
        out = attn(q, k, v)
        out.backward(go)
        got = [out.detach().float()] + [x.grad.float() for x in (q, k, v)]
        q.grad = k.grad = v.grad = None
        return got

    os.environ.pop(config.TILES_ENV, None)   # the spaces as built in (the sweep sets the variable per config)
    spaces = {kern: config.tile_configs(kern, 128, 128, rows_class) for kern in ("fwd", "dq", "dkv")}
    todo = {kern: candidates(kern, rows_class) for kern in ("dkv", "dq", "fwd")}
    first = {kern: space[0] for kern, space in spaces.items()}
    ref: list = []
    measured: list[dict] = []
    ctx.save(config={"seqlen": S, "heads": H, "kv_heads": HK, "head_dim": D, "mask": "causal", "reps": reps,
                     "dtype": "bf16" if not ctx.dry_run else "fp32"}, first=first, rows=measured)

    def measure(row: dict, label: str, phases: tuple[str, ...]) -> None:
        """Run, compare with the reference (the first entries), time ``phases``; errors become the row's."""
        try:
            got = results()   # (builds the kernels, or autotunes: not timed)
            if not ref:
                ref.extend(got)
            row["max_diff"] = max(float((x - y).abs().max()) for x, y in zip(got, ref))
            for phase in phases:
                t, tflops, spread = bench.phase_time(attn, q, k, v, dev, reps, phase, flops_fwd)
                row.update({f"{phase}_ms": t * 1e3, f"{phase}_tflops": tflops, f"{phase}_spread": spread})
                print(f"[tiles] {label}: {phase} {t * 1e3:.3f} ms ({tflops:.1f} TFLOP/s), "
                      f"diff {row['max_diff']:.3g}", flush=True)
            if not row["max_diff"] <= MAX_DIFF:
                ctx.fail(f"{label}: |this - first entries| = {row['max_diff']:.3g} > {MAX_DIFF}")
        except Exception as exc:  # noqa: BLE001 - a config that cannot build or run is a row, not the end
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
            print(f"[tiles] {label}: {row['error']}", flush=True)
        measured.append(row)
        ctx.save(rows=measured)

    for kern, cfgs in todo.items():
        for cfg in cfgs:
            if ctx.time_left() < 30:
                ctx.note(f"{kern} {_label(cfg)}: not run (the deadline is near)")
                continue
            pins = {**first, kern: cfg}
            os.environ[config.TILES_ENV] = ",".join(f"{n}={_label(c)}" for n, c in pins.items())
            measure({"kernel": kern, "config": list(cfg), "in_space": cfg in spaces[kern]}, f"{kern} {_label(cfg)}",
                    ("fwd",) if kern == "fwd" else ("bwd",))
    os.environ.pop(config.TILES_ENV, None)
    if ctx.time_left() >= 30:   # what a user's run gets: every kernel autotuned over its whole space
        measure({"kernel": "autotuned", "config": None, "in_space": True}, "autotuned", ("fwd", "bwd"))
    auto = next((r for r in measured if r["kernel"] == "autotuned"), {})
    best = {}
    for kern in ("dkv", "dq", "fwd"):
        key = "fwd_ms" if kern == "fwd" else "bwd_ms"
        timed = [r for r in measured if r["kernel"] == kern and key in r]
        if timed:
            b = min(timed, key=lambda r: r[key])
            base = next((r for r in timed if tuple(r["config"]) == first[kern]), None)
            best[kern] = {"config": b["config"], "in_space": b["in_space"], key: b[key],
                          "vs_first": base[key] / b[key] if base else None,
                          "vs_autotuned": auto[key] / b[key] if key in auto else None}
    ctx.save(rows=measured, best=best,
             summary=f"{len(measured)} rows; best " + ", ".join(
                 f"{k} {_label(v['config'])}" + (f" ({v['vs_autotuned']:.2f}x autotuned)" if v["vs_autotuned"] else "")
                 for k, v in best.items()))
