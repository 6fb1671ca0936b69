"""Masks: mask_mod factories, ``BlockPattern`` and its constructors, CLI mask specs (re-exports only)."""

from ultraattn.masks.convert import (
    pattern_from_block_mask,
    pattern_from_dense,
    pattern_from_full,
    pattern_from_is_causal,
    pattern_from_mask_mod,
    to_block_pattern,
)
from ultraattn.masks.factories import (
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
)
from ultraattn.masks.pattern import EMPTY, FULL, PARTIAL, BlockPattern
from ultraattn.masks.spec import MASK_NAMES, describe_masks, parse_mask_spec

__all__ = [
    "EMPTY",
    "FULL",
    "PARTIAL",
    "BlockPattern",
    "MASK_NAMES",
    "and_masks",
    "or_masks",
    "describe_masks",
    "generate_causal",
    "generate_document",
    "generate_full",
    "generate_global_local",
    "generate_prefix_lm",
    "generate_sliding_window",
    "generate_star",
    "generate_streaming",
    "generate_strided",
    "parse_mask_spec",
    "pattern_from_block_mask",
    "pattern_from_dense",
    "pattern_from_full",
    "pattern_from_is_causal",
    "pattern_from_mask_mod",
    "to_block_pattern",
]
