"""Triton block-sparse attention: forward (out + fp32 LSE), dQ and dK/dV kernels.

Imported lazily (``ultraattn.kernels.ops``) because ``triton.jit`` decides at decoration time
whether kernels run compiled or under ``TRITON_INTERPRET=1`` (the CPU test path).

Block-sparse walk. A forward program owns ``BLOCK_M`` query rows of one (batch, head); it
reads its pattern's list of FULL KV blocks and runs them with no mask code at all, then its
list of PARTIAL KV blocks, each gated by a packed bit tile (``block_lists.py``). A pattern block
(``kv_block`` wide) is walked in ``BLOCK_N`` sub-tiles, so the autotuner can pick tile shapes
independently of the mask's granularity. The dK/dV program owns ``BLOCK_N`` keys of one KV
head and loops over the query heads of its GQA group and the Q blocks in the transposed
lists, accumulating in registers: no atomics, no repeated K/V. dQ is a separate program
that walks the forward lists (recomputing QK^T and dO V^T instead of atomically adding dQ:
deterministic, and the extra FLOPs are the usual FlashAttention-2 trade).

Numerics: scores are scaled into base 2 (``qk_scale = scale * log2(e)``) and the online
softmax runs in fp32; a row with no attended key keeps ``m = -inf`` and is guarded so that
its output is 0 and its LSE -inf, never NaN. Backward takes the GLOBAL LSE (a tile's local
softmax is not the final one in the distributed case) and ``delta - dlse`` per row, both as
per-row fp32 terms made once by the op (``LSE2``: the LSE in base 2, +inf where it is -inf, so
a row that attends nowhere contributes exp2(-inf) = 0; ``DD``: delta - dlse), so the dK/dV inner
loop loads two vectors and computes nothing per row. fp32 inputs use IEEE dots (no TF32) so fp32 results are
exact to fp32 rounding; 16-bit inputs feed the tensor cores and accumulate in fp32. Under the
interpreter 16-bit tiles are upcast first (it computes bf16 arithmetic wrongly).
"""

from __future__ import annotations

import functools
import os

import triton
import triton.language as tl

from ultraattn.kernels.config import TILES_ENV, interpret, triton_configs, tune_mode

# Runtime-sized integer arguments that must not trigger a recompile when they change.
_NO_SPEC = ["q_len", "kv_len", "NQ", "NK", "q0", "h0", "s_last"]


@triton.jit
def _fp32_scales(qk_scale, scale):
    """Both softmax scales as fp32. Inductor types a Python float argument fp64 on CUDA
    (``torch._inductor.codegen.triton_utils.signature_of``); the online-softmax state is fp32, and a loop-carried
    value must keep its type, so every kernel casts them once, at entry."""
    return tl.cast(qk_scale, tl.float32), tl.cast(scale, tl.float32)


