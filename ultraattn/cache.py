"""The package's process state in one home (``process_state``), and its one cache type (``LRU``).

Every module-level object that holds state across calls is declared here by name, where the module defines it
(``X = process_state("what it is", LRU(32))``): the side table (``passes/state.py``), the online planner
(``runtime/online.py``), the kernels' block lists (``kernels/ops.py``) and the score_mods' generated Triton functions
(``runtime/tile_kernels.py``). ``ultraattn.reset()`` clears everything held here (``clear_process_state``);
``held_state()`` lists it. What stays process-wide on purpose is listed in docs/architecture.md ("Where state lives").

``LRU``: a bounded mapping that evicts the least recently used entry.

Plans keyed by mask content, kernel block lists keyed by mask identity, and the forward state that
waits for its backward are all bounded this way, because a training loop that meets a new mask
every step must not grow memory without limit. Thread-safe: a plan may be made on a worker
thread while the step that uses it runs.

``gc_paused``: Python's cyclic garbage collector held off while the fast planner plans (a per-step path). A plan
allocates tens of thousands of small objects (the replayed schedule's tasks), and every collection they trigger
walks the whole heap, which in a training process holds the model, its compiled graphs and Dynamo's caches: on a
128K document mask at 8x8 ranks, a third of the planning time went to collections (docs/planner.md). PyTorch's
``torch.distributed.checkpoint.state_dict`` pauses the collector the same way. Counted, so that planning on the
online worker thread and on the step's thread at once leaves the collector as it found it.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections import OrderedDict
from collections.abc import Hashable, Iterator
from typing import Generic, Protocol, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class Clearable(Protocol):
    def clear(self) -> None: ...


C = TypeVar("C", bound=Clearable)

_STATE: dict[str, Clearable] = {}
"""Name -> holder: every piece of the process's state (``process_state``)."""
_STATE_LOCK = threading.Lock()


def process_state(name: str, holder: C) -> C:
    """Hold ``holder`` (anything with ``clear()``) as the process state called ``name``; returns it, so a module
    declares its state in one line. A second holder under one name is an error (two modules claiming one name)."""
    with _STATE_LOCK:
        if name in _STATE and _STATE[name] is not holder:
            raise RuntimeError(f"ultraattn: process state {name!r} is held already")
        _STATE[name] = holder
    return holder


def held_state() -> dict[str, Clearable]:
    """Every piece of process state, by name."""
    with _STATE_LOCK:
        return dict(_STATE)


def clear_process_state() -> None:
    """Clear every piece of process state (``ultraattn.reset``)."""
    for holder in held_state().values():
        holder.clear()


_GC_LOCK = threading.Lock()
_GC_PAUSES = [0, False]
"""[how many ``gc_paused`` blocks are open, whether the collector was enabled when the first one opened]: process-wide
on purpose (it mirrors ``gc``'s own switch, which is), and zero outside planning, so ``reset`` has nothing to clear."""


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Hold off the cyclic garbage collector inside the block (module docstring); the last block to close restores
    it as the first found it. Reference counting still frees everything that is not in a cycle."""
    with _GC_LOCK:
        if _GC_PAUSES[0] == 0:
            _GC_PAUSES[1] = gc.isenabled()
            gc.disable()
        _GC_PAUSES[0] += 1
    try:
        yield
    finally:
        with _GC_LOCK:
            _GC_PAUSES[0] -= 1
            if _GC_PAUSES[0] == 0 and _GC_PAUSES[1]:
                gc.enable()


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

    def items(self) -> list[tuple[K, V]]:
        with self._lock:
            return list(self._data.items())

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
