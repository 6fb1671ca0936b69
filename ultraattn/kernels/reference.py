"""Eager block-sparse attention over a ``BlockSparseLayout``: the CPU path of the kernel ops.

Same contract as the Triton kernels (``triton_kernels.py``): forward returns (out, lse) with
lse in fp32 and -inf for fully masked rows (their output is 0); backward takes the GLOBAL lse
and delta = rowsum(dO * O) computed by the caller, and optionally dlse, and returns dq, dk,
dv. Accumulation in fp32. Work is grouped by (unique pattern, Q block): every (batch, head)
that shares the pattern is one batched matmul over the union of that row's KV blocks, so
EMPTY blocks cost nothing and K/V are gathered per KV head (GQA is never expanded).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ultraattn.kernels.layout import unpack_bits


def _row_blocks(full_cnt, full_idx, part_cnt, part_idx, part_tile, bits, u, i, q_block, kv_block, rows, kv_len):
    """Column positions [C] and mask [rows, C] (None when all attend) of pattern u's Q block i."""
    nf, npart = int(full_cnt[u, i]), int(part_cnt[u, i])
    if nf + npart == 0:
        return None, None
    blocks = torch.cat([full_idx[u, i, :nf], part_idx[u, i, :npart]]).long()
    ar = torch.arange(kv_block, device=blocks.device)
    pos = (blocks[:, None] * kv_block + ar).reshape(-1)
    mask = None
    if npart:
        tiles = unpack_bits(bits[part_tile[u, i, :npart].long()], kv_block)  # [npart, qb, kb]
        partial = tiles.permute(1, 0, 2).reshape(q_block, npart * kv_block)[:rows]
        mask = torch.cat([torch.ones(rows, nf * kv_block, dtype=torch.bool, device=partial.device), partial], 1)
    valid = pos < kv_len
    if not bool(valid.all()):
        pos = pos[valid]
        mask = mask[:, valid] if mask is not None else None
    return pos, mask


def _work(q: Tensor, k: Tensor, pattern_of, full_cnt, full_idx, part_cnt, part_idx, part_tile, bits, q_block: int,
          kv_block: int):
    """Yield (batch ids, head ids, kv head ids, first row, last row, kv positions, mask or None) per
    (unique pattern, Q block) with work: all (batch, head) pairs sharing a pattern go together."""
    B, H, Sq, _ = q.shape
    r = H // k.shape[1]
    lists = [t.cpu() for t in (full_cnt, full_idx, part_cnt, part_idx, part_tile)]
    bits_d = bits.to(q.device)
    pat = pattern_of.view(B, H).cpu()
    for u in range(int(pat.max()) + 1):
        sel = (pat == u).nonzero()
        if not len(sel):
            continue
        bs, hs = sel[:, 0].to(q.device), sel[:, 1].to(q.device)
        for i in range(full_cnt.shape[1]):
            r0, r1 = i * q_block, min(Sq, (i + 1) * q_block)
            pos, mask = _row_blocks(*lists, bits_d, u, i, q_block, kv_block, r1 - r0, k.shape[2])
            if pos is not None:
                yield bs, hs, hs // r, r0, r1, pos.to(q.device), mask


def reference_fwd(q: Tensor, k: Tensor, v: Tensor, pattern_of: Tensor, full_cnt: Tensor, full_idx: Tensor,
                  part_cnt: Tensor, part_idx: Tensor, part_tile: Tensor, bits: Tensor, q_block: int, kv_block: int,
                  scale: float, out_dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
    B, H, Sq, D = q.shape
    out = torch.zeros(B, H, Sq, v.shape[-1], dtype=torch.float32, device=q.device)
    lse = torch.full((B, H, Sq), float("-inf"), dtype=torch.float32, device=q.device)
    for bs, hs, khs, r0, r1, pos, mask in _work(q, k, pattern_of, full_cnt, full_idx, part_cnt, part_idx, part_tile,
                                                 bits, q_block, kv_block):
        qs = q[bs, hs, r0:r1].float()
        ks = k[bs[:, None], khs[:, None], pos[None, :]].float()
        vs = v[bs[:, None], khs[:, None], pos[None, :]].float()
        s = torch.matmul(qs, ks.transpose(-1, -2)) * scale
        if mask is not None:
            s = s.masked_fill(~mask, float("-inf"))
        m = s.amax(-1, keepdim=True)
        m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
        p = torch.exp(s - m)
        lsum = p.sum(-1, keepdim=True)
        empty = lsum == 0
        out[bs, hs, r0:r1] = torch.matmul(p, vs) / torch.where(empty, torch.ones_like(lsum), lsum)
        lse[bs, hs, r0:r1] = torch.where(empty, float("-inf"), m + torch.log(lsum)).squeeze(-1)
    return out.to(out_dtype or q.dtype), lse


def reference_bwd(q: Tensor, k: Tensor, v: Tensor, do: Tensor, lse: Tensor, delta: Tensor, dlse: Tensor | None,
                  pattern_of: Tensor, full_cnt: Tensor, full_idx: Tensor, part_cnt: Tensor, part_idx: Tensor,
                  part_tile: Tensor, bits: Tensor, q_block: int, kv_block: int,
                  scale: float, fp32: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    B, H, Sq, D = q.shape
    dq = torch.zeros(B, H, Sq, D, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
    # p = exp(s - lse); a row that attends nowhere (lse = -inf) has p = 0: use +inf there.
    lse_safe = torch.where(torch.isneginf(lse), float("inf"), lse.float())
    dd = delta.float() if dlse is None else delta.float() - dlse.float()
    for bs, hs, khs, r0, r1, pos, mask in _work(q, k, pattern_of, full_cnt, full_idx, part_cnt, part_idx, part_tile,
                                                 bits, q_block, kv_block):
        qs = q[bs, hs, r0:r1].float()
        dos = do[bs, hs, r0:r1].float()
        idx = (bs[:, None], khs[:, None], pos[None, :])
        ks, vs = k[idx].float(), v[idx].float()
        s = torch.matmul(qs, ks.transpose(-1, -2)) * scale
        p = torch.exp(s - lse_safe[bs, hs, r0:r1, None])
        if mask is not None:
            p = p.masked_fill(~mask, 0.0)
        dp = torch.matmul(dos, vs.transpose(-1, -2))
        ds = p * (dp - dd[bs, hs, r0:r1, None])
        dq[bs, hs, r0:r1] = torch.matmul(ds, ks) * scale
        dk.index_put_(idx, torch.matmul(ds.transpose(-1, -2), qs) * scale, accumulate=True)
        dv.index_put_(idx, torch.matmul(p.transpose(-1, -2), dos), accumulate=True)
    if fp32:
        return dq, dk, dv
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
