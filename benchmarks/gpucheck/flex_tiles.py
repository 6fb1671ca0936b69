"""Part: tiles on torch's own kernels (issue 52), exact first, then timed against ours and flex.

``ultraattn/kernels/flex_tile.py`` runs a tile on FlexAttention (any ``BlockLists``: its lists as flex's, its bit
tiles read by the mask_mod; the backward by flex's autograd on the recomputed tile with the gradients that make it
exact under the merged softmax) or, for dense tiles, on flash (whose backward takes the merged output and LSE).

1. **Exact.** S = 2K (not a multiple of the block in the dry run), bf16, 8/2 heads, D = 128: each mask split into
   tiles (KV halves for flex, the mask's own mask_mod shifted to each tile, and document masks also through our
   bit tiles; the causal square's three dense quarters for flash), each tile's forward, the LSE
   merge, each tile's backward with the merged output and LSE, the pieces summed; the loss reaches the LSE too.
   Checked by the 2x rule (``check_2x``) against the fp64 dense oracle. A failure fails the part.
2. **Timed.** S = 8K (and 32K while time lasts), 32/8 heads, D = 128, bf16, one tile per mask (the whole mask):
   forward and backward of ours (``block_sparse_attention``), ``torch.compile(flex_attention)`` (its autograd), the
   flex tile with the mask's mask_mod and with our bit tiles (forward; backward given O and L), and the flash tile
   on causal. TFLOP/s count attended pairs
   (forward 4 D per pair, backward 2.5x). Each row records its largest difference from flex's forward output.
"""

from __future__ import annotations

import functools
import math
import os
import statistics

import kernels as bench
import torch
from torch.nn.attention.flex_attention import create_block_mask

import ultraattn.kernels as K
from ultraattn.kernels import flex_tile as FT
from ultraattn.kernels.reference import softmax_delta
from ultraattn.runtime.tiles import merge_partial
from ultraattn.testing import check_2x, dense_attention

from .common import Ctx, error_text, sync

NAME = "flex_tiles"
TITLE = "tiles on flex / flash"
CORRECTNESS = True


def _tile_mask(mask_mod, S: int, n_kv: int, off: int, B: int, H: int, device, bits: bool):
    """FlexAttention's BlockMask of the tile [all queries] x [keys off .. off + n_kv) of ``mask_mod``: our
    BlockLists with the mask's own mask_mod shifted to the tile (``bits=False``) or our bit tiles."""
    def shifted(b, h, q_idx, kv_idx):
        return mask_mod(b, h, q_idx, kv_idx + off)

    bm = create_block_mask(shifted, None, None, S, n_kv, device=device, BLOCK_SIZE=128)
    lists = K.get_block_lists(bm, q_len=S, kv_len=n_kv, batch=B, num_heads=H, device=device, mask_mod=shifted)
    return FT.block_mask_of(lists, None if bits else shifted)


FALLBACKS = (None, {"num_stages": 2}, {"BLOCK_M": 64, "BLOCK_N": 64, "num_stages": 2})
"""FlexAttention's kernel options tried in turn: its own choice first. (Session 5's first H200 call: every tile's
forward failed to build with flex's own choice, "out of resource: shared memory, required 262144, limit 232448".)"""


def first_that_compiles(fn):
    """(options, fn(options)) for the first of ``FALLBACKS`` whose kernel builds; the last error if none does."""
    err = None
    for opts in FALLBACKS:
        try:
            return opts, fn(opts)
        except Exception as exc:  # noqa: BLE001 - Inductor's error type moved between versions
            if "out of resource" not in str(exc) and "No valid triton configs" not in str(exc):
                raise
            err = exc
    raise err


