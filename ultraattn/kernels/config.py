"""Kernel selection and the autotuning space (no triton import here: it must stay importable without it)."""

from __future__ import annotations

import importlib.util
import os


def interpret() -> bool:
    """Triton runs kernels in its Python interpreter (``TRITON_INTERPRET=1``, the CPU test path).

    Triton reads the variable when a kernel is decorated, i.e. when ``triton_kernels`` is first
    imported (at the first launch), so set it before the first kernel runs.
    """
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

HAS_TRITON = importlib.util.find_spec("triton") is not None

# The autotuning spaces: (BLOCK_M, BLOCK_N, num_warps, num_stages) per kernel and row class.
# Forward: BLOCK_M query rows per program, BLOCK_N keys per inner step; dQ programs own BLOCK_M
# rows and walk keys; dK/dV programs own BLOCK_N keys and walk queries (and loop over the GQA
# group, which raises their register use at group > 1).
#
# Every entry builds for sm_90 and sm_80 with no register spill and within the target's shared
# memory, at every head dim of its class, bf16 and fp16, GQA groups 1-8: checked by ahead-of-time
# builds (kernels/aot.py) with Triton 3.6 and 3.9; `python benchmarks/kernels_ptx.py` rebuilds
# the table, tests/test_kernels_aot.py holds CI to a subset. The entries were chosen from sweeps
# of tiles 16-128, 4/8 warps and 1-4 stages, keeping the largest tiles that were clean on both
# targets. Which configs spill is not monotone in the head dim: ptxas allocates differently for
# a padded head dim (80, 96: masked loads) than for 128, and caps some 8-warp sm_80 builds at 128
# registers (forward 128 x 64 spills 20 B at head dim 32 but not at 64), hence one space per
# padded-width class and a separate one for padded head dims up to 128.
# Each entry costs one compile the first time a (head dim, dtype, group, block) key is seen,
# never per sequence length (lengths are not specialised).
_DKV_128 = [(128, 32, 8, 2), (128, 32, 8, 3), (64, 32, 8, 2), (64, 32, 8, 3), (32, 64, 8, 2), (32, 64, 8, 3)]
_SPACES: dict[tuple[str, str], list[tuple[int, int, int, int]]] = {
    ("fwd", "d32"): [(128, 128, 8, 3), (64, 128, 8, 3), (128, 32, 8, 3), (64, 64, 8, 3), (64, 64, 8, 4),
                     (32, 128, 8, 3)],
    # 128 x 128 forward tiles: clean with Triton 3.9 at head dim 64/128, but at 255 registers, and
    # Triton 3.6 spills 8 B at head dim 128 on sm_80: left to the head-dim-32 class.
    ("fwd", "d64"): [(128, 64, 8, 3), (128, 64, 8, 4), (64, 64, 8, 3), (128, 32, 8, 3), (64, 64, 4, 3)],
    ("fwd", "d128"): [(128, 64, 8, 3), (128, 64, 8, 4), (64, 128, 8, 3), (64, 64, 8, 3), (128, 32, 8, 3)],
    ("fwd", "d128p"): [(64, 128, 8, 3), (32, 128, 8, 3), (128, 32, 8, 3), (64, 64, 4, 3)],
    ("fwd", "d256"): [(64, 64, 8, 2), (64, 32, 8, 3), (64, 32, 8, 2), (32, 64, 8, 3)],
    ("dq", "d32"): [(128, 64, 8, 2), (64, 64, 8, 2), (64, 64, 8, 3), (64, 64, 4, 2), (128, 32, 8, 2),
                    (64, 32, 8, 2)],
    ("dq", "d64"): [(128, 64, 8, 2), (64, 64, 8, 2), (64, 64, 8, 3), (32, 128, 8, 2), (128, 32, 8, 2),
                    (64, 32, 8, 2)],
    ("dq", "d128"): [(128, 64, 8, 2), (64, 128, 8, 2), (64, 64, 8, 2), (64, 64, 8, 3), (32, 128, 8, 2),
                     (128, 32, 8, 2)],
    ("dq", "d128p"): [(64, 64, 8, 2), (64, 64, 8, 3), (32, 128, 8, 2), (64, 32, 8, 2), (128, 32, 8, 2)],
    ("dq", "d256"): [(64, 32, 8, 2), (32, 64, 8, 2), (32, 64, 8, 1), (32, 32, 8, 2)],
    ("dkv", "d32"): [(64, 64, 8, 2), (64, 64, 8, 3), (32, 128, 8, 3), (64, 32, 8, 2), (32, 64, 8, 2),
                     (32, 64, 4, 2)],
    ("dkv", "d64"): [(32, 128, 8, 3), (128, 32, 8, 2), (128, 32, 8, 3), (64, 32, 8, 3), (32, 64, 8, 2)],
    ("dkv", "d128"): _DKV_128,
    ("dkv", "d128p"): _DKV_128,
    ("dkv", "d256"): [(64, 32, 8, 2), (64, 32, 8, 1), (32, 32, 8, 2), (64, 16, 8, 1)],
}
# fp32 (ieee dots, no tensor cores) has spaces of its own, named by the padded head dim ("f32" ... "f256"): every
# entry of the bf16 spaces spilled in fp32 at head dim 64 on sm_90 (up to 50 KB per thread), and the first GPU
# run (2026-11-26) compiled the example model, fp32 at head dim 64, for 175 s. These entries are what a sweep of
# 464 fp32 builds (Triton 3.9, tiles 16-128, 4/8 warps) found clean on sm_90 and sm_80 at head dims 32, 64, 128
# and 256, dK/dV at GQA groups 1 and 8. Two exceptions: nothing clean at head dim 128 for dK/dV on both targets
# (these are clean on sm_90 and spill at most 12 B on sm_80 at one group), and at 256 only 16 x 32 tiles were
# clean. The padded head dims inside a class (48, 80, 96, ...) were not swept.
_FP32_SPACES: dict[tuple[str, str], list[tuple[int, int, int, int]]] = {
    ("fwd", "f32"): [(128, 32, 8, 2), (64, 64, 8, 2), (64, 32, 8, 2), (64, 32, 4, 2), (32, 64, 8, 2)],
    ("fwd", "f64"): [(32, 64, 8, 2), (32, 32, 4, 2), (32, 32, 4, 3), (16, 64, 4, 2)],
    ("fwd", "f128"): [(32, 32, 4, 3), (32, 16, 4, 2), (16, 32, 8, 2)],
    ("fwd", "f256"): [(16, 32, 8, 2)],
    ("dq", "f32"): [(64, 64, 8, 2), (64, 32, 8, 2), (64, 32, 4, 2), (32, 64, 4, 2), (32, 64, 8, 2)],
    ("dq", "f64"): [(64, 32, 8, 2), (32, 64, 8, 2), (32, 32, 8, 2), (32, 32, 4, 2)],
    ("dq", "f128"): [(32, 32, 8, 2), (32, 32, 4, 3), (16, 32, 4, 2), (32, 16, 4, 2)],
    ("dq", "f256"): [(16, 32, 8, 2)],
    ("dkv", "f32"): [(64, 32, 8, 2), (32, 64, 8, 2), (32, 32, 4, 2), (32, 32, 4, 3)],
    ("dkv", "f64"): [(16, 64, 8, 2), (16, 32, 4, 2), (32, 16, 4, 2)],
    ("dkv", "f128"): [(16, 32, 8, 2), (32, 16, 8, 2), (16, 16, 4, 2)],
    ("dkv", "f256"): [(16, 32, 8, 2)],
}
_SPACES.update(_FP32_SPACES)
# With a score_mod generated into the kernels (kernels/score_codegen.py), a kernel holds the raw score tile
# alongside the softmax's, plus whatever the score_mod computes and loads per score; dQ also adds a learned
# table's gradient atomically. The same tiles then spill: these spaces are the entries of the spaces above,
# and smaller tiles, that build clean with the sample score_mods of ``aot.SCORES`` (soft-capping; a learned
# (head, distance) table with its gradient) on sm_90 and sm_80, bf16, at head dims 32, 64, 80, 96, 128, 256,
# at most 250 registers (a sweep of 728 builds with Triton 3.9 at group 1), less the dK/dV entries that then
# spilled at GQA group 8 (a second sweep, 184 builds: the forward and dQ at head dims 128 and 256, dK/dV at
# every class). A score_mod heavier than the samples may still spill.
_SCORE_SPACES: dict[tuple[str, str], list[tuple[int, int, int, int]]] = {
    ("fwd", "d32"): [(128, 32, 8, 3), (64, 32, 8, 2), (32, 64, 8, 2), (64, 32, 4, 2)],
    ("fwd", "d64"): _SPACES[("fwd", "d64")],
    ("fwd", "d128"): [(64, 64, 8, 3), (128, 32, 8, 3), (64, 32, 8, 2), (32, 64, 8, 2)],
    ("fwd", "d128p"): [(32, 64, 8, 2), (32, 64, 4, 2), (32, 32, 4, 2)],
    ("fwd", "d256"): [(64, 32, 8, 3), (64, 32, 8, 2), (32, 64, 8, 3), (32, 64, 8, 2)],
    ("dq", "d32"): [(128, 32, 8, 2), (64, 32, 8, 2), (32, 64, 8, 2), (64, 32, 4, 2)],
    ("dq", "d64"): [(64, 32, 8, 2), (32, 64, 8, 2), (32, 32, 4, 2)],
    ("dq", "d128"): [(32, 64, 8, 2), (32, 32, 4, 2)],
    ("dq", "d128p"): [(32, 32, 4, 2)],
    ("dq", "d256"): [(32, 64, 8, 2), (32, 32, 8, 2), (32, 32, 4, 2)],
    ("dkv", "d32"): [(64, 64, 8, 2), (64, 64, 8, 3), (64, 32, 8, 2), (32, 64, 4, 2)],
    ("dkv", "d64"): [(32, 128, 8, 3), (128, 32, 8, 2), (128, 32, 8, 3), (32, 64, 8, 2)],
    ("dkv", "d128"): [(64, 32, 8, 2), (64, 32, 8, 3), (32, 64, 8, 2), (32, 64, 8, 3)],
    ("dkv", "d128p"): [(64, 32, 8, 2), (64, 32, 8, 3), (32, 64, 8, 2), (32, 64, 8, 3)],
    ("dkv", "d256"): [(32, 32, 8, 2), (64, 16, 8, 1)],
}
ROW_CLASSES = tuple(dict.fromkeys(rows for _, rows in _SPACES))
"""The row classes, narrowest first (``row_class``)."""


