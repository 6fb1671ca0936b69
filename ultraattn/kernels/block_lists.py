"""``BlockLists``: the block-sparse description the tile kernels read.

The planner's ``BlockPattern`` says, per (batch, head group), which Q-block x KV-block cells
are EMPTY, FULL or PARTIAL. A kernel needs two more things, built here once per mask and
cached by the caller:

* **Block lists.** For each Q block, its FULL KV blocks and its PARTIAL KV blocks, ascending
  (FlexAttention's ``kv_num_blocks``/``kv_indices`` form, split by kind so that FULL blocks
  run a loop body without any mask code); and the transposed lists (for each KV block, the
  Q blocks that see it) for the dK/dV kernel. Lists are int32 ``[U, N, N']`` with a count.
* **Bit tiles.** Each PARTIAL cell gets a tile of ``q_block x kv_block`` bits, packed 32 per
  int32 word along the KV axis (``bits[t, r, c // 32] >> (c % 32) & 1``). A kernel applies it
  with one word load per 32 elements and shifts: no Python, no mask_mod compiled into the
  kernel, so one compiled kernel serves
  every mask (any BlockMask, data-dependent document masks included) without recompiling.
  A 128 x 128 tile is 2 KiB, an eighth of a dense bool tile and 1/32 of the K/V tile it
  gates. Generating code from the mask_mod would save those loads but recompile per mask
  and fail for mask_mods that index tensors; bit tiles are exact for all of them.

Every (batch, head) pair is mapped to one of ``U`` unique (kind grid, bit tiles) patterns
(``pattern_of[b * H + h]``); mask_mods are evaluated for every batch entry and head, so a
mask that depends on ``h`` or ``b`` inside a block is exact even when the BlockMask's block
structure is shared. The KV tail block (``kv_len % kv_block != 0``) is promoted from FULL to
PARTIAL so that FULL blocks never need bounds checks on the KV axis; rows past ``q_len`` are
handled by the kernels' row predicates (their tile bits are 0).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from ultraattn.masks.pattern import FULL, PARTIAL, BlockPattern
from ultraattn.masks.read import read_mask

Element = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
"""An element test: (b, h, q, kv) broadcastable index tensors -> bool of their broadcast shape (a mask's
``masks.read.ElementMask``, or a function built on one)."""

# Elements of mask evaluation per chunk (bounds the index tensors' memory to a few hundred MB).
_EVAL_CHUNK = 1 << 24


@dataclass(frozen=True, eq=False)
class BlockLists:
    """Kernel-side block-sparse description (see module docstring). Tensors live on ``device``."""

    q_len: int
    kv_len: int
    q_block: int
    kv_block: int
    batch: int
    num_heads: int
    pattern_of: Tensor
    """int32 [B * H]: index into the U unique patterns."""
    kind: Tensor
    """int8 [U, NQ, NK]: EMPTY/PARTIAL/FULL after the KV tail promotion."""
    full_cnt: Tensor
    """int32 [U, NQ]: FULL KV blocks per Q block."""
    full_idx: Tensor
    """int32 [U, NQ, NK]: their indices, ascending, then padding."""
    part_cnt: Tensor
    part_idx: Tensor
    part_tile: Tensor
    """int32 [U, NQ, NK]: bit-tile index of each listed PARTIAL block."""
    full_q_cnt: Tensor
    """int32 [U, NK]: FULL Q blocks per KV block (for dK/dV)."""
    full_q_idx: Tensor
    """int32 [U, NK, NQ]."""
    part_q_cnt: Tensor
    part_q_idx: Tensor
    part_q_tile: Tensor
    bits: Tensor
    """int32 [P, q_block, ceil(kv_block / 32)]: packed masks of the PARTIAL cells (P >= 1)."""
    name: str = "custom"

    @property
    def grid(self) -> tuple[int, int]:
        return (self.kind.shape[1], self.kind.shape[2])

    @property
    def num_patterns(self) -> int:
        return self.kind.shape[0]

    def fwd_tensors(self) -> tuple[Tensor, ...]:
        return (self.pattern_of, self.full_cnt, self.full_idx, self.part_cnt, self.part_idx, self.part_tile, self.bits)

    def bwd_tensors(self) -> tuple[Tensor, ...]:
        return self.fwd_tensors() + (self.full_q_cnt, self.full_q_idx, self.part_q_cnt, self.part_q_idx,
                                     self.part_q_tile)

    def to(self, device: torch.device | str) -> BlockLists:
        kw = {f.name: getattr(self, f.name) for f in fields(self)}
        for k, v in kw.items():
            if isinstance(v, Tensor):
                kw[k] = v.to(device)
        return BlockLists(**kw)

    @property
    def device(self) -> torch.device:
        return self.kind.device

    def attended_pairs(self) -> int:
        """Exact number of attending (q, kv) pairs over all batch entries and heads."""
        u_count = torch.zeros(self.num_patterns, dtype=torch.int64)
        kind = self.kind.cpu()
        nq, nk = self.grid
        qrows = torch.clamp(self.q_len - torch.arange(nq) * self.q_block, max=self.q_block)
        kcols = torch.clamp(self.kv_len - torch.arange(nk) * self.kv_block, max=self.kv_block)
        area = qrows[:, None] * kcols[None, :]
        u_count += ((kind == FULL) * area).sum((1, 2))
        bits = unpack_bits(self.bits.cpu(), self.kv_block).sum((1, 2))
        tiles = self.part_tile.cpu()
        cnt = self.part_cnt.cpu()
        for u in range(self.num_patterns):
            for i in range(nq):
                n = int(cnt[u, i])
                if n:
                    u_count[u] += bits[tiles[u, i, :n].long()].sum()
        return int(u_count[self.pattern_of.cpu().long()].sum())

    def __repr__(self) -> str:
        nq, nk = self.grid
        return (f"BlockLists({self.name}, q_len={self.q_len}, kv_len={self.kv_len}, "
                f"blocks={self.q_block}x{self.kv_block}, grid={nq}x{nk}, patterns={self.num_patterns}, "
                f"partial_tiles={self.bits.shape[0]}, B={self.batch}, H={self.num_heads})")


def pack_bits(mask: Tensor) -> Tensor:
    """bool [..., K] -> int32 [..., ceil(K / 32)]: bit c % 32 of word c // 32 (K % 8 == 0).

    The same bits as little-endian bytes with bit c % 8 of byte c // 8; words let a kernel fetch
    32 mask elements with one load (``triton_kernels._load_bits``). Built as bytes (eight shift-ors
    over uint8) and read as words: a few passes over one byte per element, where a weighted int64 sum
    took most of the block lists' build time."""
    *lead, k = mask.shape
    w = (k + 31) // 32
    m = mask.to(torch.uint8)
    if 32 * w != k:
        m = torch.nn.functional.pad(m, (0, 32 * w - k))
    m = m.reshape(*lead, 4 * w, 8)
    byte = m[..., 0].clone()
    for i in range(1, 8):
        byte |= m[..., i] << i
    if sys.byteorder == "little":
        return byte.view(torch.int32)
    return byte.reshape(*lead, w, 4).flip(-1).contiguous().view(torch.int32).reshape(*lead, w)