def _merge(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The tiles' (out, lse) merged as the runtime merges a row's partials (``runtime.tiles.merge_partial``, fp32),
    out back in the tiles' dtype."""
    out, lse = functools.reduce(merge_partial, [(o.float(), l_t) for o, l_t in parts], None)
    return out.to(parts[0][0].dtype), lse


def exact_flex(ctx: Ctx, name: str, S: int, dims: dict, bits: bool) -> dict:
    torch._dynamo.reset()
    B, H, Hk, D = dims["batch"], dims["heads"], dims["kv_heads"], dims["head_dim"]
    dev, dt = ctx.device, dims["dtype"]
    mm = bench.mask_mod_for(name, S, dev.type)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(B, H, S, D, generator=g).to(dev, dt)
    k, v = (torch.randn(B, Hk, S, D, generator=g).to(dev, dt) for _ in range(2))
    go, gl = torch.randn(B, H, S, D, generator=g).to(dev, dt), torch.randn(B, H, S, generator=g).to(dev)
    scale = 1.0 / math.sqrt(D)
    cut = (S // 2 // 128) * 128
    tiles = [(0, cut), (cut, S - cut)]
    lists = [_tile_mask(mm, S, n, off, B, H, dev, bits) for off, n in tiles]
    opts, first = first_that_compiles(lambda o: FT.flex_forward(q, k[:, :, :cut], v[:, :, :cut], lists[0], scale, o))
    parts = [first] + [FT.flex_forward(q, k[:, :, off:off + n], v[:, :, off:off + n], bm, scale, opts)
                       for (off, n), bm in zip(tiles[1:], lists[1:])]
    out, lse = _merge(parts)
    delta = softmax_delta(out, go, gl)
    dq, dk, dv = torch.zeros_like(q, dtype=torch.float32), torch.zeros_like(k, dtype=torch.float32), \
        torch.zeros_like(v, dtype=torch.float32)
    for (off, n), bm in zip(tiles, lists):
        a, b, c = FT.flex_backward(q, k[:, :, off:off + n], v[:, :, off:off + n], lse, delta, go, bm, scale,
                                   kernel_options=opts)
        dq += a.float()
        dk[:, :, off:off + n] += b.float()
        dv[:, :, off:off + n] += c.float()
    got = {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}
    idx = torch.arange(S, device=dev)
    allowed = mm(torch.zeros((), dtype=torch.long, device=dev), torch.zeros((), dtype=torch.long, device=dev),
                 idx[:, None], idx[None, :])
    ref64 = dense_attention(q, k, v, allowed, go, gl, torch.float64)
    ref = dense_attention(q, k, v, allowed, go, gl, dt)
    return {"case": f"flex{' bits' if bits else ''} {name} S={S} 2 KV tiles", "kernel_options": opts,
            "problems": check_2x(got, ref64, ref, dims["dtype_name"])}


def exact_flash(ctx: Ctx, S: int, dims: dict) -> dict:
    """Causal as three dense tiles: the two diagonal squares (causal) and the square below them (all FULL)."""
    B, H, Hk, D = dims["batch"], dims["heads"], dims["kv_heads"], dims["head_dim"]
    dev, dt = ctx.device, dims["dtype"]
    g = torch.Generator().manual_seed(4)
    q = torch.randn(B, H, S, D, generator=g).to(dev, dt)
    k, v = (torch.randn(B, Hk, S, D, generator=g).to(dev, dt) for _ in range(2))
    go, gl = torch.randn(B, H, S, D, generator=g).to(dev, dt), torch.randn(B, H, S, generator=g).to(dev)
    scale, h = 1.0 / math.sqrt(D), S // 2
    lo, hi = slice(0, h), slice(h, S)
    tiles = [(lo, lo, True), (hi, lo, False), (hi, hi, True)]
    fwd = {i: FT.flash_forward(q[:, :, qs], k[:, :, ks], v[:, :, ks], scale, c) for i, (qs, ks, c) in enumerate(tiles)}
    out_lo, lse_lo = fwd[0]
    out_hi, lse_hi = _merge([fwd[1], fwd[2]])
    out, lse = torch.cat([out_lo, out_hi], 2), torch.cat([lse_lo, lse_hi], 2)
    dq = torch.zeros_like(q, dtype=torch.float32)
    dk, dv = (torch.zeros_like(k, dtype=torch.float32) for _ in range(2))
    for qs, ks, c in tiles:
        # (flash's backward takes no dLSE: this case's loss reaches the output alone, and so does its oracle's)
        a, b, d = FT.flash_backward(q[:, :, qs], k[:, :, ks], v[:, :, ks], out[:, :, qs], lse[:, :, qs],
                                    go[:, :, qs], scale, c)
        dq[:, :, qs] += a.float()
        dk[:, :, ks] += b.float()
        dv[:, :, ks] += d.float()
    got = {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}
    allowed = torch.ones(S, S, dtype=torch.bool, device=dev).tril()
    zero = torch.zeros_like(gl)
    ref64 = dense_attention(q, k, v, allowed, go, zero, torch.float64)
    ref = dense_attention(q, k, v, allowed, go, zero, dt)
    return {"case": f"flash causal S={S} 3 dense tiles (no dLSE)", "problems": check_2x(got, ref64, ref,
                                                                                       dims["dtype_name"])}


def timed_row(ctx: Ctx, name: str, S: int, dims: dict, reps: int) -> dict:
    torch._dynamo.reset()  # a row's compiles count afresh (kernels.py's rule)
    B, H, Hk, D = dims["batch"], dims["heads"], dims["kv_heads"], dims["head_dim"]
    dev, dt, dname = ctx.device, dims["dtype"], ctx.device.type
    mm = bench.mask_mod_for(name, S, dname)
    bm = create_block_mask(mm, None, None, S, S, device=dname, BLOCK_SIZE=128)
    lay = K.get_block_lists(bm, q_len=S, kv_len=S, batch=B, num_heads=H, device=dev)
    fb = FT.block_mask_of(lay, mm)
    fb_bits = FT.block_mask_of(lay)
    pairs = lay.attended_pairs()
    flops = 4.0 * pairs * D
    g = torch.Generator(device=dname).manual_seed(0)
    q = torch.randn(B, H, S, D, device=dname, dtype=dt, generator=g)
    k, v = (torch.randn(B, Hk, S, D, device=dname, dtype=dt, generator=g) for _ in range(2))
    go = torch.randn_like(q)
    scale = 1.0 / math.sqrt(D)
    row = {"seqlen": S, "mask": name, "density": pairs / (B * H * S * S), "methods": {}}
    qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
    flex = torch.compile(bench.flex_attention) if dname == "cuda" else bench.flex_attention

    def record(method: str, phase: str, fn) -> None:
        """Time ``fn`` (``bwd_autograd``: a backward through ``fn(q, k, v)``'s autograd, kernels.py's way)."""
        autograd = phase == "bwd_autograd"
        phase = "bwd" if autograd else phase
        try:
            ts = bench.bwd_time(fn, qg, kg, vg, dname, reps) if autograd else bench.timeit(fn, dname, reps)
        except Exception as exc:  # noqa: BLE001 - a method that cannot run is its row's error
            row["methods"].setdefault(method, {})[f"{phase}_error"] = error_text(exc).splitlines()[0][:300]
            ctx.note(f"S={S} {name} {method} {phase}: {row['methods'][method][f'{phase}_error']}")
            return
        t = statistics.median(ts)
        spread = (max(ts) - min(ts)) / t
        f = flops * (2.5 if phase == "bwd" else 1.0)
        row["methods"].setdefault(method, {}).update(
            {f"{phase}_s": t, f"{phase}_tflops": f / t / 1e12, f"{phase}_spread": spread})

    gqa = Hk != H
    record("ultraattn", "fwd", lambda: K.block_sparse_attention(q, k, v, lay))
    record("ultraattn", "bwd_autograd", lambda q_, k_, v_: K.block_sparse_attention(q_, k_, v_, lay))
    record("flex", "fwd", lambda: flex(q, k, v, block_mask=bm, enable_gqa=gqa))
    if dname == "cuda":
        record("flex", "bwd_autograd", lambda q_, k_, v_: flex(q_, k_, v_, block_mask=bm, enable_gqa=gqa))
    row["max_abs_diff_vs_flex"] = {}
    ref = None
    if "fwd_s" in row["methods"].get("flex", {}):
        with torch.no_grad():
            ref = flex(q, k, v, block_mask=bm, enable_gqa=gqa).float()
    tiles = {"flex_tile": fb, "flex_tile_bits": fb_bits}
    for method, mask in tiles.items():
        try:
            opts, (out, lse) = first_that_compiles(lambda o, mask=mask: FT.flex_forward(q, k, v, mask, scale, o))
        except Exception as exc:  # noqa: BLE001
            row["methods"][method] = {"fwd_error": error_text(exc).splitlines()[0][:300]}
            ctx.note(f"S={S} {name} {method}: {row['methods'][method]['fwd_error']}")
            continue
        if ref is not None:
            row["max_abs_diff_vs_flex"][method] = float((out.float() - ref).abs().max())
        record(method, "fwd", lambda mask=mask, opts=opts: FT.flex_forward(q, k, v, mask, scale, opts))
        delta = softmax_delta(out, go)
        record(method, "bwd", lambda mask=mask, lse=lse, delta=delta, opts=opts: FT.flex_backward(
            q, k, v, lse, delta, go, mask, scale, kernel_options=opts))
        row["methods"][method]["kernel_options"] = opts
    if name == "causal" and dname == "cuda":
        o2, l2 = FT.flash_forward(q, k, v, scale, True)
        if ref is not None:
            row["max_abs_diff_vs_flex"]["flash_tile"] = float((o2.float() - ref).abs().max())
        record("flash_tile", "fwd", lambda: FT.flash_forward(q, k, v, scale, True))
        record("flash_tile", "bwd", lambda: FT.flash_backward(q, k, v, o2, l2, go, scale, True))
    base = row["methods"].get("flex", {})
    for res in row["methods"].values():
        for phase in ("fwd", "bwd"):
            if f"{phase}_s" in res and f"{phase}_s" in base:
                res[f"{phase}_vs_flex"] = base[f"{phase}_s"] / res[f"{phase}_s"]
    sync(dev)
    return row


def run(ctx: Ctx) -> None:
    if ctx.dry_run:
        os.environ["ULTRAATTN_KERNELS"] = "reference"  # the interpreter is far too slow to time
    # every mask (and every tile) is one more compile of flex_attention; past Dynamo's recompile limit flex would run
    # unfused (session 3's 32K baselines did), which is no measurement
    import torch._dynamo.config as dynamo_config

    for knob, value in (("recompile_limit", 256), ("cache_size_limit", 256), ("accumulated_recompile_limit", 4096),
                        ("accumulated_cache_size_limit", 4096)):
        if hasattr(dynamo_config, knob):
            setattr(dynamo_config, knob, value)
    if hasattr(dynamo_config, "fail_on_recompile_limit_hit"):
        dynamo_config.fail_on_recompile_limit_hit = True  # a limit hit is an error row, never an unfused flex
    dt = ctx.pick(torch.bfloat16, torch.float32)
    small = {"batch": 1, "heads": ctx.pick(8, 4), "kv_heads": 2, "head_dim": ctx.pick(128, 32), "dtype": dt,
             "dtype_name": ctx.pick("bf16", "fp32")}
    ctx.save(exact=[], rows=[])
    s_exact = ctx.pick(2048, 384)
    for name, bits in (("causal", False), ("document", False), ("document", True)):
        try:
            res = exact_flex(ctx, name, s_exact, small, bits)
        except Exception as exc:  # noqa: BLE001
            res = {"case": f"flex{' bits' if bits else ''} {name}", "problems": [error_text(exc)]}
        ctx.save(exact=ctx.record["exact"] + [res])
        for p in res["problems"]:
            ctx.fail(f"{res['case']}: {p.splitlines()[0][:300]}")
    if ctx.device.type == "cuda":
        try:
            res = exact_flash(ctx, s_exact, small)
        except Exception as exc:  # noqa: BLE001
            res = {"case": "flash causal", "problems": [error_text(exc)]}
        ctx.save(exact=ctx.record["exact"] + [res])
        for p in res["problems"]:
            ctx.fail(f"{res['case']}: {p.splitlines()[0][:300]}")
    big = {"batch": 1, "heads": ctx.pick(32, 4), "kv_heads": ctx.pick(8, 2), "head_dim": ctx.pick(128, 32),
           "dtype": dt}
    for S in ctx.pick((8192, 32768), (512,)):
        for name in ("causal", "document", "sliding_window", "strided", "global_local"):
            if ctx.time_left() < 40:
                ctx.note(f"S={S} {name}: no time left")
                continue
            try:
                row = timed_row(ctx, name, S, big, ctx.pick(10, 2))
            except Exception as exc:  # noqa: BLE001
                row = {"seqlen": S, "mask": name, "error": error_text(exc)}
                ctx.fail(f"S={S} {name}: {row['error'].splitlines()[0][:300]}")
            ctx.save(rows=ctx.record["rows"] + [row])
    rows = [r for r in ctx.record["rows"] if "methods" in r]
    summary = []
    for m in ("flex_tile", "flex_tile_bits", "flash_tile", "ultraattn"):
        for phase in ("fwd", "bwd"):
            vals = [r["methods"][m][f"{phase}_vs_flex"] for r in rows if f"{phase}_vs_flex" in r["methods"].get(m, {})]
            if vals:
                summary.append(f"{m} {phase} {statistics.median(vals):.2f}x flex")
    ctx.save(summary="; ".join(summary) or "no timed rows")
