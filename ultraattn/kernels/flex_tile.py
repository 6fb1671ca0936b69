"""Tiles on kernels torch already has: FlexAttention's for any ``BlockLists``, flash's for dense ones.

A tile kernel's contract (``reference.py``): the forward returns the tile's output and its LSE (natural log, fp32,
-inf where a row attends nowhere); the backward takes the GLOBAL output ``O`` and LSE ``L`` (every tile of the row
merged) and returns this tile's share of dQ, dK, dV. Two kernels torch ships meet it:

* **FlexAttention** (``flex_forward`` / ``flex_backward``). The ``BlockLists`` become a ``BlockMask``
  (``block_mask_of``): its FULL and PARTIAL lists are flex's ``full_kv_*`` and ``kv_*`` lists, and its mask_mod reads
  the mask's own mask_mod where the caller has one (shifted to the tile), else our bit tiles (a gather per element:
  0.2-0.5x flex's speed on an H200, ``docs/gpu.md``). The backward cannot hand flex ``O`` and ``L`` through the
  public API, so on CUDA it runs flex's autograd on the tile's own output ``o``, ``l`` (recomputed) with the
  gradients that make the result exact under the merged softmax: ``w = exp(l - L)``, ``dO_t = w dO``,
  ``dl_t = w (dO . o - delta)`` with ``delta = dO . O - dL``. Then flex's ``delta_t = dO_t . o - dl_t = w delta``
  and its ``P_t = P / w``, so ``dS_t = P (dP - delta)``: the merged softmax's. The price is one recomputed
  forward (about 0.4 of a backward).
* **Flash** (``flash_forward`` / ``flash_backward``): a tile whose blocks are all FULL (``causal=False``), or the
  square causal tile on the diagonal (``causal=True``), on ``aten._scaled_dot_product_flash_attention``, whose
  backward takes ``O`` and ``L`` as arguments. GQA is expanded (flash wants equal heads) and dK/dV summed back.

Both run on CUDA; ``flex_*`` also on CPU (eager FlexAttention, for the tests). The runtime runs a tile here when
``ULTRAATTN_TILE_KERNEL=flex`` (``runtime/tiles.py``); ``benchmarks/gpucheck/flex_tiles.py`` measures them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import lru_cache

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from ultraattn.kernels.block_lists import BlockLists
from ultraattn.masks.pattern import FULL


def _tile_table(lists: BlockLists) -> Tensor:
    """int32 [U * NQ * NK]: the bit tile of each PARTIAL cell, -1 for a FULL one, -2 for an EMPTY one (FlexAttention's
    compiled kernels ask the mask_mod only in PARTIAL blocks; its eager path asks everywhere)."""
    u_n, nq, nk = lists.kind.shape
    table = torch.where(lists.kind == FULL, -1, -2).to(torch.int32)
    slots = torch.arange(nk, device=lists.device)
    live = slots[None, None, :] < lists.part_cnt[:, :, None]
    u, i, j = live.nonzero(as_tuple=True)
    table[u, i, lists.part_idx[u, i, j].long()] = lists.part_tile[u, i, j]
    return table.reshape(-1)


def block_mask_of(lists: BlockLists, mask_mod: Callable | None = None) -> BlockMask:
    """FlexAttention's ``BlockMask`` for ``lists``: the same blocks; PARTIAL cells masked by ``mask_mod`` (in the
    tile's own coordinates) where the caller has one, else by our bit tiles.

    Off CUDA, FlexAttention runs eagerly and asks the mask_mod about every cell, blocks or not; there the mask_mod
    also answers by the block kinds (FULL true, EMPTY false), so that masks whose blocks decide (per-head block
    lists with a no-op mask_mod) stay exact. The compiled kernel never asks outside PARTIAL blocks."""
    b_n, h_n, qb, kb = lists.batch, lists.num_heads, lists.q_block, lists.kv_block
    pat = lists.pattern_of.long()

    def per_bh(t: Tensor) -> Tensor:
        return t[pat].reshape(b_n, h_n, *t.shape[1:]).contiguous()

    if mask_mod is None:
        mask_mod = bits_mask_mod(lists)
    elif lists.device.type != "cuda":
        mask_mod = _gated(lists, mask_mod)
    return BlockMask.from_kv_blocks(per_bh(lists.part_cnt), per_bh(lists.part_idx), per_bh(lists.full_cnt),
                                    per_bh(lists.full_idx), BLOCK_SIZE=(qb, kb), mask_mod=mask_mod,
                                    seq_lengths=(lists.q_len, lists.kv_len))


def _cells(lists: BlockLists) -> Callable:
    """(b, h, q_idx, kv_idx) -> the cell's entry of ``_tile_table``."""
    b_n, h_n, qb, kb = lists.batch, lists.num_heads, lists.q_block, lists.kv_block
    _, nq, nk = lists.kind.shape
    pattern = lists.pattern_of.to(torch.int32).reshape(b_n, h_n)
    table = _tile_table(lists)

    def cell(b, h, q_idx, kv_idx):
        return table[(pattern[b, h] * nq + q_idx // qb) * nk + kv_idx // kb]

    return cell


def _gated(lists: BlockLists, mask_mod: Callable) -> Callable:
    cell = _cells(lists)

    def gated(b, h, q_idx, kv_idx):
        tile = cell(b, h, q_idx, kv_idx)
        return (tile == -1) | ((tile >= 0) & mask_mod(b, h, q_idx, kv_idx))

    return gated


def bits_mask_mod(lists: BlockLists) -> Callable:
    """A mask_mod that reads ``lists``' bit tiles (int32 arithmetic throughout: the kernel gathers per element)."""
    qb, kb = lists.q_block, lists.kv_block
    cell, bits, words = _cells(lists), lists.bits.reshape(-1), lists.bits.shape[2]

    def bit_mask(b, h, q_idx, kv_idx):
        tile = cell(b, h, q_idx, kv_idx)
        col = kv_idx % kb
        word = bits[(tile.clamp(min=0) * qb + q_idx % qb) * words + col // 32]
        return (tile == -1) | ((tile >= 0) & (((word >> (col % 32)) & 1) > 0))

    return bit_mask


@lru_cache(maxsize=1)
def _compiled_flex():
    return torch.compile(flex_attention, dynamic=False)


RECOMPILES = 256
"""Compiles of FlexAttention a tile call may add (each mask, tile shape and grad mode is one; Dynamo's default limit,
8, would silently run flex unfused past it). Scoped to the tile calls; a limit hit raises instead."""


def _flex_call(q: Tensor, *args, **kwargs):
    if not q.is_cuda:
        return flex_attention(q, *args, **kwargs)
    import torch._dynamo.config as dynamo_config

    knobs = {k: RECOMPILES for k in ("recompile_limit", "cache_size_limit") if hasattr(dynamo_config, k)}
    if hasattr(dynamo_config, "fail_on_recompile_limit_hit"):
        knobs["fail_on_recompile_limit_hit"] = True
    with dynamo_config.patch(**knobs):
        return _compiled_flex()(q, *args, **kwargs)


def flex_forward(q: Tensor, k: Tensor, v: Tensor, mask: BlockMask, scale: float,
                 kernel_options: dict | None = None) -> tuple[Tensor, Tensor]:
    """(out, lse): the tile on FlexAttention (compiled on CUDA, eager elsewhere), lse in natural log, fp32.
    ``kernel_options`` go to FlexAttention as they are."""
    from torch.nn.attention.flex_attention import AuxRequest  # (torch >= 2.9; return_lse is deprecated)

    if not q.is_cuda:  # (eager FlexAttention refuses inputs that want a gradient off CUDA; the backward is ours)
        q, k, v = q.detach(), k.detach(), v.detach()

    out, aux = _flex_call(q, k, v, block_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1],
                          return_aux=AuxRequest(lse=True), kernel_options=kernel_options)
    return out, aux.lse.float()


def merge_weight(lse_tile: Tensor, lse: Tensor) -> Tensor:
    """``exp(l - L)`` per row, 0 where the row attends nowhere (both -inf)."""
    w = torch.exp(lse_tile.float() - lse.float())
    return torch.where(torch.isfinite(lse.float()), w, torch.zeros_like(w))


def flex_backward(q: Tensor, k: Tensor, v: Tensor, lse: Tensor, delta: Tensor, dout: Tensor, mask: BlockMask,
                  scale: float, kernel_options: dict | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) in q's dtype: the tile's share under the merged softmax, given the row's merged ``lse`` and
    ``delta = rowsum(dO * O) - dLSE`` (``reference.softmax_delta``).

    On CUDA: flex's autograd on the recomputed tile (module docstring; its ``dl_t = w (dO . o - delta)``). Elsewhere:
    FlexAttention's backward operator itself, which takes the merged statistics (its eager path, exact math): ``out``
    zero and ``grad_logsumexp = -delta ln 2`` make its ``rowsum(out * dO) - grad_lse / ln 2`` our delta, and its
    LSE is in base 2."""
    dout = dout.to(q.dtype)
    if not q.is_cuda:
        from torch._higher_order_ops.flex_attention import flex_attention_backward

        def identity(score, b, h, q_idx, kv_idx):
            return score

        grads = flex_attention_backward(q, k, v, torch.zeros_like(q), lse.float() / math.log(2), dout,
                                        -delta.float() * math.log(2), identity, None, mask.as_tuple(), scale,
                                        dict(kernel_options or {}), (), ())
        return grads[0], grads[1], grads[2]
    qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
    with torch.enable_grad():
        o_t, l_t = flex_forward(qg, kg, vg, mask, scale, kernel_options)
        w = merge_weight(l_t.detach(), lse)
        dl_t = w * ((dout.float() * o_t.detach().float()).sum(-1) - delta.float())
        torch.autograd.backward([o_t, l_t], [(w[..., None] * dout.float()).to(o_t.dtype), dl_t])
    return qg.grad, kg.grad, vg.grad


def _expand(k: Tensor, heads: int) -> Tensor:
    return k if k.shape[1] == heads else k.repeat_interleave(heads // k.shape[1], 1)


def flash_forward(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool) -> tuple[Tensor, Tensor]:
    """(out, lse) of a dense tile on flash (CUDA); ``causal`` for the square diagonal tile."""
    res = torch.ops.aten._scaled_dot_product_flash_attention(q, _expand(k, q.shape[1]), _expand(v, q.shape[1]),
                                                              0.0, causal, False, scale=scale)
    return res[0], res[1][..., : q.shape[2]].float()


@lru_cache(maxsize=8)
def _no_dropout_rng(device: str, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """The (seed, offset) tensors flash's forward returns without dropout (unread by the backward then, but typed
    per torch version): taken from one tiny forward."""
    x = torch.zeros(1, 1, 16, 64, device=device, dtype=dtype)
    res = torch.ops.aten._scaled_dot_product_flash_attention(x, x, x, 0.0, False, False)
    return res[6], res[7]


def flash_backward(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor, scale: float,
                   causal: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv): the dense tile's share under the merged softmax (flash's backward takes ``out``, ``lse``)."""
    h_n, hk = q.shape[1], k.shape[1]
    kx, vx = _expand(k, h_n), _expand(v, h_n)
    seed, offset = _no_dropout_rng(str(q.device), q.dtype)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout, q, kx, vx, out, lse.float().contiguous(), None, None, q.shape[2], k.shape[2], 0.0, causal,
        seed, offset, scale=scale)[:3]
    if hk != h_n:
        shape = (k.shape[0], hk, h_n // hk, *k.shape[2:])
        dk, dv = dk.reshape(shape).sum(2), dv.reshape(shape).sum(2)
    return dq, dk, dv
