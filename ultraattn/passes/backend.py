"""The ``ultraattn`` torch.compile backend.

``torch.compile(model, backend="ultraattn", options={...})`` finds this function through the
``torch_dynamo_backends`` entry point (pyproject.toml), so a training script needs no import
of ultraattn. Per Dynamo graph it finds the attention sites (``capture.py``), rewrites the
ones it can run exactly (``rewrite.py``, ``site_op.py``), records what it did for reports,
and hands the graph to Inductor.

CPU FlexAttention training: PyTorch's flex_attention refuses ``requires_grad`` inputs on CPU
in its Python front end (``_validate_device``), which Dynamo executes while tracing, before
any backend sees the graph. Importing this module wraps that check so that, on CPU and only
while Dynamo is tracing, the backward refusal is skipped (every other check still runs).
Eager calls and non-CPU devices behave exactly as before. A flex site that the backend
rewrites then trains on CPU through ultraattn's kernels; one it cannot rewrite still fails
later with Inductor's own "CPU only supports inference" error.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx

from ultraattn.passes.capture import Site, _val, estimate_density, find_sites
from ultraattn.passes.options import BackendOptions, parse_options
from ultraattn.passes.rewrite import rewrite_sites
from ultraattn.passes.site_op import SiteSpec


@dataclass
class GraphRecord:
    """What the backend did to one Dynamo graph (for reports and tests)."""

    index: int
    sites: list[Site]
    specs: list[SiteSpec]
    options: BackendOptions
    code_before: str
    code_after: str
    world_size: int
    extra: dict = field(default_factory=dict)

    @property
    def rewritten(self) -> int:
        return len(self.specs)


RECORDS: list[GraphRecord] = []
"""Every graph compiled by this process (most recent last)."""

COUNTERS = {"graphs": 0, "sites": 0, "rewritten": 0, "sharded_ops": 0, "fallbacks": 0}


def reset() -> None:
    """Forget the records and counters (tests)."""
    RECORDS.clear()
    for k in COUNTERS:
        COUNTERS[k] = 0


def ultraattn_backend(gm: fx.GraphModule, example_inputs, options: dict | None = None, **unused):
    """torch.compile backend: rewrite attention sites for context parallelism, then Inductor."""
    if unused:
        mode = unused.get("mode")
        raise ValueError(f"the ultraattn backend takes no torch.compile mode (got mode={mode!r}); "
                         f"pass options={{...}} instead")
    opts = parse_options(options)
    before = gm.code
    sites = find_sites(gm, opts.world_size)
    values = dict(zip([n for n in gm.graph.nodes if n.op == "placeholder"], example_inputs))
    for s in sites:
        try:
            s.density = estimate_density(s, values)
        except Exception:  # noqa: BLE001 - fake example inputs (no data): the report shows "?"
            s.density = None
    specs = rewrite_sites(gm, sites, opts, graph_index=COUNTERS["graphs"])
    shard = None
    if opts.world_size > 1 and specs:
        from ultraattn.passes.shard import check_no_shards, shard_graph

        check_no_shards(example_inputs)
        if opts.shard:
            shard = shard_graph(gm, specs, opts, example_inputs, COUNTERS["graphs"])
    rec = GraphRecord(index=COUNTERS["graphs"], sites=sites, specs=specs, options=opts, code_before=before,
                      code_after=gm.code, world_size=opts.world_size)
    if shard is not None:
        rec.extra["shard"] = shard
        COUNTERS["sharded_ops"] += shard.sharded_ops
        COUNTERS["fallbacks"] += len(shard.fallbacks)
    RECORDS.append(rec)
    COUNTERS["graphs"] += 1
    COUNTERS["sites"] += len(sites)
    COUNTERS["rewritten"] += len(specs)
    rank0 = _rank0()
    if opts.report != "off" and rank0:
        from ultraattn.passes.report import print_graph_report

        print_graph_report(rec, full=opts.report == "full")
    if opts.report_file and rank0:
        from ultraattn.passes.report import save_report

        save_report(opts.report_file)
    if opts.compiler == "eager":
        return _tag_outputs(gm.forward, shard)
    from ultraattn.passes.explicit import explicit_reason, prepare

    by_name = {sp.name: sp for sp in specs}
    for s in sites:
        spec = by_name.get(s.name)
        if spec is not None and explicit_reason(spec) is None:
            prepare(spec, _val(s.q).device)
    if opts.compiler == "aot_eager":
        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.common import aot_autograd

        def expand_only(g, _inputs):
            _expand(rec, g)
            return make_boxed_func(g.forward)

        return _tag_outputs(aot_autograd(fw_compiler=expand_only, bw_compiler=expand_only)(gm, example_inputs), shard)
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    def inner_compile(g, inputs, **kw):
        _expand(rec, g, backward=bool(kw.get("is_backward")))
        return compile_fx_inner(g, inputs, **kw)

    return _tag_outputs(compile_fx(gm, example_inputs, inner_compile=inner_compile), shard)


def _tag_outputs(fn, shard):
    """With ``outputs="sharded"``: mark each returned shard (``ultraattn.undispatch`` reads the mark)."""
    if shard is None or not any(o is not None for o in shard.outputs):
        return fn
    from ultraattn.passes.seq_ops import LAYOUTS

    marks = [(i, (LAYOUTS[shard.key], *o)) for i, o in enumerate(shard.outputs) if o is not None]
    boxed = getattr(fn, "_boxed_call", False)

    def run(*args):
        outs = fn(*args)
        for i, mark in marks:
            if isinstance(outs[i], torch.Tensor):
                outs[i]._ultraattn_shard = mark
        return outs

    run._boxed_call = boxed
    return run


def _expand(rec: GraphRecord, g: fx.GraphModule, backward: bool | None = None) -> None:
    """Explicit per-rank nodes for the sites of one AOT graph (``explicit.py``); keep what Inductor receives."""
    from ultraattn.passes.explicit import expand_sites, order_comm, schedule_rows

    names = expand_sites(g)
    order_comm(g)
    if backward is None:
        backward = any(n.op == "placeholder" and n.name.startswith("tangents") for n in g.graph.nodes)
    entry = {"kind": "backward" if backward else "forward", "expanded": names, "code": g.code,
             "schedule": schedule_rows(g) if names else []}
    rec.extra.setdefault("aot_graphs", []).append(entry)
    opts = rec.options
    if names and _rank0():
        if opts.report != "off":
            from ultraattn.passes.report import print_schedule

            print_schedule(rec.index, entry, full=opts.report == "full")
        if opts.report_file:
            from ultraattn.passes.report import save_report

            save_report(opts.report_file)


def _rank0() -> bool:
    return not (torch.distributed.is_available() and torch.distributed.is_initialized()) or \
        torch.distributed.get_rank() == 0


backend = ultraattn_backend


# ----------------------------------------------------------------------------- flex CPU backward shim
def _install_flex_cpu_shim() -> bool:
    import torch.nn.attention.flex_attention as fa

    orig = getattr(fa, "_validate_device", None)
    if orig is None or getattr(orig, "_ultraattn_shim", False):
        return False

    def _validate_device(query, key, value):
        if query.device.type == "cpu" and torch.compiler.is_dynamo_compiling():
            return None  # tracing for a backend: the backward refusal is the backend's call to make
        return orig(query, key, value)

    _validate_device._ultraattn_shim = True
    _validate_device.__wrapped__ = orig
    fa._validate_device = _validate_device
    return True


SHIM_INSTALLED = _install_flex_cpu_shim()
