"""The compile entry points users meet: the registered ``ultraattn`` backend, and ``explain`` (a dry run).

``torch.compile(model, backend="ultraattn", options={...})`` finds ``ultraattn_backend`` through the
``torch_dynamo_backends`` entry point (pyproject.toml), so a training script needs no import of
ultraattn; ``ultraattn.backend`` is the same callable.

Why this module sits at the top of the package, not in ``passes/``: it composes the pass pipeline
(``passes.backend.compile_graph``) with the reports (``ultraattn/report/``), and the reports render
the passes' records, so they sit above the passes. ``LiveReport`` is the observer that decides how
a compile is shown: printed on rank 0 per ``options["report"]``, saved to ``options["report_file"]``.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.fx as fx
from rich.console import Console

from ultraattn.cache import clear_process_state
from ultraattn.passes.backend import analyse_sharding, compile_graph, find_and_rewrite, site_forms
from ultraattn.passes.flex_shim import install_flex_cpu_shim
from ultraattn.passes.fx_util import meta_value, placeholders
from ultraattn.passes.kept import keep_flex_eager
from ultraattn.passes.options import BackendOptions, parse_options
from ultraattn.passes.records import (
    AotGraphRecord,
    BackendError,
    GraphRecord,
    NullObserver,
    PlanEvent,
    ShardSummary,
    SiteStats,
)
from ultraattn.passes.shard import summarize
from ultraattn.passes.site import plan_offline
from ultraattn.passes.state import KeyCollision, SideTable, private_side_table, side_table
from ultraattn.report.compile_report import (
    print_graph_report,
    print_plan_event,
    print_schedule,
    render_graph,
    save_report,
)
from ultraattn.report.plan_report import plan_row, plans_table, print_plan_result
from ultraattn.report.style import print_line, report_console
from ultraattn.runtime.comm import RankTimeoutError
from ultraattn.runtime.plan_cache import content_digest

SHIM_INSTALLED = install_flex_cpu_shim()
"""Dynamo can trace CPU flex_attention training for this backend (``passes/flex_shim.py``)."""


def _rank0() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


class LiveReport:
    """Shows one compile as its options ask, on rank 0: printed (``report``), saved (``report_file``)."""

    def __init__(self, opts: BackendOptions, table: SideTable):
        self.opts, self.table = opts, table
        self.full = opts.report == "full"
        self.console = report_console()

    def _save(self) -> None:
        if self.opts.report_file:
            save_report(self.opts.report_file, self.table.snapshot(self.opts.report_file))

    def graph_compiled(self, rec: GraphRecord) -> None:
        if _rank0():
            if self.opts.report != "off":
                print_graph_report(rec, full=self.full)
            self._save()

    def aot_graph_compiled(self, rec: AotGraphRecord) -> None:
        if rec.expanded and _rank0():
            if self.opts.report != "off":
                print_schedule(rec, full=self.full)
            self._save()

    def progress(self, text: str) -> None:
        if self.opts.report != "off" and _rank0():
            print_line(self.console, f"[dim]ultraattn {text}[/dim]")

    def plan_made(self, event: PlanEvent) -> None:
        if event.rank == 0 and _rank0():
            if self.opts.report != "off":
                print_plan_event(event, full=self.full)
            self._save()


def ultraattn_backend(gm: fx.GraphModule, example_inputs, options: dict | None = None, **unused):
    """torch.compile backend: context-parallel attention for ``gm`` (``passes/backend.py``), then the compiler.

    An error of the user's making (an option, a mesh, a shape the site cannot take, a peer rank that did not answer)
    reaches the user as ``ultraattn.BackendError`` with ultraattn's message first; anything else is a bug and reaches
    them as Dynamo reports it."""
    try:
        if unused:
            raise ValueError(f"the ultraattn backend takes no torch.compile mode (got mode={unused.get('mode')!r}); "
                             f"pass options={{...}} instead")
        table = side_table()
        opts = parse_options(options, meshes=table.meshes)
        return compile_graph(gm, example_inputs, opts, table=table, observer=LiveReport(opts, table))
    except USER_ERRORS as exc:
        raise BackendError(exc, inspect.currentframe()) from None


USER_ERRORS = (ValueError, TypeError, KeyCollision, RankTimeoutError)
"""What ``ultraattn_backend`` raises as ``BackendError``: errors our checks raise with a message for the user."""


backend = ultraattn_backend


def compile_blocks(blocks, *, options: dict | None = None, **compile_kwargs) -> int:
    """Compile each block of a model with the ultraattn backend, in place, as regional compilation does (PyTorch's
    advice for large models; torchtitan's ``apply_compile``, which refuses backends other than its own two).

    ``blocks``: an ``nn.ModuleDict`` or ``nn.ModuleList`` (``model.layers``) or any iterable of modules (a model's
    final norm and output projection too: ``[model.norm, model.lm_head]``). Each one is compiled in place as
    ``block.compile(backend="ultraattn", options=options, **compile_kwargs)`` would (``fullgraph=True`` unless
    given), PyTorch's own modules included: identical blocks share one compiled graph per input kind.

    The first block meets the global sequence and dispatches it; each block returns this rank's shard (a
    ``SeqShard``, ``options["outputs"] = "sharded"``, the default), so the next takes it with no communication, and
    eager code around the blocks (the embedding before, the final norm, output projection and loss after) sees the
    exact global values. Returns how many blocks were compiled."""
    if isinstance(blocks, torch.nn.ModuleDict):
        mods = list(blocks.values())
    elif isinstance(blocks, torch.nn.Module) and not isinstance(blocks, torch.nn.ModuleList):
        raise TypeError(f"ultraattn.compile_blocks: `blocks` is one {type(blocks).__name__}; pass the container of "
                        f"the model's blocks (model.layers), or torch.compile(model, backend='ultraattn') to compile "
                        f"the whole model as one graph")
    else:
        try:
            mods = list(blocks)
        except TypeError:
            raise TypeError(f"ultraattn.compile_blocks: `blocks` must be an nn.ModuleDict, nn.ModuleList or an "
                            f"iterable of modules, got {type(blocks).__name__}") from None
    bad = [type(m).__name__ for m in mods if not isinstance(m, torch.nn.Module)]
    if bad:
        raise TypeError(f"ultraattn.compile_blocks: `blocks` holds {bad[0]}, not a module; pass model.layers")
    if "backend" in compile_kwargs:
        raise TypeError("ultraattn.compile_blocks: `backend` is always 'ultraattn'; drop the argument")
    compile_kwargs.setdefault("fullgraph", True)
    for m in mods:
        # what ``Module.compile`` does (its ``_compiled_call_impl`` is what ``Module.__call__`` runs), but Dynamo's
        # first frame is ours: Dynamo skips a first frame inside torch.nn, so ``nn.RMSNorm(...).compile()``
        # compiles nothing (and with fullgraph=True raises), where a user's block does not
        m._compiled_call_impl = torch.compile(_region_call(m), backend="ultraattn", options=dict(options or {}),
                                              **compile_kwargs)
    return len(mods)


def _region_call(module: torch.nn.Module):
    def region(*args, **kwargs):
        return module._call_impl(*args, **kwargs)

    return region


# ----------------------------------------------------------------------------- explain
@dataclass
class Explanation:
    records: list[GraphRecord] = field(default_factory=list)
    """One record per graph Dynamo produced."""
    plans: dict = field(default_factory=dict)
    """"graph<i>/<site>" -> PlanResult (world > 1), BlockLists (world 1) or a string saying why not planned."""
    sharding: dict[int, ShardSummary] = field(default_factory=dict)
    """graph index -> what sequence sharding would do (world > 1)."""
    stats: list[SiteStats] = field(default_factory=list)
    """Run-time counts of every site (all zero: nothing runs)."""


def _zeros_like_outputs(gm: fx.GraphModule):
    """A stand-in for the compiled graph: zeros shaped like its outputs (from Dynamo's example values)."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    vals = fx.node.map_arg(out.args[0], meta_value)

    def run(*args):
        return fx.node.map_aggregate(vals, lambda v: torch.zeros(v.shape, dtype=v.dtype, device=v.device)
                                     if isinstance(v, torch.Tensor) else v)

    return run


def _print_sharding(console: Console, index: int, sh: ShardSummary, world: int) -> None:
    fb = sh.fallbacks
    print_line(console, f"graph {index}: sequence sharding would run {sh.sharded_ops} ops on local tokens ({world} "
               f"ranks), {sh.reductions} reductions over the sequence as local sums + all-reduce, "
               + (f"[bold red]{len(fb)} ops on gathered data: " + ", ".join(f"{f.op} ({f.why})" for f in fb)
                  + "[/bold red]" if fb else "[bold green]no gathered fallbacks[/bold green]"))


EXPLAIN_DETAILS = ("summary", "plans", "all")
"""What ``explain`` prints: the sites and one line per distinct plan; and each distinct plan's full report; and the
rewritten graphs too."""


def _explain_graph(gm, example_inputs, *, opts, table, result: Explanation, console: Console, nodes: int,
                   detail: str, seen: dict) -> None:
    """Capture, rewrite, analyse and plan one graph (nothing compiles, nothing runs); print as ``detail`` says.
    ``seen``: plan key -> the first site planned with it (sites that would get the same plan are planned once)."""
    world = opts.world_size
    index, before, sites, states = find_and_rewrite(gm, example_inputs, opts, table=table, observer=NullObserver())
    keep_flex_eager(sites, table, before)
    forms = site_forms(sites, world)
    rec = GraphRecord(index=index, world_size=world, sites=tuple(s.record(forms[s.name]) for s in sites),
                      site_keys=tuple(s.spec.key for s in states), code_before=before, code_after=gm.code)
    result.records.append(rec)
    console.print(render_graph(rec, full=detail == "all"))
    if world > 1 and opts.shard and states:
        _inlined, an = analyse_sharding(gm, example_inputs, table)
        if an is not None:
            result.sharding[index] = summarize(gm, an)
            _print_sharding(console, index, result.sharding[index], world)
    values = dict(zip(placeholders(gm), example_inputs))
    site_nodes = {n.args[4]: n for mod in gm.modules() if isinstance(mod, fx.GraphModule)
                  for n in mod.graph.nodes if n.target is torch.ops.ultraattn.site_attention.default}
    rows: dict[str, dict] = {}
    for state in states:
        spec = state.spec
        name = f"graph{index}/{spec.name}"
        tensors = [values.get(m) for m in site_nodes[spec.key].args[3]]
        if any(t is None for t in tensors):
            result.plans[name] = "the mask is computed inside the graph: planned at run time"
            rows[name] = {"sites": [name], "mask": spec.mask, "seq": spec.q_shape[2], "plan": result.plans[name]}
            continue
        key = content_digest(tensors, (spec.identity, nodes))
        first = seen.setdefault(key, name)
        if first != name:  # the same site and mask as one planned before (another layer): the same plan
            result.plans[name] = result.plans[first]
        else:
            result.plans[name] = plan_offline(spec, tensors, nodes=nodes, devices=world // nodes)
        row = rows.setdefault(key, {"sites": [], **plan_row(result.plans[name], spec.mask, spec.q_shape[2])})
        row["sites"].append(name if first == name or first in row["sites"] else f"{name} (as {first})")
        if first == name and detail != "summary":
            _print_full_plan(console, result.plans[name], name, spec, world)
    if rows:
        console.print(plans_table(list(rows.values()), title=f"graph {index}: plans for {world} "
                                  f"{'rank' if world == 1 else 'ranks'} (modelled)"))
    result.stats.extend(s.stats() for s in states)


def _print_full_plan(console: Console, res, name: str, spec, world: int) -> None:
    if world == 1:
        print_line(console, f"{name}: block-sparse kernels, {res!r}")
    else:
        print_plan_result(console, res, res.plan.mesh,
                          title=f"{name} · {res.pattern.name} · S={spec.q_shape[2]} · {world} ranks")


def explain(model, *inputs, world_size: int = 8, nodes: int = 1, options: dict | None = None,
            console: Console | None = None, detail: str = "summary", **kwargs) -> Explanation:
    """Capture, rewrite and plan ``model(*inputs, **kwargs)``'s attention for ``world_size`` ranks; print; don't run.

    Dynamo traces the model and hands each graph to a backend that captures and rewrites the attention sites
    exactly as ``backend="ultraattn"`` does (on a private side table: the process's own state is untouched),
    plans every rewritten site for ``world_size`` ranks with the example inputs' masks (no process group
    needed: planning is pure) and prints the report. Sites that would get the same plan (the layers of a model)
    are planned, and shown, once. No graph runs: each graph returns zeros of its outputs' shapes, so Dynamo goes
    on to the graphs after a graph break (the Python between graphs runs on those zeros; a model whose control
    flow depends on tensor values may take another path).

    Args:
        world_size: ranks to plan for (``nodes`` x devices per node); 1 shows the kernels' block lists.
        options: backend options (as for ``torch.compile(..., options=)``), e.g. planner settings.
        detail: ``"summary"`` (default): each graph's sites (what each runs as, and why) and one line per
            distinct plan against the best baseline; ``"plans"``: each distinct plan's full report too (mask,
            tiles, ranks, schedule, solver, baselines); ``"all"``: the rewritten graphs' code too.
    """
    if not isinstance(world_size, int) or not isinstance(nodes, int) or world_size < 1 or nodes < 1 or \
            world_size % nodes:
        raise ValueError(f"ultraattn.explain: world_size={world_size!r} must be a positive multiple of "
                         f"nodes={nodes!r}")
    if detail not in EXPLAIN_DETAILS:
        raise ValueError(f"ultraattn.explain: detail={detail!r} is not one of {', '.join(EXPLAIN_DETAILS)}")
    opts = parse_options({**(options or {}), "world_size": world_size}, require_group=False)
    console = console or report_console()
    result = Explanation()
    seen: dict = {}
    with private_side_table() as table:

        def backend(gm, example_inputs):
            _explain_graph(gm, example_inputs, opts=opts, table=table, result=result, console=console, nodes=nodes,
                           detail=detail, seen=seen)
            return _zeros_like_outputs(gm)

        torch._dynamo.reset()
        try:
            with torch.no_grad():
                torch.compile(model, backend=backend)(*inputs, **kwargs)
        finally:
            torch._dynamo.reset()
    if not result.records:
        console.print("[yellow]Dynamo produced no graph: nothing to explain[/yellow]")
    elif detail == "summary" and seen:
        console.print("[dim]explain(..., detail='plans') prints each plan's full report; detail='all' adds the "
                      "rewritten graphs[/dim]", soft_wrap=True)
    return result


def reset() -> None:
    """Forget all of ultraattn's process state, and Dynamo's compiled graphs (which hold keys into it).

    The state has one home, ``ultraattn.cache`` (``held_state()``), and all of it is cleared here: the backend's side
    table (sites, token layouts, records, counts, meshes: ``passes/state.py``), the online planner of masks that
    arrive at run time (``runtime/online.py``), the kernels' cache of block lists (``kernels/ops.py``) and the
    score_mods' generated Triton functions (``runtime/tile_kernels.py``); docs/architecture.md lists what stays
    process-wide on purpose. Every rank must call it at the same point."""
    torch._dynamo.reset()
    side_table().reset()   # (the active table: a private one inside ``explain``, else the process's)
    clear_process_state()
