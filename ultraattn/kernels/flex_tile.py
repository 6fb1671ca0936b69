"""Tiles on kernels torch already has: FlexAttention's for any ``BlockLists``, flash's for dense ones.

A tile kernel's contract (``reference.py``): the forward returns the tile's output and its LSE (natural log, fp32,
-inf where a row attends nowhere); the backward takes the GLOBAL output ``O`` and LSE ``L`` (every tile of the row
merged) and returns this tile's share of dQ, dK, dV. Two kernels torch ships meet it:

* **FlexAttention** (``flex_forward`` / ``flex_backward``). The ``BlockLists`` become a ``BlockMask``
  (``block_mask_of``): its FULL and PARTIAL lists are flex's ``full_kv_*`` and ``kv_*`` lists, and its mask_mod reads
  our bit tiles (one word per element of a PARTIAL block; FULL blocks run without it), so any mask the kernels take
  runs, run-time masks included, without compiling per mask. The backward cannot hand flex ``O`` and ``L``
  through the public API, so it runs flex's autograd on the tile's own output ``o``, ``l`` (recomputed) with the
  gradients that make the result exact under the merged softmax: ``w = exp(l - L)``, ``dO_t = w dO``,
  ``dl_t = w (dO . (o - O) + dL)``. Then flex's ``delta_t = dO_t . o - dl_t = w (dO . O - dL)`` and its
  ``P_t = P / w``, so ``dS_t = P (dP - delta)``: the merged softmax's. The price is one recomputed forward
  (about 0.4 of a backward).
* **Flash** (``flash_forward`` / ``flash_backward``): a tile whose blocks are all FULL (``causal=False``), or the
  square causal tile on the diagonal (``causal=True``), on ``aten._scaled_dot_product_flash_attention``, whose
  backward takes ``O`` and ``L`` as arguments. GQA is expanded (flash wants equal heads) and dK/dV summed back.

Both run on CUDA; ``flex_*`` also on CPU (eager FlexAttention, for the tests). Which kernel runs a tile is chosen
by measurement (``benchmarks/gpucheck/flex_tiles.py``), not here.
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
    tile's own coordinates) where the caller has one, else by our bit tiles."""
    b_n, h_n, qb, kb = lists.batch, lists.num_heads, lists.q_block, lists.kv_block
    pat = lists.pattern_of.long()

    def per_bh(t: Tensor) -> Tensor:
        return t[pat].reshape(b_n, h_n, *t.shape[1:]).contiguous()

    return BlockMask.from_kv_blocks(per_bh(lists.part_cnt), per_bh(lists.part_idx), per_bh(lists.full_cnt),
                                    per_bh(lists.full_idx), BLOCK_SIZE=(qb, kb),
                                    mask_mod=mask_mod if mask_mod is not None else bits_mask_mod(lists),
                                    seq_lengths=(lists.q_len, lists.kv_len))


