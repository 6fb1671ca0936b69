"""The backend's pipeline for one Dynamo graph, top-down: capture -> rewrite -> analyse -> plan -> lower -> expand.

``compile_graph`` is what the registered backend (``ultraattn.compiler.ultraattn_backend``) runs
for every graph Dynamo hands it:

1. **capture** (``capture.py``): the SDPA and flex_attention calls, each marked rewritable or not;
2. **rewrite** (``rewrite.py``): rewritable sites become ``ultraattn::site_attention`` calls;
3. **analyse** (``shard/analysis.py``, world size > 1): which values carry the sequence and which ops
   can run on this rank's tokens (pure);
4. **plan** (here): the graph's token layout, from its first attention's plan, a collective that
   every rank runs in the same order; and the plans of the sites expanded at compile time;
5. **lower** (``shard/lowering.py``): the graph rewritten to run on local tokens;
6. **expand** (``explicit/``): in the forward and backward graphs AOT autograd makes, each site with a
   compile-time plan becomes this rank's explicit program; communication is put in one order.

State lives in the side table (``state.py``); what was done is reported as records
(``records.py``) to the observer the caller passes, which decides how to show them.
"""

from __future__ import annotations

import dataclasses
import os
import time
import warnings

import torch
import torch.fx as fx
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

from ultraattn.passes.capture import Site, estimate_density, find_sites
from ultraattn.passes.carrier import Carried, SeqShard
from ultraattn.passes.explicit.expand import expand_sites, prepare, schedule_rows
from ultraattn.passes.explicit.order import order_comm
from ultraattn.passes.explicit.per_mask import RUNTIME_MASK_STRIPES
from ultraattn.passes.fx_util import placeholders, refresh_fake_values, specialize_sizes, tensor_value, ultraattn_op
from ultraattn.passes.kept import keep_flex_eager
from ultraattn.passes.options import BackendOptions
from ultraattn.passes.records import (
    AotGraphRecord,
    FallbackWarning,
    GraphRecord,
    Observer,
    PlanEvent,
    ShardSummary,
    SiteForm,
)
from ultraattn.passes.rewrite import rewrite_sites
from ultraattn.passes.shard import Seq, analyse, inline_checkpoints, lower
from ultraattn.passes.site import SiteState, seed_plan
from ultraattn.passes.state import SideTable
from ultraattn.planner.api import padded_chunk
from ultraattn.planner.baselines import striped_owner, zigzag_owner
from ultraattn.planner.plan import TokenSharding
from ultraattn.runtime.comm import GroupRef, resolve_group
from ultraattn.runtime.sequence import SequenceShards


class _Recorded:
    """The caller's observer, behind the side table: every record is kept before it is shown."""

    def __init__(self, table: SideTable, observer: Observer):
        self.table, self.observer = table, observer

    def graph_compiled(self, rec: GraphRecord) -> None:
        self.table.record_graph(rec)
        self.observer.graph_compiled(rec)

    def aot_graph_compiled(self, rec: AotGraphRecord) -> None:
        self.table.record_aot_graph(rec)
        self.observer.aot_graph_compiled(rec)

    def plan_made(self, event: PlanEvent) -> None:
        self.table.record_plan(event)
        self.observer.plan_made(event)

    def progress(self, text: str) -> None:
        self.observer.progress(text)


class _Phases:
    """Progress lines of one graph's compile: each phase says what it does or waits for, with the seconds since the
    backend received the graph."""

    def __init__(self, observer: Observer):
        self.observer, self.t0, self.index = observer, time.perf_counter(), None

    def __call__(self, text: str) -> None:
        where = "" if self.index is None else f"graph {self.index}: "
        self.observer.progress(f"[{time.perf_counter() - self.t0:5.1f} s] {where}{text}")


