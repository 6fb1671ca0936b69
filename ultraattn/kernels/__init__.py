"""Tile kernels: block-sparse attention forward/backward with LSE (Triton on GPU, eager reference elsewhere).

``block_sparse_attention`` is the public entry; ``make_block_lists`` builds the kernels' block-sparse
description (``BlockLists``) once per mask; the ops ``torch.ops.ultraattn.bsa_fwd`` /
``bsa_bwd`` are what compiled graphs contain. Triton itself is imported only when a kernel runs.
"""

from ultraattn.kernels.block_lists import BlockLists, make_block_lists, pack_bits, unpack_bits
from ultraattn.kernels.ops import block_sparse_attention, bsa_bwd, bsa_fwd, get_block_lists, uses_triton

__all__ = [
    "BlockLists",
    "block_sparse_attention",
    "bsa_bwd",
    "bsa_fwd",
    "get_block_lists",
    "make_block_lists",
    "pack_bits",
    "unpack_bits",
    "uses_triton",
]