def bits_mask_mod(lists: BlockLists) -> Callable:
    """A mask_mod that reads ``lists``' bit tiles (int32 arithmetic throughout: the kernel gathers per element)."""
    b_n, h_n, qb, kb = lists.batch, lists.num_heads, lists.q_block, lists.kv_block
    _, nq, nk = lists.kind.shape
    pattern = lists.pattern_of.to(torch.int32).reshape(b_n, h_n)
    table, bits = _tile_table(lists), lists.bits.reshape(-1)
    words = lists.bits.shape[2]

    def bit_mask(b, h, q_idx, kv_idx):
        cell = (pattern[b, h] * nq + q_idx // qb) * nk + kv_idx // kb
        col = kv_idx % kb
        tile = table[cell]
        word = bits[(tile.clamp(min=0) * qb + q_idx % qb) * words + col // 32]
        return (tile == -1) | ((tile >= 0) & (((word >> (col % 32)) & 1) > 0))

    return bit_mask


@lru_cache(maxsize=1)
def _compiled_flex():
    return torch.compile(flex_attention)


def _flex(q: Tensor) -> object:
    return _compiled_flex() if q.is_cuda else flex_attention


def flex_forward(q: Tensor, k: Tensor, v: Tensor, mask: BlockMask, scale: float,
                 kernel_options: dict | None = None) -> tuple[Tensor, Tensor]:
    """(out, lse): the tile on FlexAttention (compiled on CUDA), lse in natural log, fp32. ``kernel_options`` go to
    FlexAttention as they are."""
    out, lse = _flex(q)(q, k, v, block_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1],
                        return_lse=True, kernel_options=kernel_options)
    return out, lse.float()


def merge_weight(lse_tile: Tensor, lse: Tensor) -> Tensor:
    """``exp(l - L)`` per row, 0 where the row attends nowhere (both -inf)."""
    w = torch.exp(lse_tile.float() - lse.float())
    return torch.where(torch.isfinite(lse.float()), w, torch.zeros_like(w))


def flex_backward(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor, mask: BlockMask,
                  scale: float, dlse: Tensor | None = None, kernel_options: dict | None = None
                  ) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv): the tile's share under the merged softmax (``out``, ``lse`` are the row's merged ones).

    On CPU, where FlexAttention has no backward, the same identity runs on its reference backward."""
    qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
    with torch.enable_grad():
        if q.is_cuda:
            o_t, l_t = flex_forward(qg, kg, vg, mask, scale, kernel_options)
        else:
            o_t, l_t = _reference_flex(qg, kg, vg, mask, scale)
        w = merge_weight(l_t.detach(), lse)
        do_t = (w[..., None] * dout.float()).to(o_t.dtype)
        dl_t = (dout.float() * (o_t.detach().float() - out.float())).sum(-1)
        if dlse is not None:
            dl_t = dl_t + dlse.float()
        torch.autograd.backward([o_t, l_t], [do_t, w * dl_t])
    return qg.grad, kg.grad, vg.grad


def _reference_flex(q: Tensor, k: Tensor, v: Tensor, mask: BlockMask, scale: float) -> tuple[Tensor, Tensor]:
    """Differentiable dense attention with ``mask``'s semantics (CPU tests; FlexAttention has no CPU backward)."""
    from torch.nn.attention.flex_attention import create_mask

    b_n, h_n, sq, _ = q.shape
    allowed = create_mask(mask.mask_mod, b_n, h_n, sq, k.shape[2], device=q.device)
    kv_rows = _blocks_allowed(mask, sq, k.shape[2])
    allowed = allowed & kv_rows
    rep = h_n // k.shape[1]
    kx, vx = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    acc = torch.promote_types(q.dtype, torch.float32)
    s = (q.to(acc) @ kx.to(acc).transpose(-1, -2)) * scale
    s = s.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))[..., None])
    return (p @ vx.to(acc)).to(q.dtype), lse


def _blocks_allowed(mask: BlockMask, sq: int, sk: int) -> Tensor:
    """bool [B, H, sq, sk]: the cells inside a listed block (FULL or PARTIAL); mask_mod decides only there,
    as in FlexAttention."""
    qb, kb = mask.BLOCK_SIZE
    nq, nk = -(-sq // qb), -(-sk // kb)
    grid = torch.zeros(*mask.kv_num_blocks.shape[:2], nq, nk + 1, dtype=torch.bool, device=mask.kv_indices.device)
    for cnt, idx in ((mask.kv_num_blocks, mask.kv_indices), (mask.full_kv_num_blocks, mask.full_kv_indices)):
        if cnt is None:
            continue
        live = torch.arange(idx.shape[-1], device=idx.device) < cnt[..., None]
        grid.scatter_(3, torch.where(live, idx.long(), nk)[..., :nq, :], True)
    cells = grid[..., :nk].repeat_interleave(qb, 2).repeat_interleave(kb, 3)
    return cells[..., :sq, :sk]


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


def default_scale(q: Tensor) -> float:
    return 1.0 / math.sqrt(q.shape[-1])
