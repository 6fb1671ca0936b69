"""Constructors of ``BlockPattern`` from the ways a user can express an attention mask.

* ``pattern_from_mask_mod``: a FlexAttention mask_mod plus lengths. Factory masks
  (``ultraattn.masks.factories``) carry an exact analytic counter ``count_pairs`` and build
  patterns at any length (S = 2M tokens included); other mask_mods are evaluated densely.
* ``pattern_from_block_mask``: a FlexAttention ``BlockMask``.
* ``pattern_from_dense``: a boolean mask tensor ``[Q, K]`` or ``[B, H, Q, K]``.
* ``pattern_from_is_causal`` / ``pattern_from_full``: SDPA's ``is_causal=True`` / no mask.
* ``to_block_pattern``: dispatch on any of the above.

Cell kinds follow the token counts: EMPTY if no pair attends, FULL if every pair of the cell
(at its real size) attends, PARTIAL otherwise.

Caution (tail blocks): when a length is not a multiple of the block size, FlexAttention's
``create_block_mask`` pads the dense mask with False up to whole blocks and calls a block full
only when all ``Q_BLOCK * KV_BLOCK`` pairs attend, so a tail cell (last row or column of blocks)
is never FULL there: it is PARTIAL even when every real pair attends. Here such a cell is FULL
(its count equals its real area), as ``BlockPattern`` documents; the two grids agree on every
other cell. Kernels must bound-check tail blocks anyway, so FULL only means "no mask_mod".

Legend (shape suffixes): B batch entries, H heads, G head pattern groups, Q query blocks,
K key/value blocks, N cells in a list, R query rows, T tokens.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex
from torch.nn.attention.flex_attention import BlockMask

from ultraattn.eager import eager_dispatch
from ultraattn.masks.factories import MaskKind, generate_causal, generate_full
from ultraattn.masks.pattern import EMPTY, FULL, PARTIAL, BlockPattern

__all__ = [
    "pattern_from_mask_mod",
    "pattern_from_block_mask",
    "pattern_from_dense",
    "pattern_from_is_causal",
    "pattern_from_full",
    "to_block_pattern",
]

#: largest q_len * kv_len * batch * heads evaluated densely for a mask_mod without a counter
MAX_DENSE_PAIRS = 2**31
#: largest total PARTIAL-cell area evaluated exactly by ``pattern_from_block_mask``
MAX_PARTIAL_EVAL_PAIRS = 2**28
#: elements per vectorised step (about an L2 cache of int64: much faster than huge tensors)
_STEP = 2**17
#: grids with at most this many cells are counted directly; larger ones coarse-to-fine
_DIRECT_CELLS = 2**18
#: coarse grid side used to skip EMPTY / FULL regions of large grids
_COARSE_SIDE = 256


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _check_len(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"`{name}` must be an int, got {value!r}")
    if value <= 0:
        raise ValueError(f"`{name}` must be positive, got {value}")
    return value


def _blocks(block_size: int | tuple[int, int]) -> tuple[int, int]:
    if isinstance(block_size, tuple):
        if len(block_size) != 2:
            raise ValueError(f"`block_size` must be an int or a (q_block, kv_block) pair, got {block_size!r}")
        return _check_len("block_size", block_size[0]), _check_len("block_size", block_size[1])
    b = _check_len("block_size", block_size)
    return b, b


def _edges(n: int, block: int) -> Tensor:
    """int64 [cdiv(n, block) + 1]: block boundaries, the last one clipped to n."""
    return (torch.arange(_cdiv(n, block) + 1, dtype=torch.int64) * block).clamp(max=n)


def _kind_from_count(count: Tensor, area: Tensor) -> Tensor:
    kind = torch.full(count.shape, PARTIAL, dtype=torch.int8)
    kind[count == 0] = EMPTY
    kind[count == area] = FULL
    return kind


# ----------------------------------------------------------------------------- mask evaluation
def eval_mask(mask_mod: Callable, b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
    """Evaluate a mask_mod on broadcastable index tensors: bool of their broadcast shape, on their device.

    Most mask_mods are plain elementwise torch code and take broadcast tensors directly; the
    others (written for 0-d inputs, e.g. with ``torch.where`` on scalars or indexing that needs
    FlexAttention's ``vmap`` treatment) are evaluated with ``vmap`` over the flattened indices,
    as ``create_mask`` does.

    A mask_mod whose tables live on another device than the indices (a document mask built for CUDA, as flex on a
    GPU needs, evaluated on CPU indices; or the reverse) is evaluated there, and its result brought back. The
    result is always on the indices' device: indexing a CUDA table with CPU indices succeeds and answers on CUDA,
    which every caller would otherwise meet as a device mismatch of its own (issue 51: ``_count_partial_cells``
    with transformers' flex masks on an H100).
    """
    try:
        return _eval_mask(mask_mod, b, h, q, kv).to(q.device)
    except RuntimeError as exc:
        other = _other_device(q.device)
        if other is None or "device" not in str(exc):
            raise
        out = _eval_mask(mask_mod, *(x.to(other) for x in (b, h, q, kv)))
        return out.to(q.device)


def _other_device(device: torch.device) -> torch.device | None:
    """Where else a mask_mod's tables may live: the current CUDA device for CPU indices, the CPU for others."""
    if device.type != "cpu":
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None


def _eval_mask(mask_mod: Callable, b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
    shape = torch.broadcast_shapes(b.shape, h.shape, q.shape, kv.shape)
    try:
        out = mask_mod(b, h, q, kv)
        if isinstance(out, Tensor) and out.dtype == torch.bool and torch.broadcast_shapes(out.shape, shape) == shape:
            return out.expand(shape)
    except Exception:  # noqa: BLE001 - any failure: retry the FlexAttention way
        pass
    flat = [x.expand(shape).reshape(-1) for x in (b, h, q, kv)]
    with eager_dispatch(), TransformGetItemToIndex():  # (inside a custom op, vmap needs the eager keys back)
        out = torch.vmap(mask_mod)(*flat)
    return out.to(torch.bool).reshape(shape)


# ----------------------------------------------------------------------------- counter path
def _count_cells(counter: Callable, b: int, q0: Tensor, q1: Tensor, k0: Tensor, k1: Tensor) -> Tensor:
    """Counter over a list of cells (flat int64 [N] rectangles), in cache-sized steps."""
    out = torch.empty(q0.shape, dtype=torch.int64)
    for s in range(0, q0.numel(), _STEP):
        e = s + _STEP
        out[s:e] = counter(q0[s:e], q1[s:e], k0[s:e], k1[s:e], b=b)
    return out


def _count_grid_direct(counter: Callable, b: int, qe: Tensor, ke: Tensor) -> Tensor:
    """Counter over the full grid given by edges, row chunk by row chunk."""
    nq, nk = qe.numel() - 1, ke.numel() - 1
    out = torch.empty((nq, nk), dtype=torch.int64)
    rows = max(1, _STEP // nk)
    q0, q1, k0, k1 = qe[:-1, None], qe[1:, None], ke[None, :-1], ke[None, 1:]
    for r in range(0, nq, rows):
        out[r : r + rows] = counter(q0[r : r + rows], q1[r : r + rows], k0, k1, b=b)
    return out


def _counted_grid(counter: Callable, b: int, qe: Tensor, ke: Tensor) -> tuple[Tensor, Tensor]:
    """(kind_QK, count_QK) for one batch entry from an exact rectangle counter.

    [Note] Large grids go coarse to fine: the counter first classifies super-cells of F x F cells;
    an EMPTY super-cell has only EMPTY cells and a FULL one only FULL cells (exactly), so only
    the PARTIAL super-cells (the boundaries of the pattern) are counted cell by cell. This keeps
    2M-token patterns with 16K x 16K cells cheap: their cost is the output's size, not the
    counter's.
    """
    nq, nk = qe.numel() - 1, ke.numel() - 1
    qs_Q, ks_K = qe.diff(), ke.diff()
    if nq * nk <= _DIRECT_CELLS:
        count_QK = _count_grid_direct(counter, b, qe, ke)
        return _kind_from_count(count_QK, qs_Q[:, None] * ks_K[None, :]), count_QK
    f = _cdiv(max(nq, nk), _COARSE_SIDE)
    sqe = qe[(torch.arange(_cdiv(nq, f) + 1) * f).clamp(max=nq)]
    ske = ke[(torch.arange(_cdiv(nk, f) + 1) * f).clamp(max=nk)]
    skind = _kind_from_count(_count_grid_direct(counter, b, sqe, ske), sqe.diff()[:, None] * ske.diff()[None, :])
    sq, sk = skind.shape
    kind_QK = skind[:, None, :, None].expand(sq, f, sk, f).reshape(sq * f, sk * f)[:nq, :nk].contiguous()
    # FULL cells: their area; EMPTY and (for now) PARTIAL cells: 0. Only the last row and column
    # of blocks can be smaller than q_block x kv_block.
    full_QK = kind_QK == FULL
    count_QK = full_QK.to(torch.int64).mul_(int(qs_Q[0] * ks_K[0]))  # (faster than torch.where)
    count_QK[-1] = full_QK[-1] * (qs_Q[-1] * ks_K)
    count_QK[:, -1] = full_QK[:, -1] * (qs_Q * ks_K[-1])
    sup = torch.nonzero(skind == PARTIAL)
    if sup.numel():
        # Rows/cols past the grid end are clamped onto the last one: those duplicates recount
        # the same cell and write the same value.
        ar = torch.arange(f)
        rows_NF = (sup[:, :1] * f + ar).clamp(max=nq - 1)
        cols_NF = (sup[:, 1:] * f + ar).clamp(max=nk - 1)
        per = max(1, _STEP // (f * f))
        for s in range(0, rows_NF.shape[0], per):
            r_NF1 = rows_NF[s : s + per, :, None]
            c_N1F = cols_NF[s : s + per, None, :]
            cnt = counter(qe[r_NF1], qe[r_NF1 + 1], ke[c_N1F], ke[c_N1F + 1], b=b)
            count_QK[r_NF1, c_N1F] = cnt
            kind_QK[r_NF1, c_N1F] = _kind_from_count(cnt, qs_Q[r_NF1] * ks_K[c_N1F])
    return kind_QK, count_QK


# ----------------------------------------------------------------------------- dense path
def _dense_counts(mask_mod: Callable, q_len: int, kv_len: int, qb: int, kb: int, batch: int, num_heads: int) -> Tensor:
    """int64 [B, H, Q, K]: attending pairs per cell by evaluating the mask in row tiles."""
    nq, nk = _cdiv(q_len, qb), _cdiv(kv_len, kb)
    b_B111 = torch.arange(batch)[:, None, None, None]
    h_1H11 = torch.arange(num_heads)[None, :, None, None]
    kv_111T = torch.arange(kv_len)[None, None, None, :]
    out = torch.empty((batch, num_heads, nq, nk), dtype=torch.int64)
    rows = max(qb, (2**23 // max(1, kv_len * batch * num_heads)) // qb * qb)
    pad_k = nk * kb - kv_len
    for r in range(0, q_len, rows):
        r1 = min(q_len, r + rows)
        q_11R1 = torch.arange(r, r1)[None, None, :, None]
        m = eval_mask(mask_mod, b_B111, h_1H11, q_11R1, kv_111T)
        m = torch.nn.functional.pad(m, (0, pad_k, 0, _cdiv(r1 - r, qb) * qb - (r1 - r)))
        cnt = m.reshape(batch, num_heads, -1, qb, nk, kb).sum(dim=(3, 5))
        out[:, :, r // qb : r // qb + cnt.shape[2]] = cnt
    return out


def _group(
    count_BHQK: Tensor, area_QK: Tensor, kind_BHQK: Tensor | None = None
) -> tuple[Tensor, Tensor, tuple[int, ...] | None]:
    """Collapse identical batch entries (to B = 1) and group heads with identical patterns.

    Kinds follow the counts unless ``kind_BHQK`` is given (then both must agree for two heads or
    batch entries to merge). Heads are grouped on their counts, so heads with equal kind grids but
    different PARTIAL counts are different groups: a group has one count grid.
    """
    if kind_BHQK is None:
        kind_BHQK = _kind_from_count(count_BHQK, area_QK)

    def same(x: tuple[Tensor, Tensor], y: tuple[Tensor, Tensor]) -> bool:
        return torch.equal(x[0], y[0]) and torch.equal(x[1], y[1])

    if all(same((count_BHQK[0], kind_BHQK[0]), (count_BHQK[i], kind_BHQK[i])) for i in range(1, count_BHQK.shape[0])):
        count_BHQK, kind_BHQK = count_BHQK[:1], kind_BHQK[:1]
    reps: list[tuple[Tensor, Tensor]] = []
    group_of: list[int] = []
    for h in range(count_BHQK.shape[1]):
        cur = (count_BHQK[:, h], kind_BHQK[:, h])
        for g, rep in enumerate(reps):
            if same(rep, cur):
                group_of.append(g)
                break
        else:
            group_of.append(len(reps))
            reps.append(cur)
    count_BGQK = torch.stack([r[0] for r in reps], dim=1).contiguous()
    kind_BGQK = torch.stack([r[1] for r in reps], dim=1).contiguous()
    return kind_BGQK, count_BGQK, (tuple(group_of) if len(reps) > 1 else None)


# ----------------------------------------------------------------------------- public API
def pattern_from_mask_mod(
    mask_mod: Callable,
    q_len: int,
    kv_len: int | None = None,
    *,
    block_size: int | tuple[int, int] = 128,
    batch: int = 1,
    num_heads: int = 1,
    name: str | None = None,
) -> BlockPattern:
    """Block pattern of a FlexAttention mask_mod.

    A mask_mod with an exact counter (``mask_mod.count_pairs``, every factory mask) is counted
    analytically at any length; it is head-independent (G = 1) and has ``mask_mod.num_batch``
    batch patterns (collapsed to B = 1 when they are identical). Any other mask_mod is evaluated
    densely for every batch entry ``b < batch`` and head ``h < num_heads``; identical batch
    entries collapse and heads with identical patterns share a group (``head_group_of``).

    Args:
        mask_mod: ``mask_mod(b, h, q_idx, kv_idx) -> bool``.
        q_len: query tokens.
        kv_len: key/value tokens (default: ``q_len``).
        block_size: block size in tokens, or a ``(q_block, kv_block)`` pair.
        batch: batch entries to evaluate (a per-batch factory mask needs 1 or its ``num_batch``).
        num_heads: heads to evaluate (mask_mods without a counter).
        name: pattern name (default: ``mask_mod.__name__``).

    Returns:
        The ``BlockPattern``.

    Raises:
        TypeError: ``mask_mod`` is not callable.
        ValueError: bad lengths or sizes, a batch that does not fit a per-batch mask, or a mask
            without counter too large to evaluate densely.
    """
    if not callable(mask_mod):
        raise TypeError(f"`mask_mod` must be callable as mask_mod(b, h, q_idx, kv_idx), got {type(mask_mod).__name__}")
    q_len = _check_len("q_len", q_len)
    kv_len = q_len if kv_len is None else _check_len("kv_len", kv_len)
    batch = _check_len("batch", batch)
    num_heads = _check_len("num_heads", num_heads)
    qb, kb = _blocks(block_size)
    qe, ke = _edges(q_len, qb), _edges(kv_len, kb)
    name = name if name is not None else getattr(mask_mod, "__name__", "custom")
    counter = getattr(mask_mod, "count_pairs", None)
    if counter is not None:
        nb = getattr(mask_mod, "num_batch", 1)
        if nb > 1 and batch not in (1, nb):
            raise ValueError(f"`batch` must be 1 or {nb} (the per-batch entries of {name}), got {batch}")
        grids = [_counted_grid(counter, b, qe, ke) for b in range(nb)]
        if all(torch.equal(grids[0][1], g[1]) for g in grids[1:]):
            grids = grids[:1]
        return BlockPattern(  # (stacking copies; one grid is just viewed as [1, 1, Q, K])
            kind_BGQK=grids[0][0][None, None] if len(grids) == 1 else torch.stack([g[0] for g in grids])[:, None],
            count_BGQK=grids[0][1][None, None] if len(grids) == 1 else torch.stack([g[1] for g in grids])[:, None],
            q_len=q_len, kv_len=kv_len, q_block=qb, kv_block=kb, name=name,
        )
    pairs = q_len * kv_len * batch * num_heads
    if pairs > MAX_DENSE_PAIRS:
        raise ValueError(
            f"mask_mod {name!r} has no analytic counter (`count_pairs`), so it must be evaluated densely, "
            f"but q_len * kv_len * batch * num_heads = {pairs} exceeds {MAX_DENSE_PAIRS}; use a shorter "
            f"sequence or a factory mask from ultraattn.masks.factories (composed masks are dense)"
        )
    count_BHQK = _dense_counts(mask_mod, q_len, kv_len, qb, kb, batch, num_heads)
    kind, count, group_of = _group(count_BHQK, qe.diff()[:, None] * ke.diff()[None, :])
    return BlockPattern(kind_BGQK=kind, count_BGQK=count, q_len=q_len, kv_len=kv_len, q_block=qb, kv_block=kb,
                        head_group_of=group_of, name=name)


def _ordered_to_dense_BHQK(num_BHQ: Tensor, idx_BHQX: Tensor, nq: int, nk: int) -> Tensor:
    """bool [B, H, nq, nk] from FlexAttention's (num_blocks, indices) rows (extra rows/cols dropped)."""
    valid = torch.arange(idx_BHQX.shape[-1], device=idx_BHQX.device) < num_BHQ[..., None].long()
    idx = torch.where(valid & (idx_BHQX.long() < nk), idx_BHQX.long(), nk)
    dense = torch.zeros((*idx.shape[:-1], nk + 1), dtype=torch.bool, device=idx.device)
    dense.scatter_(-1, idx, True)
    dense = dense[..., :nk]
    if dense.shape[-2] < nq:
        dense = torch.nn.functional.pad(dense, (0, 0, 0, nq - dense.shape[-2]))
    return dense[..., :nq, :]


def pattern_from_block_mask(block_mask: BlockMask, *, count: bool = True) -> BlockPattern:
    """Block pattern of a FlexAttention ``BlockMask``.

    Cells listed in ``kv_indices[:kv_num_blocks]`` are PARTIAL, in
    ``full_kv_indices[:full_kv_num_blocks]`` FULL (``create_block_mask`` only fills ``full_kv_*``
    with ``separate_full_blocks=True``, its default), the rest EMPTY; batch and head dimensions of
    size 1 broadcast.

    A ``BlockMask`` carries no pair counts. PARTIAL cells are counted exactly with
    ``block_mask.mask_mod``: analytically when it has a counter (factory masks, any size), else
    by evaluating it over the PARTIAL cells only when their total area is at most
    ``MAX_PARTIAL_EVAL_PAIRS`` (2**28). Exactly counted cells are then re-classified by their
    counts (a PARTIAL cell whose pairs all attend, e.g. a tail cell, becomes FULL; one with none
    EMPTY). Caution: past that limit a PARTIAL cell's count is its area, an upper estimate, and
    it stays PARTIAL. ``count=False`` takes that path at any size: the BlockMask's own kinds, read
    from its index lists without evaluating the mask_mod (what a plan that needs only kinds reads).

    Returns:
        The ``BlockPattern``: identical batch entries collapse to B = 1, heads with identical
        patterns share a group.

    Raises:
        TypeError: ``block_mask`` is not a ``BlockMask``.
    """
    if not isinstance(block_mask, BlockMask):
        raise TypeError(
            f"`block_mask` must be a torch.nn.attention.flex_attention.BlockMask, got {type(block_mask).__name__}"
        )
    q_len, kv_len = (int(x) for x in block_mask.seq_lengths)
    qb, kb = (int(x) for x in block_mask.BLOCK_SIZE)
    qe, ke = _edges(q_len, qb), _edges(kv_len, kb)
    area_QK = qe.diff()[:, None] * ke.diff()[None, :]
    partial, full = _block_mask_kinds(block_mask, qe.numel() - 1, ke.numel() - 1)
    count_BHQK = torch.where(full | partial, area_QK, 0)
    mask_mod = block_mask.mask_mod
    cells = torch.nonzero(partial)  # [N, 4]: b, h, i, j
    counter = getattr(mask_mod, "count_pairs", None)
    sliced = getattr(mask_mod, "__name__", "") == "_sliced_mask_mod_error"
    exact = count and bool(cells.numel()) and not sliced and (
        counter is not None or int(area_QK[cells[:, 2], cells[:, 3]].sum()) <= MAX_PARTIAL_EVAL_PAIRS
    )
    kind_BHQK = None  # exact counts: kinds follow them
    if exact:
        bi, hi, qi, ki = cells.unbind(1)
        if counter is not None:
            cnt_N = torch.empty(cells.shape[0], dtype=torch.int64)
            for b in bi.unique().tolist():
                sel = bi == b
                cnt_N[sel] = _count_cells(counter, b, qe[qi[sel]], qe[qi[sel] + 1], ke[ki[sel]], ke[ki[sel] + 1])
        else:
            cnt_N = _count_partial_cells(block_mask, cells)
        count_BHQK[bi, hi, qi, ki] = cnt_N
    elif cells.numel():
        # Upper estimates (count = area): keep the BlockMask's own kinds.
        kind_BHQK = torch.where(full, FULL, torch.where(partial, PARTIAL, EMPTY)).to(torch.int8)
    kind, count, group_of = _group(count_BHQK, area_QK, kind_BHQK)
    return BlockPattern(kind_BGQK=kind, count_BGQK=count, q_len=q_len, kv_len=kv_len, q_block=qb, kv_block=kb,
                        head_group_of=group_of, name=getattr(mask_mod, "__name__", "block_mask"))


def _block_mask_kinds(block_mask: BlockMask, nq: int, nk: int) -> tuple[Tensor, Tensor]:
    """(partial, full) bool [B, H, nq, nk] of a BlockMask's listed blocks (``listed_blocks``)."""
    return listed_blocks(block_mask.kv_num_blocks, block_mask.kv_indices, block_mask.full_kv_num_blocks,
                         block_mask.full_kv_indices, nq, nk)


def listed_blocks(kv_num_blocks: Tensor, kv_indices: Tensor, full_kv_num_blocks: Tensor | None,
                  full_kv_indices: Tensor | None, nq: int, nk: int, *, on_host: bool = True) -> tuple[Tensor, Tensor]:
    """(partial, full) bool [B, H, nq, nk] of the blocks a BlockMask's index lists name, broadcast to one shape; a
    block listed as both counts as PARTIAL. On the CPU, or (``on_host=False``) where the lists live."""

    def to4(x: Tensor) -> Tensor:
        x = x.cpu() if on_host else x
        while x.dim() < 4:
            x = x.unsqueeze(0)
        return x

    idx = to4(kv_indices)
    num = to4(kv_num_blocks.unsqueeze(-1))[..., 0]
    partial = _ordered_to_dense_BHQK(num, idx, nq, nk)
    full = torch.zeros_like(partial)
    if full_kv_indices is not None:
        fidx = to4(full_kv_indices)
        fnum = to4(full_kv_num_blocks.unsqueeze(-1))[..., 0]
        full = _ordered_to_dense_BHQK(fnum, fidx, nq, nk)
    shape = torch.broadcast_shapes(partial.shape, full.shape)
    return partial.expand(shape), full.expand(shape) & ~partial.expand(shape)


def block_table_kinds(kv_num_blocks: Tensor, kv_indices: Tensor, full_kv_num_blocks: Tensor | None,
                      full_kv_indices: Tensor | None, nq: int, nk: int) -> Tensor:
    """int8 [B, H, nq, nk] block kinds (EMPTY / PARTIAL / FULL) of a BlockMask's index lists, computed where the
    lists live: the one small table a run-time BlockMask's plan reads (``pattern_from_kinds``), not its int32
    lists."""
    partial, full = listed_blocks(kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, nq, nk,
                                  on_host=False)
    return (full.to(torch.int8) * FULL + partial.to(torch.int8) * PARTIAL).contiguous()


def _count_partial_cells(block_mask: BlockMask, cells: Tensor) -> Tensor:
    """Attending pairs of each listed cell (``cells`` [N, 4]: b, h, q block, kv block), by evaluating the
    mask_mod over the cells in batches, on the BlockMask's device (tensors the mask_mod captured live there)."""
    q_len, kv_len = (int(x) for x in block_mask.seq_lengths)
    qb, kb = (int(x) for x in block_mask.BLOCK_SIZE)
    dev = block_mask.kv_indices.device
    cnt_N = torch.empty(cells.shape[0], dtype=torch.int64)
    per = max(1, _STEP // (qb * kb))
    aq, ak = torch.arange(qb, device=dev), torch.arange(kb, device=dev)
    bd, hd, qd, kd = (x.to(dev) for x in cells.unbind(1))
    for s in range(0, cells.shape[0], per):
        e = s + per
        q_N11 = qd[s:e, None, None] * qb + aq[None, :, None]
        k_N11 = kd[s:e, None, None] * kb + ak[None, None, :]
        inside = (q_N11 < q_len) & (k_N11 < kv_len)
        m = eval_mask(block_mask.mask_mod, bd[s:e, None, None], hd[s:e, None, None],
                      q_N11.clamp(max=q_len - 1), k_N11.clamp(max=kv_len - 1))
        cnt_N[s:e] = (m & inside).sum(dim=(1, 2)).cpu()
    return cnt_N


def pattern_from_dense(mask: Tensor, *, block_size: int | tuple[int, int] = 128, name: str = "dense") -> BlockPattern:
    """Block pattern of a dense boolean mask ``mask_QK`` or ``mask_BHQK`` (True = attends).

    Raises:
        TypeError: not a bool tensor.
        ValueError: not 2-D or 4-D, or an empty dimension.
    """
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
        raise TypeError(
            f"`mask` must be a bool tensor (True = attends), got "
            f"{mask.dtype if isinstance(mask, Tensor) else type(mask).__name__}; for an additive float mask "
            f"pass `mask != float('-inf')`"
        )
    if mask.dim() == 2:
        mask = mask[None, None]
    if mask.dim() != 4 or 0 in mask.shape:
        raise ValueError(f"`mask` must be a non-empty [Q, K] or [B, H, Q, K] tensor, got shape {tuple(mask.shape)}")
    qb, kb = _blocks(block_size)
    bsz, nh, q_len, kv_len = mask.shape
    qe, ke = _edges(q_len, qb), _edges(kv_len, kb)
    nq, nk = qe.numel() - 1, ke.numel() - 1
    padded = torch.nn.functional.pad(mask.cpu(), (0, nk * kb - kv_len, 0, nq * qb - q_len))
    count_BHQK = padded.reshape(bsz, nh, nq, qb, nk, kb).sum(dim=(3, 5))
    kind, count, group_of = _group(count_BHQK, qe.diff()[:, None] * ke.diff()[None, :])
    return BlockPattern(kind_BGQK=kind, count_BGQK=count, q_len=q_len, kv_len=kv_len, q_block=qb, kv_block=kb,
                        head_group_of=group_of, name=name)


def pattern_from_kinds(kind_BHQK: Tensor, *, q_len: int, kv_len: int, q_block: int, kv_block: int,
                       name: str = "dense") -> BlockPattern:
    """Block pattern of a block-kind table (int8 ``[B, H, NQ, NK]`` of EMPTY / PARTIAL / FULL, as
    ``kernels.block_lists.dense_block_kinds`` reduces a dense mask on its device): what a run-time mask's plan
    reads instead of the mask's elements. A PARTIAL cell counts as its area (an upper estimate), as a BlockMask's
    own kinds do (``pattern_from_block_mask(count=False)``).

    Raises:
        ValueError: a table that is not 4-D or whose grid does not cover the lengths in those blocks.
    """
    kind = kind_BHQK.detach().to("cpu", torch.int8)
    qe, ke = _edges(q_len, q_block), _edges(kv_len, kv_block)
    if kind.dim() != 4 or tuple(kind.shape[2:]) != (qe.numel() - 1, ke.numel() - 1):
        raise ValueError(f"`kind_BHQK` must be [B, H, {qe.numel() - 1}, {ke.numel() - 1}] for {q_len} x {kv_len} "
                         f"tokens in {q_block} x {kv_block} blocks, got shape {tuple(kind.shape)}")
    area_QK = qe.diff()[:, None] * ke.diff()[None, :]
    count_BHQK = torch.where(kind != EMPTY, area_QK, 0)
    kind, count, group_of = _group(count_BHQK, area_QK, kind)
    return BlockPattern(kind_BGQK=kind, count_BGQK=count, q_len=q_len, kv_len=kv_len, q_block=q_block,
                        kv_block=kv_block, head_group_of=group_of, name=name)


def pattern_from_is_causal(
    q_len: int, kv_len: int | None = None, *, block_size: int | tuple[int, int] = 128
) -> BlockPattern:
    """SDPA ``is_causal=True``: top-left aligned causal mask, ``kv <= q``."""
    return pattern_from_mask_mod(generate_causal(), q_len, kv_len, block_size=block_size)


def pattern_from_full(
    q_len: int, kv_len: int | None = None, *, block_size: int | tuple[int, int] = 128
) -> BlockPattern:
    """SDPA without a mask: every pair attends."""
    return pattern_from_mask_mod(generate_full(), q_len, kv_len, block_size=block_size)


def to_block_pattern(
    mask: BlockPattern | BlockMask | Callable | str | Tensor,
    *,
    q_len: int | None = None,
    kv_len: int | None = None,
    block_size: int | tuple[int, int] = 128,
    batch: int = 1,
    num_heads: int = 1,
    count: bool = True,
) -> BlockPattern:
    """Any supported mask as a ``BlockPattern``.

    Args:
        mask: a ``BlockPattern`` (returned as is), a ``BlockMask``, a mask_mod, ``"causal"`` or
            ``"full"`` (SDPA semantics), or a bool mask tensor ``[Q, K]`` / ``[B, H, Q, K]``.
        q_len, kv_len: lengths, required for a mask_mod or a string (kv_len defaults to q_len);
            checked against a ``BlockMask``'s or tensor's own lengths when given.
        block_size, batch, num_heads: as in ``pattern_from_mask_mod`` (``block_size`` also for tensors).
        count: a ``BlockMask``'s PARTIAL cells are counted (``pattern_from_block_mask``); False: its own kinds.

    Raises:
        TypeError: an unsupported mask type.
        ValueError: an unknown string, missing lengths or lengths that disagree with the mask.
    """
    match mask:
        case BlockPattern():
            return mask
        case BlockMask():
            pattern = pattern_from_block_mask(mask, count=count)
        case str():
            if mask not in (MaskKind.CAUSAL, MaskKind.FULL):
                raise ValueError(f"a string mask must be one of 'causal', 'full', got {mask!r}")
            if q_len is None:
                raise ValueError(f"`q_len` is required to build a pattern from {mask!r}")
            maker = pattern_from_is_causal if mask == MaskKind.CAUSAL else pattern_from_full
            return maker(q_len, kv_len, block_size=block_size)
        case Tensor():
            pattern = pattern_from_dense(mask, block_size=block_size)
        case _ if callable(mask):
            if q_len is None:
                what = getattr(mask, "__name__", mask)
                raise ValueError(f"`q_len` is required to build a pattern from mask_mod {what!r}")
            return pattern_from_mask_mod(mask, q_len, kv_len, block_size=block_size, batch=batch, num_heads=num_heads)
        case _:
            raise TypeError(
                f"`mask` must be a BlockPattern, BlockMask, mask_mod, 'causal', 'full' or a bool tensor, "
                f"got {type(mask).__name__}"
            )
    if q_len is not None and (q_len, kv_len if kv_len is not None else q_len) != (pattern.q_len, pattern.kv_len):
        raise ValueError(
            f"`q_len`/`kv_len` ({q_len}, {kv_len}) disagree with the mask's own lengths "
            f"({pattern.q_len}, {pattern.kv_len})"
        )
    return pattern