def crowded_cores(world: int) -> str:
    """Words for a compile whose ranks share this machine's cores (more ranks on the host than cores), else ''."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if local <= cores:
        return ""
    return f"; {local} ranks compile at once on {cores} CPU cores, so each takes about {local / cores:.0f}x as long"


def compile_graph(gm: fx.GraphModule, example_inputs, opts: BackendOptions, *, table: SideTable,
                  observer: Observer):
    """Run the pipeline on ``gm`` (module docstring) and compile it with ``opts.compiler``; returns the callable
    Dynamo keeps. Every rank must call this with the same graphs in the same order (planning is collective)."""
    observer = _Recorded(table, observer)
    say = _Phases(observer)
    example_inputs = specialize_sizes(gm, example_inputs)
    carried = carried_inputs(gm, example_inputs)
    index, before, sites, states = find_and_rewrite(gm, example_inputs, opts, table=table, observer=observer)
    say.index = index
    say(f"captured {len(sites)} attention sites, {len(states)} rewritten")
    kept = keep_flex_eager(sites, table, before)
    shard = None
    if opts.world_size > 1 and (states or carried) and opts.shard:
        say("sharding the sequence (the token layout: rank 0 plans it, every rank waits for it)")
        shard = shard_sequence(gm, states, opts, example_inputs, table, carried)
    taken = _taken(gm, carried, shard)
    example_inputs = _entry_values(gm, example_inputs, carried, taken)
    forms = site_forms(sites, opts.world_size)
    rec = GraphRecord(index=index, world_size=opts.world_size, code_before=before, code_after=gm.code,
                      sites=tuple(s.record(forms[s.name]) for s in sites),
                      site_keys=tuple(s.spec.key for s in states), report_file=opts.report_file, shard=shard)
    table.bump("graphs")
    table.bump("sites", len(sites))
    warn_fallbacks(rec)
    observer.graph_compiled(rec)
    compiled = boundary(_compile(gm, example_inputs, rec, opts, table, observer, _devices(sites, states),
                                 say), carried, taken, shard)
    table.forget_with(compiled, rec.site_keys + tuple(kept.values()))
    say("ready" + ("" if opts.compiler == "eager" else "; its backward compiles when it first runs"))
    return compiled


def warn_fallbacks(rec: GraphRecord) -> None:
    """One ``FallbackWarning`` per site of ``rec`` that runs replicated across ranks, and per op that needed a sharded
    tensor whole, with the reason (the report's table says the same). At world size 1 nothing is split, so nothing
    falls back; a site kept because its own op is faster there is a choice, not a fallback."""
    if rec.world_size <= 1:
        return
    for s in rec.sites:
        if not s.rewritten and not s.why.startswith("kept ("):
            warnings.warn(f"ultraattn: attention site {s.name} of graph {rec.index} ({s.op}, q {list(s.q_shape)}, "
                          f"{s.dtype}, mask {s.mask}) runs replicated on every rank, as the model wrote it: {s.why}",
                          FallbackWarning, stacklevel=2)
    for f in rec.shard.fallbacks if rec.shard is not None else ():
        warnings.warn(f"ultraattn: {f.op} ({f.node}) of graph {rec.index} needs a sharded tensor whole: one all-gather "
                      f"per call ({f.why})", FallbackWarning, stacklevel=2)


def find_and_rewrite(gm: fx.GraphModule, example_inputs, opts: BackendOptions, *, table: SideTable,
                     observer: Observer) -> tuple[int, str, list[Site], list[SiteState]]:
    """The pipeline's first steps, shared by ``compile_graph`` and ``ultraattn.explain``: number the graph, keep its
    code, capture its sites and rewrite the rewritable ones. Returns (graph index, code before, sites, states)."""
    index = table.next_graph_index()
    before = gm.code
    sites = capture(gm, example_inputs, opts.world_size)
    states = rewrite_sites(gm, sites, opts, graph_index=index, table=table, observer=observer)
    return index, before, sites, states


# ----------------------------------------------------------------------------- capture
def capture(gm: fx.GraphModule, example_inputs, world: int) -> list[Site]:
    """The graph's attention sites, each with its mask density from the example inputs where they hold data."""
    sites = find_sites(gm, world)
    values = dict(zip(placeholders(gm), example_inputs))
    for s in sites:
        try:
            s.density = estimate_density(s, values)
        except Exception:  # noqa: BLE001 - fake example inputs (no data): the report shows "?"
            s.density = None
    return sites


def site_forms(sites: list[Site], world: int) -> dict[str, str]:
    """What each site of a graph runs as, in the words the report's "form" column shows (site name -> its
    ``SiteForm``'s word, as ``forms.form_for`` decided it when the graph was rewritten); ``as written`` says
    ``replicated`` at world size > 1 where the site could not be rewritten.

    Shared by ``compile_graph`` and ``ultraattn.explain``, so both say the same."""
    forms = {}
    for s in sites:
        # (a site is kept by choice only at world size 1, ``forms.form_for``: above it, as written is replicated)
        forms[s.name] = s.form.word(s.form_why) + (", replicated" if s.form is SiteForm.AS_WRITTEN and world > 1
                                                   else "")
    return forms


def _devices(sites: list[Site], states: list[SiteState]) -> dict[str, torch.device]:
    """The device of each site that is expanded at compile time (by site key)."""
    device_of = {s.name: s.device for s in sites}
    return {st.spec.key: device_of[st.spec.name] for st in states if st.form is not SiteForm.ONE_OP}


# ----------------------------------------------------------------------------- analyse, plan, lower
def _has_site(gm: fx.GraphModule) -> bool:
    return any(ultraattn_op(n) == "site_attention" for n in gm.graph.nodes) or \
        any(_has_site(m) for m in gm.children() if isinstance(m, fx.GraphModule))


def analyse_sharding(gm: fx.GraphModule, example_inputs, table: SideTable, taken: dict[fx.Node, Carried] | None = None):
    """Inline checkpointed regions, refresh the fake values and analyse which values carry the sequence (pure):
    ``shard_sequence``'s first steps, and all ``ultraattn.explain`` shows of sharding. Returns (checkpoints
    inlined, the analysis or None)."""
    inlined = inline_checkpoints(gm, table.next_id)
    refresh_fake_values(gm, placeholders(gm), example_inputs)
    seeds = {ph: Seq(c.dim, c.length, c.inner) for ph, c in (taken or {}).items()}
    return inlined, analyse(gm, seeds)


def shard_sequence(gm: fx.GraphModule, states: list[SiteState], opts: BackendOptions, example_inputs,
                   table: SideTable, carried: dict[int, Carried]) -> ShardSummary | None:
    """Sequence-shard ``gm`` in place for this rank; None when it has no site to shard around.

    ``carried``: inputs that arrive as shards (``SeqShard``); those in this graph's layout and aligned with its
    sequence the same way are taken as they are (no communication), the others are gathered where the graph is
    called (``boundary``)."""
    phs = placeholders(gm)
    _mesh, ranks, group, me = resolve_group(opts.mesh, None)
    taken = _takeable(phs, carried, table, ranks)
    if not _has_site(gm) and not taken:
        return None
    inlined, an = analyse_sharding(gm, example_inputs, table, taken)
    if an is None or not (an.sites or an.carried):
        return None
    if any(not isinstance(d, int) for n in an.sites for d in tensor_value(n.args[0]).shape):
        return None  # dynamic shapes: attention-only CP
    by_key = {s.spec.key: s for s in states}
    if an.carried:  # the layout the shards arrive in
        key = taken[next(iter(an.carried))].key
        layout, how = table.layout(key).layout, "the layout the input shards arrive in"
    else:
        key, how = table.decided.get((an.seq_len, ranks), (None, None))
        if key is not None:
            layout, how = table.layout(key).layout, f"this run's layout for {an.seq_len} tokens: {how}"
        else:
            layout, how = choose_layout(an, by_key, dict(zip(phs, example_inputs)), opts)  # a collective
            key = layout_key(layout, ranks)
            table.decided[(an.seq_len, ranks)] = (key, how)
    for n in an.sites:
        by_key[n.args[4]].layout = layout
    table.add_layout(key, SequenceShards(layout, rank=me, global_ranks=ranks, group_ref=GroupRef(group),
                                         timeout=opts.timeout))
    an.carried = {ph: s for ph, s in an.carried.items() if taken[ph].key == key}
    summary = lower(gm, an, key, outputs=opts.outputs, local_len=layout.local_len,
                    layout_text=f"{layout.to_string()} ({how})", debug=opts.debug)
    for ph in an.carried:  # from here on the placeholder holds this rank's tokens
        ph.meta["example_value"] = ph.meta["ultraattn_local"]
    refresh_fake_values(gm, phs, example_inputs)
    table.bump("sharded_ops", summary.sharded_ops)
    table.bump("fallbacks", len(summary.fallbacks))
    return dataclasses.replace(summary, inlined_checkpoints=inlined)


def layout_key(layout: TokenSharding, ranks: tuple[int, ...]) -> str:
    """A layout's name in the side table: its chunks and the global ranks that hold them."""
    return f"{layout.to_string()} @ {','.join(map(str, ranks))}"


def choose_layout(an, states: dict[str, SiteState], values: dict, opts: BackendOptions) -> tuple[TokenSharding, str]:
    """The token layout of the run's first graph at a sequence length: fine head-tail stripes where the first
    attention is an explicit site whose mask arrives every batch; else its own plan (planned now, without a given
    layout, where its mask is known at compile time: a static mask or mask tensors among the example inputs), else
    head-tail chunks (two per rank: balanced for causal-like masks). Every site of the graph, and of every later
    graph at that length on these ranks (``SideTable.decided``), is then planned in it.

    Returns (layout, how it was chosen)."""
    first = an.sites[0]
    state = states[first.args[4]]
    spec = state.spec
    block = spec.flex.q_block if spec.flex is not None else opts.block_size
    world = opts.world_size
    if state.form is SiteForm.PROGRAM_PER_MASK:
        # a new mask every batch, computed where its query rows live: no single mask's plan fits the next one;
        # fine head-tail stripes balance document masks within ~1.1 (passes/explicit/per_mask.py's [Note]): the
        # most stripes (up to RUNTIME_MASK_STRIPES) that pad the sequence no more than the fewest would
        chunks = {s: padded_chunk(an.seq_len, 2 * world * s, block) for s in range(1, RUNTIME_MASK_STRIPES + 1)}
        least = min(2 * world * s * c for s, c in chunks.items())
        stripes = max(s for s, c in chunks.items() if 2 * world * s * c == least)
        chunk = chunks[stripes]
        return TokenSharding(chunk_size=chunk, owner=tuple(striped_owner(world, stripes))), \
            f"head-tail stripes x{stripes} (a new mask every batch)"
    tensors = [values.get(m) for m in first.args[3]]
    real = tensors and all(isinstance(t, torch.Tensor) and not isinstance(t, torch._subclasses.FakeTensor)
                           for t in tensors)
    if spec.static_mask or real:
        q = tensor_value(first.args[0])
        plan = seed_plan(state, q.dtype, q.device, [] if spec.static_mask else tensors)
        return plan.layout, f"the plan of {spec.name}"
    chunk = padded_chunk(an.seq_len, 2 * world, block)
    return TokenSharding(chunk_size=chunk, owner=tuple(zigzag_owner(world))), \
        "head-tail (the first mask is built in the graph)"


# ----------------------------------------------------------------------------- compile, expand
def _compile(gm, example_inputs, rec: GraphRecord, opts: BackendOptions, table: SideTable, observer: Observer,
             devices: dict[str, torch.device], say=lambda text: None):
    if opts.compiler == "eager":
        return gm.forward
    for key, device in devices.items():  # compile-time plans (collective): now, not inside Inductor
        state = table.site(key)
        if state.program is None:
            say(f"planning {state.spec.name} for {opts.world_size} rank{'s' if opts.world_size > 1 else ''}"
                + (" (rank 0 plans, every rank waits for it)" if opts.world_size > 1 else ""))
        prepare(state, device)

    def expand(g: fx.GraphModule, backward: bool | None = None) -> None:
        expand_graph(rec, g, table, observer, backward)

    if opts.compiler == "aot_eager":
        def expand_only(g, _inputs):
            expand(g)
            return make_boxed_func(g.forward)

        return aot_autograd(fw_compiler=expand_only, bw_compiler=expand_only)(gm, example_inputs)
    # (imported here: Inductor's compile machinery is heavy and only this path needs it)
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    def inner_compile(g, inputs, **kw):
        which = "backward" if kw.get("is_backward") else "forward"
        expand(g, backward=which == "backward")
        say(f"Inductor compiling the {which}: code generation and kernel builds{crowded_cores(opts.world_size)}")
        t0 = time.perf_counter()
        out = compile_fx_inner(g, inputs, **kw)
        say(f"Inductor compiled the {which} in {time.perf_counter() - t0:.1f} s")
        return out

    # AOT autograd's cache is keyed on the graph before ``expand``: a hit would skip it and serve another compile's
    # programs (another plan, other options). Inductor's FX graph cache, keyed on the expanded graph's text, stays on:
    # the site keys are deterministic, so a restart hits it.
    with torch._functorch.config.patch(enable_autograd_cache=False):
        return compile_fx(gm, example_inputs, inner_compile=inner_compile)


def expand_graph(rec: GraphRecord, g: fx.GraphModule, table: SideTable, observer: Observer,
                 backward: bool | None = None) -> AotGraphRecord:
    """Explicit per-rank programs for the sites of one AOT graph, communication in one order; recorded."""
    names = expand_sites(g, table)
    table.bump("comm_ordered", order_comm(g))
    if backward is None:
        backward = any(n.op == "placeholder" and n.name.startswith("tangents") for n in g.graph.nodes)
    aot = AotGraphRecord(graph=rec.index, kind="backward" if backward else "forward", expanded=tuple(names),
                         code=g.code, schedule=schedule_rows(g, table) if names else ())
    observer.aot_graph_compiled(aot)
    return aot


# ----------------------------------------------------------------------------- shards in and out
def carried_inputs(gm: fx.GraphModule, example_inputs) -> dict[int, Carried]:
    """The inputs that arrive as shards another graph returned (``SeqShard``), by input index.

    Dynamo traced them with their global shape; from here on the graph's placeholders hold plain (fake) global
    values, the analysis's view, and each keeps its fake local tensor (``meta["ultraattn_local"]``)."""
    out = {}
    for i, (ph, x) in enumerate(zip(placeholders(gm), example_inputs)):
        if isinstance(x, SeqShard):
            out[i] = x._carried
            fv = ph.meta.get("example_value")
            if isinstance(fv, SeqShard):
                ph.meta["ultraattn_local"] = fv._local
                ph.meta["example_value"] = fv._local.new_empty(fv.shape)
    return out


def _takeable(phs: list[fx.Node], carried: dict[int, Carried], table: SideTable, ranks) -> dict[fx.Node, Carried]:
    """The carried placeholders this graph can take as they are: their layout is on this graph's ranks."""
    out = {}
    for i, c in carried.items():
        held = table.layouts.get(c.key)
        if held is not None and tuple(held.global_ranks) == tuple(ranks) and "ultraattn_local" in phs[i].meta:
            out[phs[i]] = c
    return out


def _taken(gm: fx.GraphModule, carried: dict[int, Carried], shard: ShardSummary | None) -> tuple[int, ...]:
    """Indices of the carried inputs the sharded graph takes as they are (by placeholder name)."""
    names = set(shard.carried) if shard is not None else set()
    return tuple(i for i, ph in enumerate(placeholders(gm)) if i in carried and ph.name in names)


def _entry_values(gm: fx.GraphModule, example_inputs, carried: dict[int, Carried], taken: tuple[int, ...]):
    """The example inputs of the graph as compiled: local tensors for the carried inputs it takes as they are,
    plain global ones (gathered where it is called) for the other shards."""
    values = list(example_inputs)
    for i in carried:
        x = values[i]
        values[i] = x._local if i in taken else x._local.new_empty(x.shape)  # (real or fake, as the input is)
    return values


def boundary(fn, carried: dict[int, Carried], taken: tuple[int, ...], shard: ShardSummary | None):
    """The callable Dynamo keeps: ``fn`` between the shards that arrive and those that leave.

    Carried inputs the graph takes as they are enter as their local tensors (``SeqShard.to_local``), other shards
    as their global value (``full_tensor``: an all-gather, once); with ``outputs="sharded"`` every output that is
    this rank's tokens leaves as a ``SeqShard`` of the graph's layout (``passes/carrier.py``). All three are
    differentiable, so gradients cross the boundary the same way, as shards.

    [Note] Always a new function: the side table drops a graph's sites when Dynamo drops what the backend
    returned (``SideTable.forget_with``), and Dynamo keeps exactly that object, whereas the compiler's own
    callable may be referenced only through it."""
    gathered = tuple(i for i in carried if i not in taken)
    leaving = []
    if shard is not None:
        leaving = [(i, Carried(shard.key, *o)) for i, o in enumerate(shard.outputs) if o is not None]

    def run(*args):
        args = list(args)  # (Dynamo calls what a backend returns unboxed, whatever its ``_boxed_call`` says)
        for i in taken:
            args[i] = args[i].to_local()
        for i in gathered:
            if isinstance(args[i], SeqShard):
                args[i] = args[i].full_tensor()
        outs = fn(*args)
        if leaving:
            outs = list(outs)
            for i, c in leaving:
                if isinstance(outs[i], torch.Tensor) and not isinstance(outs[i], SeqShard):
                    outs[i] = SeqShard.from_local(outs[i], c)
        return outs

    run._boxed_call = getattr(fn, "_boxed_call", False)
    return run
