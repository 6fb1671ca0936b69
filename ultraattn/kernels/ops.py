"""The block-sparse attention ops, registered with ``torch.library`` so Inductor sees them.

* ``ultraattn::bsa_fwd`` / ``ultraattn::bsa_bwd`` are ``triton_op``s: on CUDA their bodies
  launch the Triton kernels through ``wrap_triton``, so inside ``torch.compile`` Inductor
  traces into them and schedules the kernels with the rest of the graph. ``bsa_fwd`` has an
  autograd formula that calls ``bsa_bwd`` (delta = rowsum(dO * O) in fp32, dLSE passed on).
* ``ultraattn::bsa_fwd_ref`` / ``ultraattn::bsa_bwd_ref`` are plain custom ops with the
  eager implementation (``reference.py``) and fake kernels. The triton_ops call them for
  tensors that are not on CUDA, so the same op works on every device, eagerly and compiled
  (a triton_op's body is also its fake implementation, so its CPU branch must be an op with
  a fake kernel, not data-dependent Python).
* With ``TRITON_INTERPRET=1`` and ``ULTRAATTN_KERNELS=triton``, CPU tensors run the Triton
  kernels in the interpreter (eager only: the interpreter cannot run on fake tensors, and
  interpreted ``wrap_triton`` fails inside torch.compile: checked with torch 2.13, Triton 3.9).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.library import custom_op, triton_op, wrap_triton

from ultraattn.cache import LRU, process_state
from ultraattn.kernels import config
from ultraattn.kernels.block_lists import BlockLists, make_block_lists
from ultraattn.kernels.reference import reference_bwd, reference_fwd, softmax_delta

_LOG2E = 1.4426950408889634
_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def _interpreted(t: Tensor) -> bool:
    """Run the Triton kernels on a non-CUDA tensor (interpreter, eager, explicitly asked for)."""
    if config.kernel_mode() != "triton":
        return False
    if not config.interpret():
        raise RuntimeError(
            "ULTRAATTN_KERNELS=triton with CPU tensors needs Triton's interpreter: set TRITON_INTERPRET=1 "
            "before ultraattn.kernels is first used (or unset ULTRAATTN_KERNELS to use the reference path)"
        )
    from torch._subclasses.fake_tensor import FakeTensor

    return not isinstance(t, FakeTensor) and not torch.compiler.is_compiling()


def uses_triton(t: Tensor) -> bool:
    """Whether the block-sparse ops run the Triton kernels for ``t`` (CUDA, or the interpreter when asked for)."""
    if t.device.type == "cuda":
        if config.kernel_mode() == "reference":
            return False
        if not config.HAS_TRITON:
            if config.kernel_mode() == "triton":
                raise RuntimeError("ULTRAATTN_KERNELS=triton but triton is not installed")
            return False
        return True
    return _interpreted(t)


# ----------------------------------------------------------------------------- reference ops
@custom_op("ultraattn::bsa_fwd_ref", mutates_args=())
def bsa_fwd_ref(q: Tensor, k: Tensor, v: Tensor, pattern_of: Tensor, full_cnt: Tensor, full_idx: Tensor,
                part_cnt: Tensor, part_idx: Tensor, part_tile: Tensor, bits: Tensor, q_block: int, kv_block: int,
                scale: float, fp32_out: bool = False) -> tuple[Tensor, Tensor]:
    out, lse = reference_fwd(q, k, v, pattern_of, full_cnt, full_idx, part_cnt, part_idx, part_tile, bits, q_block,
                             kv_block, scale, out_dtype=torch.float32 if fp32_out else None)
    return out, lse


@bsa_fwd_ref.register_fake
def _(q, k, v, pattern_of, full_cnt, full_idx, part_cnt, part_idx, part_tile, bits, q_block, kv_block, scale,
      fp32_out=False):
    B, H, S, _ = q.shape
    return (q.new_empty(B, H, S, v.shape[-1], dtype=torch.float32 if fp32_out else q.dtype),
            q.new_empty(B, H, S, dtype=torch.float32))


@custom_op("ultraattn::bsa_bwd_ref", mutates_args=())
def bsa_bwd_ref(q: Tensor, k: Tensor, v: Tensor, do: Tensor, lse: Tensor, delta: Tensor, dlse: Tensor | None,
                pattern_of: Tensor, full_cnt: Tensor, full_idx: Tensor, part_cnt: Tensor, part_idx: Tensor,
                part_tile: Tensor, bits: Tensor, q_block: int, kv_block: int,
                scale: float, fp32_grads: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    return reference_bwd(q, k, v, do, lse, delta, dlse, pattern_of, full_cnt, full_idx, part_cnt, part_idx,
                         part_tile, bits, q_block, kv_block, scale, fp32=fp32_grads)


@bsa_bwd_ref.register_fake
def _(q, k, v, do, lse, delta, dlse, pattern_of, full_cnt, full_idx, part_cnt, part_idx, part_tile, bits, q_block,
      kv_block, scale, fp32_grads=False):
    # contiguous, like reference_bwd's results
    return tuple(x.new_empty(x.shape, dtype=torch.float32 if fp32_grads else x.dtype) for x in (q, k, v))


# ----------------------------------------------------------------------------- triton ops
@dataclass(frozen=True)
class ScoreArgs:
    """A score_mod for one kernel launch: its generated functions (``score_codegen.generate``), the tensors
    they read, and where the launch's local tile sits in the global attention."""

    kernels: object
    """``score_codegen.ScoreKernels``."""
    buffers: Sequence[Tensor]
    """The score_mod's buffers, in its order."""
    constants: Sequence[Tensor]
    """The kernels' tensor constants (``ScoreKernels.constants``) on the launch's device, passed after the
    buffers."""
    kv_pos: Tensor
    """int32 [local KV blocks]: each block's first global key."""
    q0: int
    """Global position of local query 0."""
    h0: int
    """Global head of local head 0."""
    seq_len: int
    """Global sequence length: positions past it (the padded tail) are clamped to the last token."""

    def pointers(self) -> list[Tensor]:
        from ultraattn.kernels.score_codegen import MAX_BUFFERS

        ptrs = [t.contiguous() for t in self.buffers] + list(self.constants)
        return ptrs + [self.kv_pos] * (MAX_BUFFERS - len(ptrs))

    def scalars(self) -> tuple[int, int, int]:
        return self.q0, self.h0, self.seq_len - 1


