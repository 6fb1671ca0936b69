"""Eager block-sparse attention over a ``BlockLists``: the CPU path of the kernel ops.

Same contract as the Triton kernels (``triton_kernels.py``): forward returns (out, lse) with
lse in fp32 and -inf for fully masked rows (their output is 0); backward takes the GLOBAL lse
and delta = rowsum(dO * O) computed by the caller, and optionally dlse, and returns dq, dk,
dv. Accumulation in fp32. Work is grouped by (unique pattern, Q block): every (batch, head)
that shares the pattern is one batched matmul over the union of that row's KV blocks, so
EMPTY blocks cost nothing; the query heads of a GQA group that share the pattern are one
matmul against their KV head's K/V, gathered once (GQA is never expanded). Scores are
exponentiated once, in place, and the scale is applied to Q (rows x D) rather than to the
scores (rows x keys): a CPU run's attention time is mostly these passes.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ultraattn.kernels.block_lists import unpack_bits


def softmax_delta(out: Tensor, dout: Tensor, dlse: Tensor | None = None) -> Tensor:
    """``delta = rowsum(dO * O) - dLSE`` in fp32 [..., rows]: what every attention backward subtracts from ``dP``
    (dS = P * (dP - delta)). With the GLOBAL output and LSE it makes each tile's backward exact on its own, which
    is why partial tiles on different ranks can be differentiated apart. The one place it is computed."""
    delta = (dout.float() * out.float()).sum(-1)
    return delta if dlse is None else delta - dlse.float()


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
    """Yield (batch ids [n], kv head ids [n], q heads [n, g], first row, last row, kv positions, mask or None) per
    (unique pattern, Q block, head grouping) with work. ``g`` query heads go together per (batch, kv head):
    all ``r = H // Hk`` of a GQA group when they share the pattern (one matmul against K/V gathered once per
    KV head: GQA is never expanded), else each head alone (g = 1)."""
    B, H, Sq, _ = q.shape
    hk = k.shape[1]
    r = H // hk
    lists = [t.cpu() for t in (full_cnt, full_idx, part_cnt, part_idx, part_tile)]
    bits_d = bits.to(q.device)
    pat = pattern_of.view(B, hk, r).cpu()
    heads = torch.arange(H).view(hk, r)
    for u in range(int(pat.max()) + 1):
        has = pat == u
        whole = has.all(-1)                                      # [B, Hk]: every head of the group has u
        groups = []
        sel = whole.nonzero()
        if len(sel):
            groups.append((sel[:, 0], sel[:, 1], heads[sel[:, 1]]))
        sel = (has & ~whole[..., None]).nonzero()              # [n, 3]: (b, kv head, head in group)
        if len(sel):
            groups.append((sel[:, 0], sel[:, 1], (sel[:, 1] * r + sel[:, 2])[:, None]))
        if not groups:
            continue
        groups = [tuple(t.to(q.device) for t in grp) for grp in groups]
        for i in range(full_cnt.shape[1]):
            r0, r1 = i * q_block, min(Sq, (i + 1) * q_block)
            pos, mask = _row_blocks(*lists, bits_d, u, i, q_block, kv_block, r1 - r0, k.shape[2])
            if pos is not None:
                pos = pos.to(q.device)
                for bs, khs, hs in groups:
                    yield bs, khs, hs, r0, r1, pos, mask


def reference_fwd(q: Tensor, k: Tensor, v: Tensor, pattern_of: Tensor, full_cnt: Tensor, full_idx: Tensor,
                  part_cnt: Tensor, part_idx: Tensor, part_tile: Tensor, bits: Tensor, q_block: int, kv_block: int,
                  scale: float, out_dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
    B, H, Sq, D = q.shape
    out = torch.zeros(B, H, Sq, v.shape[-1], dtype=torch.float32, device=q.device)
    lse = torch.full((B, H, Sq), float("-inf"), dtype=torch.float32, device=q.device)
    for bs, khs, hs, r0, r1, pos, mask in _work(q, k, pattern_of, full_cnt, full_idx, part_cnt, part_idx, part_tile,
                                                 bits, q_block, kv_block):
        n, g, t = hs.shape[0], hs.shape[1], r1 - r0
        rows = (bs[:, None], hs, slice(r0, r1))
        qs = (q[rows].float() * scale).view(n, g * t, D)              # scaled here: rows x D, not rows x keys
        kv = (bs[:, None], khs[:, None], pos[None, :])
        ks, vs = k[kv].float(), v[kv].float()                          # [n, C, D]: once per KV head
        s = torch.matmul(qs, ks.transpose(-1, -2))                     # [n, g*t, C]
        if mask is not None:
            s.view(n, g, t, -1).masked_fill_(~mask, float("-inf"))
        # one exp pass, in place; the output is normalised after the matmul (rows x D)
        m = s.amax(-1, keepdim=True)
        m = torch.where(torch.isinf(m), torch.zeros_like(m), m)       # rows that attend nothing: exp(-inf) = 0
        lsum = s.sub_(m).exp_().sum(-1, keepdim=True)
        empty = lsum == 0
        o = torch.matmul(s, vs).div_(torch.where(empty, torch.ones_like(lsum), lsum))
        out[rows] = o.view(n, g, t, -1)
        lse[rows] = torch.where(empty, float("-inf"), m + torch.log(lsum)).view(n, g, t)
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
    for bs, khs, hs, r0, r1, pos, mask in _work(q, k, pattern_of, full_cnt, full_idx, part_cnt, part_idx, part_tile,
                                                 bits, q_block, kv_block):
        n, g, t = hs.shape[0], hs.shape[1], r1 - r0
        rows = (bs[:, None], hs, slice(r0, r1))
        qs = (q[rows].float() * scale).view(n, g * t, D)               # carries the scale into s and dk
        dos = do[rows].float().view(n, g * t, -1)
        kv = (bs[:, None], khs[:, None], pos[None, :])
        ks, vs = k[kv].float(), v[kv].float()
        p = torch.matmul(qs, ks.transpose(-1, -2))
        if mask is not None:
            p.view(n, g, t, -1).masked_fill_(~mask, float("-inf"))
        p.sub_(lse_safe[rows].reshape(n, g * t, 1)).exp_()             # P with the given (global) lse, in place
        ds = torch.matmul(dos, vs.transpose(-1, -2))                   # dP, then P * (dP - delta) in place
        ds.sub_(dd[rows].reshape(n, g * t, 1)).mul_(p)
        dq[rows] = (torch.matmul(ds, ks) * scale).view(n, g, t, D)
        dk.index_put_(kv, torch.matmul(ds.transpose(-1, -2), qs), accumulate=True)    # sums the g heads
        dv.index_put_(kv, torch.matmul(p.transpose(-1, -2), dos), accumulate=True)
    if fp32:
        return dq, dk, dv
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