def row_class(head_dim: int, dtype: str) -> str:
    """Which space a (head dim, dtype) uses: the padded row width in bf16/fp16 elements, 'p' for a head dim
    padded inside the 128 class (65-127); fp32 has spaces of its own by padded head dim ('f32', 'f64', 'f128',
    'f256'). Rows wider than 256 use the 256 space: ``benchmarks/kernels_ptx.py`` reports what that costs."""
    pad = max(16, 1 << (head_dim - 1).bit_length())
    if dtype == "fp32":
        return f"f{min(max(pad, 32), 256)}"
    if pad <= 32:
        return "d32"
    if pad <= 64:
        return "d64"
    if pad <= 128:
        return "d128" if head_dim == pad else "d128p"
    return "d256"


TILES_ENV = "ULTRAATTN_TILES"


def tile_override() -> dict[str, list[tuple[int, int, int, int]]]:
    """``ULTRAATTN_TILES``: tile configs that replace a kernel's autotune space, e.g.
    ``dkv=64x128x8x3,dq=128x64x8x2`` (``kernel=BLOCK_MxBLOCK_Nxnum_warpsxnum_stages``; a kernel named twice is
    autotuned over its entries). For sweeps of configs outside the spaces (``benchmarks/gpucheck/tiles.py``) and
    for pinning one config per kernel, which spares the autotuner's compiles. Unset: the spaces."""
    text = os.environ.get(TILES_ENV, "").strip()
    out: dict[str, list[tuple[int, int, int, int]]] = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        kernel, _, cfg = item.partition("=")
        parts = cfg.lower().split("x")
        if kernel not in ("fwd", "dq", "dkv") or len(parts) != 4 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"ultraattn: {TILES_ENV}={text!r}: entry {item!r} is not kernel=MxNxWxS with kernel one "
                             f"of fwd, dq, dkv and four positive integers (e.g. dkv=64x128x8x3); unset it to "
                             f"autotune over the built-in spaces")
        m, n, w, st = (int(p) for p in parts)
        if m & (m - 1) or n & (n - 1) or m < 16 or n < 16:
            raise ValueError(f"ultraattn: {TILES_ENV}={text!r}: entry {item!r}: BLOCK_M and BLOCK_N must be powers "
                             f"of two, at least 16 (Triton's tl.dot)")
        out.setdefault(kernel, []).append((m, n, w, st))
    return out


