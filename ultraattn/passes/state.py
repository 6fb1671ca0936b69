"""The side table: all process state of the ultraattn backend, in one object.

Why it exists. A compiled graph can only hold what FX can put in a graph: tensors, numbers,
strings. Everything else a rewritten graph needs at run time (a site's plans cached on mask
content, the forward state its backward takes back, the explicit program's stage tables, a
sequence layout's process group) must live outside the graph, found again through a string
key that the graph carries. PyTorch does the same for user Triton kernels
(``torch/_higher_order_ops/triton_kernel_wrap.py``: ``KernelSideTable``). Keeping all of it in
one object makes the state visible, bounded and resettable:

* ``sites``: ``SiteState`` per rewritten site (``passes/site.py``), keyed by ``SiteSpec.key``;
* ``kept``: ``KeptFlex`` per kept flex_attention site that runs eagerly (``passes/kept.py``);
* ``layouts``: ``runtime.sequence.SequenceShards`` per token layout and process group, shared by every graph
  sharded in it, and ``decided``: the layout chosen per (sequence length, ranks), so that every compiled region of
  a run shards a sequence the same way and hands its shards to the next (``passes/carrier.py``);
* ``graphs`` / ``aot_graphs`` / ``plan_events``: the records of what was compiled and planned;
* ``meshes``: the default DeviceMesh per (world, local world), created once (a collective);
* ``counters``: ``torch._dynamo.utils.counters["ultraattn"]`` for the process table (a private
  table, as ``ultraattn.explain`` uses, counts apart).

The custom ops look their state up in ``side_table()``, the active table. The backend's state is all
here; the rest of ultraattn's process state is the online planner of masks that arrive at run time
(``runtime/online.py``) and the kernels' block-list cache (``kernels/ops.py``). ``ultraattn.reset()``
clears all three together with Dynamo's graphs (graphs compiled before a reset hold keys into this
table and could no longer run); the tests' fixture calls it. A site's state is also dropped when the
compiled graph that holds it is garbage collected (``forget_with``), so recompiles do not grow the table.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import re
import threading
import weakref
from collections import Counter, deque
from collections.abc import Iterator

from torch._dynamo.utils import counters as dynamo_counters

from ultraattn.cache import LRU, process_state
from ultraattn.passes.opinfo import ops_digest
from ultraattn.passes.records import AotGraphRecord, CompileReport, GraphRecord, Observer, PlanEvent
from ultraattn.passes.site import SiteSpec, SiteState
from ultraattn.runtime.plan_cache import TensorMemo

MAX_PLAN_EVENTS = 256
"""Plan events kept (the newest); reports show the latest plan of each site."""


class SideTable:
    """All process state of the backend (see the module docstring)."""

    def __init__(self, *, private: bool = True):
        self.lock = threading.RLock()
        self._own_counters: Counter | None = Counter() if private else None
        self.sites: dict[str, SiteState] = {}
        self.kept: dict[str, object] = {}
        self.layouts: dict[str, object] = {}
        self.decided: dict[tuple, tuple[str, str]] = {}
        """(sequence length, global ranks) -> (layout key, how it was chosen): one decision per run."""
        self.graphs: list[GraphRecord] = []
        self.aot_graphs: list[AotGraphRecord] = []
        self.plan_events: deque[PlanEvent] = deque(maxlen=MAX_PLAN_EVENTS)
        self.meshes: dict = {}
        self.tensor_memo = TensorMemo()
        """What the sites read off this step's mask tensors (``runtime.plan_cache.TensorMemo``): one read per mask
        tensor however many sites receive it."""
        self.exchange_runs: LRU = LRU(64)
        """Run-time programs' plans by configuration and mask content: sites that see the same mask (every layer of
        a model) plan it once (``explicit/per_mask.py``)."""
        self._ids = itertools.count(1)
        self._graph_count = 0
        self._key_uses: Counter = Counter()

    # ------------------------------------------------------------------ ids and counters
    @property
    def counters(self) -> Counter:
        """``torch._dynamo.utils.counters["ultraattn"]`` for the process table (looked up each time: Dynamo's
        test utilities may clear that dict), a table's own ``Counter`` for a private one."""
        return dynamo_counters["ultraattn"] if self._own_counters is None else self._own_counters

    def next_id(self) -> int:
        """A process-unique positive int (tickets, handles, generated attribute names)."""
        with self.lock:
            return next(self._ids)

    def next_graph_index(self) -> int:
        """The next Dynamo graph's number (every rank compiles the same graphs in the same order)."""
        with self.lock:
            self._graph_count += 1
            return self._graph_count - 1

    def site_key(self, name: str, graph_code: str, *parts) -> str:
        """The key a site's call carries in the graph: ``name`` and a digest of the code of the graph it sits in, of
        ``parts`` (the site's identity: everything that defines what it computes, ``site.site_identity``; a kept
        site's shapes, dtype and ``KeptFlex.identity``) and of the ops themselves (``opinfo.ops_digest``).

        Deterministic, so that the same model compiles to the same graph text in every process and run and
        Inductor's FX graph cache hits on a restart; complete, so that graph text, and that cache, never stand for
        two different sites (the graph's code names a score_mod's submodule, not what it computes: the identity
        does); and it misses after an upgrade that changed the ops. The n-th repeat of one key in this table (two
        identical blocks, a recompile) gets ``.n`` appended, in compile order, which every run repeats."""
        text = "|".join([ops_digest(), re.sub(r"0x[0-9a-fA-F]+", "0x", graph_code), *map(str, parts)])
        key = f"{name}-{hashlib.sha1(text.encode()).hexdigest()[:12]}"
        with self.lock:
            n = self._key_uses[key]
            self._key_uses[key] += 1
        return key if n == 0 else f"{key}.{n}"

    def bump(self, name: str, n: int = 1) -> None:
        self.counters[name] += n

    # ------------------------------------------------------------------ sites and layouts
    def add_site(self, spec: SiteSpec, observer: Observer) -> SiteState:
        """A new state for ``spec`` under its key. A key held by a site that computes something else is an error,
        never a reuse: it would run one site's graph with the other's score_mod, mask_mod or options."""
        state = SiteState(spec=spec, next_id=self.next_id, observer=observer, memo=self.tensor_memo)
        with self.lock:
            held = self.sites.get(spec.key)
            if held is not None and held.spec.identity != spec.identity:
                raise KeyCollision(spec.key, f"{held.spec.name} (graph {held.spec.graph}, identity "
                                             f"{held.spec.identity})", f"{spec.name} (graph {spec.graph}, identity "
                                                                      f"{spec.identity})")
            self.sites[spec.key] = state
        return state

    def site(self, key: str) -> SiteState:
        return _held(self.sites, key, "state for site")

    def add_kept(self, key: str, kept) -> None:
        """Hold ``kept`` (a ``KeptFlex``) under ``key``; a key held by a different call is an error (``add_site``)."""
        with self.lock:
            held = self.kept.get(key)
            if held is not None and held.identity != kept.identity:
                raise KeyCollision(key, f"a kept flex site (identity {held.identity})",
                                   f"another kept flex site (identity {kept.identity})")
            self.kept[key] = kept

    def kept_site(self, key: str):
        return _held(self.kept, key, "state for kept site")

    def add_layout(self, key: str, shards) -> object:
        """Hold ``shards`` under ``key`` unless a layout is held there already; returns the one held."""
        with self.lock:
            return self.layouts.setdefault(key, shards)

    def layout(self, key: str):
        return _held(self.layouts, key, "sequence layout")

    def forget(self, site_keys: tuple[str, ...]) -> None:
        with self.lock:
            for k in site_keys:
                self.sites.pop(k, None)
                self.kept.pop(k, None)

    def forget_with(self, owner: object, site_keys: tuple[str, ...]) -> None:
        """Drop these sites (rewritten or kept) once ``owner`` (the compiled callable Dynamo keeps) is garbage
        collected. (Layouts stay: other graphs and the shards they returned share them; there is one per sequence
        length and process group.)"""
        weakref.finalize(owner, self.forget, tuple(site_keys))

    # ------------------------------------------------------------------ records
    def record_graph(self, rec: GraphRecord) -> None:
        with self.lock:
            self.graphs.append(rec)

    def record_aot_graph(self, rec: AotGraphRecord) -> None:
        with self.lock:
            self.aot_graphs.append(rec)

    def record_plan(self, event: PlanEvent) -> None:
        with self.lock:
            self.plan_events.append(event)

    def aot_graphs_of(self, graph: int) -> list[AotGraphRecord]:
        return [g for g in self.aot_graphs if g.graph == graph]

    def sites_of(self, rec: GraphRecord) -> list[SiteState]:
        """The states of a graph's rewritten sites that are still held (in site order)."""
        return [self.sites[k] for k in rec.site_keys if k in self.sites]

    def snapshot(self, report_file: str | None = None) -> CompileReport:
        """The report of every graph (or of those compiled with ``report_file``), with plans and counts so far."""
        with self.lock:
            graphs = [g for g in self.graphs if report_file is None or g.report_file == report_file]
            idx = {g.index for g in graphs}
            latest: dict[tuple[int, str], PlanEvent] = {}
            history = []
            for ev in self.plan_events:
                if ev.graph in idx:
                    latest[(ev.graph, ev.site)] = ev
                    history.append(dataclasses.replace(ev, comparison=None, result=None))
            return CompileReport(graphs=tuple(graphs), aot_graphs=tuple(g for g in self.aot_graphs if g.graph in idx),
                                 plans=tuple(latest.values()), history=tuple(history),
                                 stats=tuple(s.stats() for g in graphs for s in self.sites_of(g)))

    # ------------------------------------------------------------------ reset
    def clear(self) -> None:
        """``reset`` (what ``cache.clear_process_state`` calls)."""
        self.reset()

    def reset(self) -> None:
        """Forget every site, layout, record and count (mesh handles too)."""
        with self.lock:
            self.sites.clear()
            self.kept.clear()
            self.layouts.clear()
            self.decided.clear()
            self.graphs.clear()
            self.aot_graphs.clear()
            self.plan_events.clear()
            self.meshes.clear()
            self.exchange_runs.clear()
            self.tensor_memo.clear()
            self.counters.clear()
            self._graph_count = 0
            self._key_uses.clear()


