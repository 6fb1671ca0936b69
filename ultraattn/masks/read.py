"""A mask read once: its blocks for the planner, its element test for the tiles.

A mask reaches the layers below the passes in one of six forms: a FlexAttention ``BlockMask``, a
mask_mod, ``"causal"`` / ``"full"``, a ``BlockPattern``, ``BlockCells`` or a boolean tensor.
``read_mask`` is the one place that tells them apart. It returns a ``MaskRead``:

* ``blocks``: the block structure. The planners read it: a dense ``BlockPattern``, or the sparse
  ``BlockCells`` of a run-time ``BlockMask`` (``sparse=True``: the fast planner's form, read in
  O(non-empty cells)).
* ``element``: an ``ElementMask``, the vectorised test of single (b, h, q, kv) positions that
  PARTIAL blocks need, bound to the mask_mod once (``eval_mask``: broadcasting, the vmap
  fallback, the device of its tables).

The runtime's tiles and the kernels' block lists call the ``ElementMask`` they are handed, and
FlexAttention tiles compile its ``mask_mod``. None of them calls back into this package to
interpret a mask. From a site op to a kernel, a mask goes down to ``masks`` once and climbs once:
passes -> runtime (``plan_attention``) -> masks (``read_mask``) -> planner -> runtime (executor,
tiles) -> kernels (docs/architecture.md, "A mask's path through the layers").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from ultraattn.masks.cells import BlockCells, cells_from_block_mask, cells_from_pattern
from ultraattn.masks.convert import eval_mask, to_block_pattern
from ultraattn.masks.factories import generate_causal, generate_full
from ultraattn.masks.pattern import PARTIAL, BlockPattern

__all__ = ["MASK_DEPENDS", "ElementMask", "MaskRead", "element_mask", "read_mask"]

MASK_DEPENDS = "ultraattn_depends"
"""Attribute a mask_mod may carry: (depends on b, depends on h), read off its graph by whoever builds it; absent:
both (every (b, h) pair is evaluated)."""


@dataclass(frozen=True, eq=False)
class ElementMask:
    """A mask's element test: ``element(b, h, q, kv)`` on broadcastable index tensors is a bool tensor of their
    broadcast shape, on their device (``eval_mask`` over ``mask_mod``)."""

    mask_mod: Callable
    """The mask_mod as written (what FlexAttention compiles into its kernels)."""

    def __call__(self, b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        return eval_mask(self.mask_mod, b, h, q, kv)

    @property
    def depends(self) -> tuple[bool, bool]:
        """(depends on the batch entry, depends on the head): both unless the mask_mod says (``MASK_DEPENDS``)."""
        return getattr(self.mask_mod, MASK_DEPENDS, (True, True))


def element_mask(mask_mod: Callable | ElementMask | None) -> ElementMask | None:
    """``mask_mod`` as an ``ElementMask`` (one already is stays as it is; None stays None)."""
    if mask_mod is None or isinstance(mask_mod, ElementMask):
        return mask_mod
    if not callable(mask_mod):
        raise TypeError(f"ultraattn: `mask_mod` must be a FlexAttention mask_mod (b, h, q_idx, kv_idx) -> bool, got "
                        f"{type(mask_mod).__name__}")
    return ElementMask(mask_mod)


@dataclass(eq=False)
class MaskRead:
    """A mask as the planner and the tiles need it (module docstring)."""

    blocks: BlockPattern | BlockCells
    """The block structure: a dense pattern, or the non-empty cells (``sparse=True``)."""
    element: ElementMask | None
    """The element test of PARTIAL blocks (None: the mask has none, it is known by its blocks alone)."""

    @property
    def pattern(self) -> BlockPattern:
        """The dense ``BlockPattern`` (cells are made dense on first use and kept)."""
        if isinstance(self.blocks, BlockCells):
            self.blocks = self.blocks.to_pattern()
        return self.blocks

    @property
    def cells(self) -> BlockCells:
        """The non-empty cells (``cells_from_pattern`` of a dense pattern)."""
        return self.blocks if isinstance(self.blocks, BlockCells) else cells_from_pattern(self.blocks)


def read_mask(
    mask,
    *,
    q_len: int | None,
    kv_len: int | None = None,
    batch: int = 1,
    num_heads: int = 1,
    block_size: int | tuple[int, int] = 128,
    mask_mod: Callable | ElementMask | None = None,
    sparse: bool = False,
    read_cells: Callable[[BlockMask], BlockCells] = cells_from_block_mask,
) -> MaskRead:
    """Read ``mask`` once (module docstring).

    Args:
        mask: a ``BlockMask``, a mask_mod, ``"causal"`` / ``"full"``, a ``BlockPattern``, ``BlockCells`` or a
            boolean tensor ``[Q, K]`` / ``[B, H, Q, K]``.
        q_len, kv_len: the attention's lengths (``kv_len`` defaults to ``q_len``); a mask that brings its own must
            agree; None: take the mask's.
        batch, num_heads, block_size: for masks given as a function or a string.
        mask_mod: the element test of a ``BlockPattern``'s or ``BlockCells``' PARTIAL blocks (a ``BlockMask``'s own
            mask_mod otherwise; this one wins when both are given).
        sparse: a ``BlockMask`` is read as ``BlockCells`` without densifying its grid (the fast planner's form).
        read_cells: how a ``BlockMask``'s cells are read once its lengths are checked (the runtime's
            ``ONLINE.cells`` takes them from ``plan_ahead``'s worker where it read them already).

    Raises:
        ValueError: lengths that disagree with the mask's, PARTIAL blocks without a mask_mod, an unknown string.
        TypeError: an unsupported mask type.
    """
    kv_len = q_len if kv_len is None else kv_len
    if isinstance(mask, BlockMask):
        if q_len is not None and tuple(mask.seq_lengths) != (q_len, kv_len):
            raise ValueError(f"ultraattn: the BlockMask is for lengths {tuple(mask.seq_lengths)} but "
                             f"{_lengths(q_len, kv_len)}; build it with Q_LEN={q_len}, KV_LEN={kv_len}")
        blocks = read_cells(mask) if sparse else to_block_pattern(mask)
        return MaskRead(blocks, element_mask(mask_mod if mask_mod is not None else mask.mask_mod))
    if isinstance(mask, str):
        if mask not in ("causal", "full"):
            raise ValueError(f"ultraattn: `mask` as a string must be 'causal' or 'full', got {mask!r}")
        blocks = to_block_pattern(mask, q_len=q_len, kv_len=kv_len, block_size=block_size)
        return MaskRead(blocks, element_mask(generate_causal() if mask == "causal" else generate_full()))
    if isinstance(mask, BlockPattern | BlockCells):
        what = type(mask).__name__
        if q_len is not None and (mask.q_len, mask.kv_len) != (q_len, kv_len):
            raise ValueError(f"ultraattn: the {what} is for lengths ({mask.q_len}, {mask.kv_len}) but "
                             f"{_lengths(q_len, kv_len)}")
        kinds = mask.kind_BGQK if isinstance(mask, BlockPattern) else mask.kind_N
        if mask_mod is None and bool((kinds == PARTIAL).any()):
            raise ValueError(f"ultraattn: `mask` is a {what} with PARTIAL blocks but no `mask_mod` to evaluate inside "
                             f"them; pass mask_mod=... (or the BlockMask itself)")
        return MaskRead(mask, element_mask(mask_mod))
    if isinstance(mask, Tensor):
        return MaskRead(to_block_pattern(mask, q_len=q_len, kv_len=kv_len, block_size=block_size),
                        element_mask(mask_mod))
    if callable(mask):
        blocks = to_block_pattern(mask, q_len=q_len, kv_len=kv_len, block_size=block_size, batch=batch,
                                  num_heads=num_heads)
        return MaskRead(blocks, element_mask(mask_mod if mask_mod is not None else mask))
    raise TypeError(f"ultraattn: `mask` must be a BlockMask, a mask_mod, 'causal', 'full', a BlockPattern, BlockCells "
                    f"or a boolean tensor, got {type(mask).__name__}")


def _lengths(q_len: int, kv_len: int) -> str:
    return f"seqlen={q_len}" if q_len == kv_len else f"q_len={q_len}, kv_len={kv_len}"