def tile_configs(kernel: str, qb: int, kb: int, rows: str, score: bool = False) -> list[tuple[int, int, int, int]]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) the autotuner may launch for ``kernel`` ('fwd', 'dq',
    'dkv') and row class ``rows`` (:func:`row_class`), with a score_mod when ``score``: the configs whose
    tiles divide the pattern blocks qb x kb, or one 32 x 32 tile (at most) where none does. ``ULTRAATTN_TILES``
    (:func:`tile_override`) replaces the space of a kernel it names; its tiles must divide the blocks."""
    pinned = tile_override().get(kernel)
    if pinned:
        bad = [c for c in pinned if qb % c[0] or kb % c[1]]
        if bad:
            raise ValueError(f"ultraattn: {TILES_ENV}: {kernel} tiles {[f'{m}x{n}' for m, n, *_ in bad]} do not "
                             f"divide the mask's {qb} x {kb} blocks; choose BLOCK_M dividing {qb} and BLOCK_N "
                             f"dividing {kb}")
        return pinned
    space = _SPACES[(kernel, rows)]
    if score:   # (fp32 has no score_mod spaces: its own, not swept with a score_mod generated in)
        space = _SCORE_SPACES.get((kernel, rows), space)
    ok = [c for c in space if qb % c[0] == 0 and kb % c[1] == 0]
    return ok or [(min(qb, 32), min(kb, 32), 4, 2)]


def triton_configs(kernel: str, qb: int, kb: int, rows: str, score: bool = False):
    import triton

    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s)
            for m, n, w, s in tile_configs(kernel, qb, kb, rows, score)]


def launch_constexprs(dtype: str, head_dim: int, group: int, q_block: int, kv_block: int, *,
                      interpret: bool) -> dict:
    """The compile-time arguments every kernel takes, from the inputs' dtype ('bf16', 'fp16', 'fp32')."""
    return dict(GROUP=group, D=head_dim, BLOCK_D=max(16, 1 << (head_dim - 1).bit_length()), QB=q_block,
                KB=kv_block, UPCAST=interpret or dtype == "fp32", PREC="ieee" if dtype == "fp32" else "tf32")


