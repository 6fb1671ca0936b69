"""Tile rows on kernels: ours (the block-sparse Triton kernels, ``kernels/``) and FlexAttention's.

``runtime/tiles.py`` runs a row in plain torch; where kernels serve (on CUDA, or under Triton's interpreter when
asked for), it hands the row to a function here. Coordinates are the row's own: queries ``0..chunk`` of the row's
Q chunk, keys the row's KV chunks concatenated in column order (``row_block_lists``); a score_mod reaches our kernels
as generated Triton functions with the global offsets (``_score_args``). With ``ULTRAATTN_TILE_KERNEL=flex`` a row
with a mask_mod and no score_mod runs on FlexAttention instead (``kernels/flex_tile.py``), with the same lists and
the site's mask_mod shifted to the row.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..cache import LRU, process_state
from ..eager import eager_dispatch
from ..masks.pattern import FULL, PARTIAL, BlockPattern

Geometry = object
"""What ``geo`` is here: the plan's ``runtime.tiles.TileGeometry`` (not imported: ``tiles.py`` imports this module,
and the import graph stays one-way)."""


def _kernels_on(geo: Geometry, t: Tensor, score: list[Tensor]) -> bool:
    """Whether ``t``'s tiles run on the Triton kernels: on CUDA (or the interpreter when asked for), and with a
    score_mod only when it has a Triton translation (``score_kernels``)."""
    from ..kernels.ops import uses_triton

    if not uses_triton(t):
        return False
    return geo.score_mod is None or score_kernels(geo.score_mod, score) is not None


_SCORE_KERNELS: LRU = process_state("runtime: the score_mods' generated Triton functions", LRU(64))
"""(ScoreMod, buffer shapes and dtypes) -> its generated Triton functions, or None where there are none."""
_NONE = object()


def score_kernels(score_mod, buffers: list[Tensor]):
    """The score_mod's generated Triton functions (``kernels.score_codegen``) for these buffers, or None (with one
    warning naming the reason) when it has no translation: its tiles then take the plain-torch path."""
    key = (score_mod, tuple((tuple(t.shape), t.dtype) for t in buffers))
    hit = _SCORE_KERNELS.get(key, _NONE)
    if hit is not _NONE:
        return hit
    from ..kernels.score_codegen import Unsupported, generate

    try:
        with eager_dispatch():
            got = generate(score_mod.fn, [t.detach() for t in buffers], score_mod.grads)
    except Unsupported as e:
        import warnings

        warnings.warn(f"ultraattn: a score_mod has no Triton translation ({e}); its tiles run on the plain-torch "
                      f"path, which is exact but slower on a GPU", stacklevel=2)
        got = None
    _SCORE_KERNELS.put(key, got)
    return got


def kv_block_ids(geo: Geometry, cols: list[int]) -> Tensor:
    """Global KV block id of each block of the KV chunks ``cols`` concatenated (a row's keys, in column order)."""
    nbk = geo.chunk // geo.kv_block
    return torch.cat([j * nbk + torch.arange(nbk) for j in cols])


def kv_positions(geo: Geometry, cols: list[int]) -> Tensor:
    """Global key position of each key of the KV chunks ``cols`` concatenated (int64, on the CPU)."""
    bk = geo.kv_block
    return (kv_block_ids(geo, cols)[:, None] * bk + torch.arange(bk)).flatten()


def _score_args(geo: Geometry, g: int, i: int, cols: list[int], score: list[Tensor], device: torch.device):
    """The kernels' ``ScoreArgs`` for row ``i`` (head group ``g``) against KV chunks ``cols``, or None without a
    score_mod."""
    if geo.score_mod is None:
        return None
    from ..kernels.ops import ScoreArgs

    key = ("kv_pos", tuple(cols), str(device))
    kv_pos = geo.mask_cache.get(key)
    if kv_pos is None:
        kv_pos = geo.mask_cache[key] = (kv_block_ids(geo, cols) * geo.kv_block).to(torch.int32).to(device)
    kernels = score_kernels(geo.score_mod, score)
    key = ("score constants", str(device))   # (moved to the device once, not at every launch)
    hit = geo.mask_cache.get(key)
    if hit is None or hit[0] is not kernels:
        hit = geo.mask_cache[key] = (kernels, [c.to(device) for c in kernels.constants])
    return ScoreArgs(kernels=kernels, buffers=list(score), constants=hit[1], kv_pos=kv_pos, q0=i * geo.chunk,
                     h0=g * geo.hq, seq_len=geo.seq_len)


def row_block_lists(geo: Geometry, g: int, i: int, cols: list[int], device: torch.device):
    """The kernels' block lists of row ``i`` (head group ``g``) against the concatenated KV chunks ``cols`` (cached).

    Coordinates are the row's: queries ``0..chunk``, keys ``0..len(cols)*chunk`` in column order.
    Cells touching the padded tail are PARTIAL so their bits exclude the padding.
    """
    key = ("kernel", g, i, tuple(cols), str(device))
    hit = geo.mask_cache.get(key)
    if hit is not None:
        return hit
    from ..kernels.block_lists import block_lists_from_pattern

    c, bq, bk, s = geo.chunk, geo.q_block, geo.kv_block, geo.seq_len
    nqb = c // bq
    kv_ids = kv_block_ids(geo, cols)
    per = geo.kinds_bh(g, i * nqb + torch.arange(nqb), kv_ids)  # per (batch, head): the block lists are exact per head
    kinds = (geo.kind_gQK[g][i * nqb:(i + 1) * nqb][:, kv_ids][None, None] if per is None else per).clone()
    touch = ((i * nqb + torch.arange(nqb) + 1) * bq > s)[:, None] | ((kv_ids + 1) * bk > s)[None, :]
    kinds[(kinds == FULL) & touch] = PARTIAL
    kv_pos = kv_positions(geo, cols)
    element, h0 = geo.element, g * geo.hq

    def row_mask(b, h, q_local, kv_local):
        gq, gk = i * c + q_local, kv_pos[kv_local]
        ok = (gq < s) & (gk < s)
        if element is None:
            return ok
        return ok & element(b, h + h0, gq.clamp(max=s - 1), gk.clamp(max=s - 1))

    pattern = BlockPattern(kind_BGQK=kinds.to(torch.int8), count_BGQK=torch.zeros(kinds.shape, dtype=torch.int64),
                           q_len=c, kv_len=kv_ids.numel() * bk, q_block=bq, kv_block=bk, name="row",
                           head_group_of=None if per is None else tuple(range(geo.hq)))
    lay = block_lists_from_pattern(pattern, row_mask, batch=geo.batch, num_heads=geo.hq, device=device)
    geo.mask_cache[key] = lay
    return lay


def flex_tiles_on(geo: Geometry) -> bool:
    """Whether rows run on FlexAttention (``kernels/flex_tile.py``): asked for (``ULTRAATTN_TILE_KERNEL=flex``), no
    score_mod (ours is generated into our kernels), and a mask_mod to hand it (a mask known by its bits alone would
    need our bit tiles read per element: 0.2-0.5x flex's speed on an H200)."""
    from ..kernels.config import tile_kernel

    return tile_kernel() == "flex" and geo.score_mod is None and geo.element is not None


def flex_row_mask(geo: Geometry, g: int, i: int, cols: list[int], device: torch.device):
    """FlexAttention's BlockMask of row ``i`` (head group ``g``) against the KV chunks ``cols`` (cached): the lists of
    ``row_block_lists``, and the site's mask_mod in global coordinates. Offsets are tensors the mask_mod closes over,
    so every row of a site is one compiled flex kernel (Python ints would be guarded constants: one compile per
    row)."""
    key = ("flex", g, i, tuple(cols), str(device))
    hit = geo.mask_cache.get(key)
    if hit is not None:
        return hit
    from ..kernels.flex_tile import block_mask_of

    lists = row_block_lists(geo, g, i, cols, device)
    s, mask_mod = geo.seq_len, geo.element.mask_mod   # (as written: FlexAttention compiles it)
    kv_pos = kv_positions(geo, cols).to(torch.int32).to(device)
    q0 = torch.tensor(i * geo.chunk, dtype=torch.int32, device=device)
    h0 = torch.tensor(g * geo.hq, dtype=torch.int32, device=device)

    def row_mask(b, h, q_local, kv_local):
        gq, gk = q0 + q_local, kv_pos[kv_local]
        inside = (gq < s) & (gk < s)
        return inside & mask_mod(b, h + h0, torch.clamp(gq, max=s - 1), torch.clamp(gk, max=s - 1))

    bm = geo.mask_cache[key] = block_mask_of(lists, row_mask)
    return bm


def flex_row_forward(geo: Geometry, g: int, i: int, cols: list[int], q: Tensor, kvs: list[tuple[Tensor, Tensor]],
                     scale: float) -> tuple[Tensor, Tensor]:
    """``row_forward`` on FlexAttention (fp32 out, as every row path returns)."""
    from ..kernels.flex_tile import flex_forward

    k_cat, v_cat = _kv_cat(kvs, q.dtype)
    with eager_dispatch():  # (a BlockMask's lists are built with vmap, and eager flex evaluates masks with it)
        o, lse = flex_forward(q, k_cat, v_cat, flex_row_mask(geo, g, i, cols, q.device), scale)
    return o.float(), lse


def flex_row_backward(geo: Geometry, g: int, i: int, cols: list[int], q: Tensor, do: Tensor, lse: Tensor,
                      delta: Tensor, kvs: list[tuple[Tensor, Tensor]], scale: float,
                      ) -> tuple[Tensor, list[tuple[Tensor, Tensor]], list[Tensor]]:
    """``row_backward`` on FlexAttention: dq and per column (dK, dV), fp32."""
    from ..kernels.flex_tile import flex_backward

    k_cat, v_cat = _kv_cat(kvs, q.dtype)
    with eager_dispatch():  # (vmap, and on CUDA flex's autograd)
        dq, dk_cat, dv_cat = flex_backward(q, k_cat, v_cat, lse, delta, do,
                                           flex_row_mask(geo, g, i, cols, q.device), scale)
    c = geo.chunk
    return dq.float(), [(dk_cat[:, :, n * c:(n + 1) * c].float(), dv_cat[:, :, n * c:(n + 1) * c].float())
                        for n in range(len(kvs))], []


def _kv_cat(kvs: list[tuple[Tensor, Tensor]], dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    return (torch.cat([k for k, _ in kvs], dim=2).to(dtype), torch.cat([v for _, v in kvs], dim=2).to(dtype))


def kernel_row_forward(geo: Geometry, lay: tuple[Tensor, ...], q: Tensor, kvs: list[tuple[Tensor, Tensor]],
                       scale: float, score=None) -> tuple[Tensor, Tensor]:
    """``row_forward`` on the block-sparse kernel op, given the row's ``row_block_lists`` tensors (fp32 out);
    with a score_mod (``score``: the row's ``ScoreArgs``) on the plain kernel launch that takes one."""
    k_cat, v_cat = _kv_cat(kvs, q.dtype)
    if score is not None:
        from ..kernels.ops import score_fwd

        return score_fwd(q, k_cat, v_cat, lay, geo.q_block, geo.kv_block, scale, score)
    return torch.ops.ultraattn.bsa_fwd(q, k_cat, v_cat, *lay, geo.q_block, geo.kv_block, scale, True)


def kernel_row_backward(geo: Geometry, lay: tuple[Tensor, ...], q: Tensor, do: Tensor, lse: Tensor,
                        delta: Tensor, kvs: list[tuple[Tensor, Tensor]], scale: float, score=None,
                        ) -> tuple[Tensor, list[tuple[Tensor, Tensor]], list[Tensor]]:
    """``row_backward`` on the block-sparse kernels: dq, per column (dK, dV), and the wanted score_mod buffers'
    gradients, fp32."""
    k_cat, v_cat = _kv_cat(kvs, q.dtype)
    dbufs: list[Tensor] = []
    if score is not None:
        from ..kernels.ops import score_bwd

        dq, dk_cat, dv_cat, dbufs = score_bwd(q, k_cat, v_cat, do, lse, delta, lay, geo.q_block, geo.kv_block,
                                              scale, score, geo.score_mod.wanted)
    else:
        dq, dk_cat, dv_cat = torch.ops.ultraattn.bsa_bwd(q, k_cat, v_cat, do, lse, delta, None, *lay, geo.q_block,
                                                         geo.kv_block, scale, True)
    c = geo.chunk
    return dq, [(dk_cat[:, :, n * c:(n + 1) * c], dv_cat[:, :, n * c:(n + 1) * c]) for n in range(len(kvs))], dbufs
