"""BlockCells: the non-empty cells of a block mask as flat lists (a sparse ``BlockPattern``).

A document mask at S = 512K with 128-token blocks has a 4096 x 4096 block grid (16.7M cells) but
only ~10^5 non-empty cells. Run-time planning (``ultraattn.planner.fast``) reads masks in this
form: ``cells_from_block_mask`` reads a FlexAttention ``BlockMask``'s ``(num_blocks, indices)``
rows in O(non-empty cells), without densifying the grid or evaluating the mask_mod; statistics on
the planner's chunk grid are one ``bincount`` (``chunk_stats``, the same numbers as
``BlockPattern.chunk_stats``).

Legend (shape suffixes): N non-empty cells, B batch entries, G head pattern groups, H heads,
Q query blocks, K key/value blocks, P planner chunks.

Caution: kinds are the BlockMask's own (a cell listed in ``kv_indices`` is PARTIAL, in
``full_kv_indices`` FULL); pair counts are not evaluated, a cell counts its area. This is
``pattern_from_block_mask``'s estimate mode: the planner needs kinds only, and a PARTIAL cell runs
the mask_mod, so it is exact whatever its real count (a tail cell stays PARTIAL, as in the
BlockMask).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from ultraattn.masks.pattern import EMPTY, FULL, PARTIAL, BlockPattern, _cdiv, check_chunk_grid

__all__ = ["BlockCells", "cells_from_block_mask", "cells_from_pattern"]


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class BlockCells:
    """The non-empty cells of a block mask (module docstring); numpy arrays, one entry per cell."""

    row_N: np.ndarray
    """int64: query block of each cell."""
    col_N: np.ndarray
    """int64: key/value block of each cell."""
    kind_N: np.ndarray
    """int8: FULL or PARTIAL (EMPTY cells are not listed)."""
    entry_N: np.ndarray
    """int64: ``b * num_groups + g``, the (batch entry, head pattern group) grid the cell belongs to."""
    count_N: np.ndarray
    """int64: attending (q, kv) pairs of the cell (its area when read from a BlockMask: an upper estimate)."""
    num_batch: int
    """Batch entries with their own cells (1: the same for every batch entry)."""
    num_groups: int
    """Head pattern groups (1: every head has the same cells)."""
    head_group_of: tuple[int, ...] | None
    """For each head, its pattern group; None when ``num_groups == 1``."""
    q_len: int
    """Query tokens."""
    kv_len: int
    """Key/value tokens."""
    q_block: int
    """Query block size in tokens."""
    kv_block: int
    """Key/value block size in tokens."""
    name: str = "custom"
    """Human-readable mask name."""
    _hash: list = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        n = self.row_N.shape[0]
        for nm in ("row_N", "col_N", "kind_N", "entry_N", "count_N"):
            a = getattr(self, nm)
            if not isinstance(a, np.ndarray) or a.ndim != 1 or a.shape[0] != n:
                raise ValueError(f"`{nm}` must be a 1-D numpy array of {n} cells, got "
                                 f"{getattr(a, 'shape', type(a).__name__)}")
        for nm in ("q_len", "kv_len", "q_block", "kv_block", "num_batch", "num_groups"):
            if getattr(self, nm) < 1:
                raise ValueError(f"`{nm}` must be positive, got {getattr(self, nm)}")
        if (self.head_group_of is None) != (self.num_groups == 1):
            raise ValueError(f"`head_group_of` must be given exactly when num_groups > 1, got num_groups="
                             f"{self.num_groups} and head_group_of={self.head_group_of}")

    @property
    def grid(self) -> tuple[int, int]:
        """(query blocks, key/value blocks)."""
        return _cdiv(self.q_len, self.q_block), _cdiv(self.kv_len, self.kv_block)

    @property
    def num_batch_patterns(self) -> int:
        """``num_batch`` (the name ``BlockPattern`` uses)."""
        return self.num_batch

    @property
    def num_cells(self) -> int:
        return int(self.row_N.shape[0])

    def content_hash(self) -> str:
        """sha256 over the cells and sizes (not the name): equal for equal masks built the same way."""
        if not self._hash:
            h = hashlib.sha256()
            h.update(repr((self.q_len, self.kv_len, self.q_block, self.kv_block, self.num_batch, self.num_groups,
                           self.head_group_of)).encode())
            for a in (self.entry_N, self.row_N, self.col_N, self.kind_N, self.count_N):
                h.update(np.ascontiguousarray(a).tobytes())
            self._hash.append(h.hexdigest())
        return self._hash[0]

    def __repr__(self) -> str:
        q, k = self.grid
        return (f"BlockCells(name={self.name!r}, q_len={self.q_len}, block=({self.q_block}, {self.kv_block}), "
                f"grid={q}x{k}, B={self.num_batch}, G={self.num_groups}, cells={self.num_cells})")

    def heads_per_group(self, num_heads: int) -> np.ndarray:
        """int64 [G]: how many of ``num_heads`` heads fall in each pattern group."""
        if self.head_group_of is None:
            return np.array([num_heads], dtype=np.int64)
        if len(self.head_group_of) != num_heads:
            raise ValueError(f"num_heads must equal the mask's {len(self.head_group_of)} heads, got {num_heads}")
        return np.bincount(np.asarray(self.head_group_of, dtype=np.int64), minlength=self.num_groups)

    def chunk_stats(self, chunk: int, num_chunks: int, heads_in_groups: list[list[int]] | None = None,
                    num_heads: int = 1, stats: tuple[str, ...] = ("full", "partial", "pairs")
                    ) -> dict[str, np.ndarray]:
        """``BlockPattern.chunk_stats`` from the cell lists: float64 [Hg, P, P] ``full`` and ``partial`` block
        counts and ``pairs`` summed over batch entries and heads (same arguments, same numbers; O(cells), no dense
        grid but the result). ``stats``: those of the three wanted (at 512 chunks each is a 2 MiB grid)."""
        check_chunk_grid(self, chunk, num_chunks)
        if heads_in_groups is None:
            heads_in_groups = [list(range(num_heads))]
        per = chunk // self.q_block
        p, g_count = num_chunks, self.num_groups
        # heads of pattern group g in planner group h: [Hg, G]
        weight_HG = np.zeros((len(heads_in_groups), g_count), dtype=np.float64)
        for n, heads in enumerate(heads_in_groups):
            groups = [0] * len(heads) if self.head_group_of is None else [self.head_group_of[h] for h in heads]
            weight_HG[n] = np.bincount(np.asarray(groups, dtype=np.int64), minlength=g_count)
        group_N = self.entry_N % g_count
        flat = (group_N * p + self.row_N // per) * p + self.col_N // per
        out = {}
        for name, sel, w in (("full", self.kind_N == FULL, None), ("partial", self.kind_N == PARTIAL, None),
                             ("pairs", slice(None), self.count_N)):
            if name not in stats:
                continue
            per_group = np.bincount(flat[sel], None if w is None else w.astype(np.float64),
                                    minlength=g_count * p * p).astype(np.float64, copy=False).reshape(g_count, p * p)
            if weight_HG.shape == (1, 1):   # (one group: the product in place, the same numbers as the matmul)
                per_group *= weight_HG[0, 0]
                out[name] = per_group.reshape(1, p, p)
            else:
                out[name] = (weight_HG @ per_group).reshape(len(heads_in_groups), p, p)
        return out

    def to_pattern(self) -> BlockPattern:
        """The dense ``BlockPattern`` (identical batch entries collapse, heads with identical cells share a group)."""
        from ultraattn.masks.convert import _edges, _group

        q, k = self.grid
        e_count = self.num_batch * self.num_groups
        kind = torch.zeros(e_count * q * k, dtype=torch.int8)
        count = torch.zeros(e_count * q * k, dtype=torch.int64)
        flat = torch.from_numpy((self.entry_N * q + self.row_N) * k + self.col_N)
        kind[flat] = torch.from_numpy(self.kind_N)
        count[flat] = torch.from_numpy(self.count_N)
        kind = kind.view(self.num_batch, self.num_groups, q, k)
        count = count.view(self.num_batch, self.num_groups, q, k)
        area = _edges(self.q_len, self.q_block).diff()[:, None] * _edges(self.kv_len, self.kv_block).diff()[None, :]
        kind_BGQK, count_BGQK, group_of = _group(count, area, kind)
        if group_of is not None:  # (G > 1 here, so head_group_of is given): compose head -> group -> merged group
            group_of = tuple(group_of[g] for g in self.head_group_of)
        return BlockPattern(kind_BGQK=kind_BGQK, count_BGQK=count_BGQK, q_len=self.q_len, kv_len=self.kv_len,
                            q_block=self.q_block, kv_block=self.kv_block, head_group_of=group_of, name=self.name)


def _listed_cells(num: Tensor, idx: Tensor, nq: int, nk: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(entry, row, col) of the cells listed in FlexAttention's (num_blocks [E, Q], indices [E, Q, X]) rows, in
    list order; rows past ``nq`` and indices past ``nk`` are dropped. O(listed cells): the padding of
    ``indices`` is never read."""
    e_count, rows, width = idx.shape
    num_M = num.reshape(-1).to(torch.int64).clamp(min=0, max=width).numpy()
    idx_MX = idx.reshape(e_count * rows, width).numpy()
    total = int(num_M.sum())
    row_of = np.repeat(np.arange(e_count * rows, dtype=np.int64), num_M)
    start_M = np.cumsum(num_M) - num_M
    off = np.arange(total, dtype=np.int64) - start_M[row_of]
    col = idx_MX[row_of, off].astype(np.int64)
    entry, row = np.divmod(row_of, rows)
    keep = (row < nq) & (col >= 0) & (col < nk)
    if not keep.all():
        entry, row, col = entry[keep], row[keep], col[keep]
    return entry, row, col


