"""Mask factories, their exact counters and the BlockPattern constructors.

The oracle for block kinds is FlexAttention's own ``create_block_mask``; the oracle for pair
counts is dense evaluation of the mask. Everything is compared exactly (``torch.equal``).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

import ultraattn.masks.convert as convert
from ultraattn.masks import (
    EMPTY,
    FULL,
    MASK_NAMES,
    PARTIAL,
    BlockPattern,
    and_masks,
    generate_causal,
    generate_document,
    generate_full,
    generate_global_local,
    generate_prefix_lm,
    generate_sliding_window,
    generate_star,
    generate_streaming,
    generate_strided,
    or_masks,
    parse_mask_spec,
    pattern_from_block_mask,
    pattern_from_dense,
    pattern_from_full,
    pattern_from_is_causal,
    pattern_from_mask_mod,
    to_block_pattern,
)

# Factory masks as functions of the sequence length S (UltraAttn's defaults plus variants).
FACTORIES = {
    "full": lambda s: generate_full(),
    "causal": lambda s: generate_causal(),
    "sliding_window": lambda s: generate_sliding_window(max(1, s // 8)),
    "sliding_window_bidir": lambda s: generate_sliding_window(max(1, s // 8) + 3, causal=False),
    "strided": lambda s: generate_strided(max(1, s // 16)),
    "strided_causal": lambda s: generate_strided(max(1, s // 16), causal=True),
    "strided_odd": lambda s: generate_strided(max(1, s // 10) + 1, stride=3, band=1),
    "strided_stride1": lambda s: generate_strided(max(1, s // 12), stride=1, band=2, causal=True),
    "global_local": lambda s: generate_global_local(max(1, s // 16), max(1, s // 16)),
    "global_local_unaligned": lambda s: generate_global_local(s // 7, s // 5 + 1),
    "star": lambda s: generate_star(max(1, s // 4)),
    "streaming": lambda s: generate_streaming(max(1, s // 8), 2, max(1, s // 8)),
    "streaming_odd": lambda s: generate_streaming(s // 9, 1, s // 6 + 1),
    "document": lambda s: generate_document([s // 4, s // 3, s // 5]),
    "document_bidir_batched": lambda s: generate_document([[s // 2, s // 3], [s], [1, 2, s - 10]], causal=False),
    "prefix_lm": lambda s: generate_prefix_lm(s // 4),
    "prefix_lm_batched": lambda s: generate_prefix_lm([s // 4, 0, s + 5]),
}
# every registered mask (masks/registry.py) not listed above, at its spec defaults: a new factory meets the oracles
FACTORIES.update({nm: (lambda s, nm=nm: parse_mask_spec(nm, s)) for nm in MASK_NAMES if nm not in FACTORIES})


def dense_mask(mask_mod, q_len: int, kv_len: int, b: int = 0, h: int = 0) -> torch.Tensor:
    q = torch.arange(q_len)[:, None]
    kv = torch.arange(kv_len)[None, :]
    return mask_mod(torch.tensor(b), torch.tensor(h), q, kv).expand(q_len, kv_len)


def flex_kind_BHQK(bm: BlockMask) -> torch.Tensor:
    """Kind grid straight from a BlockMask's index lists (independent of ultraattn.convert)."""
    q_len, kv_len = bm.seq_lengths
    qb, kb = bm.BLOCK_SIZE
    nb, nh, nq = bm.kv_num_blocks.shape
    kind = torch.zeros((nb, nh, nq, math.ceil(kv_len / kb)), dtype=torch.int8)
    for b in range(nb):
        for h in range(nh):
            for i in range(nq):
                for j in bm.kv_indices[b, h, i, : bm.kv_num_blocks[b, h, i]].tolist():
                    kind[b, h, i, j] = PARTIAL
                if bm.full_kv_indices is not None:
                    for j in bm.full_kv_indices[b, h, i, : bm.full_kv_num_blocks[b, h, i]].tolist():
                        kind[b, h, i, j] = FULL
    return kind


