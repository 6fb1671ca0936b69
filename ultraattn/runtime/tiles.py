"""Tile compute on any device in plain torch: the reference path of the runtime.

One call computes every cell of one plan row (a Q chunk) that a kernel holds, for one
head group, as ONE softmax over the KV blocks the row's cells need:

* the block grid says which KV blocks each Q block attends (EMPTY blocks are skipped,
  never multiplied);
* FULL blocks need no mask evaluation; a Q block whose gathered KV blocks include a
  PARTIAL block, or that touches the padded tail, evaluates the mask_mod once (cached);
* arithmetic is fp32 whatever the input dtype; the partial result is ``(o, lse)`` with
  ``o`` already normalised by its own sum (merging is done with the LSE, runtime/merge).

On CUDA (or with ``ULTRAATTN_KERNELS=triton`` under Triton's interpreter) a row runs the
block-sparse Triton kernels instead (``tile_kernels.py``): the row's cells become a kernel
block lists in the row's own coordinates, with fp32 partial outputs and gradients; with
``ULTRAATTN_TILE_KERNEL=flex`` a row with a mask_mod runs on FlexAttention (any device).

GQA: Q heads are viewed as ``[B, Hk, r, L, D]`` against K/V ``[B, Hk, 1, L, D]``: K/V are
never repeated.

A FlexAttention score_mod (``ScoreMod``) is applied to every tile's scaled scores before the mask, with
the GLOBAL batch, head, query and key indices, exactly as FlexAttention's own eager path applies it (vmap
over the four index dimensions): the merge by log-sum-exp is then exact for any score_mod. Its gradient is
autograd's through the score_mod; buffers that want a gradient (a learned bias) get this tile's part of it.
On the kernels, the score_mod is generated into them as Triton code (the [Note] at ``ScoreMod``); one the
generator cannot translate keeps the plain-torch path, on CUDA too, with a warning.

Backward takes the GLOBAL LSE and ``delta = rowsum(dO * O) - dLSE`` (plan.py): with
``P = exp(S - lse)``, ``dS = P * (dP - delta)``, which is exact for the distributed case
where a tile's partial output is not the final one.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..eager import eager_dispatch
from ..masks.pattern import EMPTY, FULL, PARTIAL, BlockPattern
from ..masks.read import ElementMask
from .tile_kernels import (
    _kernels_on,
    _score_args,
    flex_row_backward,
    flex_row_forward,
    flex_tiles_on,
    kernel_row_backward,
    kernel_row_forward,
    kv_block_ids,
    row_block_lists,
)

#: bytes of cached element masks per plan before the cache stops growing
MASK_CACHE_BYTES = 512 << 20
#: rows per Q tile at most, and the extra (EMPTY, masked) work a tile may carry to be one launch
TILE_ROWS = 512
TILE_WASTE = 0.15
#: fp32 score elements (batch x query heads x rows x kv columns) one matmul produces at most. Consecutive Q
#: blocks merge into a tile only below it, and a tile wider than it runs in column pieces (the forward
#: merges the pieces' (o, lse); the backward, which uses the global LSE, just sums). The workspace (scores,
#: and dS beside them in the backward) stays 16 MiB a buffer however long the sequence, so the peak of a
#: sharded model's step follows its activations rather than its longest attention row.
TILE_ELEMS = 1 << 22


def group_kind_grid(pattern: BlockPattern, heads: range, padded_blocks_q: int, padded_blocks_k: int) -> Tensor:
    """int8 [Qp, Kp] kinds for a set of heads over every batch entry, on the padded grid.

    A cell is FULL only if FULL for every (batch, head); EMPTY only if EMPTY for all; else PARTIAL.
    """
    groups = sorted({pattern.head_group_of[h] if pattern.head_group_of else 0 for h in heads})
    k = pattern.kind_BGQK[:, groups].reshape(-1, *pattern.kind_BGQK.shape[2:])
    full = (k == FULL).all(0)
    nonempty = (k != EMPTY).any(0)
    kind = torch.where(full, FULL, torch.where(nonempty, PARTIAL, EMPTY)).to(torch.int8)
    out = torch.zeros(padded_blocks_q, padded_blocks_k, dtype=torch.int8)
    out[: kind.shape[0], : kind.shape[1]] = kind
    return out


@dataclass(frozen=True, slots=True)
class ScoreMod:
    """A FlexAttention score_mod for the tiles: ``fn(score, b, h, q_idx, kv_idx, *buffers)`` on 0-d values
    (vmapped here as FlexAttention does), with its buffers passed to every tile call.

    [Note] The GPU path for score_mods. Where the kernels run (``_kernels_on``), the score_mod is generated into
    them: ``kernels/score_codegen.py`` traces it on 0-d inputs (forward, and the joint graph of its backward) and
    writes each aten graph as a Triton function that the forward, dQ and dK/dV kernels call between QK^T and the
    softmax, with the global indices (``_score_args``: the row's query offset, head offset, and each local KV
    block's first global key). That is what FlexAttention's Inductor template does, without Inductor: the tiles
    are custom ops that run eagerly, so the generated functions go to the kernels as compile-time arguments.
    FlexAttention itself as the tile kernel (``ULTRAATTN_TILE_KERNEL=flex``, ``runtime/tile_kernels.py``) takes
    the mask_mod shifted to the row but not yet a score_mod: rows with one stay on our kernels. A score_mod the
    generator does not translate (a gather of vectors, MLA's RoPE term) runs the plain-torch tile below, and
    ``score_kernels`` warns once. Nothing of this has been timed on a GPU; the kernels build for sm_90.
    """

    fn: Callable
    grads: tuple[bool, ...] = ()
    """Per buffer: whether its gradient is wanted (a learned bias); the backward returns one per True."""

    @property
    def wanted(self) -> list[int]:
        return [n for n, want in enumerate(self.grads) if want]


@functools.lru_cache(maxsize=64)
def _score_fn(score_mod: ScoreMod, n_buffers: int) -> Callable:
    """The score_mod vmapped over [B, H, Q, KV] (FlexAttention's own ``_vmap_for_bhqkv``), built once per site."""
    from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex
    from torch.nn.attention.flex_attention import _vmap_for_bhqkv

    fn = _vmap_for_bhqkv(score_mod.fn, prefix=(0,), suffix=(None,) * n_buffers)

    def apply(*args):
        with TransformGetItemToIndex():
            return fn(*args)

    return apply


@dataclass(slots=True)
class TileGeometry:
    """Static facts every tile call needs (one per plan; shared by forward and backward)."""

    seq_len: int
    chunk: int
    q_block: int
    kv_block: int
    batch: int
    num_heads: int
    num_kv_heads: int
    head_groups: int
    head_dim: int
    kind_gQK: list[Tensor]
    """Per runtime head group: kinds on the padded grid (``group_kind_grid``)."""
    element: ElementMask | None
    """The element test of PARTIAL blocks (``masks/read.py``; None: the blocks alone decide)."""
    pattern: BlockPattern | None = None
    """The mask's block kinds per (batch, head) (``_mask``: a BlockMask's blocks decide as much as its mask_mod)."""
    mask_cache: dict = field(default_factory=dict)
    cache_bytes: int = 0
    score_mod: ScoreMod | None = None
    """The site's FlexAttention score_mod (None: scores are plain ``q k^T * scale``)."""

    @property
    def hq(self) -> int:
        return self.num_heads // self.head_groups

    @property
    def hk(self) -> int:
        return self.num_kv_heads // self.head_groups

    def pieces(self, g: int, i: int, kv_ids: Tensor) -> list[tuple[int, int, Tensor, bool]]:
        """``tiles`` with every tile wider than ``TILE_ELEMS`` cut into column pieces of whole KV blocks.

        Each piece is ``(a, b, sel, need_mask)`` like a tile; a piece whose blocks are all FULL (and
        inside the sequence) needs no mask, so a causal row masks only its diagonal piece.
        """
        key = ("pieces", g, i, tuple(kv_ids.tolist()))
        hit = self.mask_cache.get(key)
        if hit is not None:
            return hit
        nqb = self.chunk // self.q_block
        kinds = self.kind_gQK[g][i * nqb:(i + 1) * nqb][:, kv_ids]
        out = []
        for a, b, sel, need in self.tiles(g, i, kv_ids):
            per_block = self.batch * self.hq * (b - a) * self.q_block * self.kv_block
            width = max(1, TILE_ELEMS // per_block)
            groups = [(sel, need)]
            if need:
                # [Note] the columns that need no mask run apart from those that do: evaluating it costs a masked
                # piece ~45 % more per block on a CPU (one rank, S = 8192: 1.35-1.49 ms a block in masked pieces,
                # 1.0 in unmasked ones)
                free = self._unmasked_columns(i * nqb + a, b - a, kinds[a:b][:, sel], kv_ids[sel])
                if bool(free.any()):
                    groups = [(sel[free], False), (sel[~free], True)]
            for cols, masked in groups:
                for p0 in range(0, cols.numel(), width):
                    part = cols[p0:p0 + width]
                    out.append((a, b, part, masked and self._needs_mask(i * nqb + a, b - a, kinds[a:b][:, part],
                                                                        kv_ids[part])))
        self.mask_cache[key] = out
        return out

    def _unmasked_columns(self, qa0: int, nq: int, kinds: Tensor, blocks: Tensor) -> Tensor:
        """bool [m]: the KV ``blocks`` (kinds ``[nq, m]``) that Q blocks ``qa0 .. qa0+nq`` attend without the mask_mod:
        FULL in every row, inside the sequence, and the rows too."""
        if (qa0 + nq) * self.q_block > self.seq_len:
            return torch.zeros(blocks.numel(), dtype=torch.bool, device=blocks.device)
        return (kinds == FULL).all(0) & ((blocks + 1) * self.kv_block <= self.seq_len)

    def _needs_mask(self, qa0: int, nq: int, kinds: Tensor, blocks: Tensor) -> bool:
        """Whether Q blocks ``qa0 .. qa0+nq`` against KV ``blocks`` (kinds ``[nq, m]``) need the mask_mod."""
        return not bool(self._unmasked_columns(qa0, nq, kinds, blocks).all())

    def tiles(self, g: int, i: int, kv_ids: Tensor) -> list[tuple[int, int, Tensor, bool]]:
        """Q tiles of row chunk ``i``: (first, last+1 Q block within the chunk, KV block positions into
        ``kv_ids``, whether a mask is needed). Cached.

        Consecutive Q blocks share one launch over the union of their KV blocks while the union
        wastes at most ``TILE_WASTE`` of the work (fewer, larger matmuls: the CPU path is bound by
        per-op overhead at 128-row blocks); EMPTY blocks inside a union are masked out exactly.
        """
        key = ("tiles", g, i, tuple(kv_ids.tolist()))
        hit = self.mask_cache.get(key)
        if hit is not None:
            return hit
        nqb = self.chunk // self.q_block
        kinds = self.kind_gQK[g][i * nqb:(i + 1) * nqb][:, kv_ids]  # [nqb, m]
        nonempty = kinds != EMPTY
        max_blocks = max(1, TILE_ROWS // self.q_block)
        per_cell = self.batch * self.hq * self.q_block * self.kv_block  # score elements per (Q, KV) block pair
        out = []
        a = 0
        while a < nqb:
            if not bool(nonempty[a].any()):
                a += 1
                continue
            b, union, work = a + 1, nonempty[a].clone(), int(nonempty[a].sum())
            while b < nqb and b - a < max_blocks and bool(nonempty[b].any()):
                u2 = union | nonempty[b]
                w2 = work + int(nonempty[b].sum())
                if int(u2.sum()) * (b + 1 - a) > (1 + TILE_WASTE) * w2:
                    break
                if int(u2.sum()) * (b + 1 - a) * per_cell > TILE_ELEMS:
                    break
                union, work, b = u2, w2, b + 1
            sel = union.nonzero().flatten()
            out.append((a, b, sel, self._needs_mask(i * nqb + a, b - a, kinds[a:b][:, sel], kv_ids[sel])))
            a = b
        self.mask_cache[key] = out
        return out

    def _mask(self, g: int, qa0: int, nq: int, blocks: Tensor) -> Tensor:
        """bool [mb, hk|1, r|1, nq*bq, m*bk] for Q blocks ``qa0 .. qa0+nq`` against KV blocks ``blocks``
        (global ids)."""
        key = (g, qa0, nq, tuple(blocks.tolist()))
        hit = self.mask_cache.get(key)
        if hit is not None:
            return hit
        s, bq, bk = self.seq_len, self.q_block, self.kv_block
        q_pos = qa0 * bq + torch.arange(nq * bq)
        kv_pos = (blocks[:, None] * bk + torch.arange(bk)[None, :]).flatten()
        valid = (q_pos[:, None] < s) & (kv_pos[None, :] < s)
        kinds = self.kind_gQK[g][qa0:qa0 + nq][:, blocks]
        if bool(((kinds != FULL) & (kinds != EMPTY)).any()) or bool((kinds == EMPTY).any()):
            if self.element is None:
                if bool((kinds == PARTIAL).any()):
                    raise ValueError(
                        "the mask has PARTIAL blocks but no mask_mod to evaluate them: pass the BlockMask or the "
                        "mask_mod (plan_attention(..., mask_mod=...)) instead of a bare BlockPattern"
                    )
                m = (kinds == FULL).repeat_interleave(bq, 0).repeat_interleave(bk, 1)[None, None]
            else:
                b = torch.arange(self.batch).view(-1, 1, 1, 1)
                h = (g * self.hq + torch.arange(self.hq)).view(1, -1, 1, 1)
                qi = q_pos.clamp(max=s - 1).view(1, 1, -1, 1)
                ki = kv_pos.clamp(max=s - 1).view(1, 1, 1, -1)
                m = self.element(b, h, qi, ki)
                per = self.kinds_bh(g, torch.arange(qa0, qa0 + nq), blocks)
                if per is not None and not bool((per == PARTIAL).all()):  # the blocks decide outside PARTIAL ones
                    full, part = ((per == k).repeat_interleave(bq, 2).repeat_interleave(bk, 3) for k in (FULL, PARTIAL))
                    m = full | (part & m)
            # keep the smallest broadcast shape: a mask that ignores b or h stays size 1 there
            if bool((m == m[:1]).all()):
                m = m[:1]
            if bool((m == m[:, :1]).all()):
                m = m[:, :1]
            m = m & valid
        else:
            m = valid[None, None]
        mb, mh = m.shape[0], m.shape[1]
        r = self.num_heads // self.num_kv_heads
        m5 = m.reshape(mb, 1, 1, nq * bq, -1) if mh == 1 else m.reshape(mb, self.hk, r, nq * bq, -1)
        nbytes = m5.numel()
        if self.cache_bytes + nbytes <= MASK_CACHE_BYTES:
            self.mask_cache[key] = m5
            self.cache_bytes += nbytes
        return m5

    def kinds_bh(self, g: int, q_blocks: Tensor, kv_blocks: Tensor) -> Tensor | None:
        """int8 [B|1, hq, len(q_blocks), len(kv_blocks)]: the kinds of these blocks for every (batch, head) of group
        ``g`` (EMPTY past the mask), or None without the mask's pattern. A BlockMask means FULL, the mask_mod's
        verdict, and nothing in a FULL, PARTIAL and EMPTY block of that (batch, head): the merged kinds
        (``kind_gQK``) cannot say this where blocks differ between heads or batch entries, and a mask_mod need not
        be False outside its blocks (attn-gym's VSA masks use ``noop_mask``)."""
        if self.pattern is None:
            return None
        kind = self.pattern.kind_BGQK
        nqp, nkp = kind.shape[2:]
        groups = self.pattern.head_group_of
        heads = [groups[h] if groups is not None else 0 for h in range(g * self.hq, (g + 1) * self.hq)]
        qi, ki = q_blocks.long(), kv_blocks.long()
        at = kind[:, heads][:, :, qi.clamp(max=nqp - 1)][:, :, :, ki.clamp(max=nkp - 1)]
        return torch.where((qi < nqp)[:, None] & (ki < nkp)[None, :], at, torch.full_like(at, EMPTY))


def _view5(x: Tensor, hk: int) -> Tensor:
    """[B, Hq, L, D] -> [B, Hk, r, L, D] (a view)."""
    b, hq, ln, d = x.shape
    return x.view(b, hk, hq // hk, ln, d)


def _column_blocks(geo: TileGeometry, cols: list[int], kvs: list[tuple[Tensor, Tensor]]
                   ) -> tuple[Tensor, Tensor, Tensor]:
    """The row's K and V, fp32, as blocks [B, hk, blocks, bk, D], and each block's global KV block id."""
    k_cat = torch.cat([k for k, _ in kvs], dim=2).float()
    v_cat = torch.cat([v for _, v in kvs], dim=2).float()
    bsz, hk, _, d = k_cat.shape
    return (k_cat.view(bsz, hk, -1, geo.kv_block, d), v_cat.view(bsz, hk, -1, geo.kv_block, d),
            kv_block_ids(geo, cols))


def _mask_scores(geo: TileGeometry, g: int, qa0: int, nq: int, masked_ids: Tensor | None, s: Tensor, r: int
                 ) -> Tensor:
    """Scores ``s`` [B, hk, r*T, M] with -inf where the mask is False, in place (``masked_ids``: the KV block ids
    of the columns when their blocks need the mask evaluated, None when they are all FULL)."""
    if masked_ids is not None:
        m = geo._mask(g, qa0, nq, masked_ids).to(s.device)
        bsz, hk = s.shape[:2]
        s.view(bsz, hk, r, nq * geo.q_block, -1).masked_fill_(~m, -math.inf)
    return s


def _apply_score(geo: TileGeometry, g: int, qa0: int, nq: int, ids: Tensor, s: Tensor, score: list[Tensor]
                 ) -> Tensor:
    """The score_mod of scaled scores ``s`` [B, hk, r*T, M] (Q blocks ``qa0 ..``, KV blocks ``ids``): a new fp32
    tensor of that shape. The score_mod sees each score with its global (b, h, q_idx, kv_idx); positions in the
    padded tail are clamped to the last token (the mask removes them)."""
    sl, bq, bk, dev = geo.seq_len, geo.q_block, geo.kv_block, s.device
    q_pos = (qa0 * bq + torch.arange(nq * bq, device=dev)).clamp(max=sl - 1)
    kv_pos = (ids.to(dev)[:, None] * bk + torch.arange(bk, device=dev)).flatten().clamp(max=sl - 1)
    b = torch.arange(s.shape[0], device=dev)
    h = g * geo.hq + torch.arange(geo.hq, device=dev)
    fn = _score_fn(geo.score_mod, len(score))
    out = fn(s.view(s.shape[0], geo.hq, nq * bq, -1), b, h, q_pos, kv_pos, *score)
    return out.to(torch.float32).reshape(s.shape)


def row_forward(geo: TileGeometry, g: int, i: int, cols: list[int], q: Tensor, kvs: list[tuple[Tensor, Tensor]],
                scale: float, score: list[Tensor] = ()) -> tuple[Tensor, Tensor]:
    """Partial attention of Q chunk ``i`` (head group ``g``) over KV chunks ``cols``.

    Args:
        q: [B, hq, C, D] the row's queries (any float dtype).
        kvs: per column, (K, V) each [B, hk, C, D].
        score: the buffers of ``geo.score_mod`` (none without one).

    Returns:
        o fp32 [B, hq, C, D] (normalised) and lse fp32 [B, hq, C]; rows that attend nothing get
        o = 0 and lse = -inf.
    """
    if flex_tiles_on(geo):
        return flex_row_forward(geo, g, i, cols, q, kvs, scale)
    if _kernels_on(geo, q, list(score)):
        return kernel_row_forward(geo, row_block_lists(geo, g, i, cols, q.device).bwd_tensors(), q, kvs, scale,
                                  _score_args(geo, g, i, cols, list(score), q.device))
    c, bq, hk = geo.chunk, geo.q_block, geo.hk
    bsz, hq, _, d = q.shape
    r = hq // hk
    kb, vb, kv_ids = _column_blocks(geo, cols, kvs)
    q5 = _view5(q, hk)
    o = torch.zeros(bsz, hk, r, c, d, dtype=torch.float32, device=q.device)
    lse = torch.full((bsz, hk, r, c), -math.inf, dtype=torch.float32, device=q.device)
    nqb = c // bq
    pieces = geo.pieces(g, i, kv_ids)
    for n, (a, b, sel, need_mask) in enumerate(pieces):
        rows = slice(a * bq, b * bq)
        t = (b - a) * bq
        ks = kb[:, :, sel].reshape(bsz, hk, -1, d)
        vs = vb[:, :, sel].reshape(bsz, hk, -1, d)
        # [B, Hk, r*T, D]: the r query heads of a KV head share one matmul against it (GQA, no repeat)
        qs = (q5[:, :, :, rows].float() * scale).reshape(bsz, hk, r * t, d)
        s = torch.matmul(qs, ks.transpose(-1, -2))
        if geo.score_mod is not None:
            with eager_dispatch():
                s = _apply_score(geo, g, i * nqb + a, b - a, kv_ids[sel], s, list(score))
        s = _mask_scores(geo, g, i * nqb + a, b - a, kv_ids[sel] if need_mask else None, s, r)
        # [Note] one exp pass over the scores: subtract the row max, exponentiate in place, sum; the output is
        # normalised after the matmul (rows x D, not rows x keys) and lse = max + log(sum). (logsumexp, then
        # exp(s - lse), made a temporary the size of the scores and two exp passes: ~10% of a CPU forward step.)
        mx = s.amax(-1)
        mx = torch.where(torch.isinf(mx), torch.zeros_like(mx), mx)   # rows that attend nothing: exp(-inf) = 0
        tot = s.sub_(mx[..., None]).exp_().sum(-1)
        o_t = torch.matmul(s, vs).div_(torch.where(tot > 0, tot, torch.ones_like(tot))[..., None])
        part = (o_t.view(bsz, hk, r, t, d), (mx + torch.log(tot)).view(bsz, hk, r, t))
        del s
        if n and pieces[n - 1][:2] == (a, b):   # another column piece of the same rows: merge
            part = merge_partial((o[:, :, :, rows], lse[:, :, :, rows]), part)
        o[:, :, :, rows], lse[:, :, :, rows] = part
    return o.view(bsz, hq, c, d), lse.view(bsz, hq, c)


def row_backward(geo: TileGeometry, g: int, i: int, cols: list[int], q: Tensor, do: Tensor, lse: Tensor,
                 delta: Tensor, kvs: list[tuple[Tensor, Tensor]], scale: float, score: list[Tensor] = (),
                 ) -> tuple[Tensor, list[tuple[Tensor, Tensor]], list[Tensor]]:
    """Gradients of row ``i``'s tiles: dq fp32 [B, hq, C, D], per column (dK, dV) fp32 [B, hk, C, D], and the
    gradient of each score_mod buffer that wants one (``ScoreMod.wanted``; fp32, this row's part).

    ``lse`` is the GLOBAL log-sum-exp of the row and ``delta = rowsum(dO * O) - dLSE`` (fp32 [B, hq, C]).
    """
    c, bq, bk, hk = geo.chunk, geo.q_block, geo.kv_block, geo.hk
    if flex_tiles_on(geo):
        return flex_row_backward(geo, g, i, cols, q, do, lse, delta, kvs, scale)
    if _kernels_on(geo, q, list(score)):
        lay = row_block_lists(geo, g, i, cols, q.device).bwd_tensors()
        return kernel_row_backward(geo, lay, q, do, lse, delta, kvs, scale,
                                   _score_args(geo, g, i, cols, list(score), q.device))
    bsz, hq, _, d = q.shape
    r = hq // hk
    kb, vb, kv_ids = _column_blocks(geo, cols, kvs)
    dkb = torch.zeros_like(kb)
    dvb = torch.zeros_like(vb)
    q5, do5 = _view5(q, hk), _view5(do, hk)
    lse5 = lse.view(bsz, hk, r, c)
    lse5 = torch.where(torch.isinf(lse5), torch.zeros_like(lse5), lse5)
    delta5 = delta.view(bsz, hk, r, c)
    dq = torch.zeros(bsz, hk, r, c, d, dtype=torch.float32, device=q.device)
    wanted = geo.score_mod.wanted if geo.score_mod is not None else []
    dbufs = [torch.zeros(score[n].shape, dtype=torch.float32, device=score[n].device) for n in wanted]
    nqb = c // bq
    for a, b, sel, need_mask in geo.pieces(g, i, kv_ids):   # column pieces of a row sum into dq
        rows = slice(a * bq, b * bq)
        t = (b - a) * bq
        m_sel = sel.numel()
        ks = kb[:, :, sel].reshape(bsz, hk, -1, d)
        vs = vb[:, :, sel].reshape(bsz, hk, -1, d)
        qs = (q5[:, :, :, rows].float() * scale).reshape(bsz, hk, r * t, d)
        dos = do5[:, :, :, rows].float().reshape(bsz, hk, r * t, d)
        s = torch.matmul(qs, ks.transpose(-1, -2))
        if geo.score_mod is not None:   # the score_mod recorded by autograd, for its gradient below
            with eager_dispatch(), torch.enable_grad():
                raw = s.requires_grad_()
                bufs = [x.detach().requires_grad_(n in wanted) for n, x in enumerate(score)]
                modded = _apply_score(geo, g, i * nqb + a, b - a, kv_ids[sel], raw, bufs)
            s = modded.detach().clone()
        s = _mask_scores(geo, g, i * nqb + a, b - a, kv_ids[sel] if need_mask else None, s, r)
        p = s.sub_(lse5[:, :, :, rows].reshape(bsz, hk, r * t, 1)).exp_()       # P with the GLOBAL lse
        dv = torch.matmul(p.transpose(-1, -2), dos)                              # sums the r heads
        ds = torch.matmul(dos, vs.transpose(-1, -2))
        ds.sub_(delta5[:, :, :, rows].reshape(bsz, hk, r * t, 1)).mul_(p)       # P * (dP - delta)
        if geo.score_mod is not None:   # through the score_mod: d raw score, and its buffers' part
            with eager_dispatch():
                got = torch.autograd.grad(modded, [raw, *(bufs[n] for n in wanted)], ds, allow_unused=True)
            ds = torch.zeros_like(ds) if got[0] is None else got[0]
            for acc, gb in zip(dbufs, got[1:]):
                if gb is not None:
                    acc += gb
        dq[:, :, :, rows] += (torch.matmul(ds, ks) * scale).view(bsz, hk, r, t, d)
        dk = torch.matmul(ds.transpose(-1, -2), qs)                              # qs carries the scale
        dkb.index_add_(2, sel.to(dkb.device), dk.view(bsz, hk, m_sel, bk, d))
        dvb.index_add_(2, sel.to(dvb.device), dv.view(bsz, hk, m_sel, bk, d))
    dk_cat = dkb.view(bsz, hk, -1, d)
    dv_cat = dvb.view(bsz, hk, -1, d)
    per_col = [(dk_cat[:, :, n * c:(n + 1) * c], dv_cat[:, :, n * c:(n + 1) * c]) for n in range(len(cols))]
    return dq.view(bsz, hq, c, d), per_col, dbufs


def merge_partial(acc: tuple[Tensor, Tensor] | None, part: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    """Merge two normalised partials ``(o, lse)`` (fp32) in the stable log-sum-exp form.

    ``lse = max + log(exp(a - max) + exp(b - max))`` never exponentiates a positive number;
    rows where both sides are -inf stay (0, -inf) without NaN.
    """
    if acc is None:
        return part
    o_a, l_a = acc
    o_b, l_b = part
    mx = torch.maximum(l_a, l_b)
    mx_safe = torch.where(torch.isinf(mx), torch.zeros_like(mx), mx)
    w_a = torch.exp(l_a - mx_safe)
    w_b = torch.exp(l_b - mx_safe)
    tot = w_a + w_b
    lse = mx_safe + torch.log(tot)
    tot_safe = torch.where(tot > 0, tot, torch.ones_like(tot))
    o = (o_a * (w_a / tot_safe)[..., None]) + (o_b * (w_b / tot_safe)[..., None])
    return o, lse
