"""mask_mod factories for the attention patterns UltraAttn studies, each with an exact pair counter.

Every ``generate_<name>(...)`` returns a FlexAttention ``mask_mod(b, h, q_idx, kv_idx) -> bool``
built from torch ops only (it works on broadcast index tensors, under ``vmap`` inside
``create_block_mask`` and inside compiled ``flex_attention``). Parameters are validated eagerly
(``ValueError``) and ``__name__`` carries them, e.g. ``sliding_window(window=1024,causal=True)``.

Each factory also attaches an exact, vectorised rectangle counter::

    mask_mod.count_pairs(q0, q1, k0, k1, b=0) -> int64 tensor

giving, for broadcastable int64 tensors of half-open token ranges ``[q0, q1) x [k0, k1)``, the
number of (q, kv) pairs inside the rectangle for which the mask is True, and ``mask_mod.num_batch``
(how many batch entries have their own pattern; 1 unless a per-batch parameter was given). The
counter is what makes ``BlockPattern`` construction possible at S = 512K..2M tokens, where dense
evaluation of an S x S mask is not. Composed masks (``and_masks`` / ``or_masks``) carry no counter
and are evaluated densely by ``ultraattn.masks.convert``.

Counting building blocks (``u`` a block unit in tokens, ``u = 1`` means token level)::

    _count_block_le(q0, q1, k0, k1, d, u) = #{(q, kv) in rect : kv // u - q // u <= d}

which is a sum over q-blocks of a clipped arithmetic series and has a closed form
(``_sum_clip_linear``) however many u-blocks the rectangle spans. Every mask below is a signed
sum of such terms on (clipped) rectangles; e.g. causal = ``le(d=0, u=1)``, "same u-block" =
``le(0, u) - le(-1, u)``.

Every factory is registered (``@register_mask``, ``masks/registry.py``) with its CLI spec parameters and
defaults: that one entry is what the spec parser, the CLI, ``MaskKind`` and the tests read.

Legend (shape suffixes): B batch entries, T tokens, D documents.

Caution: the counters assume non-negative token coordinates (q0, k0 >= 0); ranges with
q1 <= q0 or k1 <= k0 count 0.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import and_masks, or_masks

from ultraattn.masks.registry import MASKS, Param, ParamKind, frac, mask_kinds, register_mask

MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


# ----------------------------------------------------------------------------- validation
def _check_int(name: str, value: object, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"`{name}` must be an int, got {value!r}")
    if value < minimum:
        what = "positive" if minimum == 1 else f">= {minimum}"
        raise ValueError(f"`{name}` must be {what}, got {value}")
    return value


def _check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"`{name}` must be a bool, got {value!r}")
    return value


# ----------------------------------------------------------------------------- closed forms
def _i64(x: Tensor | int) -> Tensor:
    return torch.as_tensor(x, dtype=torch.int64)


def _sum_clip_linear(lo: Tensor, hi: Tensor, u: int, c: Tensor | int, w: Tensor) -> Tensor:
    """``sum_{x=lo}^{hi-1} clip(u * x + c, 0, w)`` elementwise (0 where hi <= lo); u > 0, w >= 0.

    The terms are 0 up to ``xa`` (first x with u*x + c >= 1), linear up to ``xb`` (first x with
    u*x + c >= w) and w afterwards, so the sum is an arithmetic series plus a constant run.
    """
    xa = -((c - 1) // u)
    xb = -((c - w) // u)
    a = torch.maximum(lo, xa)
    b = torch.maximum(torch.minimum(hi, xb), a)
    n = b - a
    # [Note] (a + b - 1) * n is always even, so the floor division is exact.
    linear = (u * (a + b - 1) * n) // 2 + c * n
    return linear + w * (hi - torch.maximum(lo, xb)).clamp(min=0)


def _count_block_le(q0: Tensor, q1: Tensor, k0: Tensor, k1: Tensor, d: int, u: int) -> Tensor:
    """Pairs (q, kv) in ``[q0, q1) x [k0, k1)`` with ``kv // u - q // u <= d``.

    For one q the count is ``clip(u * (q // u + d + 1) - k0, 0, k1 - k0)``; it depends on q only
    through its u-block, so we sum over the q-blocks ``[q0 // u, ceil(q1 / u))`` with weight u and
    subtract the parts of the first and last block that lie outside ``[q0, q1)``.
    """
    w = (k1 - k0).clamp(min=0)
    c = u * (d + 1) - k0
    if u == 1:
        return _sum_clip_linear(q0, q1, 1, c, w)
    b0 = q0 // u
    b1 = -((-q1) // u)

    def per_block(bq: Tensor) -> Tensor:
        return torch.minimum((u * bq + c).clamp(min=0), w)

    total = u * _sum_clip_linear(b0, b1, u, c, w) - (q0 - b0 * u) * per_block(b0) - (b1 * u - q1) * per_block(b1 - 1)
    return torch.where(q1 > q0, total, 0)


def _area(q0: Tensor, q1: Tensor, k0: Tensor, k1: Tensor) -> Tensor:
    return (q1 - q0).clamp(min=0) * (k1 - k0).clamp(min=0)


def _count_causal(q0: Tensor, q1: Tensor, k0: Tensor, k1: Tensor) -> Tensor:
    """Pairs with kv <= q."""
    return _count_block_le(q0, q1, k0, k1, 0, 1)


def _count_same_block(q0: Tensor, q1: Tensor, k0: Tensor, k1: Tensor, u: int) -> Tensor:
    """Pairs with q // u == kv // u."""
    return _count_block_le(q0, q1, k0, k1, 0, u) - _count_block_le(q0, q1, k0, k1, -1, u)


def _count_same_block_causal(q0: Tensor, q1: Tensor, k0: Tensor, k1: Tensor, u: int) -> Tensor:
    """Pairs with q // u == kv // u and kv <= q (every kv in an earlier block is causal too)."""
    return _count_causal(q0, q1, k0, k1) - _count_block_le(q0, q1, k0, k1, -1, u)


def _attach(mask_mod: MaskMod, name: str, counter: Callable[..., Tensor], num_batch: int = 1) -> MaskMod:
    mask_mod.__name__ = name
    mask_mod.__qualname__ = name

    def count_pairs(q0, q1, k0, k1, b: int | Tensor = 0) -> Tensor:
        """Exact number of attending pairs in ``[q0, q1) x [k0, k1)`` (int64, broadcast shape)."""
        q0, q1, k0, k1 = (_i64(x) for x in (q0, q1, k0, k1))
        # [Note] Inputs are NOT broadcast up front: on a [Q, 1] x [1, K] grid the per-axis
        # terms stay cheap and only the mixed terms are [Q, K].
        shape = torch.broadcast_shapes(q0.shape, q1.shape, k0.shape, k1.shape)
        out = counter(q0, q1, k0, k1, int(b))
        return out if out.shape == shape else out.expand(shape)

    count_pairs.__name__ = f"count_pairs[{name}]"
    mask_mod.count_pairs = count_pairs
    mask_mod.num_batch = num_batch
    return mask_mod


# ----------------------------------------------------------------------------- factories
@register_mask()
def generate_full() -> MaskMod:
    """Every pair attends."""

    def full(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (q_idx >= 0) | (kv_idx >= 0)

    return _attach(full, "full", lambda q0, q1, k0, k1, b: _area(q0, q1, k0, k1))


@register_mask()
def generate_causal() -> MaskMod:
    """Top-left aligned causal mask: ``kv <= q`` (SDPA ``is_causal`` semantics)."""

    def causal(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return kv_idx <= q_idx

    return _attach(causal, "causal", lambda q0, q1, k0, k1, b: _count_causal(q0, q1, k0, k1))


@register_mask(
    Param(name="window", kind=ParamKind.TOKENS, default=frac(8), doc="S/8"),
    Param(name="causal", kind=ParamKind.BOOL, default=lambda s: True, doc="true"),
)
def generate_sliding_window(window: int, causal: bool = True) -> MaskMod:
    """Sliding window: causal ``0 <= q - kv < window``; bidirectional ``|q - kv| < window``.

    Raises:
        ValueError: ``window`` not positive.
    """
    _check_int("window", window, minimum=1)
    _check_bool("causal", causal)

    def sliding_window(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        diff = q_idx - kv_idx
        lower = diff >= 0 if causal else diff > -window
        return lower & (diff < window)

    def count(q0, q1, k0, k1, b):
        upper = 0 if causal else window - 1  # kv - q <= upper
        return _count_block_le(q0, q1, k0, k1, upper, 1) - _count_block_le(q0, q1, k0, k1, -window, 1)

    return _attach(sliding_window, f"sliding_window(window={window},causal={causal})", count)


@register_mask(
    Param(name="block", kind=ParamKind.TOKENS, default=frac(16), doc="S/16"),
    Param(name="stride", kind=ParamKind.COUNT, default=lambda s: 4, doc="4"),
    Param(name="band", kind=ParamKind.COUNT, default=lambda s: 2, doc="2"),
    Param(name="causal", kind=ParamKind.BOOL, default=lambda s: False, doc="false"),
)
def generate_strided(block: int, stride: int = 4, band: int = 2, causal: bool = False) -> MaskMod:
    """Strided block pattern: with ``bq = q // block``, ``bk = kv // block``, True iff
    ``(bq - bk) % stride == 0`` and ``|bq - bk| <= band * stride`` (and ``kv <= q`` if causal).

    With ``block = S/16, stride = 4, band = 2`` this is UltraAttn's strided pattern: permuting the
    16 blocks by ``(b % 4, b // 4)`` gives four 4x4 diagonal groups with band ``|i - j| <= 2``
    (56/256 cells).

    Raises:
        ValueError: ``block`` or ``stride`` not positive, ``band`` negative.
    """
    _check_int("block", block, minimum=1)
    _check_int("stride", stride, minimum=1)
    _check_int("band", band, minimum=0)
    _check_bool("causal", causal)
    reach = band * stride

    def strided(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        delta = q_idx // block - kv_idx // block
        ok = (torch.remainder(delta, stride) == 0) & (delta.abs() <= reach)
        if causal:
            ok = ok & (kv_idx <= q_idx)
        return ok

    def exact_delta(q0, q1, k0, k1, delta: int) -> Tensor:  # pairs with bq - bk == delta
        return _count_block_le(q0, q1, k0, k1, -delta, block) - _count_block_le(q0, q1, k0, k1, -delta - 1, block)

    def count(q0, q1, k0, k1, b):
        if stride == 1:  # contiguous band: 0 < bq - bk <= band (causal) or |bq - bk| <= band
            out = _count_block_le(q0, q1, k0, k1, -1 if causal else reach, block)
            out = out - _count_block_le(q0, q1, k0, k1, -reach - 1, block)
            return out + _count_same_block_causal(q0, q1, k0, k1, block) if causal else out
        # Only block offsets that can occur in these rectangles matter (keeps huge bands cheap).
        span = 0  # an upper bound on |bq - bk| over all rectangles
        if q0.numel() and q1.numel() and k0.numel() and k1.numel():
            bq_lo, bq_hi = int((q0 // block).min()), int(((q1 - 1) // block).max())
            bk_lo, bk_hi = int((k0 // block).min()), int(((k1 - 1) // block).max())
            span = max(bq_hi - bk_lo, bk_hi - bq_lo, 0)
        jmax = min(band, span // stride)
        out = _count_same_block_causal(q0, q1, k0, k1, block) if causal else exact_delta(q0, q1, k0, k1, 0)
        for j in range(1, jmax + 1):
            out = out + exact_delta(q0, q1, k0, k1, j * stride)
            if not causal:
                out = out + exact_delta(q0, q1, k0, k1, -j * stride)
        return out

    return _attach(strided, f"strided(block={block},stride={stride},band={band},causal={causal})", count)


@register_mask(
    Param(name="num_global", kind=ParamKind.TOKENS, default=frac(16), doc="S/16"),
    Param(name="window", kind=ParamKind.TOKENS, default=frac(16), doc="S/16"),
)
def generate_global_local(num_global: int, window: int) -> MaskMod:
    """Global tokens plus aligned local blocks: ``q < num_global or kv < num_global or
    q // window == kv // window``. With ``num_global = window = S/16``: row 0, column 0 and the
    diagonal of a 16x16 block table (46/256 cells).

    Raises:
        ValueError: ``num_global`` negative or ``window`` not positive.
    """
    _check_int("num_global", num_global, minimum=0)
    _check_int("window", window, minimum=1)

    def global_local(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (q_idx < num_global) | (kv_idx < num_global) | (q_idx // window == kv_idx // window)

    def count(q0, q1, k0, k1, b):
        # Outside the global row/column stripes only the local blocks attend.
        g = torch.tensor(num_global, dtype=torch.int64)
        lq0, lk0 = torch.maximum(q0, g), torch.maximum(k0, g)
        local = _count_same_block(lq0, q1, lk0, k1, window)
        return _area(q0, q1, k0, k1) - _area(lq0, q1, lk0, k1) + local

    return _attach(global_local, f"global_local(num_global={num_global},window={window})", count)


@register_mask(Param(name="block", kind=ParamKind.TOKENS, default=frac(4), doc="S/4"))
def generate_star(block: int) -> MaskMod:
    """Star: causal and (``kv < block`` or same block). With ``block = S/4``: a 4x4 table with
    column 0 and the causal diagonal.

    Raises:
        ValueError: ``block`` not positive.
    """
    _check_int("block", block, minimum=1)

    def star(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (kv_idx <= q_idx) & ((kv_idx < block) | (q_idx // block == kv_idx // block))

    def count(q0, q1, k0, k1, b):
        u = torch.tensor(block, dtype=torch.int64)
        head = _count_causal(q0, q1, k0, torch.minimum(k1, u))
        return head + _count_same_block_causal(q0, q1, torch.maximum(k0, u), k1, block)

    return _attach(star, f"star(block={block})", count)


@register_mask(
    Param(name="sink", kind=ParamKind.TOKENS, default=frac(8), doc="S/8"),
    Param(name="window", kind=ParamKind.COUNT, default=lambda s: 2, doc="2 (blocks)"),
    Param(name="block", kind=ParamKind.TOKENS, default=frac(8), doc="S/8"),
)
def generate_streaming(sink: int, window: int, block: int) -> MaskMod:
    """Streaming (attention sinks): causal and (``kv < sink`` or ``q // block - kv // block <=
    window``). With ``sink = block = S/8, window = 2``: an 8x8 table with the sink column, the two
    previous blocks and the causal diagonal.

    Raises:
        ValueError: ``sink`` or ``window`` negative, ``block`` not positive.
    """
    _check_int("sink", sink, minimum=0)
    _check_int("window", window, minimum=0)
    _check_int("block", block, minimum=1)

    def streaming(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        near = (q_idx // block - kv_idx // block) <= window
        return (kv_idx <= q_idx) & ((kv_idx < sink) | near)

    def count(q0, q1, k0, k1, b):
        s = torch.tensor(sink, dtype=torch.int64)
        head = _count_causal(q0, q1, k0, torch.minimum(k1, s))
        t0 = torch.maximum(k0, s)
        # causal minus the pairs whose block offset exceeds the window (those are all causal)
        near = _count_causal(q0, q1, t0, k1) - _count_block_le(q0, q1, t0, k1, -(window + 1), block)
        return head + near

    return _attach(streaming, f"streaming(sink={sink},window={window},block={block})", count)


def _per_batch_lengths(lengths: Sequence[int] | Sequence[Sequence[int]]) -> list[list[int]]:
    if isinstance(lengths, (str, bytes)) or not isinstance(lengths, Sequence) or len(lengths) == 0:
        raise ValueError(
            f"`lengths` must be a non-empty list of document lengths (or one per batch entry), got {lengths!r}"
        )
    nested = [isinstance(x, Sequence) and not isinstance(x, (str, bytes)) for x in lengths]
    if any(nested) and not all(nested):
        raise ValueError(f"`lengths` must be a list of ints or a list of lists of ints, not a mix, got {lengths!r}")
    per_batch = [list(x) for x in lengths] if all(nested) else [list(lengths)]
    for i, row in enumerate(per_batch):
        if not row:
            raise ValueError(f"`lengths` of batch entry {i} must not be empty, got {row!r}")
        for n in row:
            if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
                raise ValueError(f"`lengths` entries must be positive ints, got {n!r} in {row!r}")
    return per_batch


def _equal_lengths(docs: int, seq_len: int) -> list[int]:
    if not 1 <= docs <= seq_len:
        raise ValueError(f"`docs` must lie in [1, seq_len={seq_len}], got {docs}")
    base, extra = divmod(seq_len, docs)
    return [base + (1 if i < extra else 0) for i in range(docs)]


def _document_spec(kwargs: dict, seq_len: int, given: dict) -> dict:
    """The spec's ``docs`` (equal documents, 4 by default) or ``lengths``, checked against seq_len."""
    if "lengths" in kwargs and "docs" in kwargs:
        raise ValueError("mask 'document' takes `lengths` or `docs`, not both")
    if "lengths" not in kwargs:
        kwargs["lengths"] = _equal_lengths(kwargs.pop("docs", 4), seq_len)
    if sum(kwargs["lengths"]) > seq_len:
        raise ValueError(
            f"`lengths` must sum to at most seq_len={seq_len}, got {given.get('lengths')!r} "
            f"(= {sum(kwargs['lengths'])} tokens)"
        )
    return kwargs


@register_mask(
    Param(name="lengths", kind=ParamKind.LENGTHS, default=None, doc="a+b+... tokens (exclusive with docs)"),
    Param(name="docs", kind=ParamKind.COUNT, default=None, doc="4 equal documents"),
    Param(name="causal", kind=ParamKind.BOOL, default=lambda s: True, doc="true"),
    resolve=_document_spec,
)
def generate_document(
    lengths: Sequence[int] | Sequence[Sequence[int]], causal: bool = True, *, device: torch.device | str | None = None
) -> MaskMod:
    """Document (packed sequences) mask: True iff q and kv lie in the same document (and
    ``kv <= q`` if causal). Tokens past ``sum(lengths)`` belong to no document: masked out.

    Args:
        lengths: per-document lengths of one sequence, or one such list per batch entry.
        causal: also require ``kv <= q``.
        device: where the mask_mod's ``doc_ids_BT`` table lives (the device ``create_block_mask``
            and ``flex_attention`` run on; default CPU). The counter always runs on CPU.

    The mask_mod reads a precomputed ``doc_ids_BT`` table, FlexAttention style
    (``doc_ids[b, q] == doc_ids[b, kv]``); ``num_batch`` is the number of per-batch lists.

    Raises:
        ValueError: empty ``lengths`` or a length that is not a positive int.
    """
    per_batch = _per_batch_lengths(lengths)
    _check_bool("causal", causal)
    nb = len(per_batch)
    t_max = max(sum(row) for row in per_batch)
    # [Note] One extra sentinel column (-1, "no document"): indices are clamped to it, so any
    # token at or past a sequence's document total is masked, whatever the sequence length.
    doc_ids_BT = torch.full((nb, t_max + 1), -1, dtype=torch.int32)
    tables = []
    for i, row in enumerate(per_batch):
        len_D = torch.tensor(row, dtype=torch.int64)
        doc_ids_BT[i, : int(len_D.sum())] = torch.repeat_interleave(torch.arange(len(row), dtype=torch.int32), len_D)
        end_D = len_D.cumsum(0)
        start_D = end_D - len_D
        weight_D = len_D * (len_D + 1) // 2 if causal else len_D * len_D
        prefix_D = torch.cat([torch.zeros(1, dtype=torch.int64), weight_D.cumsum(0)])
        tables.append((start_D, end_D, prefix_D, int(end_D[-1])))
    if device is not None:
        doc_ids_BT = doc_ids_BT.to(device)

    def document(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        if nb == 1:  # one list shared by every batch entry
            b = b * 0
        dq = doc_ids_BT[b, q_idx.clamp(max=t_max)]
        dk = doc_ids_BT[b, kv_idx.clamp(max=t_max)]
        ok = (dq == dk) & (dq >= 0)
        if causal:
            ok = ok & (kv_idx <= q_idx)
        return ok

    def in_doc(q0, q1, k0, k1, start, end) -> Tensor:
        a0, a1 = torch.maximum(q0, start), torch.minimum(q1, end)
        c0, c1 = torch.maximum(k0, start), torch.minimum(k1, end)
        return _count_causal(a0, a1, c0, c1) if causal else _area(a0, a1, c0, c1)

    def count(q0, q1, k0, k1, b):
        if not 0 <= b < nb:
            raise ValueError(f"`b` must lie in [0, {nb}) for {document.__name__}, got {b}")
        start_D, end_D, prefix_D, total = tables[b]
        nd = start_D.numel()
        q1c, k1c = q1.clamp(max=total), k1.clamp(max=total)
        valid = (q1c > q0) & (k1c > k0)

        def doc_of(x: Tensor) -> Tensor:  # document holding token x (x < total)
            return torch.searchsorted(end_D, x.clamp(0, total - 1).contiguous(), right=True)

        lo = torch.maximum(doc_of(q0), doc_of(k0))
        hi = torch.minimum(doc_of(q1c - 1), doc_of(k1c - 1))
        valid = valid & (lo <= hi)
        lo_c, hi_c = lo.clamp(max=nd - 1), hi.clamp(max=nd - 1)
        # documents strictly between lo and hi lie inside both ranges: prefix sums
        inner = torch.where(hi > lo + 1, prefix_D[hi_c] - prefix_D[(lo_c + 1).clamp(max=nd)], 0)
        first = in_doc(q0, q1c, k0, k1c, start_D[lo_c], end_D[lo_c])
        last = torch.where(hi > lo, in_doc(q0, q1c, k0, k1c, start_D[hi_c], end_D[hi_c]), 0)
        return torch.where(valid, inner + first + last, 0)

    if sum(len(r) for r in per_batch) <= 8:
        shown = per_batch[0] if nb == 1 else per_batch
        desc = f"lengths={shown}".replace(" ", "")
    else:
        desc = f"docs={[len(r) for r in per_batch] if nb > 1 else len(per_batch[0])},tokens={t_max}".replace(" ", "")
    return _attach(document, f"document({desc},causal={causal})", count, num_batch=nb)


@register_mask(Param(name="prefix", kind=ParamKind.TOKENS, default=frac(4), doc="S/4"))
def generate_prefix_lm(prefix: int | Sequence[int], *, device: torch.device | str | None = None) -> MaskMod:
    """Prefix-LM: bidirectional over the first ``prefix`` keys, causal after (``kv <= q or
    kv < prefix``). ``prefix`` may be one int or a list with one prefix per batch entry;
    ``device`` is where the mask_mod's per-batch prefix table lives (default CPU).

    Raises:
        ValueError: a negative prefix or an empty list.
    """
    if isinstance(prefix, Sequence) and not isinstance(prefix, (str, bytes)):
        if len(prefix) == 0:
            raise ValueError("`prefix` must be an int or a non-empty list of ints, got []")
        values = [_check_int("prefix", p, minimum=0) for p in prefix]
        per_batch = True
    else:
        values = [_check_int("prefix", prefix, minimum=0)]
        per_batch = False
    prefix_B = torch.tensor(values, dtype=torch.int64, device=device)

    def prefix_lm(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        if not per_batch:  # one prefix shared by every batch entry
            b = b * 0
        return (kv_idx <= q_idx) | (kv_idx < prefix_B[b])

    def count(q0, q1, k0, k1, b):
        if not 0 <= b < len(values):
            raise ValueError(f"`b` must lie in [0, {len(values)}) for {prefix_lm.__name__}, got {b}")
        p1 = torch.minimum(k1, torch.tensor(values[b], dtype=torch.int64))
        # causal pairs + the non-causal pairs inside the prefix columns
        return _count_causal(q0, q1, k0, k1) + _area(q0, q1, k0, p1) - _count_causal(q0, q1, k0, p1)

    shown = str(values if per_batch else values[0]).replace(" ", "")
    return _attach(prefix_lm, f"prefix_lm(prefix={shown})", count, num_batch=len(values))


# ----------------------------------------------------------------------------- kinds
# register every factory above: MaskKind and __all__ are made from the registry here
MaskKind = mask_kinds()
"""One member per registered mask, equal to its spec name (``MaskKind.CAUSAL == "causal"``)."""

__all__ = ["MaskKind", "and_masks", "or_masks", *(entry.factory.__name__ for entry in MASKS.values())]


# ----------------------------------------------------------------------------- visualisation
