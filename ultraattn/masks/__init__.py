"""Masks: mask_mod factories (registered in ``masks/registry.py``), ``BlockPattern`` and its constructors, CLI mask
specs (re-exports only)."""

from ultraattn.masks.convert import (
    pattern_from_block_mask,
    pattern_from_dense,
    pattern_from_full,
    pattern_from_is_causal,
    pattern_from_mask_mod,
    to_block_pattern,
)
from ultraattn.masks.factories import (
    MaskKind,
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
from ultraattn.masks.registry import MASKS
from ultraattn.masks.spec import MASK_NAMES, describe_masks, parse_mask_spec

__all__ = [
    "EMPTY",
    "FULL",
    "PARTIAL",
    "BlockPattern",
    "MASK_NAMES",
    "MASKS",
    "MaskKind",
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

# every registered factory, those not named above included (a new mask is one factory in factories.py)
globals().update({entry.factory.__name__: entry.factory for entry in MASKS.values()})
__all__ += [entry.factory.__name__ for entry in MASKS.values() if entry.factory.__name__ not in __all__]
