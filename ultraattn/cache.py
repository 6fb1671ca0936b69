"""A bounded mapping that evicts the least recently used entry: the one cache type of the package.

Plans keyed by mask content, kernel layouts keyed by mask identity, and the forward state that
waits for its backward are all bounded this way, because a training loop that meets a new mask
every step must not grow memory without limit. Thread-safe: a plan may be made on a worker
thread while the step that uses it runs.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable, Iterator
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class LRU(Generic[K, V]):
    """At most ``capacity`` entries; a hit (``get``) makes an entry the most recent."""

    def __init__(self, capacity: int):
        if not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"`capacity` must be a positive int, got {capacity!r}")
        self.capacity = capacity
        self._data: OrderedDict[K, V] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: K, default: V | None = None) -> V | None:
        with self._lock:
            if key not in self._data:
                return default
            self._data.move_to_end(key)
            return self._data[key]

    def put(self, key: K, value: V) -> None:
        """Insert or replace ``key``; the oldest entries beyond ``capacity`` are dropped."""
        with self._lock:
            self._data[key] = value
            self._data.move_to_end(key)
            while len(self._data) > self.capacity:
                self._data.popitem(last=False)

    def pop(self, key: K, default: V | None = None) -> V | None:
        with self._lock:
            return self._data.pop(key, default)

    def clear(self) -> None:
        with self._lock:
            self._data.clear()

    def values(self) -> list[V]:
        with self._lock:
            return list(self._data.values())

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._data

    def __len__(self) -> int:
        return len(self._data)

    def __iter__(self) -> Iterator[K]:
        with self._lock:
            return iter(list(self._data))

    def __repr__(self) -> str:
        return f"LRU({len(self._data)}/{self.capacity})"
