"""Array helpers the planner's vectorised code shares (numpy only, no planner types).

Runs of equal consecutive items are how the planner groups sorted arrays (cells per (row, target), messages per
destination, tasks per stream); ``np.r_`` built those boundaries in tens of places at ~10 us a call, a few
milliseconds of every plan.
"""

from __future__ import annotations

import numpy as np


def run_starts(key: np.ndarray) -> np.ndarray:
    """int64: the index where each run of equal consecutive items of ``key`` begins. ``key`` [n], or [fields, n]
    where an item is a column (it differs from the one before when any field does)."""
    n = key.shape[-1]
    first = np.empty(n, dtype=bool)
    if n:
        first[0] = True
        changed = key[..., 1:] != key[..., :-1]
        first[1:] = changed if changed.ndim == 1 else changed.any(0)
    return np.flatnonzero(first)


def run_ends(starts: np.ndarray, n: int) -> np.ndarray:
    """int64: where each run that begins at ``starts`` (``run_starts`` of ``n`` items) ends (exclusive)."""
    return np.concatenate((starts[1:], np.array([n], dtype=np.int64))) if starts.size else starts.astype(np.int64)


def renumber(*flat: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
    """The distinct values of ``flat`` (sorted) and each array as indices into them: a replay's arrays then span the
    units a plan names, not the whole (group, chunk, rank) grid (262144 entries at 128K on 8x8, most never used)."""
    u, inv = np.unique(np.concatenate(flat), return_inverse=True)
    return u, np.split(inv, np.cumsum([f.size for f in flat])[:-1])
