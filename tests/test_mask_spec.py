"""CLI mask specs: defaults (UltraAttn's experiment patterns), overrides, suffixes, errors."""

from __future__ import annotations

import re

import pytest
import torch

from ultraattn.masks import EMPTY, MASK_NAMES, MASKS, MaskKind, describe_masks, parse_mask_spec, pattern_from_mask_mod

S = 1 << 20


@pytest.mark.parametrize(
    ("spec", "name"),
    [
        ("full", "full"),
        ("causal", "causal"),
        ("sliding_window", f"sliding_window(window={S // 8},causal=True)"),
        ("strided", f"strided(block={S // 16},stride=4,band=2,causal=False)"),
        ("global_local", f"global_local(num_global={S // 16},window={S // 16})"),
        ("star", f"star(block={S // 4})"),
        ("streaming", f"streaming(sink={S // 8},window=2,block={S // 8})"),
        ("document", f"document(lengths=[{S // 4},{S // 4},{S // 4},{S // 4}],causal=True)"),
        ("prefix_lm", f"prefix_lm(prefix={S // 4})"),
    ],
)
def test_defaults(spec, name):
    m = parse_mask_spec(spec, S)
    assert m.__name__ == name
    assert hasattr(m, "count_pairs") and m.num_batch == 1


ORIGINAL = ("full", "causal", "sliding_window", "strided", "global_local", "star", "streaming", "document", "prefix_lm")


def test_every_name_has_a_default():
    # the names are the registry's, in registration order (the original nine first, in their order)
    assert MASK_NAMES == tuple(MASKS) == tuple(MaskKind) and MASK_NAMES[:len(ORIGINAL)] == ORIGINAL
    for name in MASK_NAMES:
        m = parse_mask_spec(name, 4096)
        assert callable(m) and hasattr(m, "count_pairs") and m.num_batch == 1, name
        assert m.__name__.partition("(")[0] == name == MaskKind(name) == getattr(MaskKind, name.upper())


def test_mask_kinds_read_as_their_names():
    """MaskKind members are the bare strings they replace: equal, hashed, printed and JSON-encoded alike."""
    import json

    assert MaskKind.CAUSAL == "causal" and {"causal": 1}[MaskKind.CAUSAL] == 1
    assert str(MaskKind.SLIDING_WINDOW) == f"{MaskKind.SLIDING_WINDOW}" == "sliding_window"
    assert json.dumps({"mask": MaskKind.DOCUMENT, MaskKind.FULL: 1}) == '{"mask": "document", "full": 1}'


@pytest.mark.parametrize(
    ("spec", "name"),
    [
        ("strided:stride=4,band=2", f"strided(block={S // 16},stride=4,band=2,causal=False)"),
        ("strided:block=64k,stride=2,band=1,causal=true", "strided(block=65536,stride=2,band=1,causal=True)"),
        ("sliding_window:window=4096,causal=false", "sliding_window(window=4096,causal=False)"),
        ("sliding_window:window=0.5", f"sliding_window(window={S // 2},causal=True)"),
        ("sliding_window:window=.25", f"sliding_window(window={S // 4},causal=True)"),
        ("global_local:num_global=1k,window=64K", "global_local(num_global=1024,window=65536)"),
        ("star:block=1m", "star(block=1048576)"),
        ("streaming:sink=0,window=5,block=4096", "streaming(sink=0,window=5,block=4096)"),
        ("document:lengths=1000+3000+2000,causal=true", "document(lengths=[1000,3000,2000],causal=True)"),
        ("document:lengths=1k+2k,causal=false", "document(lengths=[1024,2048],causal=False)"),
        ("document:docs=2", f"document(lengths=[{S // 2},{S // 2}],causal=True)"),
        ("prefix_lm:prefix=0.25", f"prefix_lm(prefix={S // 4})"),
        ("prefix_lm:prefix=100", "prefix_lm(prefix=100)"),
        (" sliding_window : window = 8 , causal = FALSE ", "sliding_window(window=8,causal=False)"),
        ("causal:", "causal"),
    ],
)
def test_overrides_and_suffixes(spec, name):
    assert parse_mask_spec(spec, S).__name__ == name


def test_equal_documents_cover_the_sequence():
    m = parse_mask_spec("document:docs=3", 10)
    assert m.__name__ == "document(lengths=[4,3,3],causal=True)"
    assert int(m.count_pairs(0, 10, 0, 10)) == 10 + 6 + 6