def _score_launch(score: ScoreArgs | None, dummy: Tensor) -> tuple[list[Tensor], tuple[int, int, int], dict]:
    """(KV_POS and P0..P3, (q0, h0, s_last), constexprs) of a launch; dummies and ``SCORE=None`` without a
    score_mod. The constexpr is passed even then: Inductor (torch 2.11, Triton 3.6) leaves a constexpr that a
    launch omits out of the kernel's constants, and its launcher then wants one argument more than it is given."""
    from ultraattn.kernels.score_codegen import MAX_BUFFERS

    if score is None:
        return [dummy] * (1 + MAX_BUFFERS), (0, 0, 0), {"SCORE": None}
    return [score.kv_pos, *score.pointers()], score.scalars(), {"SCORE": score.kernels.fwd}


def _launch_args(q: Tensor, k: Tensor, q_block: int, kv_block: int):
    """(B, H, Hk, Sq, Sk, row class (``config.row_class``: which autotune space), keyword arguments
    every kernel takes: constexprs, and the tile shape under the interpreter, where kernels are not
    autotuned)."""
    B, H, Sq, D = q.shape
    Hk, Sk = k.shape[1], k.shape[2]
    const = config.launch_constexprs(_DTYPE_NAMES[q.dtype], D, H // Hk, q_block, kv_block,
                                     interpret=config.interpret())
    if config.interpret():
        const.update(zip(("BLOCK_M", "BLOCK_N"), config.interpret_blocks(q_block, kv_block)))
    return B, H, Hk, Sq, Sk, config.row_class(D, _DTYPE_NAMES[q.dtype]), const


@triton_op("ultraattn::bsa_fwd", mutates_args=())
def bsa_fwd(q: Tensor, k: Tensor, v: Tensor, pattern_of: Tensor, full_cnt: Tensor, full_idx: Tensor,
            part_cnt: Tensor, part_idx: Tensor, part_tile: Tensor, bits: Tensor, full_q_cnt: Tensor,
            full_q_idx: Tensor, part_q_cnt: Tensor, part_q_idx: Tensor, part_q_tile: Tensor, q_block: int,
            kv_block: int, scale: float, fp32_out: bool = False) -> tuple[Tensor, Tensor]:
    """Block-sparse attention forward: (out [B, H, Sq, D] in q's dtype, or fp32 with ``fp32_out``
    (partial results that are merged later), lse [B, H, Sq] fp32)."""
    if not uses_triton(q):
        return torch.ops.ultraattn.bsa_fwd_ref(q, k, v, pattern_of, full_cnt, full_idx, part_cnt, part_idx,
                                              part_tile, bits, q_block, kv_block, scale, fp32_out)
    return _fwd_launch(q, k, v, (pattern_of, full_cnt, full_idx, part_cnt, part_idx, part_tile, bits), q_block,
                       kv_block, scale, fp32_out, None, wrap_triton)