def as_flex_sees_it(kind_QK: torch.Tensor, q_len: int, kv_len: int, block: int) -> torch.Tensor:
    """FlexAttention pads tail blocks with masked pairs, so a tail cell is never FULL there."""
    out = kind_QK.clone()
    tail = torch.zeros(kind_QK.shape, dtype=torch.bool)
    if q_len % block:
        tail[-1, :] = True
    if kv_len % block:
        tail[:, -1] = True
    out[(out == FULL) & tail] = PARTIAL
    return out


# ----------------------------------------------------------------------------- FlexAttention oracle
@pytest.mark.parametrize("block", [64, 128])
@pytest.mark.parametrize("seq", [256, 232, 97, 1025])
@pytest.mark.parametrize("which", list(FACTORIES))
def test_kinds_match_create_block_mask(which, seq, block):
    mask_mod = FACTORIES[which](seq)
    nb = mask_mod.num_batch
    bm = create_block_mask(mask_mod, nb, 2, seq, seq, device="cpu", BLOCK_SIZE=block)
    flex = flex_kind_BHQK(bm)
    pattern = pattern_from_mask_mod(mask_mod, seq, block_size=block, num_heads=2)
    assert pattern.num_head_groups == 1 and pattern.head_group_of is None
    ours = pattern.kind_BGQK.expand(nb, 2, *pattern.grid)
    for b in range(nb):
        for h in range(2):
            assert torch.equal(as_flex_sees_it(ours[b, h], seq, seq, block), flex[b, h]), (b, h)
    # Round trip: a BlockMask's PARTIAL cells are recounted exactly, tails included.
    assert pattern_from_block_mask(bm) == pattern


def test_flex_never_marks_tail_blocks_full():
    """Why tails differ: create_block_mask pads to whole blocks with False before classifying."""
    bm = create_block_mask(generate_full(), 1, 1, 232, 232, device="cpu", BLOCK_SIZE=64)
    flex = flex_kind_BHQK(bm)[0, 0]
    assert (flex[:3, :3] == FULL).all()
    assert (flex[3, :] == PARTIAL).all() and (flex[:, 3] == PARTIAL).all()
    ours = pattern_from_full(232, block_size=64)
    assert (ours.kind_BGQK == FULL).all()
    assert ours.count_BGQK[0, 0, 3, 3] == 40 * 40 and ours.count_BGQK.sum() == 232 * 232
    assert pattern_from_block_mask(bm) == ours


def test_rectangular_and_unequal_blocks():
    mask_mod = generate_sliding_window(50, causal=False)
    bm = create_block_mask(mask_mod, 1, 1, 300, 170, device="cpu", BLOCK_SIZE=(64, 32))
    pattern = pattern_from_mask_mod(mask_mod, 300, 170, block_size=(64, 32))
    assert (pattern.q_block, pattern.kv_block, pattern.grid) == (64, 32, (5, 6))
    flex = flex_kind_BHQK(bm)[0, 0]
    assert torch.equal(flex[:-1, :-1], pattern.kind_BGQK[0, 0, :-1, :-1])
    assert pattern_from_block_mask(bm) == pattern
    dense = dense_mask(mask_mod, 300, 170)
    assert pattern_from_dense(dense, block_size=(64, 32)) == pattern


# ----------------------------------------------------------------------------- exact counters
@pytest.mark.parametrize("which", list(FACTORIES))
def test_counter_matches_dense_on_random_rectangles(which):
    seq = 83
    mask_mod = FACTORIES[which](seq)
    gen = torch.Generator().manual_seed(0)
    for b in range(mask_mod.num_batch):
        d = dense_mask(mask_mod, seq, seq, b).long()
        pre = torch.zeros(seq + 1, seq + 1, dtype=torch.long)
        pre[1:, 1:] = d.cumsum(0).cumsum(1)
        x = torch.randint(0, seq + 1, (3000, 4), generator=gen)
        q0, q1 = x[:, 0].minimum(x[:, 1]), x[:, 0].maximum(x[:, 1])
        k0, k1 = x[:, 2].minimum(x[:, 3]), x[:, 2].maximum(x[:, 3])
        want = pre[q1, k1] - pre[q0, k1] - pre[q1, k0] + pre[q0, k0]
        assert torch.equal(mask_mod.count_pairs(q0, q1, k0, k1, b=b), want)
        # inverted ranges are empty
        assert not mask_mod.count_pairs(q1, q0 - 1, k0, k1, b=b).any()
        assert not mask_mod.count_pairs(q0, q1, k1, k0 - 1, b=b).any()
        # broadcasting over a grid, python ints and 0-d tensors
        e = torch.tensor([0, 5, 17, 40, 83])
        grid = mask_mod.count_pairs(e[:-1, None], e[1:, None], e[None, :-1], e[None, 1:], b=b)
        assert grid.shape == (4, 4) and int(grid.sum()) == int(d.sum())
        assert int(mask_mod.count_pairs(0, seq, 0, seq, b=b)) == int(d.sum())
        assert int(mask_mod.count_pairs(torch.tensor(9), 9, 0, seq, b=b)) == 0


