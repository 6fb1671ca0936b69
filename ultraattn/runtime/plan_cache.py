"""Plans cached on the content of the mask that made them.

A compiled graph sees a mask as run-time data (a BlockMask's tensors, a boolean ``attn_mask``),
so the same graph meets a new mask every batch of packed documents and the same mask again in
the next epoch or micro-batch. The cache key is a digest of the mask tensors' bytes together
with what else the plan depends on (shapes, dtype, device, token layout), so a hit is always the
plan of exactly this content and a miss plans again; nothing is recompiled either way.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch
from torch import Tensor

from ultraattn.cache import LRU


def content_digest(tensors: Sequence[Tensor], extra: object = ()) -> str:
    """A digest of ``tensors``' shapes, dtypes and bytes, and of ``repr(extra)``."""
    h = hashlib.blake2b(repr(extra).encode(), digest_size=16)
    for t in tensors:
        t = t.detach()
        h.update(repr((tuple(t.shape), str(t.dtype))).encode())
        h.update(t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


class PlanCache:
    """The latest ``capacity`` plans of one attention site, by content digest, with the counts reports show."""

    def __init__(self, capacity: int = 16):
        self._lru: LRU[str, object] = LRU(capacity)
        self.plans = 0
        """Plans made (cache misses)."""
        self.hits = 0
        self.seconds = 0.0
        """Time spent planning, over all misses."""

    def lookup(self, key: str):
        """The plan stored under ``key`` (counted as a hit), or None."""
        hit = self._lru.get(key)
        if hit is not None:
            self.hits += 1
        return hit

    def store(self, key: str, plan: object, seconds: float) -> None:
        self._lru.put(key, plan)
        self.plans += 1
        self.seconds += seconds

    def alias(self, key: str, plan: object) -> None:
        """Store a plan already counted under another key (the same plan, reached by another content key)."""
        self._lru.put(key, plan)

    def values(self) -> list:
        return self._lru.values()

    def __len__(self) -> int:
        return len(self._lru)