def interpret_blocks(qb: int, kb: int) -> tuple[int, int]:
    """Tile shape under the interpreter: 64 at most, so 128-blocks also exercise the sub-tile loops."""
    return min(qb, 64), min(kb, 64)


def kernel_mode() -> str:
    """``ULTRAATTN_KERNELS``: ``auto`` (Triton on CUDA, the eager reference elsewhere), ``triton`` or ``reference``."""
    mode = os.environ.get("ULTRAATTN_KERNELS", "auto")
    if mode not in ("auto", "triton", "reference"):
        raise ValueError(f"ULTRAATTN_KERNELS={mode!r}: expected 'auto', 'triton' or 'reference'")
    return mode


def tile_kernel() -> str:
    """``ULTRAATTN_TILE_KERNEL``: ``ours`` (default: the block-sparse kernels of this package) or ``flex`` (a tile row
    with a mask_mod and no score_mod runs on FlexAttention, ``kernels/flex_tile.py``: on an H200 its forward at flex's
    speed, its backward 1.00-1.28x ours, ``docs/gpu.md``; not yet run inside a compiled program on a GPU)."""
    mode = os.environ.get("ULTRAATTN_TILE_KERNEL", "ours")
    if mode not in ("ours", "flex"):
        raise ValueError(f"ultraattn: ULTRAATTN_TILE_KERNEL={mode!r}: expected 'ours' or 'flex'; unset it for ours")
    return mode


def tune_mode() -> str:
    """``ULTRAATTN_TUNE``: ``full`` (default: autotune over each space) or ``first`` (each space's first entry,
    untimed: one compile per kernel and key, for checks that cover many keys, as ``benchmarks/gpu_check.py``'s
    correctness part does)."""
    mode = os.environ.get("ULTRAATTN_TUNE", "full")
    if mode not in ("full", "first"):
        raise ValueError(f"ultraattn: ULTRAATTN_TUNE={mode!r}: expected 'full' or 'first'; unset it to autotune")
    return mode