def unpack_bits(bits: Tensor, k: int) -> Tensor:
    """int32 [..., ceil(K / 32)] -> bool [..., K]."""
    shifts = torch.arange(32, dtype=torch.int32, device=bits.device)
    out = (bits.to(torch.int32)[..., None] >> shifts) & 1
    return out.reshape(*bits.shape[:-1], -1)[..., :k].bool()


def _sorted_lists(sel: Tensor) -> tuple[Tensor, Tensor]:
    """bool [..., N] -> (count int32 [...], indices int32 [..., N]: the True positions ascending, then the rest)."""
    cnt = sel.sum(-1).to(torch.int32)
    idx = torch.sort((~sel).to(torch.int8), dim=-1, stable=True).indices.to(torch.int32)
    return cnt, idx


def _check_block(name: str, value: int) -> None:
    if value < 16 or value & (value - 1):
        raise ValueError(
            f"ultraattn: {name}={value}: the block-sparse kernels need a power-of-two block size >= 16 "
            f"(the tile is also the dot-product tile); build the mask with BLOCK_SIZE=128 (FlexAttention's default)"
        )


def make_block_lists(
    mask: BlockPattern | BlockMask | str | Callable,
    *,
    q_len: int | None = None,
    kv_len: int | None = None,
    batch: int = 1,
    num_heads: int = 1,
    mask_mod: Callable | None = None,
    block_size: int | tuple[int, int] = 128,
    device: torch.device | str = "cpu",
) -> BlockLists:
    """Build the kernels' block lists for ``mask`` at the given batch and head count.

    Args:
        mask: a ``BlockMask``, a ``BlockPattern`` (with ``mask_mod=`` when it has PARTIAL
            cells), a mask_mod, or ``"causal"`` / ``"full"`` (SDPA semantics).
        q_len, kv_len: lengths (required for strings and mask_mods; checked otherwise).
        batch, num_heads: the attention's batch size and number of query heads.
        mask_mod: the mask function for PARTIAL cells when ``mask`` doesn't carry one.
        block_size: block size for strings and mask_mods (a BlockMask/BlockPattern brings its own).
        device: where the block lists' tensors go.
    """
    read = read_mask(mask, q_len=q_len, kv_len=kv_len, block_size=block_size, batch=batch, num_heads=num_heads,
                     mask_mod=mask_mod)
    return block_lists_from_pattern(read.pattern, read.element, batch=batch, num_heads=num_heads, device=device)


