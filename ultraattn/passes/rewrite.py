"""Rewrite captured attention sites into calls of ``ultraattn::site_attention``.

Rewrites each site ``capture.find_sites`` marked rewritable::

    a = scaled_dot_product_attention(q, k, v, is_causal=True)
    out, lse, _ = flex_attention(q, k, v, score_mod, block_mask_tuple, ...)

into::

    r = ultraattn.site_attention(q, k, v, [mask tensors...], "sdpa#0-<id>")
    a = r[0]                                   # flex: out = r[0]; lse = r[1] / ln 2

registering the site's ``SiteSpec`` in the side table under the key the call carries. Every
inserted node carries its fake value, and each rewrite bumps ``counters["ultraattn"]["rewritten"]``.
A mask_mod's scalar inputs (a Python number it closes over, which Dynamo makes a SymInt once it
changes between calls: a window size per batch) enter the op as 0-d tensors (``_as_tensors``, through the ops
``ultraattn::int_tensor`` / ``float_tensor``): the op takes tensors only, and the mask_mod computes with a 0-d
tensor as with the number.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.fx as fx

from ultraattn.passes.capture import Site
from ultraattn.passes.forms import form_for
from ultraattn.passes.fx_util import insert_call, is_impure, meta_value, set_value, tensor_value, value_fake_mode
from ultraattn.passes.options import BackendOptions
from ultraattn.passes.records import NullObserver, Observer, SiteForm
from ultraattn.passes.site import SiteSpec, SiteState, site_identity
from ultraattn.passes.state import SideTable
from ultraattn.runtime.tiles import ScoreMod

ops = torch.ops.ultraattn


def site_spec(s: Site, options: BackendOptions, graph_index: int, table: SideTable, code: str) -> SiteSpec:
    """The site's spec, keyed in ``table`` by its name, ``code`` (its graph's) and its identity."""
    scale = float(s.scale) if s.scale is not None else 1.0 / math.sqrt(s.q_shape[3])
    spec = SiteSpec(key="", name=s.name, graph=graph_index, op=s.op, mask=s.mask,
                    q_shape=s.q_shape, kv_shape=s.kv_shape, dtype=s.dtype, scale=scale, options=options,
                    flex=s.flex_info(),
                    score=ScoreMod(fn=s.score_mod, grads=s.score_grads) if s.score_mod is not None else None)
    identity = site_identity(spec)
    return dataclasses.replace(spec, identity=identity, key=table.site_key(s.name, code, identity))


def _as_tensors(graph: fx.Graph, inputs: list, like: fx.Node) -> list[fx.Node]:
    """``inputs`` with every scalar (a SymInt/SymFloat node or a number) made a 0-d tensor node, its fake value
    made in the fake mode of ``like``'s (the op's other inputs')."""
    out = []
    for x in inputs:
        if isinstance(x, fx.Node) and tensor_value(x) is not None:
            out.append(x)
            continue
        value = meta_value(x) if isinstance(x, fx.Node) else x
        op = ops.float_tensor if isinstance(value, (float, torch.SymFloat)) else ops.int_tensor
        node = graph.call_function(op.default, (x,))
        with value_fake_mode([tensor_value(like)]):
            set_value(node, op.default(value))
        out.append(node)
    return out


def _block_kinds(graph: fx.Graph, mask: fx.Node, block: int, made: dict[fx.Node, fx.Node]) -> fx.Node:
    """The node of ``mask``'s block table (``ultraattn::mask_block_kinds``: reduced on the mask's device, one small
    transfer to the host), made once after the mask and shared by every site of the graph that reads it: the layers
    of a model read one mask, and a step moves its block table, not its S x S elements, once."""
    node = made.get(mask)
    if node is None:
        with graph.inserting_after(mask):
            node = made[mask] = insert_call(graph, torch.ops.ultraattn.mask_block_kinds.default, (mask, block))
    return node


def rewrite_sites(gm: fx.GraphModule, sites: list[Site], options: BackendOptions, *, graph_index: int,
                  table: SideTable, observer: Observer | None = None) -> list[SiteState]:
    """Decide every site's form (``forms.form_for``, kept on the site) and replace each site that it rewrites in
    place (module docstring); returns the new sites' states, in site order, each holding its form."""
    states = []
    touched: dict[int, fx.GraphModule] = {}
    kinds: dict[fx.Node, fx.Node] = {}
    code = gm.code
    for s in sites:
        s.form, s.form_why = form_for(s, options)
        if s.rewritable and s.form is SiteForm.AS_WRITTEN:  # rewritable, and its own op is faster (world size 1)
            s.skip(s.form_why)
        if not s.rewritable:
            if s.folded:
                s.keep_folded()
                touched[id(s.node.graph.owning_module)] = s.node.graph.owning_module
            continue
        graph = s.node.graph
        touched[id(graph.owning_module)] = graph.owning_module
        state = table.add_site(site_spec(s, options, graph_index, table, code), observer or NullObserver())
        state.form, state.form_why = s.form, s.form_why
        inputs = s.mask_inputs()
        if s.mask == "bool_mask":  # its block table, what planning reads (once per mask and step, on its device)
            inputs.append(_block_kinds(graph, s.mask_node, options.block_size, kinds))
        with graph.inserting_before(s.node):
            res = insert_call(graph, torch.ops.ultraattn.site_attention.default,
                              (s.q, s.k, s.v, _as_tensors(graph, inputs, s.q), state.spec.key))
        s.replace_with(res)
        table.bump("rewritten")
        states.append(state)
    for mod in touched.values():
        mod.graph.eliminate_dead_code(is_impure_node=is_impure)
        mod.graph.lint()
        mod.recompile()
    if touched:
        gm.recompile()
    return states
