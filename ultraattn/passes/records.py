"""What a compile produced, as plain frozen records: the one interface between the passes and the reports.

The backend builds these records and hands them to an ``Observer`` (installed by whoever
called it: ``ultraattn.compiler`` prints and saves reports); the side table keeps them for
tests and saved reports. ``ultraattn/report/`` renders records and imports nothing else from
``passes``. Every record round-trips through ``to_json()`` / ``from_json()``, so a live report
and one saved with ``options={"report_file": ...}`` draw the same tables from the same data.

Nothing here imports torch: a record holds names, shapes as tuples, dtypes as strings.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields
from typing import Any, Protocol

from ultraattn.passes.opinfo import TILE_OPS

REPORT_VERSION = 3
"""Saved report files carry this; ``CompileReport.from_json`` refuses other versions with the fix."""


def _tuple(x) -> tuple:
    return tuple(x) if x is not None else ()


class SiteForm(enum.Enum):
    """What an attention site runs as, decided once per site when the graph is rewritten
    (``passes.forms.form_for``, the one place; ``passes.backend.site_forms`` puts it in words). The value is the
    report's word."""

    PROGRAM = "program"
    """This rank's tiles and messages, planned at compile time and expanded into the graphs Inductor compiles."""
    PROGRAM_PER_MASK = "program, planned per mask"
    """The same, over a fixed skeleton, with a plan made for each mask as it arrives (a run-time mask)."""
    KERNEL = "program (world size 1: the kernel op)"
    """World size 1 with a mask known at compile time: nothing to split, the site is the block-sparse kernel op."""
    ONE_OP = "one op"
    """The tiles run inside one opaque op (the record says why it is not expanded)."""
    AS_WRITTEN = "as written"
    """The model's own call (replicated across ranks at world size > 1)."""
    KEPT_FLEX = "as written (eager flex_attention on CPU)"
    """A flex site on CPU that is not rewritten, made to run as the model wrote it (``passes/kept.py``)."""

    def word(self, why: str = "") -> str:
        """The report's form column: the value, and for ``ONE_OP`` why."""
        return f"{self.value} ({why})" if self is SiteForm.ONE_OP and why else self.value


@dataclass(frozen=True, slots=True, kw_only=True)
class SiteRecord:
    """One attention call found in a Dynamo graph, and what the backend made of it."""

    name: str
    """``sdpa#i`` or ``flex#i`` (i: the call's index in the graph)."""
    op: str
    """'sdpa' or 'flex'."""
    q_shape: tuple[int, ...]
    kv_shape: tuple[int, ...]
    dtype: str
    """'float32', 'bfloat16', ... ('' when unknown)."""
    mask: str
    """full | causal | bool_mask | block_mask."""
    density: float | None
    """Fraction of (q, kv) pairs that attend (SDPA) or of non-empty blocks (BlockMask); None: unknown."""
    rewritten: bool
    why: str
    """Why the site was or was not rewritten."""
    form: str = ""
    """What the site runs as: a ``SiteForm``'s word ('program', 'program, planned per mask', 'one op (<why>)',
    'as written[, replicated]', ...; ``passes.backend.site_forms``)."""

    def to_json(self) -> dict:
        return {f.name: (list(v) if isinstance(v := getattr(self, f.name), tuple) else v) for f in fields(self)}

    @classmethod
    def from_json(cls, d: dict) -> SiteRecord:
        return cls(**{**d, "q_shape": _tuple(d["q_shape"]), "kv_shape": _tuple(d["kv_shape"])})


try:  # what Dynamo passes through from a backend as it is (not wrapped in BackendCompilerFailed)
    from torch._dynamo.exc import ShortenTraceback as _PassedThrough
except ImportError:  # pragma: no cover - a torch without it: the error arrives wrapped, message intact
    _PassedThrough = RuntimeError