def block_lists_from_pattern(pattern: BlockPattern, element: Element | None, *, batch: int, num_heads: int,
                             device: torch.device | str = "cpu") -> BlockLists:
    """Block lists from a pattern plus the element test that resolves its PARTIAL cells (see
    ``make_block_lists``)."""
    qb, kb = pattern.q_block, pattern.kv_block
    _check_block("q_block", qb)
    _check_block("kv_block", kb)
    bp = pattern.num_batch_patterns
    if bp not in (1, batch):
        raise ValueError(f"the mask has {bp} batch entries but batch={batch}; build it for batch {batch} or 1")
    groups = pattern.head_group_of
    if groups is not None and len(groups) != num_heads:
        raise ValueError(f"the mask has {len(groups)} heads but num_heads={num_heads}; build it for {num_heads} "
                         f"heads or 1")
    nk = pattern.grid[1]
    q_len, kv_len = pattern.q_len, pattern.kv_len
    kind_all = pattern.kind_BGQK.clone()
    if kv_len % kb:
        tail = kind_all[..., nk - 1]
        tail[tail == FULL] = PARTIAL
    has_partial = bool((kind_all == PARTIAL).any())
    if has_partial and element is None:
        raise ValueError(
            "the mask has PARTIAL blocks but no mask_mod to evaluate them: pass the BlockMask, or "
            "mask_mod=... together with the BlockPattern"
        )
    # a mask that declares it ignores b or h (``ElementMask.depends``) is evaluated once for all of them; a function
    # built on one (a tile row's) is evaluated for every (b, h)
    dep_b, dep_h = getattr(element, "depends", (True, True))
    kinds, bit_sets, seen = [], [], {}
    for b in range(batch):
        for h in range(num_heads):
            g = 0 if groups is None else groups[h]
            kind = kind_all[b % bp, g]
            key = (b if dep_b else -1, h if dep_h else -1, b % bp, g)
            if key not in seen:
                seen[key] = _partial_bits(element, kind, b, h, qb, kb, q_len, kv_len)
            kinds.append(kind)
            bit_sets.append(seen[key])
    pattern_of, kind_u, bits_all, tile_grid = _dedupe(kinds, bit_sets, qb, kb)
    lay = _assemble(kind_u, tile_grid, bits_all, torch.tensor(pattern_of, dtype=torch.int32), q_len=q_len,
                    kv_len=kv_len, q_block=qb, kv_block=kb, batch=batch, num_heads=num_heads, name=pattern.name)
    return lay.to(device) if torch.device(device).type != "cpu" else lay