@triton.jit
def _load_bits(BITS, tile, r_in, c_in, QB: tl.constexpr, KB: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr):
    """Mask bits [BLOCK_M, BLOCK_N] of bit tile ``tile`` at rows ``r_in``.., columns ``c_in``.. of the block.

    Bits are 32-bit words along the KV axis (``block_lists.pack_bits``). With ``BLOCK_N >= 32`` a row of
    the tile is BLOCK_N / 32 word loads, expanded by shifts: one load per 32 mask elements, where an
    element-wise gather keeps a 64-bit address per element in registers (what made these kernels spill).
    """
    KW: tl.constexpr = (KB + 31) // 32
    rows = r_in + tl.arange(0, BLOCK_M)
    base = BITS + tile.to(tl.int64) * (QB * KW) + rows[:, None] * KW
    if BLOCK_N >= 32:
        words = tl.load(base + (c_in // 32 + tl.arange(0, BLOCK_N // 32))[None, :])
        bits = (words[:, :, None] >> tl.arange(0, 32)[None, None, :]) & 1
        return tl.reshape(bits, [BLOCK_M, BLOCK_N]) != 0
    else:
        cols = c_in + tl.arange(0, BLOCK_N)
        return ((tl.load(base + (cols // 32)[None, :]) >> (cols % 32)[None, :]) & 1) != 0


@triton.jit
def _key_pos(KV_POS, start, s_last, KB: tl.constexpr, BLOCK_N: tl.constexpr):
    """Global key positions of local keys ``start ..`` (``KV_POS``: each local KV block's first global key),
    clamped to the last token (the mask removes the padded tail)."""
    return tl.minimum(tl.load(KV_POS + start // KB) + start % KB + tl.arange(0, BLOCK_N), s_last)


@triton.jit
def _row_program(PAT, H, GROUP: tl.constexpr, QB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """Who a row program is: (b*H+h, b, h, kv head, pattern, Q block, row offset in it, row ids, dim ids)."""
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    row0 = tl.program_id(0) * BLOCK_M
    u = tl.load(PAT + bh)
    return bh, b, h, h // GROUP, u, row0 // QB, row0 % QB, row0 + tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_D)


@triton.jit
def _load_rows(PTR, b, h, sb, sh, sm, sd, offs_m, offs_d, q_len, D: tl.constexpr, UPCAST: tl.constexpr):
    """Rows ``offs_m`` of head ``h`` of batch ``b`` of a [B, H, S, D] tensor (0 past q_len or D; fp32 if UPCAST)."""
    x = tl.load(PTR + b.to(tl.int64) * sb + h.to(tl.int64) * sh + offs_m[:, None].to(tl.int64) * sm
                + offs_d[None, :] * sd, mask=(offs_m[:, None] < q_len) & (offs_d[None, :] < D), other=0.0)
    if UPCAST:
        x = x.to(tl.float32)
    return x


@triton.jit
def _fwd_inner(acc, l_i, m_i, q, K_base, V_base, skn, skd, svn, svd, BITS, tile, start, sub_in, r_in, kv_len,
               qk_scale, offs_d, b, h, qg, KV_POS, s_last, scale, P0, P1, P2, P3,
               D: tl.constexpr, QB: tl.constexpr, KB: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, IS_PARTIAL: tl.constexpr, EVEN_D: tl.constexpr, UPCAST: tl.constexpr,
               PREC: tl.constexpr, SCORE: tl.constexpr):
    offs_n = start + tl.arange(0, BLOCK_N)
    dmask = offs_d < D
    k_ptr = K_base + offs_n[None, :].to(tl.int64) * skn + offs_d[:, None] * skd
    if IS_PARTIAL:
        kt = tl.load(k_ptr, mask=(offs_n[None, :] < kv_len) & dmask[:, None], other=0.0)
    elif EVEN_D:
        kt = tl.load(k_ptr)
    else:
        kt = tl.load(k_ptr, mask=dmask[:, None], other=0.0)
    if UPCAST:
        kt = kt.to(tl.float32)
    s = tl.dot(q, kt, input_precision=PREC)
    if SCORE is not None:   # the score_mod on natural-log scores with global indices, then base 2
        kg = _key_pos(KV_POS, start, s_last, KB, BLOCK_N)
        s = SCORE(s * scale, b, h, qg[:, None], kg[None, :], P0, P1, P2, P3) * 1.4426950408889634
    else:
        s = s * qk_scale
    if IS_PARTIAL:
        s = tl.where(_load_bits(BITS, tile, r_in, sub_in, QB, KB, BLOCK_M, BLOCK_N), s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    v_ptr = V_base + offs_n[:, None].to(tl.int64) * svn + offs_d[None, :] * svd
    if IS_PARTIAL:
        vt = tl.load(v_ptr, mask=(offs_n[:, None] < kv_len) & dmask[None, :], other=0.0)
    elif EVEN_D:
        vt = tl.load(v_ptr)
    else:
        vt = tl.load(v_ptr, mask=dmask[None, :], other=0.0)
    if UPCAST:
        vt = vt.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=PREC)
    return acc, l_i, m_new


@triton.jit(do_not_specialize=_NO_SPEC)
def bsa_fwd_kernel(Q, K, V, OUT, LSE, PAT, FULL_CNT, FULL_IDX, PART_CNT, PART_IDX, PART_TILE, BITS,
                   KV_POS, P0, P1, P2, P3,
                   sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, som, sod,
                   H, q_len, kv_len, NQ, NK, qk_scale, scale, q0, h0, s_last,
                   GROUP: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, QB: tl.constexpr, KB: tl.constexpr,
                   UPCAST: tl.constexpr, PREC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   SCORE: tl.constexpr):
    qk_scale, scale = _fp32_scales(qk_scale, scale)
    EVEN_D: tl.constexpr = D == BLOCK_D
    SUBS: tl.constexpr = KB // BLOCK_N
    bh, b, h, kh, u, i, r_in, offs_m, offs_d = _row_program(PAT, H, GROUP, QB, BLOCK_M, BLOCK_D)
    dmask = offs_d < D
    q = _load_rows(Q, b, h, sqb, sqh, sqm, sqd, offs_m, offs_d, q_len, D, UPCAST)
    K_base = K + b.to(tl.int64) * skb + kh.to(tl.int64) * skh
    V_base = V + b.to(tl.int64) * svb + kh.to(tl.int64) * svh
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    row = u.to(tl.int64) * NQ + i
    qg = tl.minimum(q0 + offs_m, s_last)   # global query positions, for a score_mod
    # FULL blocks (no mask code), then PARTIAL blocks (bit tiles). Each path is ONE flat loop over
    # (listed block, BLOCK_N sub-tile): a nested static sub-tile loop would unroll the body
    # KB / BLOCK_N times, and the software pipeliner would keep every copy's loads in flight.
    for partial in tl.static_range(2):
        if partial == 0:
            CNT, IDX = FULL_CNT, FULL_IDX
        else:
            CNT, IDX = PART_CNT, PART_IDX
        for it in range(0, tl.load(CNT + row) * SUBS):
            t = it // SUBS
            sub = (it % SUBS) * BLOCK_N
            j = tl.load(IDX + row * NK + t)
            tile = tl.load(PART_TILE + row * NK + t) if partial == 1 else 0
            acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, K_base, V_base, skn, skd, svn, svd, BITS, tile,
                                       j * KB + sub, sub, r_in, kv_len, qk_scale, offs_d,
                                       b, h0 + h, qg, KV_POS, s_last, scale, P0, P1, P2, P3,
                                       D, QB, KB, BLOCK_M, BLOCK_N, partial == 1, EVEN_D, UPCAST, PREC, SCORE)
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * 0.6931471805599453)
    omask = (offs_m[:, None] < q_len) & dmask[None, :]
    tl.store(OUT + b.to(tl.int64) * sob + h.to(tl.int64) * soh + offs_m[:, None].to(tl.int64) * som
             + offs_d[None, :] * sod, out.to(OUT.dtype.element_ty), mask=omask)
    tl.store(LSE + bh.to(tl.int64) * q_len + offs_m, lse, mask=offs_m < q_len)


@triton.jit
def _bwd_dq_inner(dq, q, do, lse2, dd, K_base, V_base, skn, skd, svn, svd, BITS, tile, start, sub_in, r_in,
                  kv_len, qk_scale, offs_d, b, h, qg, mmask, KV_POS, s_last, scale, P0, P1, P2, P3, D0, D1, D2, D3,
                  D: tl.constexpr, QB: tl.constexpr, KB: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_PARTIAL: tl.constexpr, EVEN_D: tl.constexpr,
                  UPCAST: tl.constexpr, PREC: tl.constexpr, SCORE: tl.constexpr, SCORE_BWD: tl.constexpr):
    offs_n = start + tl.arange(0, BLOCK_N)
    dmask = offs_d < D
    k_ptr = K_base + offs_n[:, None].to(tl.int64) * skn + offs_d[None, :] * skd
    v_ptr = V_base + offs_n[:, None].to(tl.int64) * svn + offs_d[None, :] * svd
    if IS_PARTIAL:
        lmask = (offs_n[:, None] < kv_len) & dmask[None, :]
        k = tl.load(k_ptr, mask=lmask, other=0.0)
        v = tl.load(v_ptr, mask=lmask, other=0.0)
    elif EVEN_D:
        k = tl.load(k_ptr)
        v = tl.load(v_ptr)
    else:
        k = tl.load(k_ptr, mask=dmask[None, :], other=0.0)
        v = tl.load(v_ptr, mask=dmask[None, :], other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=PREC)
    if SCORE is not None:
        kg = _key_pos(KV_POS, start, s_last, KB, BLOCK_N)
        raw = s * scale
        s = SCORE(raw, b, h, qg[:, None], kg[None, :], P0, P1, P2, P3) * 1.4426950408889634
    else:
        s = s * qk_scale
    p = tl.math.exp2(s - lse2[:, None])
    if IS_PARTIAL:
        bits = _load_bits(BITS, tile, r_in, sub_in, QB, KB, BLOCK_M, BLOCK_N)
        p = tl.where(bits, p, 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=PREC)
    ds = p * (dp - dd[:, None])
    if SCORE is not None:   # back through the score_mod; its buffers' gradients are added here (GRADS)
        keep = mmask[:, None] & (offs_n < kv_len)[None, :]
        if IS_PARTIAL:
            keep = keep & bits
        ds = tl.where(keep, SCORE_BWD(ds, raw, b, h, qg[:, None], kg[None, :], keep, P0, P1, P2, P3,
                                      D0, D1, D2, D3, True), 0.0)
    dq += tl.dot(ds.to(k.dtype), k, input_precision=PREC)
    return dq


@triton.jit(do_not_specialize=_NO_SPEC)
def bsa_bwd_dq_kernel(Q, K, V, DO, LSE2, DD, DQ, PAT, FULL_CNT, FULL_IDX, PART_CNT, PART_IDX, PART_TILE, BITS,
                      KV_POS, P0, P1, P2, P3, D0, D1, D2, D3,
                      sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sdb, sdh, sdm, sdd,
                      sgb, sgh, sgm, sgd, H, q_len, kv_len, NQ, NK, qk_scale, scale, q0, h0, s_last,
                      GROUP: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, QB: tl.constexpr,
                      KB: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SCORE: tl.constexpr,
                      SCORE_BWD: tl.constexpr):
    """dQ for BLOCK_M rows of one (b, h); strides: DO sd*, DQ sg*. LSE2, DD: the per-row terms (ops.bsa_bwd)."""
    qk_scale, scale = _fp32_scales(qk_scale, scale)
    EVEN_D: tl.constexpr = D == BLOCK_D
    SUBS: tl.constexpr = KB // BLOCK_N
    bh, b, h, kh, u, i, r_in, offs_m, offs_d = _row_program(PAT, H, GROUP, QB, BLOCK_M, BLOCK_D)
    mmask = offs_m < q_len
    qmask = mmask[:, None] & (offs_d < D)[None, :]
    q = _load_rows(Q, b, h, sqb, sqh, sqm, sqd, offs_m, offs_d, q_len, D, UPCAST)
    do = _load_rows(DO, b, h, sdb, sdh, sdm, sdd, offs_m, offs_d, q_len, D, UPCAST)
    lse2 = tl.load(LSE2 + bh.to(tl.int64) * q_len + offs_m, mask=mmask, other=float("inf"))
    dd = tl.load(DD + bh.to(tl.int64) * q_len + offs_m, mask=mmask, other=0.0)
    K_base = K + b.to(tl.int64) * skb + kh.to(tl.int64) * skh
    V_base = V + b.to(tl.int64) * svb + kh.to(tl.int64) * svh
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    row = u.to(tl.int64) * NQ + i
    qg = tl.minimum(q0 + offs_m, s_last)
    for partial in tl.static_range(2):  # one flat loop per path, as in the forward
        if partial == 0:
            CNT, IDX = FULL_CNT, FULL_IDX
        else:
            CNT, IDX = PART_CNT, PART_IDX
        for it in range(0, tl.load(CNT + row) * SUBS):
            t = it // SUBS
            sub = (it % SUBS) * BLOCK_N
            j = tl.load(IDX + row * NK + t)
            tile = tl.load(PART_TILE + row * NK + t) if partial == 1 else 0
            dq = _bwd_dq_inner(dq, q, do, lse2, dd, K_base, V_base, skn, skd, svn, svd, BITS, tile,
                               j * KB + sub, sub, r_in, kv_len, qk_scale, offs_d,
                               b, h0 + h, qg, mmask, KV_POS, s_last, scale, P0, P1, P2, P3, D0, D1, D2, D3,
                               D, QB, KB, BLOCK_M, BLOCK_N, partial == 1, EVEN_D, UPCAST, PREC, SCORE, SCORE_BWD)
    tl.store(DQ + b.to(tl.int64) * sgb + h.to(tl.int64) * sgh + offs_m[:, None].to(tl.int64) * sgm
             + offs_d[None, :] * sgd, (dq * scale).to(DQ.dtype.element_ty), mask=qmask)


@triton.jit
def _bwd_kv_inner(dk, dv, k, v, Q_base, DO_base, LSE2_row, DD_row, sqm, sqd, sdm, sdd, BITS, tile, start,
                  sub_in, c_in, q_len, qk_scale, offs_d, b, h, kg, nmask, q0, s_last, scale, P0, P1, P2, P3,
                  D: tl.constexpr, QB: tl.constexpr, KB: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_PARTIAL: tl.constexpr, EVEN_D: tl.constexpr,
                  UPCAST: tl.constexpr, PREC: tl.constexpr, SCORE: tl.constexpr, SCORE_BWD: tl.constexpr):
    offs_m = start + tl.arange(0, BLOCK_M)
    dmask = offs_d < D
    mmask = offs_m < q_len
    lmask = mmask[:, None] & dmask[None, :]
    q = tl.load(Q_base + offs_m[:, None].to(tl.int64) * sqm + offs_d[None, :] * sqd, mask=lmask, other=0.0)
    do = tl.load(DO_base + offs_m[:, None].to(tl.int64) * sdm + offs_d[None, :] * sdd, mask=lmask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    lse2 = tl.load(LSE2_row + offs_m, mask=mmask, other=float("inf"))
    dd = tl.load(DD_row + offs_m, mask=mmask, other=0.0)
    # Transposed scores: [BLOCK_N, BLOCK_M], rows are keys.
    st = tl.dot(k, tl.trans(q), input_precision=PREC)
    if SCORE is not None:
        qg = tl.minimum(q0 + offs_m, s_last)
        raw = st * scale
        st = SCORE(raw, b, h, qg[None, :], kg[:, None], P0, P1, P2, P3) * 1.4426950408889634
    else:
        st = st * qk_scale
    pt = tl.math.exp2(st - lse2[None, :])
    if IS_PARTIAL:
        keep = _load_bits(BITS, tile, sub_in, c_in, QB, KB, BLOCK_M, BLOCK_N)
        pt = tl.where(tl.trans(keep), pt, 0.0)
    dv += tl.dot(pt.to(do.dtype), do, input_precision=PREC)
    dpt = tl.dot(v, tl.trans(do), input_precision=PREC)
    dst = pt * (dpt - dd[None, :])
    if SCORE is not None:   # back through the score_mod (buffer gradients are the dQ kernel's)
        keept = nmask[:, None] & mmask[None, :]
        if IS_PARTIAL:
            keept = keept & tl.trans(keep)
        dst = tl.where(keept, SCORE_BWD(dst, raw, b, h, qg[None, :], kg[:, None], keept, P0, P1, P2, P3,
                                        P0, P0, P0, P0, False), 0.0)
    dk += tl.dot(dst.to(q.dtype), q, input_precision=PREC)
    return dk, dv


@triton.jit(do_not_specialize=_NO_SPEC)
def bsa_bwd_dkv_kernel(Q, K, V, DO, LSE2, DD, DK, DV, PAT, FULL_Q_CNT, FULL_Q_IDX, PART_Q_CNT, PART_Q_IDX,
                       PART_Q_TILE, BITS, KV_POS, P0, P1, P2, P3,
                       sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sdb, sdh, sdm, sdd,
                       sgkb, sgkh, sgkn, sgkd, sgvb, sgvh, sgvn, sgvd, H, HK, q_len, kv_len, NQ, NK, qk_scale, scale,
                       q0, h0, s_last,
                       GROUP: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, QB: tl.constexpr,
                       KB: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SCORE: tl.constexpr,
                       SCORE_BWD: tl.constexpr):
    """dK, dV for BLOCK_N keys of one (b, kv head), summed over its GROUP query heads; strides: DK sgk*, DV sgv*."""
    qk_scale, scale = _fp32_scales(qk_scale, scale)
    EVEN_D: tl.constexpr = D == BLOCK_D
    SUBS: tl.constexpr = QB // BLOCK_M
    pid_n = tl.program_id(0)
    bkh = tl.program_id(1)
    b = bkh // HK
    kh = bkh % HK
    col0 = pid_n * BLOCK_N
    j = col0 // KB
    c_in = col0 % KB
    offs_n = col0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    kmask = (offs_n[:, None] < kv_len) & dmask[None, :]
    k_off = b.to(tl.int64) * skb + kh.to(tl.int64) * skh + offs_n[:, None].to(tl.int64) * skn + offs_d[None, :] * skd
    v_off = b.to(tl.int64) * svb + kh.to(tl.int64) * svh + offs_n[:, None].to(tl.int64) * svn + offs_d[None, :] * svd
    k = tl.load(K + k_off, mask=kmask, other=0.0)
    v = tl.load(V + v_off, mask=kmask, other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    nmask = offs_n < kv_len
    kg = _key_pos(KV_POS, col0, s_last, KB, BLOCK_N) if SCORE is not None else offs_n
    for g in range(0, GROUP):
        h = kh * GROUP + g
        bh = b * H + h
        u = tl.load(PAT + bh)
        Q_base = Q + b.to(tl.int64) * sqb + h.to(tl.int64) * sqh
        DO_base = DO + b.to(tl.int64) * sdb + h.to(tl.int64) * sdh
        LSE2_row = LSE2 + bh.to(tl.int64) * q_len
        DD_row = DD + bh.to(tl.int64) * q_len
        col = u.to(tl.int64) * NK + j
        for partial in tl.static_range(2):  # one flat loop per path, as in the forward
            if partial == 0:
                CNT, IDX = FULL_Q_CNT, FULL_Q_IDX
            else:
                CNT, IDX = PART_Q_CNT, PART_Q_IDX
            for it in range(0, tl.load(CNT + col) * SUBS):
                t = it // SUBS
                sub = (it % SUBS) * BLOCK_M
                i = tl.load(IDX + col * NQ + t)
                tile = tl.load(PART_Q_TILE + col * NQ + t) if partial == 1 else 0
                dk, dv = _bwd_kv_inner(dk, dv, k, v, Q_base, DO_base, LSE2_row, DD_row, sqm, sqd, sdm, sdd,
                                       BITS, tile, i * QB + sub, sub, c_in, q_len, qk_scale, offs_d,
                                       b, h0 + h, kg, nmask, q0, s_last, scale, P0, P1, P2, P3,
                                       D, QB, KB, BLOCK_M, BLOCK_N, partial == 1, EVEN_D, UPCAST, PREC,
                                       SCORE, SCORE_BWD)
    b64, kh64, n64 = b.to(tl.int64), kh.to(tl.int64), offs_n[:, None].to(tl.int64)
    dk_off = b64 * sgkb + kh64 * sgkh + n64 * sgkn + offs_d[None, :] * sgkd
    dv_off = b64 * sgvb + kh64 * sgvh + n64 * sgvn + offs_d[None, :] * sgvd
    tl.store(DK + dk_off, (dk * scale).to(DK.dtype.element_ty), mask=kmask)
    tl.store(DV + dv_off, dv.to(DV.dtype.element_ty), mask=kmask)


_JIT = {"fwd": bsa_fwd_kernel, "dq": bsa_bwd_dq_kernel, "dkv": bsa_bwd_dkv_kernel}


def tuned(kernel: str, qb: int, kb: int, rows: str, score: bool = False):
    """``kernel`` ('fwd', 'dq', 'dkv') for pattern blocks qb x kb and row class ``rows``
    (``config.row_class``), autotuned over ``config.tile_configs`` (the score_mod spaces when ``score``; the
    kernel itself under the interpreter, which launches the tile shape it is given). One autotuner per space,
    so each (head dim, dtype, group, block) key is timed once; with ``ULTRAATTN_TUNE=first`` each space's
    first entry alone, untimed (``config.tune_mode``). ``ULTRAATTN_TILES`` replaces a kernel's space
    (``config.tile_override``)."""
    return _tuned(kernel, qb, kb, rows, tune_mode(), score, os.environ.get(TILES_ENV, ""))


@functools.cache
def _tuned(kernel: str, qb: int, kb: int, rows: str, mode: str, score: bool = False, tiles: str = ""):
    if interpret():
        return _JIT[kernel]
    configs = triton_configs(kernel, qb, kb, rows, score)
    # dQ adds a score_mod's buffer gradients atomically into D0..D3: zeroed before each trial and the real launch
    return triton.autotune(configs=configs[:1] if mode == "first" else configs, key=["GROUP", "D", "QB", "KB"],
                           reset_to_zero=["D0", "D1", "D2", "D3"] if kernel == "dq" else None)(_JIT[kernel])