def cells_from_block_mask(block_mask: BlockMask) -> BlockCells:
    """The non-empty cells of a FlexAttention ``BlockMask`` (module docstring), O(listed cells).

    Batch and head dimensions of size 1 broadcast (one entry, ``num_batch``/``num_groups`` 1); a head
    dimension of size H > 1 gives H head pattern groups (``head_group_of = (0, ..., H-1)``). A cell listed
    as both FULL and PARTIAL is PARTIAL (as in ``pattern_from_block_mask``).

    Caution: the BlockMask's tensors are read on the CPU; for a mask on a GPU that is a copy that waits for
    the kernels that made it (do it early: ``ultraattn.plan_ahead``).

    Raises:
        TypeError: ``block_mask`` is not a ``BlockMask``.
    """
    if not isinstance(block_mask, BlockMask):
        raise TypeError(
            f"`block_mask` must be a torch.nn.attention.flex_attention.BlockMask, got {type(block_mask).__name__}")
    q_len, kv_len = (int(x) for x in block_mask.seq_lengths)
    qb, kb = (int(x) for x in block_mask.BLOCK_SIZE)
    nq, nk = _cdiv(q_len, qb), _cdiv(kv_len, kb)

    def to3(num: Tensor, idx: Tensor) -> tuple[Tensor, Tensor, tuple[int, int]]:
        idx = idx.detach().cpu()
        num = num.detach().cpu()
        while idx.dim() < 4:
            idx = idx.unsqueeze(0)
        while num.dim() < 3:
            num = num.unsqueeze(0)
        b, h = idx.shape[:2]
        return num.reshape(b * h, -1), idx.reshape(b * h, *idx.shape[2:]), (b, h)

    num_p, idx_p, bh = to3(block_mask.kv_num_blocks, block_mask.kv_indices)
    parts = [(_listed_cells(num_p, idx_p, nq, nk), PARTIAL, bh)]
    if block_mask.full_kv_indices is not None:
        num_f, idx_f, bh_f = to3(block_mask.full_kv_num_blocks, block_mask.full_kv_indices)
        parts.append((_listed_cells(num_f, idx_f, nq, nk), FULL, bh_f))
    b = max(p[2][0] for p in parts)
    h = max(p[2][1] for p in parts)
    entries, rows, cols, kinds = [], [], [], []
    for (entry, row, col), kind, (pb, ph) in parts:
        if (pb, ph) != (b, h):  # a size-1 batch or head dimension broadcast to the other list's (rare)
            spread = []
            for e in range(b * h):
                sel = entry == (e // h if pb > 1 else 0) * ph + (e % h if ph > 1 else 0)
                spread.append((np.full(int(sel.sum()), e, dtype=np.int64), row[sel], col[sel]))
            entry, row, col = (np.concatenate(x) for x in zip(*spread))
        entries.append(entry)
        rows.append(row)
        cols.append(col)
        kinds.append(np.full(entry.size, kind, dtype=np.int8))
    if len(parts) == 2 and entries[0].size and entries[1].size:
        keys_p = (entries[0] * nq + rows[0]) * nk + cols[0]
        keys_f = (entries[1] * nq + rows[1]) * nk + cols[1]
        dup = np.isin(keys_f, keys_p, kind="table")
        if dup.any():
            keep = ~dup
            entries[1], rows[1], cols[1], kinds[1] = entries[1][keep], rows[1][keep], cols[1][keep], kinds[1][keep]
    entry = np.concatenate(entries)
    row = np.concatenate(rows)
    col = np.concatenate(cols)
    qsz = np.minimum(qb, q_len - row * qb)
    ksz = np.minimum(kb, kv_len - col * kb)
    return BlockCells(row_N=row, col_N=col, kind_N=np.concatenate(kinds), entry_N=entry, count_N=qsz * ksz,
                      num_batch=b, num_groups=h, head_group_of=None if h == 1 else tuple(range(h)), q_len=q_len,
                      kv_len=kv_len, q_block=qb, kv_block=kb,
                      name=getattr(block_mask.mask_mod, "__name__", "block_mask"))


def cells_from_pattern(pattern: BlockPattern) -> BlockCells:
    """The non-empty cells of a dense ``BlockPattern`` (its kinds and exact counts)."""
    kind = pattern.kind_BGQK
    b, g, q, k = kind.shape
    flat = torch.nonzero(kind.reshape(-1) != EMPTY).squeeze(1)
    ent_row, col = np.divmod(flat.numpy(), k)
    entry, row = np.divmod(ent_row, q)
    return BlockCells(row_N=row, col_N=col, kind_N=kind.reshape(-1)[flat].numpy(), entry_N=entry,
                      count_N=pattern.count_BGQK.reshape(-1)[flat].numpy(), num_batch=b, num_groups=g,
                      head_group_of=pattern.head_group_of, q_len=pattern.q_len, kv_len=pattern.kv_len,
                      q_block=pattern.q_block, kv_block=pattern.kv_block, name=pattern.name)
