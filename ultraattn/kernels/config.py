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

# (BLOCK_M, BLOCK_N, num_warps, num_stages). Forward: BLOCK_M query rows per program, BLOCK_N
# keys per inner step. Kept small: each entry costs a compile the first time a (head dim,
# dtype, group, block) key is seen, never per sequence length (lengths are not specialised).
_FWD = [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 3), (128, 32, 4, 4), (64, 128, 4, 3)]
# Backward: dQ programs own BLOCK_M rows, dK/dV programs own BLOCK_N keys; both walk the other axis.
_BWD = [(64, 64, 4, 2), (64, 128, 8, 2), (128, 64, 8, 2), (32, 128, 4, 2), (128, 128, 8, 2), (32, 64, 4, 3)]


def _fit(space, qb: int, kb: int) -> list[tuple[int, int, int, int]]:
    ok = [c for c in space if qb % c[0] == 0 and kb % c[1] == 0]
    return ok or [(min(qb, 64), min(kb, 64), 4, 2)]


def _configs(space, qb: int, kb: int):
    import triton

    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s)
            for m, n, w, s in _fit(space, qb, kb)]


def fwd_configs(qb: int, kb: int):
    return _configs(_FWD, qb, kb)


def bwd_configs(qb: int, kb: int):
    return _configs(_BWD, qb, kb)


def tile_configs(kernel: str, qb: int, kb: int, *, head_dim: int, arch: int) -> list[tuple[int, int, int, int]]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) the autotuner may launch for ``kernel`` ('fwd', 'dq', 'dkv')."""
    return _fit(_FWD if kernel == "fwd" else _BWD, qb, kb)


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