def _assemble(kind_u: Tensor, tile_grid: Tensor, bits: Tensor, pattern_of: Tensor, **sizes) -> BlockLists:
    """The block lists of unique cell grids ``kind_u`` [U, NQ, NK] whose PARTIAL cells have tile ids ``tile_grid``."""
    full_cnt, full_idx = _sorted_lists(kind_u == FULL)
    part_cnt, part_idx = _sorted_lists(kind_u == PARTIAL)
    part_tile = torch.gather(tile_grid, 2, part_idx.long())
    kind_t = kind_u.transpose(1, 2)
    full_q_cnt, full_q_idx = _sorted_lists(kind_t == FULL)
    part_q_cnt, part_q_idx = _sorted_lists(kind_t == PARTIAL)
    part_q_tile = torch.gather(tile_grid.transpose(1, 2), 2, part_q_idx.long())
    part_tile[part_tile < 0] = 0  # padding entries are never read; keep them in range
    part_q_tile[part_q_tile < 0] = 0
    # Kernels index these with row-major arithmetic: every tensor must be contiguous (the
    # transposed lists come out of sort/gather with the transpose's strides otherwise).
    full_q_cnt, full_q_idx, part_q_cnt, part_q_idx, part_q_tile = (
        t.contiguous() for t in (full_q_cnt, full_q_idx, part_q_cnt, part_q_idx, part_q_tile))
    return BlockLists(
        **sizes, pattern_of=pattern_of, kind=kind_u,
        full_cnt=full_cnt, full_idx=full_idx, part_cnt=part_cnt, part_idx=part_idx, part_tile=part_tile,
        full_q_cnt=full_q_cnt, full_q_idx=full_q_idx, part_q_cnt=part_q_cnt, part_q_idx=part_q_idx,
        part_q_tile=part_q_tile, bits=bits.contiguous(),
    )