class BackendError(_PassedThrough):  # shown as ultraattn.BackendError (module set below)
    """An error the ultraattn backend met while compiling a graph (a bad option, a mesh that does not fit, a peer that
    did not answer), raised to the user with ultraattn's message first instead of inside Dynamo's
    ``BackendCompilerFailed`` ("... please report to PyTorch"). ``inner`` is the original exception (a
    ``ValueError``, ``TypeError``, ...). Dynamo may append where in the user's code the graph came from."""

    def __init__(self, inner: BaseException, frame=None):
        text = str(inner)
        msg = text if "ultraattn" in text[:60] else f"ultraattn: {text}"
        try:
            super().__init__(msg, first_useful_frame=frame)
        except TypeError:  # another torch's signature: the message still reads first
            Exception.__init__(self, msg)
            self.first_useful_frame = None
        self.inner = inner


BackendError.__module__ = "ultraattn"


class FallbackWarning(UserWarning):
    """ultraattn ran part of a context-parallel model replicated on every rank (an attention site it cannot split,
    or an op that needed a sharded tensor whole). Exact, but without context parallelism's memory and compute
    savings there. Filter it like any warning:
    ``warnings.filterwarnings("ignore", category=ultraattn.FallbackWarning)``."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Fallback:
    """A sharded tensor that an op outside the sharded region needed whole (one all-gather)."""

    node: str
    op: str
    why: str
    bytes: int
    """Bytes of the gathered (global) tensor; 0 where the analysis alone is known (``explain``)."""

    def to_json(self) -> dict:
        return {"node": self.node, "op": self.op, "why": self.why, "bytes": self.bytes}

    @classmethod
    def from_json(cls, d: dict) -> Fallback:
        return cls(**d)


@dataclass(frozen=True, slots=True, kw_only=True)
class ShardSummary:
    """What the sequence-sharding pass did to one graph (or, ``planned_only``, would do: ``explain``)."""

    layout: str
    """The token layout and how it was chosen ('' when only analysed)."""
    seq_len: int
    local_len: int
    """Tokens per rank (0 when only analysed)."""
    sharded_ops: int
    reductions: int
    """Sums, means and losses over the sequence run as local sums plus an all-reduce."""
    dispatched: tuple[str, ...] = ()
    """Replicated graph values sliced where they meet the sharded region."""
    carried: tuple[str, ...] = ()
    """Graph inputs that arrived as this rank's shard (a ``SeqShard`` another graph returned) and were taken as
    they are: no communication."""
    entered: int = 0
    """Replicated weights entering the region (their gradients are all-reduced)."""
    replicated_ops: int = 0
    fallbacks: tuple[Fallback, ...] = ()
    skipped_sites: tuple[tuple[str, str], ...] = ()
    """(site node, why it stays a global-view op)."""
    outputs: tuple[tuple[int, int, int] | None, ...] = ()
    """Per graph output: None (replicated) or (dim, length, inner) of a shard returned as is."""
    key: str = ""
    """The layout's key in the side table (``SideTable.layouts``)."""
    inlined_checkpoints: int = 0
    """Activation-checkpoint regions inlined (still recomputed in the backward)."""
    planned_only: bool = False

    def to_json(self) -> dict:
        return {"layout": self.layout, "seq_len": self.seq_len, "local_len": self.local_len,
                "sharded_ops": self.sharded_ops, "reductions": self.reductions, "dispatched": list(self.dispatched),
                "carried": list(self.carried),
                "entered": self.entered, "replicated_ops": self.replicated_ops,
                "fallbacks": [f.to_json() for f in self.fallbacks], "skipped_sites": dict(self.skipped_sites),
                "outputs": [list(o) if o is not None else None for o in self.outputs], "key": self.key,
                "inlined_checkpoints": self.inlined_checkpoints, "planned_only": self.planned_only}

    @classmethod
    def from_json(cls, d: dict) -> ShardSummary:
        return cls(**{**d, "dispatched": _tuple(d["dispatched"]), "carried": _tuple(d.get("carried", ())),
                      "fallbacks": tuple(Fallback.from_json(f) for f in d["fallbacks"]),
                      "skipped_sites": tuple(d["skipped_sites"].items()),
                      "outputs": tuple(tuple(o) if o is not None else None for o in d["outputs"])})


