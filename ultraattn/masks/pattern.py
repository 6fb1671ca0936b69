"""BlockPattern: the block-level view of an attention mask.

A ``BlockPattern`` is what every later stage reads: per (batch, head pattern group) a
grid of Q-block x KV-block cells, each EMPTY (nothing to compute), FULL (every pair
attends: no mask evaluation needed) or PARTIAL (the mask must be evaluated inside the
block), plus the exact number of attending (q, kv) pairs in each cell.

Legend (shape suffixes):
    B  batch entries with their own pattern (1 = the same for every batch entry)
    G  head pattern groups (heads that share a pattern are grouped; 1 = all heads)
    Q  query blocks, K  key/value blocks, P  planner chunks

Constructors live in ``ultraattn.masks.convert`` (from a FlexAttention ``BlockMask``,
``is_causal``, a dense boolean mask, or a mask_mod + lengths).

Caution: sequence lengths need not be multiples of the block size; the last block of
each axis is then a tail block whose ``count`` reflects its real size.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch

EMPTY: int = 0
PARTIAL: int = 1
FULL: int = 2

_KIND_CHARS = {EMPTY: ".", PARTIAL: "p", FULL: "#"}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class BlockPattern:
    """Block-level structure of an attention mask (see module docstring)."""

    kind_BGQK: torch.Tensor
    """int8 [B, G, Q, K]: EMPTY (0), PARTIAL (1) or FULL (2) for each cell."""
    count_BGQK: torch.Tensor
    """int64 [B, G, Q, K]: number of attending (q, kv) pairs in each cell."""
    q_len: int
    """Number of query tokens."""
    kv_len: int
    """Number of key/value tokens."""
    q_block: int
    """Query block size in tokens."""
    kv_block: int
    """Key/value block size in tokens."""
    head_group_of: tuple[int, ...] | None = None
    """For each head, its pattern group (index into G); None when G == 1 (all heads share)."""
    name: str = "custom"
    """Human-readable name with parameters, e.g. ``sliding_window(window=1024)``."""
    _hash: list = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        k, c = self.kind_BGQK, self.count_BGQK
        if k.dim() != 4 or c.shape != k.shape:
            raise ValueError(
                f"kind_BGQK and count_BGQK must both be 4-D [B, G, Q, K] with equal shapes, "
                f"got {tuple(k.shape)} and {tuple(c.shape)}"
            )
        if k.dtype != torch.int8 or c.dtype != torch.int64:
            raise TypeError(f"kind_BGQK must be int8 and count_BGQK int64, got {k.dtype} and {c.dtype}")
        for nm in ("q_len", "kv_len", "q_block", "kv_block"):
            if getattr(self, nm) <= 0:
                raise ValueError(f"{nm} must be positive, got {getattr(self, nm)}")
        if k.shape[2] != _cdiv(self.q_len, self.q_block) or k.shape[3] != _cdiv(self.kv_len, self.kv_block):
            raise ValueError(
                f"grid {tuple(k.shape[2:])} does not match q_len={self.q_len}/q_block={self.q_block}, "
                f"kv_len={self.kv_len}/kv_block={self.kv_block}"
            )
        if self.head_group_of is not None:
            if any(g < 0 or g >= k.shape[1] for g in self.head_group_of):
                raise ValueError(f"head_group_of entries must lie in [0, {k.shape[1]}), got {self.head_group_of}")
        elif k.shape[1] != 1:
            raise ValueError(f"head_group_of is required when there are {k.shape[1]} head pattern groups")

    # ------------------------------------------------------------------ basic views
    @property
    def num_batch_patterns(self) -> int:
        return self.kind_BGQK.shape[0]

    @property
    def num_head_groups(self) -> int:
        return self.kind_BGQK.shape[1]

    @property
    def grid(self) -> tuple[int, int]:
        return (self.kind_BGQK.shape[2], self.kind_BGQK.shape[3])

    def heads_per_group(self, num_heads: int) -> list[int]:
        """How many of ``num_heads`` heads fall in each pattern group."""
        if self.head_group_of is None:
            return [num_heads]
        if len(self.head_group_of) != num_heads:
            raise ValueError(
                f"num_heads must equal the pattern's {len(self.head_group_of)} heads, got {num_heads}"
            )
        out = [0] * self.num_head_groups
        for g in self.head_group_of:
            out[g] += 1
        return out

    def density(self) -> float:
        """Fraction of attending (q, kv) pairs over all batch patterns and head groups."""
        total = self.count_BGQK.sum().item()
        return total / (self.num_batch_patterns * self.num_head_groups * self.q_len * self.kv_len)

    def block_sparsity(self) -> float:
        """Fraction of EMPTY cells."""
        return (self.kind_BGQK == EMPTY).float().mean().item()

    def content_hash(self) -> str:
        """Stable sha256 over the pattern's content (not its name)."""
        if not self._hash:
            h = hashlib.sha256()
            h.update(repr((self.q_len, self.kv_len, self.q_block, self.kv_block, self.head_group_of)).encode())
            h.update(self.kind_BGQK.contiguous().numpy().tobytes())
            h.update(self.count_BGQK.contiguous().numpy().tobytes())
            self._hash.append(h.hexdigest())
        return self._hash[0]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, BlockPattern):
            return NotImplemented
        return (
            (self.q_len, self.kv_len, self.q_block, self.kv_block)
            == (other.q_len, other.kv_len, other.q_block, other.kv_block)
            and self.head_group_of == other.head_group_of
            and torch.equal(self.kind_BGQK, other.kind_BGQK)
            and torch.equal(self.count_BGQK, other.count_BGQK)
        )

    __hash__ = None  # mutable-content tensors: use content_hash()

    def __repr__(self) -> str:
        b, g, q, k = self.kind_BGQK.shape
        return (
            f"BlockPattern(name={self.name!r}, q_len={self.q_len}, kv_len={self.kv_len}, "
            f"block=({self.q_block}, {self.kv_block}), grid=[B={b}, G={g}, Q={q}, K={k}], "
            f"density={self.density():.3f})"
        )

    def to_dense(self) -> torch.Tensor:
        """The kind grid, int8 [B, G, Q, K] (a copy)."""
        return self.kind_BGQK.clone()

    def to_string(self, batch: int = 0, group: int = 0, max_cells: int = 64) -> str:
        """ASCII picture of one grid: ``#`` FULL, ``p`` PARTIAL, ``.`` EMPTY (downsampled if large)."""
        kind = self.kind_BGQK[batch, group]
        q, k = kind.shape
        sq, sk = max(1, _cdiv(q, max_cells)), max(1, _cdiv(k, max_cells))
        rows = []
        for i in range(0, q, sq):
            row = []
            for j in range(0, k, sk):
                sub = kind[i : i + sq, j : j + sk]
                if bool((sub == FULL).all()):
                    row.append(_KIND_CHARS[FULL])
                elif bool((sub == EMPTY).all()):
                    row.append(_KIND_CHARS[EMPTY])
                else:
                    row.append(_KIND_CHARS[PARTIAL])
            rows.append("".join(row))
        return "\n".join(rows)

    # ------------------------------------------------------------------ coarsening
    def cell_area_QK(self) -> torch.Tensor:
        """int64 [Q, K]: number of (q, kv) pairs in each cell (tail blocks are smaller)."""
        q, k = self.grid
        qs = torch.full((q,), self.q_block, dtype=torch.int64)
        ks = torch.full((k,), self.kv_block, dtype=torch.int64)
        qs[-1] = self.q_len - self.q_block * (q - 1)
        ks[-1] = self.kv_len - self.kv_block * (k - 1)
        return qs[:, None] * ks[None, :]

    def chunk_stats(self, chunk: int, num_chunks: int, heads_in_groups: list[list[int]] | None = None,
                    num_heads: int = 1) -> dict[str, torch.Tensor]:
        """Aggregate the pattern onto a square planner grid of ``num_chunks`` chunks of ``chunk`` tokens.

        The planner shards queries and keys alike, so it needs q_len == kv_len and a chunk that is a
        whole number of blocks; chunks past the sequence end (padding) are EMPTY.

        Args:
            chunk: tokens per chunk (a multiple of the block size).
            num_chunks: chunks in the padded sequence (num_chunks * chunk >= q_len).
            heads_in_groups: planner head groups as lists of head indices (None: one group of all heads).
            num_heads: total heads (used to weight pattern groups by their head counts).

        Returns:
            dict of float64 tensors [Hg, P, P] summed over batch patterns and heads:
            ``full`` (FULL blocks), ``partial`` (PARTIAL blocks), ``pairs`` (attending pairs).
        """
        check_chunk_grid(self, chunk, num_chunks)
        if heads_in_groups is None:
            heads_in_groups = [list(range(num_heads))]
        per = chunk // self.q_block
        nb = num_chunks * per
        q, k = self.grid

        def pad_and_pool(x_BGQK: torch.Tensor) -> torch.Tensor:
            x = torch.zeros((*x_BGQK.shape[:2], nb, nb), dtype=torch.float64)
            x[:, :, :q, :k] = x_BGQK.to(torch.float64)
            return x.reshape(*x.shape[:2], num_chunks, per, num_chunks, per).sum(dim=(3, 5))

        kind = self.kind_BGQK
        full = pad_and_pool(kind == FULL).sum(0)  # [G, P, P]
        part = pad_and_pool(kind == PARTIAL).sum(0)
        pairs = pad_and_pool(self.count_BGQK).sum(0)
        out = {"full": [], "partial": [], "pairs": []}
        for heads in heads_in_groups:
            gidx = [0] * len(heads) if self.head_group_of is None else [self.head_group_of[h] for h in heads]
            sel = torch.tensor(gidx, dtype=torch.long)
            out["full"].append(full[sel].sum(0))
            out["partial"].append(part[sel].sum(0))
            out["pairs"].append(pairs[sel].sum(0))
        return {key: torch.stack(v) for key, v in out.items()}


def check_chunk_grid(mask, chunk: int, num_chunks: int) -> None:
    """A planner grid of ``num_chunks`` chunks of ``chunk`` tokens must fit ``mask`` (a ``BlockPattern`` or
    ``BlockCells``): self-attention shapes, whole blocks per chunk, the sequence covered."""
    if mask.q_len != mask.kv_len or mask.q_block != mask.kv_block:
        raise NotImplementedError(
            f"context parallel planning needs self-attention shapes (q_len == kv_len, equal blocks), "
            f"got q_len={mask.q_len}, kv_len={mask.kv_len}, blocks=({mask.q_block}, {mask.kv_block})"
        )
    if chunk % mask.q_block:
        raise ValueError(f"chunk must be a multiple of the block size {mask.q_block}, got {chunk}")
    if num_chunks * chunk < mask.q_len:
        raise ValueError(f"num_chunks * chunk must cover q_len={mask.q_len}, got {num_chunks} * {chunk}")