def _fwd_launch(q, k, v, lay, q_block: int, kv_block: int, scale: float, fp32_out: bool, score: ScoreArgs | None,
                wrap: Callable) -> tuple[Tensor, Tensor]:
    """The forward kernel on the forward block-list tensors ``lay`` (with a score_mod when ``score`` is given)."""
    from ultraattn.kernels import triton_kernels as tk

    pattern_of, full_cnt, full_idx, part_cnt, part_idx, part_tile, bits = (t.contiguous() for t in lay)
    nq, nk = full_idx.shape[1], full_idx.shape[2]
    B, H, Hk, Sq, Sk, space, const = _launch_args(q, k, q_block, kv_block)
    ptrs, scalars, extra = _score_launch(score, pattern_of)
    out = torch.empty_like(q, dtype=torch.float32 if fp32_out else q.dtype)
    lse = torch.empty((B, H, Sq), dtype=torch.float32, device=q.device)
    rows = nq * q_block
    wrap(tk.tuned("fwd", q_block, kv_block, space, score is not None))[lambda meta: (rows // meta["BLOCK_M"], B * H)](
        q, k, v, out, lse, pattern_of, full_cnt, full_idx, part_cnt, part_idx, part_tile, bits, *ptrs,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(),
        H, Sq, Sk, nq, nk, scale * _LOG2E, scale, *scalars, **const, **extra)
    return out, lse


@triton_op("ultraattn::bsa_bwd", mutates_args=())
def bsa_bwd(q: Tensor, k: Tensor, v: Tensor, do: Tensor, lse: Tensor, delta: Tensor, dlse: Tensor | None,
            pattern_of: Tensor, full_cnt: Tensor, full_idx: Tensor, part_cnt: Tensor, part_idx: Tensor,
            part_tile: Tensor, bits: Tensor, full_q_cnt: Tensor, full_q_idx: Tensor, part_q_cnt: Tensor,
            part_q_idx: Tensor, part_q_tile: Tensor, q_block: int, kv_block: int,
            scale: float, fp32_grads: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """Block-sparse attention backward from the GLOBAL lse and delta = rowsum(dO * O) (minus dlse if given);
    gradients in the inputs' dtypes, or fp32 with ``fp32_grads`` (partial gradients summed later)."""
    if not uses_triton(q):
        return torch.ops.ultraattn.bsa_bwd_ref(q, k, v, do, lse, delta, dlse, pattern_of, full_cnt, full_idx,
                                              part_cnt, part_idx, part_tile, bits, q_block, kv_block, scale,
                                              fp32_grads)
    lay = (pattern_of, full_cnt, full_idx, part_cnt, part_idx, part_tile, bits, full_q_cnt, full_q_idx, part_q_cnt,
           part_q_idx, part_q_tile)
    dq, dk, dv, _ = _bwd_launch(q, k, v, do, lse, delta, dlse, lay, q_block, kv_block, scale, fp32_grads, None, (),
                                wrap_triton)
    return dq, dk, dv


def _bwd_launch(q, k, v, do, lse, delta, dlse, lay, q_block: int, kv_block: int, scale: float, fp32_grads: bool,
                score: ScoreArgs | None, wanted: Sequence[int], wrap: Callable
                ) -> tuple[Tensor, Tensor, Tensor, list[Tensor]]:
    """The dQ and dK/dV kernels on the block-list tensors ``lay`` (``bwd_tensors`` order); with a score_mod, also
    the fp32 gradients of its buffers ``wanted`` (summed over this launch's scores)."""
    from ultraattn.kernels import triton_kernels as tk
    from ultraattn.kernels.score_codegen import MAX_BUFFERS

    (pattern_of, full_cnt, full_idx, part_cnt, part_idx, part_tile, bits, full_q_cnt, full_q_idx, part_q_cnt,
     part_q_idx, part_q_tile) = (t.contiguous() for t in lay)
    nq, nk = full_idx.shape[1], full_idx.shape[2]
    B, H, Hk, Sq, Sk, space, const = _launch_args(q, k, q_block, kv_block)
    do = do.to(q.dtype)  # the kernels' dots take one input dtype (an fp32 dO of an fp32_out forward)
    # The per-row terms, once: LSE in base 2 (+inf where a row attends nowhere, so its p = exp2(-inf) = 0)
    # and delta - dLSE; the dK/dV inner loop then loads two vectors and computes nothing per row.
    lse2 = torch.where(lse == -math.inf, math.inf, lse.float() * _LOG2E).contiguous()
    dd = (delta.float() - dlse.float() if dlse is not None else delta.float()).contiguous()
    # (gradients get their own strides: empty_like of a non-dense input, e.g. a head slice, is dense)
    dq, dk, dv = (torch.empty_like(x, dtype=torch.float32 if fp32_grads else x.dtype) for x in (q, k, v))
    ptrs, scalars, extra = _score_launch(score, pattern_of)
    dbufs = [torch.zeros(score.buffers[n].shape, dtype=torch.float32, device=q.device) for n in wanted]
    # the unused gradient slots get their own zero: the autotuner zeroes D0..D3 between its trial launches
    grads = [torch.zeros(1, dtype=torch.float32, device=q.device)] * MAX_BUFFERS
    for n, g in zip(wanted, dbufs):
        grads[n] = g
    extra["SCORE_BWD"] = score.kernels.bwd if score is not None else None
    rows, cols = nq * q_block, nk * kv_block
    wrap(tk.tuned("dq", q_block, kv_block, space, score is not None))[lambda meta: (rows // meta["BLOCK_M"], B * H)](
        q, k, v, do, lse2, dd, dq, pattern_of, full_cnt, full_idx, part_cnt, part_idx, part_tile, bits, *ptrs, *grads,
        *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dq.stride(),
        H, Sq, Sk, nq, nk, scale * _LOG2E, scale, *scalars, **const, **extra)
    wrap(tk.tuned("dkv", q_block, kv_block, space, score is not None))[lambda meta: (cols // meta["BLOCK_N"], B * Hk)](
        q, k, v, do, lse2, dd, dk, dv, pattern_of, full_q_cnt, full_q_idx, part_q_cnt, part_q_idx,
        part_q_tile, bits, *ptrs,
        *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dk.stride(), *dv.stride(),
        H, Hk, Sq, Sk, nq, nk, scale * _LOG2E, scale, *scalars, **const, **extra)
    return dq, dk, dv, dbufs


def score_fwd(q: Tensor, k: Tensor, v: Tensor, lay: Sequence[Tensor], q_block: int, kv_block: int, scale: float,
              score: ScoreArgs) -> tuple[Tensor, Tensor]:
    """The forward kernel with a score_mod (fp32 out, lse): a plain launch, not an op (a score_mod's generated
    functions cannot be op arguments), for eager callers such as the tile ops (``runtime/tiles.py``)."""
    return _fwd_launch(q, k, v, lay[:7], q_block, kv_block, scale, True, score, lambda fn: fn)


def score_bwd(q: Tensor, k: Tensor, v: Tensor, do: Tensor, lse: Tensor, delta: Tensor, lay: Sequence[Tensor],
              q_block: int, kv_block: int, scale: float, score: ScoreArgs, wanted: Sequence[int]
              ) -> tuple[Tensor, Tensor, Tensor, list[Tensor]]:
    """The backward kernels with a score_mod: fp32 dq, dk, dv and the gradients of the buffers ``wanted``."""
    return _bwd_launch(q, k, v, do, lse, delta, None, lay, q_block, kv_block, scale, True, score, wanted,
                       lambda fn: fn)


_N_LISTS = 12  # block-list tensors passed to bsa_fwd


def _setup_context(ctx, inputs, output):
    q, k, v = inputs[:3]
    lay = inputs[3:3 + _N_LISTS]
    ctx.q_block, ctx.kv_block, ctx.scale, ctx.fp32_out = inputs[3 + _N_LISTS:]
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, *lay)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, *lay = ctx.saved_tensors
    delta = softmax_delta(out, dout)
    # A zero dlse (lse unused) would be materialised by autograd anyway; pass it on unchanged.
    dq, dk, dv = bsa_bwd(q, k, v, dout, lse, delta, dlse, *lay, ctx.q_block, ctx.kv_block, ctx.scale)
    return (dq, dk, dv) + (None,) * (_N_LISTS + 4)


bsa_fwd.register_autograd(_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------- public API
_BLOCK_LISTS: LRU = process_state("kernels: block_sparse_attention's block lists", LRU(32))
"""Block lists of the latest masks passed to ``block_sparse_attention``: (mask identity, mask_mod identity, shapes,
device, block size) -> (mask, mask_mod, block lists). The entry holds the mask and the mask_mod, so neither id can be
reused by another object while it is cached, and a hit is checked to be those very objects. A mask is read once:
a tensor changed in place afterwards keeps its old block lists (pass a new mask, or ``ultraattn.reset()``)."""


def get_block_lists(mask, *, q_len: int, kv_len: int, batch: int, num_heads: int, device: torch.device,
                    mask_mod: Callable | None = None, block_size: int = 128) -> BlockLists:
    """``make_block_lists`` with a small cache keyed on the mask object's identity (kept alive by the cache)."""
    if isinstance(mask, BlockLists):
        lay = mask
    else:
        key = (id(mask) if not isinstance(mask, str) else mask, id(mask_mod), q_len, kv_len, batch, num_heads,
               str(device), block_size)
        hit = _BLOCK_LISTS.get(key)
        if hit is not None and (isinstance(mask, str) or hit[0] is mask) and hit[1] is mask_mod:
            return hit[2]
        lay = make_block_lists(mask, q_len=q_len, kv_len=kv_len, batch=batch, num_heads=num_heads, mask_mod=mask_mod,
                               block_size=block_size, device=device)
        _BLOCK_LISTS.put(key, (mask, mask_mod, lay))
    if (lay.q_len, lay.kv_len, lay.batch, lay.num_heads) != (q_len, kv_len, batch, num_heads):
        raise ValueError(
            f"the block lists were built for q_len={lay.q_len}, kv_len={lay.kv_len}, batch={lay.batch}, "
            f"heads={lay.num_heads}, but the inputs have q_len={q_len}, kv_len={kv_len}, batch={batch}, "
            f"heads={num_heads}: build it with make_block_lists(..., batch=, num_heads=) for these inputs"
        )
    return lay if lay.device == torch.device(device) else lay.to(device)


def _check_inputs(q: Tensor, k: Tensor, v: Tensor) -> None:
    for nm, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor) or t.dim() != 4:
            raise ValueError(f"`{nm}` must be a 4-D tensor (batch, heads, seq, dim), got "
                             f"{tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__}")
        if t.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise TypeError(f"`{nm}` has dtype {t.dtype}; the kernels support float16, bfloat16 and float32")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype}); cast them to one dtype")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v are on different devices ({q.device}, {k.device}, {v.device})")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree in batch or head dim")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"num_heads={q.shape[1]} is not a multiple of num_kv_heads={k.shape[1]} (GQA needs it)")
    if q.shape[3] > 256:
        raise ValueError(f"head dim {q.shape[3]} > 256 is not supported by the kernels")