def _partial_bits(element: Element | None, kind: Tensor, b: int, h: int, qb: int, kb: int, q_len: int,
                  kv_len: int) -> Tensor:
    """int32 [cells, qb, ceil(kb / 32)]: the packed element mask of each PARTIAL cell of one (batch, head) grid, in
    row-major cell order, evaluated ``_EVAL_CHUNK`` elements at a time."""
    cells = (kind == PARTIAL).nonzero()
    if not len(cells):
        return torch.zeros(0, qb, (kb + 31) // 32, dtype=torch.int32)
    return torch.cat(list(_cell_bits(element, torch.tensor(b), torch.tensor(h), cells[:, 0], cells[:, 1], len(cells),
                                     qb, kb, q_len, kv_len)))


def _cell_bits(element: Element, b: Tensor, h: Tensor, q_blocks: Tensor, kv_blocks: Tensor, n: int, qb: int,
               kb: int, q_len: int, kv_len: int):
    """The packed element masks (int32 [P, qb, ceil(kb / 32)]) of the cells ``(q_blocks[p], kv_blocks[p])`` of one
    (batch entry, head), ``n`` of them, evaluated where the block ids live, ``_EVAL_CHUNK`` elements at a time
    (yielded a chunk at a time). Padded positions are evaluated clamped (mask_mods may index tables of the true
    length) and come out 0."""
    dev = q_blocks.device
    rows, cols = torch.arange(qb, device=dev), torch.arange(kb, device=dev)
    chunk = max(1, _EVAL_CHUNK // (qb * kb))
    for c0 in range(0, n, chunk):
        qi = (q_blocks[c0:c0 + chunk, None] * qb + rows)[:, :, None]  # [P, qb, 1]
        ki = (kv_blocks[c0:c0 + chunk, None] * kb + cols)[:, None, :]  # [P, 1, kb]
        m = element(b, h, qi.clamp(max=q_len - 1), ki.clamp(max=kv_len - 1))
        yield pack_bits(m & (qi < q_len) & (ki < kv_len))


def _dedupe(kinds: list[Tensor], bit_sets: list[Tensor], qb: int, kb: int
            ) -> tuple[list[int], Tensor, Tensor, Tensor]:
    """(pattern of each (b, h), the unique cell grids [U, NQ, NK], all their partial tiles' bits, the tile id of
    each PARTIAL cell of each unique grid [U, NQ, NK] (-1 elsewhere)): (b, h) grids deduplicated by content."""
    unique: dict[tuple[bytes, bytes], int] = {}
    pattern_of: list[int] = []
    u_kinds: list[Tensor] = []
    u_bits: list[Tensor] = []
    for kind, bits in zip(kinds, bit_sets):
        key = (kind.numpy().tobytes(), bits.numpy().tobytes())
        if key not in unique:
            unique[key] = len(u_kinds)
            u_kinds.append(kind)
            u_bits.append(bits)
        pattern_of.append(unique[key])
    kind_u = torch.stack(u_kinds)  # [U, NQ, NK]
    tile_grid = torch.full(kind_u.shape, -1, dtype=torch.int32)
    offset = 0
    for u in range(len(u_kinds)):  # tile ids in the order the bits were evaluated (row-major cells)
        cells = (kind_u[u] == PARTIAL).nonzero()
        tile_grid[u, cells[:, 0], cells[:, 1]] = torch.arange(offset, offset + len(cells), dtype=torch.int32)
        offset += len(cells)
    bits_all = torch.cat(u_bits) if offset else torch.zeros(1, qb, (kb + 31) // 32, dtype=torch.int32)
    return pattern_of, kind_u, bits_all, tile_grid


# ----------------------------------------------------------------------------- dense masks on their device
def dense_block_kinds(mask: Tensor, q_block: int, kv_block: int) -> Tensor:
    """int8 [B', H', NQ, NK] block kinds (EMPTY / PARTIAL / FULL) of a boolean mask [.., Q, K] (2-D, or 4-D with
    batch and head dims of size 1 or full), computed where the mask lives in one pass. Padding past the lengths is
    False, so a tail block is never FULL (the block lists' tail promotion). This table, not the mask's S x S elements,
    is what planning and cache keys read."""
    m = _dense4(mask)
    B, H, Q, K = m.shape
    nq, nk = -(-Q // q_block), -(-K // kv_block)
    if nq * q_block != Q or nk * kv_block != K:
        m = torch.nn.functional.pad(m, (0, nk * kv_block - K, 0, nq * q_block - Q))
    blocks = m.reshape(B, H, nq, q_block, nk, kv_block)
    any_ = blocks.any(dim=5).any(dim=3)
    all_ = blocks.all(dim=5).all(dim=3)
    return (all_.to(torch.int8) * FULL + (any_ & ~all_).to(torch.int8) * PARTIAL).contiguous()


def _dense4(mask: Tensor) -> Tensor:
    """The mask as [B', H', Q, K] bool (a 2-D or 3-D mask gets leading dims of 1)."""
    m = mask
    while m.dim() < 4:
        m = m.unsqueeze(0)
    return m if m.dtype == torch.bool else m.to(torch.bool)


@dataclass(frozen=True, eq=False)
class DenseBlockLists:
    """A dense mask's block lists for its block kinds (``dense_block_kinds``), with the PARTIAL cells the bit tiles of
    each call's mask fill (``bits_of``): built once per block table, so a new mask with the same blocks costs one
    gather on its device and no host work."""

    lists: BlockLists
    """The block lists with empty bit tiles."""
    cells: Tensor
    """int64 [P, 3] on the block lists' device: (pattern, q block, kv block) of tile ``p``."""
    by_pattern: tuple = ()
    """(pattern, its tiles' ids on the block lists' device, how many) per pattern with PARTIAL tiles: what ``mod_bits``
    walks without reading the device."""

    def bits_of(self, mask: Tensor) -> BlockLists:
        """The block lists with ``mask``'s bit tiles (packed on the mask's device)."""
        if not len(self.cells):
            return self.lists
        lay = self.lists
        qb, kb = lay.q_block, lay.kv_block
        m = _dense4(mask)
        B, H, Q, K = m.shape
        nq, nk = lay.grid
        if nq * qb != Q or nk * kb != K:
            m = torch.nn.functional.pad(m, (0, nk * kb - K, 0, nq * qb - Q))
        tiles = m.reshape(B * H, nq, qb, nk, kb)[self.cells[:, 0], self.cells[:, 1], :, self.cells[:, 2], :]
        return dataclasses.replace(lay, bits=pack_bits(tiles).contiguous())


def mod_bits(dense: DenseBlockLists, element: Element, mask_heads: int) -> BlockLists:
    """``dense`` with the bit tiles of ``element`` (a BlockMask's element test over this call's buffers) evaluated on
    the block lists' device over its PARTIAL cells, pattern by pattern (pattern ``u`` is batch entry
    ``u // mask_heads``, head ``u % mask_heads`` of the kinds it was built from): what a run-time BlockMask costs per
    call at world size 1, no host work. Padded positions are evaluated clamped and come out 0."""
    lay, cells = dense.lists, dense.cells
    if not len(cells):
        return lay
    qb, kb, dev = lay.q_block, lay.kv_block, cells.device
    bits = torch.empty(len(cells), qb, (kb + 31) // 32, dtype=torch.int32, device=dev)
    for u, at, n in dense.by_pattern:
        b, h = torch.tensor(u // mask_heads, device=dev), torch.tensor(u % mask_heads, device=dev)
        bits[at] = torch.cat(list(_cell_bits(element, b, h, cells[at, 1], cells[at, 2], n, qb, kb, lay.q_len,
                                             lay.kv_len)))
    return dataclasses.replace(lay, bits=bits.contiguous())


def dense_block_lists(kinds: Tensor, *, q_len: int, kv_len: int, batch: int, num_heads: int, q_block: int,
                      kv_block: int, device: torch.device | str) -> DenseBlockLists:
    """The ``DenseBlockLists`` of a dense mask's block kinds ``kinds`` [B', H', NQ, NK] (on the host): one pattern per
    (batch entry, head) of the mask, its PARTIAL cells numbered in row-major order."""
    _check_block("q_block", q_block)
    _check_block("kv_block", kv_block)
    bm, hm, nq, nk = kinds.shape
    if bm not in (1, batch) or hm not in (1, num_heads):
        raise ValueError(f"ultraattn: a boolean mask of shape [{bm}, {hm}, ...] does not broadcast to batch {batch} "
                         f"and {num_heads} heads")
    kind_u = kinds.reshape(bm * hm, nq, nk).to(torch.int8)
    b = torch.arange(batch)[:, None] if bm > 1 else torch.zeros(batch, 1, dtype=torch.long)
    h = torch.arange(num_heads)[None, :] if hm > 1 else torch.zeros(1, num_heads, dtype=torch.long)
    pattern_of = (b * hm + h).reshape(-1).to(torch.int32)
    cells = (kind_u == PARTIAL).nonzero()
    tile_grid = torch.full(kind_u.shape, -1, dtype=torch.int32)
    tile_grid[cells[:, 0], cells[:, 1], cells[:, 2]] = torch.arange(len(cells), dtype=torch.int32)
    bits = torch.zeros(max(1, len(cells)), q_block, (kv_block + 31) // 32, dtype=torch.int32)
    lay = _assemble(kind_u, tile_grid, bits, pattern_of, q_len=q_len, kv_len=kv_len, q_block=q_block,
                    kv_block=kv_block, batch=batch, num_heads=num_heads, name="dense")
    by_pattern = tuple((u, at.to(device), len(at)) for u in cells[:, 0].unique().tolist()
                       for at in [(cells[:, 0] == u).nonzero().flatten()])
    return DenseBlockLists(lists=lay.to(device), cells=cells.to(device), by_pattern=by_pattern)
