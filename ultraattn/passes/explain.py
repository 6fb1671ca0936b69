"""``ultraattn.explain(model, *inputs)``: what the backend would do, planned and printed, without a step.

Dynamo traces ``model(*inputs)`` and hands each graph to a backend that captures and rewrites
the attention sites exactly as ``backend="ultraattn"`` does, plans every rewritten site for
``world_size`` ranks (no process group needed: planning is pure) with the example inputs'
masks, and prints the report. No graph runs: each compiled graph returns zeros of its outputs'
shapes, so Dynamo goes on to the graphs after a graph break (the Python between graphs runs on
those zeros; a model whose control flow depends on tensor values may take another path).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from rich.console import Console

from ultraattn.passes.backend import GraphRecord
from ultraattn.passes.capture import estimate_density, find_sites
from ultraattn.passes.options import parse_options
from ultraattn.passes.report import render_graph_report
from ultraattn.passes.rewrite import rewrite_sites


def _zeros_like_outputs(gm: fx.GraphModule):
    """A stand-in for the compiled graph: zeros shaped like its outputs (from Dynamo's example values)."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    vals = fx.node.map_arg(out.args[0], lambda n: n.meta.get("example_value", n.meta.get("val")))

    def run(*args):
        return fx.node.map_aggregate(vals, lambda v: torch.zeros(v.shape, dtype=v.dtype, device=v.device)
                                     if isinstance(v, torch.Tensor) else v)

    return run


@dataclass
class Explanation:
    records: list = field(default_factory=list)
    """One GraphRecord per graph Dynamo produced."""
    plans: dict = field(default_factory=dict)
    """"graph<i>/<site>" -> PlanResult (world > 1), BlockSparseLayout (world 1) or a string saying why not planned."""


def _site_inputs(gm: fx.GraphModule, example_inputs) -> dict:
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return {n: v for n, v in zip(phs, example_inputs)}


def plan_site(spec, mask_tensors, *, nodes: int, devices: int):
    """Plan one rewritten site for ``nodes x devices`` ranks (pure planner) or build its kernel layout (1 rank)."""
    from ultraattn.masks.convert import to_block_pattern
    from ultraattn.passes.site_op import _mask_object
    from ultraattn.planner.api import plan
    from ultraattn.planner.plan import AttnShape, Mesh

    B, H, S, D = spec.q_shape
    Hk = spec.kv_shape[1]
    mask, mask_mod = _mask_object(spec, mask_tensors, B, H)
    if nodes * devices == 1:
        from ultraattn.kernels import make_layout

        return make_layout(mask, q_len=S, kv_len=spec.kv_shape[2], batch=B, num_heads=H, mask_mod=mask_mod,
                           block_size=spec.options.block_size)
    pattern = to_block_pattern(mask, q_len=S, kv_len=S, block_size=spec.options.block_size, batch=B, num_heads=H)
    shape = AttnShape(seq_len=S, num_heads=H, head_dim=D, num_kv_heads=Hk, batch=B)
    return plan(pattern, shape, Mesh(nodes=nodes, devices=devices), cost=spec.options.cost_model(),
                options=spec.options.planner_options())


def explain(model, *inputs, world_size: int = 8, nodes: int = 1, options: dict | None = None,
            console: Console | None = None, **kwargs) -> Explanation:
    """Capture, rewrite and plan ``model(*inputs, **kwargs)``'s attention for ``world_size`` ranks; print; don't run.

    Args:
        world_size: ranks to plan for (``nodes`` x devices per node); 1 shows the kernel layouts.
        options: backend options (as for ``torch.compile(..., options=)``), e.g. planner settings.
    """
    if world_size < 1 or nodes < 1 or world_size % nodes:
        raise ValueError(f"world_size={world_size} must be a positive multiple of nodes={nodes}")
    opts = parse_options({**(options or {}), "world_size": world_size}, require_group=False)
    console = console or Console()
    result = Explanation()

    def backend(gm, example_inputs):
        before = gm.code
        values = _site_inputs(gm, example_inputs)
        sites = find_sites(gm, world_size)
        for s in sites:
            s.density = estimate_density(s, values)
        specs = rewrite_sites(gm, sites, opts, graph_index=len(result.records))
        rec = GraphRecord(index=len(result.records), sites=sites, specs=specs, options=opts, code_before=before,
                          code_after=gm.code, world_size=world_size)
        result.records.append(rec)
        console.print(render_graph_report(rec, full=True))
        if world_size > 1 and opts.shard and specs:
            from ultraattn.passes import shard as SH

            SH.inline_checkpoints(gm)
            SH._refresh_meta(gm, [n for n in gm.graph.nodes if n.op == "placeholder"], example_inputs)
            an = SH.analyse(gm)
            if an is not None:
                info = rec.extra["shard_analysis"] = SH.summarize(gm, an)
                fb = info["fallbacks"]
                console.print(f"graph {rec.index}: sequence sharding would run {info['sharded_ops']} ops on local "
                              f"tokens ({world_size} ranks), {info['reductions']} reductions over the sequence as "
                              f"local sums + all-reduce, "
                              + (f"[bold red]{len(fb)} ops on gathered data: "
                                 + ", ".join(f"{f['op']} ({f['why']})" for f in fb) + "[/bold red]" if fb
                                 else "[bold green]no gathered fallbacks[/bold green]"))
        site_nodes = {n.args[4]: n for mod in gm.modules() if isinstance(mod, fx.GraphModule)
                      for n in mod.graph.nodes if n.target is torch.ops.ultraattn.site_attention.default}
        for spec in specs:
            node = site_nodes[spec.key]
            tensors = [values.get(m) for m in node.args[3]]
            name = f"graph{rec.index}/{spec.name}"
            if any(t is None for t in tensors):
                result.plans[name] = "the mask is computed inside the graph: planned at run time"
                console.print(f"[yellow]{name}: {result.plans[name]}[/yellow]")
                continue
            res = plan_site(spec, tensors, nodes=nodes, devices=world_size // nodes)
            result.plans[name] = res
            if world_size == 1:
                density = res.attended_pairs() / (math.prod(spec.q_shape[:3]) * spec.kv_shape[2])
                console.print(f"{name}: block-sparse kernels, {res!r}, density {density:.3f}")
            else:
                from ultraattn.planner.plan import Mesh
                from ultraattn.report.plan_report import print_plan_result

                print_plan_result(console, res, Mesh(nodes=nodes, devices=world_size // nodes),
                                  title=f"{name} · {res.pattern.name} · S={spec.q_shape[2]} · {world_size} ranks")
        return _zeros_like_outputs(gm)

    torch._dynamo.reset()
    try:
        with torch.no_grad():
            torch.compile(model, backend=backend)(*inputs, **kwargs)
    finally:
        torch._dynamo.reset()
    if not result.records:
        console.print("[yellow]Dynamo produced no graph: nothing to explain[/yellow]")
    return result