def test_small_sequences_keep_positive_defaults():
    m = parse_mask_spec("strided", 10)  # S/16 rounds down to 0: at least one token
    assert m.__name__ == "strided(block=1,stride=4,band=2,causal=False)"


def test_default_spec_reproduces_ultraattn_strided_table():
    seq = 4096
    p = pattern_from_mask_mod(parse_mask_spec("strided", seq), seq, block_size=seq // 16)
    assert int((p.kind_BGQK != EMPTY).sum()) == 56
    assert p.density() == pytest.approx(56 / 256)
    g = pattern_from_mask_mod(parse_mask_spec("global_local", seq), seq, block_size=seq // 16)
    assert int((g.kind_BGQK != EMPTY).sum()) == 46


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("foo", re.escape(f"mask must be one of {', '.join(MASK_NAMES)}, got 'foo'")),
        ("foo", r"mask must be one of full, causal, sliding_window, strided, global_local, star, streaming, "
                r"document, prefix_lm\b.*, got 'foo'"),
        ("", r"mask must be one of .*, got ''"),
        ("strided:width=3", r"mask 'strided' has no parameter 'width'; valid parameters: block, stride, band, causal"),
        ("causal:window=3", r"mask 'causal' has no parameter 'window'; valid parameters: none"),
        ("star:block", r"mask parameters must be written key=value, got 'block'"),
        ("star:block=", r"key=value"),
        ("star:block=4,block=8", r"parameter 'block' of mask 'star' is given twice"),
        ("sliding_window:window=abc", r"`window` must be a token count .* got 'abc'"),
        ("sliding_window:window=1.5", r"`window` must be a token count .* got '1.5'"),
        ("sliding_window:window=-4", r"`window` must be a token count .* got '-4'"),
        ("sliding_window:window=0.0000001", r"`window` must be at least one token, got '0.0000001'"),
        ("sliding_window:window=0", r"invalid mask spec .*`window` must be positive, got 0"),
        ("sliding_window:causal=maybe", r"`causal` must be true or false, got 'maybe'"),
        ("strided:stride=0", r"invalid mask spec 'strided:stride=0': `stride` must be positive, got 0"),
        ("strided:stride=2.5", r"`stride` must be a non-negative integer, got '2.5'"),
        ("strided:band=-1", r"`band` must be a non-negative integer, got '-1'"),
        ("streaming:window=1k", r"`window` must be a non-negative integer, got '1k'"),
        ("document:docs=0", r"`docs` must lie in \[1, seq_len=1048576\], got 0"),
        ("document:docs=8,lengths=1+2", r"takes `lengths` or `docs`, not both"),
        ("document:lengths=1m+1", r"`lengths` must sum to at most seq_len=1048576, got '1m\+1'"),
        ("document:lengths=5++3", r"`lengths` must be a token count .* got ''"),
        ("prefix_lm:prefix=x", r"`prefix` must be a token count"),
    ],
)
def test_errors(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_mask_spec(spec, S)


def test_bad_arguments():
    with pytest.raises(TypeError, match="`spec` must be a str"):
        parse_mask_spec(3, S)
    with pytest.raises(TypeError, match="`seq_len` must be an int"):
        parse_mask_spec("causal", 10.0)
    with pytest.raises(ValueError, match="`seq_len` must be positive, got 0"):
        parse_mask_spec("causal", 0)


def test_describe_masks_lists_names_params_and_defaults():
    text = describe_masks()
    for name in MASK_NAMES:
        assert f"  {name} " in text
    for fragment in ("block=S/16, stride=4, band=2, causal=false", "num_global=S/16, window=S/16", "block=S/4",
                     "sink=S/8, window=2 (blocks), block=S/8", "window=S/8, causal=true", "docs=4 equal documents",
                     "prefix=S/4", "64k"):
        assert fragment in text


def test_spec_masks_work_with_flex_attention():
    from torch.nn.attention.flex_attention import create_block_mask

    for name in MASK_NAMES:
        m = parse_mask_spec(name, 256)
        bm = create_block_mask(m, 1, 1, 256, 256, device="cpu", BLOCK_SIZE=32)
        assert int(bm.kv_num_blocks.sum()) + int(bm.full_kv_num_blocks.sum()) > 0
        assert torch.equal(
            pattern_from_mask_mod(m, 256, block_size=32).kind_BGQK[0, 0] != EMPTY,
            (bm.to_dense()[0, 0] != 0),
        ), name
