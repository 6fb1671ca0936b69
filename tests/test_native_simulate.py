"""The schedule simulator in C (``planner/native.py``, ``planner/simulate.c``) gives the Python loop's schedule to the
last bit: on random task graphs with ties everywhere (durations, priorities, ends at the same time), on the fast
planner's replays and executed replays, and on a cycle (the same error). Where it cannot be built, one warning says
why and planning goes on in Python."""

from __future__ import annotations

import contextlib
import json
import os
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ultraattn.masks.cells import cells_from_pattern
from ultraattn.masks.convert import pattern_from_mask_mod
from ultraattn.masks.factories import generate_document
from ultraattn.planner import native
from ultraattn.planner.fast import FastPlanner
from ultraattn.planner.plan import AttnShape, Mesh
from ultraattn.planner.program import executed_makespan
from ultraattn.planner.schedule import Graph, Task, replay_phases, simulate

STREAMS = [(r, name) for r in range(3) for name in ("compute", "send_intra", "recv_intra", "send_inter")]


@contextlib.contextmanager
def python_only():
    """The Python loop inside the block (``ULTRAATTN_NATIVE=0``)."""
    before = os.environ.get(native.ENV)
    os.environ[native.ENV] = "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ[native.ENV]
        else:
            os.environ[native.ENV] = before


def _both(graph: Graph, priority):
    assert native.LIBRARY.get() is not None, "the C simulator should build on this machine (cc is on CI's PATH)"
    fast_ = simulate(graph, priority)
    with python_only():
        slow = simulate(graph, priority)
    return fast_, slow


@st.composite
def graphs(draw):
    n = draw(st.integers(1, 60))
    tasks = []
    for i in range(n):
        two = draw(st.booleans())
        s0 = draw(st.sampled_from(STREAMS))
        streams = (s0,) if not two else (s0, draw(st.sampled_from([s for s in STREAMS if s != s0])))
        deps = sorted(draw(st.sets(st.integers(0, i - 1), max_size=4))) if i else []
        dur = draw(st.sampled_from([0.0, 0.5, 1.0, 1.5, 3.0]))   # (few values: equal ends, equal ready times)
        tasks.append(Task(i, "attn" if len(streams) == 1 else "kv", s0[0], streams, dur, deps))
    priority = draw(st.none() | st.lists(st.sampled_from([-2.0, -1.0, 0.0, 1.0]), min_size=n, max_size=n))
    return Graph(tasks=tasks, phase="fwd"), priority


@settings(max_examples=300, deadline=None)
@given(graphs())
def test_random_graphs_schedule_the_same_in_c_and_python(case):
    graph, priority = case
    a, b = _both(graph, priority)
    assert a.start == b.start and a.end == b.end
    a.check()


def _cells(seed: int, S: int):
    rng, lengths = np.random.default_rng(seed), []
    while sum(lengths) < S:
        lengths.append(min(S - sum(lengths), max(1, int(rng.lognormal(np.log(512), 1.2)))))
    return cells_from_pattern(pattern_from_mask_mod(generate_document(lengths), S, block_size=128))


def test_the_fast_planners_plans_and_replays_are_the_same_in_c_and_python():
    """Every plan's meta (every candidate's price, the replays that decided ties, the regrets) and run order, and the
    plain and executed replays of each phase: equal with either simulator (2x4 ranks, document masks)."""
    S = 8192
    shape = AttnShape(seq_len=S, num_heads=8, head_dim=64, num_kv_heads=2, dtype="bf16")
    fp = FastPlanner(shape=shape, mesh=Mesh(nodes=2, devices=4))
    for seed in range(4):
        cells = _cells(seed, S)
        tp = fp.plan(cells)
        with python_only():
            ref = FastPlanner(shape=shape, mesh=Mesh(nodes=2, devices=4)).plan(cells)
        strip = {"planning_ms"}
        assert (json.dumps({k: v for k, v in tp.meta.items() if k not in strip}, sort_keys=True, default=str)
                == json.dumps({k: v for k, v in ref.meta.items() if k not in strip}, sort_keys=True, default=str))
        assert tp.order == ref.order
        fast_sched = replay_phases(tp, cells, fp.cost, backward=True)
        with python_only():
            slow_sched = replay_phases(tp, cells, fp.cost, backward=True)
            slow_exec = executed_makespan(tp, slow_sched, fp.cost)
        for ph in ("fwd", "bwd"):
            assert fast_sched[ph].start == slow_sched[ph].start and fast_sched[ph].end == slow_sched[ph].end
        assert executed_makespan(tp, fast_sched, fp.cost) == slow_exec


def test_a_cycle_stalls_both_the_same_way():
    graph = Graph(tasks=[Task(0, "attn", 0, ((0, "compute"),), 1.0, [1]), Task(1, "attn", 0, ((0, "compute"),), 1.0,
                                                                             [0])], phase="fwd")
    with pytest.raises(RuntimeError, match="stalled"):
        simulate(graph)
    with python_only(), pytest.raises(RuntimeError, match="stalled"):
        simulate(graph)


def test_without_a_compiler_one_warning_and_the_python_loop(monkeypatch, tmp_path):
    graph = Graph(tasks=[Task(0, "attn", 0, ((0, "compute"),), 2.0, []),
                         Task(1, "q", 0, ((0, "send_intra"), (1, "recv_intra")), 1.0, [0])], phase="fwd")
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("ULTRAATTN_CACHE_DIR", str(tmp_path / "cache"))
    native.LIBRARY.clear()
    try:
        said = (r"ultraattn: the planner's native schedule simulator is not available \(no C compiler: "
                r"CC=.*no-such-compiler.* is not a program.*ULTRAATTN_NATIVE=0 silences this")
        with pytest.warns(RuntimeWarning, match=said):
            s = simulate(graph)
        assert (s.start, s.end) == ([0.0, 2.0], [2.0, 3.0])
        with warnings.catch_warnings():
            warnings.simplefilter("error")   # said once
            assert simulate(graph).end == [2.0, 3.0]
        assert not (tmp_path / "cache").exists()
    finally:
        native.LIBRARY.clear()   # (the next test builds with the real compiler again)


def test_the_library_is_built_once_per_source_and_compiler(monkeypatch, tmp_path):
    cc, why = native.compiler()
    assert cc is not None and why == ""
    first = native.build(cc, tmp_path)
    stamp = first.stat().st_mtime_ns
    assert native.build(cc, tmp_path) == first and first.stat().st_mtime_ns == stamp   # (found, not built again)
    assert [p.name for p in tmp_path.iterdir()] == [first.name]   # (no temporary file left behind)
    monkeypatch.setenv(native.ENV, "0")
    assert native.LIBRARY.get() is None   # (off: the Python loop, nothing built)
