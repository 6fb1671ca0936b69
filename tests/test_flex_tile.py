"""Tiles on FlexAttention (``kernels/flex_tile.py``): our block lists as flex's BlockMask, and a row split into KV
tiles, merged by LSE and differentiated with the merged statistics, equal to one dense attention (fp64)."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from ultraattn import masks
from ultraattn.kernels import flex_tile as FT
from ultraattn.kernels import make_block_lists
from ultraattn.kernels.reference import softmax_delta
from ultraattn.runtime.tiles import merge_partial
from ultraattn.testing import dense_attention

B, H, HK, D = 2, 4, 2, 16
S = 320  # not a multiple of the 128 block: tails in both axes


def _mask(name: str):
    if name == "document":
        return masks.generate_document([100, 60, 160])
    if name == "sliding_window":
        return masks.generate_sliding_window(window=70)
    return masks.generate_causal()


def _inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, S, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, HK, S, D, generator=g, dtype=torch.float64) for _ in range(2))
    go, gl = torch.randn(B, H, S, D, generator=g, dtype=torch.float64), torch.randn(B, H, S, generator=g,
                                                                                      dtype=torch.float64)
    return q, k, v, go, gl


def _tile_mask(mm, n_kv: int, off: int, bits: bool):
    def shifted(b, h, q_idx, kv_idx):
        return mm(b, h, q_idx, kv_idx + off)

    bm = create_block_mask(shifted, None, None, S, n_kv, device="cpu", BLOCK_SIZE=128)
    lists = make_block_lists(bm, q_len=S, kv_len=n_kv, batch=B, num_heads=H, mask_mod=shifted)
    return FT.block_mask_of(lists, None if bits else shifted)


@pytest.mark.parametrize("name", ["causal", "document", "sliding_window"])
def test_bit_tiles_as_a_block_mask_give_flex_its_own_output(name):
    q, k, v, *_ = _inputs(0)
    mm = _mask(name)
    bm = create_block_mask(mm, None, None, S, S, device="cpu", BLOCK_SIZE=128)
    lists = make_block_lists(bm, q_len=S, kv_len=S, batch=B, num_heads=H, mask_mod=mm)
    want = flex_attention(q, k, v, block_mask=bm, enable_gqa=True)
    got = flex_attention(q, k, v, block_mask=FT.block_mask_of(lists), enable_gqa=True)
    assert torch.equal(got, want)


@pytest.mark.parametrize("bits", [False, True], ids=["mask_mod", "bit_tiles"])
@pytest.mark.parametrize("name", ["causal", "document", "sliding_window"])
def test_kv_tiles_merged_and_differentiated_with_merged_statistics_are_one_attention(name, bits):
    q, k, v, go, gl = _inputs(1)
    mm = _mask(name)
    scale = 1.0 / math.sqrt(D)
    cut = 128
    tiles = [(0, cut), (cut, S - cut)]
    bms = [_tile_mask(mm, n, off, bits) for off, n in tiles]
    parts = [FT.flex_forward(q, k[:, :, off:off + n], v[:, :, off:off + n], bm, scale)
             for (off, n), bm in zip(tiles, bms)]
    out, lse = functools.reduce(merge_partial, parts, None)   # as the runtime merges a row's partials
    delta = softmax_delta(out, go, gl)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for (off, n), bm in zip(tiles, bms):
        a, b, c = FT.flex_backward(q, k[:, :, off:off + n], v[:, :, off:off + n], lse, delta, go, bm, scale)
        dq += a
        dk[:, :, off:off + n] += b
        dv[:, :, off:off + n] += c
    idx = torch.arange(S)
    zero = torch.zeros((), dtype=torch.long)
    ref = dense_attention(q, k, v, mm(zero, zero, idx[:, None], idx[None, :]), go, gl, torch.float64)
    # fp64 throughout, but the tiles' LSE is fp32 (FlexAttention keeps it so): the merged output and the gradients
    # carry its rounding, ~1e-7 of their scale
    for name_, got in (("out", out), ("lse", lse), ("dq", dq), ("dk", dk), ("dv", dv)):
        want = ref[name_]
        assert (got.double() - want).abs().max() <= 1e-5 * max(1.0, float(want.abs().max())), name_