@dataclass(frozen=True, slots=True, kw_only=True)
class GraphRecord:
    """What the backend did to one Dynamo graph."""

    index: int
    """The graph's number in this process (every rank compiles the same graphs in the same order)."""
    world_size: int
    sites: tuple[SiteRecord, ...]
    site_keys: tuple[str, ...]
    """Side-table keys of the rewritten sites, in site order (``SideTable.sites``)."""
    code_before: str
    code_after: str
    report_file: str | None = None
    """The ``report_file`` option this graph was compiled with (saved reports hold the graphs of one file)."""
    shard: ShardSummary | None = None

    @property
    def rewritten(self) -> int:
        return len(self.site_keys)

    def to_json(self) -> dict:
        return {"index": self.index, "world_size": self.world_size, "sites": [s.to_json() for s in self.sites],
                "site_keys": list(self.site_keys), "code_before": self.code_before, "code_after": self.code_after,
                "report_file": self.report_file, "shard": self.shard.to_json() if self.shard else None}

    @classmethod
    def from_json(cls, d: dict) -> GraphRecord:
        return cls(**{**d, "sites": tuple(SiteRecord.from_json(s) for s in d["sites"]),
                      "site_keys": _tuple(d["site_keys"]),
                      "shard": ShardSummary.from_json(d["shard"]) if d["shard"] else None})


