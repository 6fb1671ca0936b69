"""Plans cached on the content of the mask that made them.

A compiled graph sees a mask as run-time data (a BlockMask's tensors, a boolean ``attn_mask``),
so the same graph meets a new mask every batch of packed documents and the same mask again in
the next epoch or micro-batch. The cache key is a digest of the mask tensors' bytes together
with what else the plan depends on (shapes, dtype, device, token layout), so a hit is always the
plan of exactly this content and a miss plans again; nothing is recompiled either way.
"""

from __future__ import annotations

import hashlib
import weakref
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


class TensorMemo:
    """Values computed from a tensor, remembered while that very tensor object is alive and unchanged (its version
    counter): the layers of a model receive the same mask tensor in a step and read it once, and a mask built
    again next step (a new object, even at the same address) is read again. Weak references: it keeps no tensor
    alive. ``reads`` counts the computations (misses)."""

    def __init__(self, capacity: int = 32):
        self.capacity = capacity
        self._held: dict[tuple, tuple] = {}
        self.reads = 0

    def get(self, t: Tensor, what: object, make):
        key = (id(t), what)
        hit = self._held.get(key)
        if hit is not None and hit[0]() is t and hit[1] == t._version:
            return hit[2]
        value = make()
        self.reads += 1
        self._held.pop(key, None)
        self._held[key] = (weakref.ref(t), t._version, value)
        if len(self._held) > self.capacity:
            for k in [k for k, v in self._held.items() if v[0]() is None] or [next(iter(self._held))]:
                del self._held[k]
        return value

    def clear(self) -> None:
        self._held.clear()