def block_sparse_attention(q: Tensor, k: Tensor, v: Tensor, mask="full", *, scale: float | None = None,
                           return_lse: bool = False, mask_mod: Callable | None = None, block_size: int = 128):
    """Block-sparse attention with FlexAttention semantics, on the kernels of this package.

    Args:
        q: ``[B, H, Sq, D]``; k, v: ``[B, Hk, Sk, D]`` with ``H % Hk == 0`` (GQA, K/V never expanded).
        mask: a ``BlockMask``, a ``BlockPattern`` (give ``mask_mod=`` if it has PARTIAL blocks), a
            ``BlockLists``, a mask_mod, or ``"causal"`` / ``"full"`` (SDPA semantics).
        scale: softmax scale, default ``1/sqrt(D)``.
        return_lse: also return the log-sum-exp ``[B, H, Sq]`` (fp32, -inf for rows that attend nowhere).
        mask_mod, block_size: for masks that don't carry them (see ``make_block_lists``).

    Differentiable in q, k, v (and through lse). Rows that attend nowhere give 0, not NaN.
    """
    _check_inputs(q, k, v)
    B, H, Sq, D = q.shape
    lay = get_block_lists(mask, q_len=Sq, kv_len=k.shape[2], batch=B, num_heads=H, device=q.device, mask_mod=mask_mod,
                          block_size=block_size)
    s = 1.0 / math.sqrt(D) if scale is None else float(scale)
    out, lse = torch.ops.ultraattn.bsa_fwd(q, k, v, *lay.bwd_tensors(), lay.q_block, lay.kv_block, s)
    return (out, lse) if return_lse else out
