"""The planner's run helpers (``planner.arrays``) against the plain ``np.r_`` forms they replace."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from ultraattn.planner.arrays import renumber, run_ends, run_starts

keys = st.lists(st.integers(0, 3), max_size=40).map(lambda v: np.sort(np.asarray(v, dtype=np.int64)))


@settings(max_examples=200, deadline=None)
@given(keys)
def test_runs_of_a_sorted_key(key):
    want = np.flatnonzero(np.r_[True, key[1:] != key[:-1]]) if key.size else np.zeros(0, dtype=np.int64)
    starts = run_starts(key)
    assert np.array_equal(starts, want)
    ends = run_ends(starts, key.size)
    assert np.array_equal(ends, np.r_[want[1:], key.size] if key.size else want)
    # every run holds equal items, and neighbouring runs differ
    for a, b in zip(starts.tolist(), ends.tolist()):
        assert b > a and (key[a:b] == key[a]).all()
    assert (key[starts[1:]] != key[starts[1:] - 1]).all()


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 2)), max_size=30))
def test_runs_over_fields(items):
    key = np.asarray(sorted(items), dtype=np.int64).reshape(-1, 2).T   # [fields, n]
    n = key.shape[1]
    want = np.flatnonzero(np.r_[True, (key[:, 1:] != key[:, :-1]).any(0)]) if n else np.zeros(0, dtype=np.int64)
    assert np.array_equal(run_starts(key), want)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(st.integers(0, 10**6), max_size=12), min_size=1, max_size=4))
def test_renumber_keeps_order_and_identity(parts):
    """``renumber``: every array maps back to its values through the distinct values, and the numbering keeps their
    order (a replay's segmented maxima and sums then see the units in the same order as the flat indices)."""
    flat = [np.asarray(p, dtype=np.int64) for p in parts]
    u, idx = renumber(*flat)
    assert np.array_equal(u, np.unique(np.concatenate(flat)))
    assert len(idx) == len(flat)
    for f, i in zip(flat, idx):
        assert np.array_equal(u[i], f)
    assert (np.diff(u) > 0).all()