@pytest.mark.parametrize("block", [16, 13])
@pytest.mark.parametrize("which", list(FACTORIES))
def test_pattern_counts_match_dense(which, block):
    seq = 97
    mask_mod = FACTORIES[which](seq)
    nb = mask_mod.num_batch
    dense_BHQK = torch.stack([dense_mask(mask_mod, seq, seq, b) for b in range(nb)])[:, None]
    want = pattern_from_dense(dense_BHQK, block_size=block)
    got = pattern_from_mask_mod(mask_mod, seq, block_size=block, batch=nb)
    assert got == want
    # the dense path (a copy of the mask without its counter) agrees too
    plain = pattern_from_mask_mod(lambda b, h, q, kv: mask_mod(b, h, q, kv), seq, block_size=block, batch=nb)
    assert plain == want


@pytest.mark.parametrize("which", list(FACTORIES))
def test_coarse_to_fine_equals_direct(which, monkeypatch):
    """Large grids are classified on super-cells first; shrink the thresholds to test that path."""
    seq, block = 2001, 8  # 251 x 251 cells: super-cells of 16 x 16, the last ones clipped
    mask_mod = FACTORIES[which](seq)
    direct = pattern_from_mask_mod(mask_mod, seq, block_size=block)
    monkeypatch.setattr(convert, "_DIRECT_CELLS", 1000)
    monkeypatch.setattr(convert, "_COARSE_SIDE", 16)
    fast = pattern_from_mask_mod(mask_mod, seq, block_size=block)
    assert fast == direct
    total = sum(int(mask_mod.count_pairs(0, seq, 0, seq, b=b)) for b in range(mask_mod.num_batch))
    assert int(fast.count_BGQK.sum()) * (mask_mod.num_batch // fast.num_batch_patterns) == total


def test_counter_huge_band_is_cheap():
    m = generate_strided(3, stride=5, band=10**9)
    seq = 200
    d = dense_mask(m, seq, seq)
    assert int(m.count_pairs(0, seq, 0, seq)) == int(d.sum())


# ----------------------------------------------------------------------------- UltraAttn tables
def test_ultraattn_strided_table():
    seq = 1024
    kind = pattern_from_mask_mod(generate_strided(seq // 16), seq, block_size=seq // 16).kind_BGQK[0, 0]
    assert kind.shape == (16, 16) and int((kind != EMPTY).sum()) == 56 and set(kind.unique().tolist()) == {EMPTY, FULL}
    perm = sorted(range(16), key=lambda b: (b % 4, b // 4))
    permuted = kind[perm][:, perm]
    i = torch.arange(4)
    group = torch.where((i[:, None] - i[None, :]).abs() <= 2, FULL, EMPTY).to(torch.int8)
    assert torch.equal(permuted, torch.block_diag(*[group] * 4))


def test_ultraattn_global_local_table():
    seq = 1024
    kind = pattern_from_mask_mod(generate_global_local(seq // 16, seq // 16), seq, block_size=seq // 16).kind_BGQK[0, 0]
    want = torch.zeros(16, 16, dtype=torch.int8)
    want[0, :] = FULL
    want[:, 0] = FULL
    want[torch.arange(16), torch.arange(16)] = FULL
    assert torch.equal(kind, want) and int((kind != EMPTY).sum()) == 46


def test_ultraattn_star_table():
    seq = 1024
    p = pattern_from_mask_mod(generate_star(seq // 4), seq, block_size=seq // 4)
    kind = p.kind_BGQK[0, 0]
    want = torch.zeros(4, 4, dtype=torch.int8)
    want[1:, 0] = FULL
    want[torch.arange(4), torch.arange(4)] = PARTIAL
    assert torch.equal(kind, want)
    u = seq // 4
    assert int(p.count_BGQK.sum()) == 3 * u * u + 4 * u * (u + 1) // 2
    assert abs(p.density() - 0.3125) < 1e-3


def test_ultraattn_streaming_table():
    seq = 1024
    p = pattern_from_mask_mod(generate_streaming(seq // 8, 2, seq // 8), seq, block_size=seq // 8)
    kind = p.kind_BGQK[0, 0]
    i = torch.arange(8)
    delta = i[:, None] - i[None, :]
    want = torch.zeros(8, 8, dtype=torch.int8)
    want[(delta >= 1) & ((delta <= 2) | (i[None, :] == 0))] = FULL
    want[delta == 0] = PARTIAL
    assert torch.equal(kind, want)
    assert (int((kind == FULL).sum()), int((kind == PARTIAL).sum())) == (18, 8)
    u = seq // 8
    assert int(p.count_BGQK.sum()) == 18 * u * u + 8 * u * (u + 1) // 2
    assert abs(p.density() - 22 / 64) < 1e-3


def test_large_sequence_patterns():
    """S = 512K with 512-token blocks: every factory builds analytically (dense would be 2**38 pairs)."""
    s = 512 * 1024
    w = s // 8
    cells = (s // 512) ** 2
    causal = s * (s + 1) // 2
    expected_pairs = {
        "full": s * s,
        "causal": causal,
        "sliding_window": w * (w + 1) // 2 + (s - w) * w,
        "strided": 56 * (s // 16) ** 2,
        "global_local": 46 * (s // 16) ** 2,
        "star": 3 * (s // 4) ** 2 + 4 * (s // 4) * (s // 4 + 1) // 2,
        "streaming": 18 * (s // 8) ** 2 + 8 * (s // 8) * (s // 8 + 1) // 2,
        "document": 4 * (s // 4) * (s // 4 + 1) // 2,
        "prefix_lm": causal + (s // 4) * (s // 4 - 1) // 2,
    }
    masks = {
        "full": generate_full(),
        "causal": generate_causal(),
        "sliding_window": generate_sliding_window(w),
        "strided": generate_strided(s // 16),
        "global_local": generate_global_local(s // 16, s // 16),
        "star": generate_star(s // 4),
        "streaming": generate_streaming(s // 8, 2, s // 8),
        "document": generate_document([s // 4] * 4),
        "prefix_lm": generate_prefix_lm(s // 4),
    }
    for name, m in masks.items():
        p = pattern_from_mask_mod(m, s, block_size=512, batch=2, num_heads=8)
        assert p.kind_BGQK.shape == (1, 1, 1024, 1024), name
        assert int(p.count_BGQK.sum()) == expected_pairs[name], name
    strided = pattern_from_mask_mod(masks["strided"], s, block_size=512)
    assert int((strided.kind_BGQK == FULL).sum()) == 56 * cells // 256
    assert int((strided.kind_BGQK == PARTIAL).sum()) == 0


# ----------------------------------------------------------------------------- batch / heads / composition
def test_per_batch_masks_give_batch_patterns():
    doc = generate_document([[30, 70], [100], [30, 70]])
    assert doc.num_batch == 3
    p = pattern_from_mask_mod(doc, 100, block_size=16, batch=3)
    assert p.num_batch_patterns == 3 and torch.equal(p.kind_BGQK[0], p.kind_BGQK[2])
    assert not torch.equal(p.kind_BGQK[0], p.kind_BGQK[1])
    same = pattern_from_mask_mod(generate_prefix_lm([10, 10]), 64, block_size=16)
    assert same.num_batch_patterns == 1  # identical entries collapse
    with pytest.raises(ValueError, match=r"`batch` must be 1 or 3"):
        pattern_from_mask_mod(doc, 100, block_size=16, batch=2)
    with pytest.raises(ValueError, match=r"`b` must lie in \[0, 3\)"):
        doc.count_pairs(0, 10, 0, 10, b=3)


def test_head_dependent_mask_groups_heads():
    causal, full = generate_causal(), generate_full()

    def by_head(b, h, q, kv):
        return torch.where(h % 2 == 0, causal(b, h, q, kv), full(b, h, q, kv))

    p = pattern_from_mask_mod(by_head, 200, block_size=64, num_heads=4)
    assert p.head_group_of == (0, 1, 0, 1) and p.num_head_groups == 2
    assert torch.equal(p.kind_BGQK[0, 0], pattern_from_is_causal(200, block_size=64).kind_BGQK[0, 0])
    assert (p.kind_BGQK[0, 1] == FULL).all()
    bm = create_block_mask(by_head, 1, 4, 200, 200, device="cpu", BLOCK_SIZE=64)
    assert pattern_from_block_mask(bm) == p
    assert p.heads_per_group(4) == [2, 2]


def test_composed_masks_use_dense_evaluation():
    seq = 300
    m = and_masks(generate_causal(), or_masks(generate_sliding_window(40), generate_global_local(16, 1)))
    assert not hasattr(m, "count_pairs")
    p = pattern_from_mask_mod(m, seq, block_size=32)
    assert p == pattern_from_dense(dense_mask(m, seq, seq), block_size=32)
    bm = create_block_mask(m, 1, 1, seq, seq, device="cpu", BLOCK_SIZE=32)
    assert torch.equal(as_flex_sees_it(p.kind_BGQK[0, 0], seq, seq, 32), flex_kind_BHQK(bm)[0, 0])
    assert pattern_from_block_mask(bm) == p


def test_scalar_only_mask_mod_falls_back_to_vmap():
    def scalar_only(b, h, q, kv):  # reshape(1) only works on 0-d inputs (as vmap gives them)
        return (kv.reshape(1) <= q.reshape(1))[0]

    got = pattern_from_mask_mod(scalar_only, 40, block_size=16)
    assert got == pattern_from_is_causal(40, block_size=16)


def test_dense_evaluation_limit():
    m = and_masks(generate_causal(), generate_full())
    with pytest.raises(ValueError, match=r"no analytic counter.*shorter sequence or a factory mask"):
        pattern_from_mask_mod(m, 2**16, block_size=128)


# ----------------------------------------------------------------------------- BlockMask specifics
def test_block_mask_without_full_blocks_is_recounted():
    m = generate_sliding_window(100)
    bm = create_block_mask(m, 1, 1, 512, 512, device="cpu", BLOCK_SIZE=64, separate_full_blocks=False)
    assert bm.full_kv_indices is None
    assert pattern_from_block_mask(bm) == pattern_from_mask_mod(m, 512, block_size=64)


def test_block_mask_upper_estimate_past_limit(monkeypatch):
    m = and_masks(generate_causal(), generate_sliding_window(100))  # no counter
    bm = create_block_mask(m, 1, 1, 512, 512, device="cpu", BLOCK_SIZE=64)
    monkeypatch.setattr(convert, "MAX_PARTIAL_EVAL_PAIRS", 0)
    p = pattern_from_block_mask(bm)
    flex = flex_kind_BHQK(bm)[0, 0]
    assert torch.equal(p.kind_BGQK[0, 0], flex)
    assert torch.equal(p.count_BGQK[0, 0], torch.where(flex != EMPTY, 64 * 64, 0))


def test_block_mask_from_kv_blocks_noop_mask():
    num = torch.tensor([[[1, 2]]], dtype=torch.int32)
    idx = torch.tensor([[[[0, 1], [1, 0]]]], dtype=torch.int32)
    bm = BlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=32, seq_lengths=(64, 50))
    p = pattern_from_block_mask(bm)  # noop mask_mod: every pair of a listed block attends
    assert torch.equal(p.kind_BGQK[0, 0], torch.tensor([[FULL, EMPTY], [FULL, FULL]], dtype=torch.int8))
    assert torch.equal(p.count_BGQK[0, 0], torch.tensor([[32 * 32, 0], [32 * 32, 32 * 18]]))


# ----------------------------------------------------------------------------- other constructors
def test_pattern_from_dense_shapes_and_errors():
    m = torch.rand(2, 3, 50, 70) > 0.5
    m[:, 1] = m[:, 0]
    p = pattern_from_dense(m, block_size=16)
    assert p.num_batch_patterns == 2 and p.head_group_of == (0, 0, 1)
    assert int(p.count_BGQK.sum()) == int(m[:, [0, 2]].sum())
    two_d = pattern_from_dense(torch.ones(10, 20, dtype=torch.bool), block_size=8)
    assert (two_d.kind_BGQK == FULL).all() and two_d.grid == (2, 3)
    with pytest.raises(TypeError, match="must be a bool tensor"):
        pattern_from_dense(torch.zeros(4, 4))
    with pytest.raises(ValueError, match=r"\[Q, K\] or \[B, H, Q, K\]"):
        pattern_from_dense(torch.ones(2, 4, 4, dtype=torch.bool))


def test_is_causal_matches_sdpa_semantics():
    q_len, kv_len = 100, 150
    tril = torch.ones(q_len, kv_len, dtype=torch.bool).tril()  # what SDPA's is_causal masks with
    assert pattern_from_is_causal(q_len, kv_len, block_size=32) == pattern_from_dense(tril, block_size=32)
    full = pattern_from_full(q_len, kv_len, block_size=32)
    assert (full.kind_BGQK == FULL).all() and full.density() == 1.0


def test_to_block_pattern_dispatch():
    causal = pattern_from_is_causal(128, block_size=32)
    assert to_block_pattern(causal) is causal
    assert to_block_pattern("causal", q_len=128, block_size=32) == causal
    assert to_block_pattern(generate_causal(), q_len=128, block_size=32) == causal
    assert to_block_pattern(torch.ones(128, 128, dtype=torch.bool).tril(), block_size=32) == causal
    bm = create_block_mask(generate_causal(), 1, 1, 128, 128, device="cpu", BLOCK_SIZE=32)
    assert to_block_pattern(bm, q_len=128) == causal
    assert to_block_pattern("full", q_len=64, kv_len=32, block_size=32).grid == (2, 1)
    with pytest.raises(ValueError, match="must be one of 'causal', 'full'"):
        to_block_pattern("sliding", q_len=128)
    with pytest.raises(ValueError, match="`q_len` is required"):
        to_block_pattern("causal")
    with pytest.raises(ValueError, match="`q_len` is required"):
        to_block_pattern(generate_causal())
    with pytest.raises(ValueError, match="disagree"):
        to_block_pattern(bm, q_len=256)
    with pytest.raises(TypeError, match="must be a BlockPattern, BlockMask, mask_mod"):
        to_block_pattern(42)
    with pytest.raises(TypeError, match="BlockMask"):
        pattern_from_block_mask("causal")
    with pytest.raises(TypeError, match="callable"):
        pattern_from_mask_mod(3, 10)
    with pytest.raises(ValueError, match="`q_len` must be positive, got 0"):
        pattern_from_mask_mod(generate_causal(), 0)
    with pytest.raises(ValueError, match="`block_size` must be positive, got -1"):
        pattern_from_mask_mod(generate_causal(), 10, block_size=-1)


# ----------------------------------------------------------------------------- factory validation and names
@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: generate_sliding_window(-3), r"`window` must be positive, got -3"),
        (lambda: generate_sliding_window(0), r"`window` must be positive, got 0"),
        (lambda: generate_strided(0), r"`block` must be positive, got 0"),
        (lambda: generate_strided(8, stride=0), r"`stride` must be positive, got 0"),
        (lambda: generate_strided(8, band=-1), r"`band` must be >= 0, got -1"),
        (lambda: generate_global_local(-1, 4), r"`num_global` must be >= 0, got -1"),
        (lambda: generate_global_local(4, 0), r"`window` must be positive, got 0"),
        (lambda: generate_star(0), r"`block` must be positive, got 0"),
        (lambda: generate_streaming(-1, 2, 4), r"`sink` must be >= 0, got -1"),
        (lambda: generate_streaming(4, -2, 4), r"`window` must be >= 0, got -2"),
        (lambda: generate_streaming(4, 2, 0), r"`block` must be positive, got 0"),
        (lambda: generate_document([]), r"`lengths` must be a non-empty list"),
        (lambda: generate_document([3, 0]), r"`lengths` entries must be positive ints, got 0"),
        (lambda: generate_document([[3], []]), r"`lengths` of batch entry 1 must not be empty"),
        (lambda: generate_document([[3], 4]), r"not a mix"),
        (lambda: generate_prefix_lm(-1), r"`prefix` must be >= 0, got -1"),
        (lambda: generate_prefix_lm([]), r"`prefix` must be an int or a non-empty list"),
    ],
)
def test_invalid_factory_params_raise_value_error(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_wrong_param_types_raise_type_error():
    with pytest.raises(TypeError, match=r"`window` must be an int, got 1.5"):
        generate_sliding_window(1.5)
    with pytest.raises(TypeError, match=r"`causal` must be a bool, got 'yes'"):
        generate_strided(4, causal="yes")


def test_names_carry_parameters():
    assert generate_sliding_window(1024).__name__ == "sliding_window(window=1024,causal=True)"
    assert generate_strided(64).__name__ == "strided(block=64,stride=4,band=2,causal=False)"
    assert generate_global_local(8, 16).__name__ == "global_local(num_global=8,window=16)"
    assert generate_star(4).__name__ == "star(block=4)"
    assert generate_streaming(8, 2, 8).__name__ == "streaming(sink=8,window=2,block=8)"
    assert generate_document([2, 3], causal=False).__name__ == "document(lengths=[2,3],causal=False)"
    assert generate_document([1] * 20).__name__ == "document(docs=20,tokens=20,causal=True)"
    assert generate_prefix_lm([1, 2]).__name__ == "prefix_lm(prefix=[1,2])"
    assert pattern_from_mask_mod(generate_star(4), 16, block_size=4).name == "star(block=4)"


def test_tokens_past_documents_attend_nothing():
    m = generate_document([3, 4], causal=False)
    d = dense_mask(m, 12, 12)
    assert not d[7:].any() and not d[:, 7:].any()
    assert int(d.sum()) == 9 + 16
    assert isinstance(pattern_from_mask_mod(m, 12, block_size=4), BlockPattern)


def test_mask_listing_main_prints(capsys):
    from ultraattn.masks import spec

    spec.main()
    out = capsys.readouterr().out
    assert "strided(block=2,stride=4,band=2,causal=False)" in out and "#" in out


def test_eval_mask_retries_on_the_device_of_the_mask_tables(monkeypatch):
    """A mask_mod whose tables live on another device than the indices (a document mask built for CUDA, evaluated
    for block lists on CPU indices: the first GPU check's kernel-speed part) is evaluated there and brought back; any
    other error is the user's and propagates. Only a CPU here: the other device is stood in for by a CPU whose
    mask_mod refuses both first calls (broadcast, then vmap) with PyTorch's device-mismatch message."""
    doc = generate_document([40, 24])
    calls = []

    def picky(b, h, q, kv):
        calls.append(q.device)
        if len(calls) <= 2:   # the first evaluation, both ways: only the retry elsewhere succeeds
            raise RuntimeError("Expected all tensors to be on the same device, but found at least two devices")
        return doc(b, h, q, kv)

    idx = torch.arange(64)
    b, h, q, kv = torch.tensor(0), torch.tensor(0), idx[:, None], idx[None, :]
    monkeypatch.setattr(convert, "_other_device", lambda device: torch.device("cpu"))
    got = convert.eval_mask(picky, b, h, q, kv)
    assert torch.equal(got, doc(b, h, q, kv)) and len(calls) == 3

    def broken(b, h, q, kv):
        raise RuntimeError("index 99 is out of bounds")

    with pytest.raises(RuntimeError, match="out of bounds"):
        convert.eval_mask(broken, b, h, q, kv)

    def elsewhere(b, h, q, kv):
        raise RuntimeError("Expected all tensors to be on the same device, but found at least two devices")

    with pytest.raises(RuntimeError, match="same device"):   # retried once on the other device, then raised
        convert.eval_mask(elsewhere, b, h, q, kv)
    monkeypatch.setattr(convert, "_other_device", lambda device: None)   # CPU only, no CUDA: nothing to retry on
    with pytest.raises(RuntimeError, match="same device"):
        convert.eval_mask(elsewhere, b, h, q, kv)