@dataclass(frozen=True, slots=True, kw_only=True)
class ScheduleRow:
    """One ultraattn node of a graph Inductor compiles, in execution order."""

    node: str
    op: str
    site: str
    comm: bool
    """A communication node (stage start/wait, finish, gather, input check)."""
    what: str
    bytes: int
    """Bytes this rank sends at a stage start (0 elsewhere)."""

    def to_json(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_json(cls, d: dict) -> ScheduleRow:
        return cls(**d)




@dataclass(frozen=True, slots=True, kw_only=True)
class AotGraphRecord:
    """A forward or backward graph AOT autograd handed to the compiler, after site expansion."""

    graph: int
    """The Dynamo graph (``GraphRecord.index``) it came from."""
    kind: str
    """'forward' or 'backward'."""
    expanded: tuple[str, ...]
    """Sites expanded into explicit per-rank programs."""
    code: str
    schedule: tuple[ScheduleRow, ...]

    @property
    def stages(self) -> int:
        return sum(r.op == "cp_start" for r in self.schedule)

    @property
    def tiles(self) -> int:
        return sum(r.op in TILE_OPS for r in self.schedule)

    def to_json(self) -> dict:
        return {"graph": self.graph, "kind": self.kind, "expanded": list(self.expanded), "code": self.code,
                "schedule": [r.to_json() for r in self.schedule]}

    @classmethod
    def from_json(cls, d: dict) -> AotGraphRecord:
        return cls(graph=d["graph"], kind=d["kind"], expanded=_tuple(d["expanded"]), code=d["code"],
                   schedule=tuple(ScheduleRow.from_json(r) for r in d["schedule"]))


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanEvent:
    """A plan (or, at world size 1, block lists) made for a site's mask."""

    site: str
    graph: int
    rank: int
    """The plan rank that made the event (reports show rank 0's)."""
    world: int
    seconds: float
    """Planning time (pattern construction included)."""
    hash: str
    """The plan's content hash (16 hex digits), 'kernels' at world size 1."""
    structure: str
    method: str = ""
    comparison: dict | None = None
    """Modeled figures of ultraattn and every baseline (``report.plan_report.comparison``)."""
    planner: str = ""
    """Which planner made it: "fast", "ilp", "baseline", or "kernels" (block lists at world size 1)."""
    ahead: bool = False
    """The fast plan was made on the worker thread before the step asked (``ultraattn.plan_ahead``)."""
    call: int = 0
    """The site's call number (its step) that needed the plan."""
    stages: dict | None = None
    """A run-time program's plan facts: bytes all ranks send per stage ('fwd', 'bwd': lists), 'imbalance',
    'ownership' (None for other plans)."""
    regret: float | None = None
    """A fast plan's worst-case regret over the cost-model band, against the planner's finalists
    (``planner.robust``; None for other plans)."""
    result: Any = field(default=None, compare=False)
    """The planner's full result (for the full live report); not saved."""

    def to_json(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "result"}

    @classmethod
    def from_json(cls, d: dict) -> PlanEvent:
        return cls(**d)


@dataclass(frozen=True, slots=True, kw_only=True)
class SiteStats:
    """Run-time counts of one site, at the moment the report was taken."""

    graph: int
    site: str
    calls: int
    plans: int
    cache_hits: int
    planning_seconds: float

    def to_json(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_json(cls, d: dict) -> SiteStats:
        return cls(**d)


@dataclass(frozen=True, slots=True, kw_only=True)
class CompileReport:
    """Everything a report shows: graphs, the graphs handed to the compiler, plans and run-time counts."""

    graphs: tuple[GraphRecord, ...]
    aot_graphs: tuple[AotGraphRecord, ...] = ()
    plans: tuple[PlanEvent, ...] = ()
    """The latest plan of each site."""
    stats: tuple[SiteStats, ...] = ()
    history: tuple[PlanEvent, ...] = ()
    """Every plan event kept (the newest ``MAX_PLAN_EVENTS``), in order, without comparisons: the planning time
    and planner of each step that planned."""

    def to_json(self) -> dict:
        return {"version": REPORT_VERSION, "graphs": [g.to_json() for g in self.graphs],
                "aot_graphs": [g.to_json() for g in self.aot_graphs], "plans": [p.to_json() for p in self.plans],
                "stats": [s.to_json() for s in self.stats],
                "history": [p.to_json() for p in self.history]}

    @classmethod
    def from_json(cls, d: dict) -> CompileReport:
        if not isinstance(d, dict) or d.get("version") != REPORT_VERSION:
            got = d.get("version") if isinstance(d, dict) else type(d).__name__
            raise ValueError(f"report version {got!r} is not {REPORT_VERSION}: save the report again with this "
                             f"version of ultraattn (options={{'report_file': ...}})")
        return cls(graphs=tuple(GraphRecord.from_json(g) for g in d["graphs"]),
                   aot_graphs=tuple(AotGraphRecord.from_json(g) for g in d["aot_graphs"]),
                   plans=tuple(PlanEvent.from_json(p) for p in d["plans"]),
                   stats=tuple(SiteStats.from_json(s) for s in d["stats"]),
                   history=tuple(PlanEvent.from_json(p) for p in d["history"]))


class Observer(Protocol):
    """How a compile's records are shown: the backend calls these; ``ultraattn.compiler`` implements them."""

    def graph_compiled(self, rec: GraphRecord) -> None: ...

    def aot_graph_compiled(self, rec: AotGraphRecord) -> None: ...

    def plan_made(self, event: PlanEvent) -> None: ...

    def progress(self, text: str) -> None:
        """A phase of a compile begins or ends: what it is doing, or waiting for (one line)."""


class NullObserver:
    """Shows nothing (``ultraattn.explain`` renders its own report; tests may pass it)."""

    def graph_compiled(self, rec: GraphRecord) -> None:
        pass

    def aot_graph_compiled(self, rec: AotGraphRecord) -> None:
        pass

    def plan_made(self, event: PlanEvent) -> None:
        pass

    def progress(self, text: str) -> None:
        pass