class KeyCollision(RuntimeError):
    """Two different sites reached one side-table key."""

    def __init__(self, key: str, held: str, new: str):
        super().__init__(
            f"ultraattn: the site key {key!r} is already held by {held}, and now names {new}, which computes "
            f"something else (another score_mod, mask_mod, shape or option). Running either with the other's state "
            f"would be silently wrong, so ultraattn stops here. This is a bug in ultraattn's site keys "
            f"(SideTable.site_key): please report it; ultraattn.reset() before compiling the second model avoids it")


def _held(store: dict, key: str, what: str):
    value = store.get(key)
    if value is None:
        raise RuntimeError(
            f"ultraattn: no {what} {key!r}: the side table was reset (or the graph was freed) after this graph was "
            f"compiled; call torch._dynamo.reset() together with ultraattn's reset so graphs recompile")
    return value


_PROCESS_TABLE = process_state("passes: the side table", SideTable(private=False))
_active: list[SideTable] = [_PROCESS_TABLE]
_active_lock = threading.Lock()


def side_table() -> SideTable:
    """The active side table: the process's own, or a private one inside ``private_side_table()``."""
    return _active[-1]


@contextlib.contextmanager
def private_side_table() -> Iterator[SideTable]:
    """Run with a fresh side table (``ultraattn.explain``: plans and records that the process table never sees)."""
    table = SideTable()
    with _active_lock:
        _active.append(table)
    try:
        yield table
    finally:
        with _active_lock:
            _active.remove(table)


def reset() -> None:
    """Forget the active side table's state (tests; see ``SideTable.reset``)."""
    side_table().reset()
