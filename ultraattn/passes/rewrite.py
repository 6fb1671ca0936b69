"""Rewrite captured attention sites into calls of ``ultraattn::site_attention``."""

from __future__ import annotations

import math
import operator
import uuid

import torch
import torch.fx as fx

from ultraattn.passes.capture import Site
from ultraattn.passes.options import BackendOptions
from ultraattn.passes.site_op import SiteSpec, register

_INV_LN2 = 1.0 / math.log(2.0)


def rewrite_sites(gm: fx.GraphModule, sites: list[Site], options: BackendOptions, graph_index: int = 0
                  ) -> list[SiteSpec]:
    """Replace every rewritable site in place; returns the registered specs (in site order)."""
    specs = []
    touched: dict[int, fx.GraphModule] = {}
    for s in sites:
        if not s.rewritable:
            continue
        graph = s.node.graph
        touched[id(graph.owning_module)] = graph.owning_module
        D = s.q_shape[3]
        scale = float(s.scale) if s.scale is not None else 1.0 / math.sqrt(D)
        info = {}
        mask_nodes: list[fx.Node] = []
        if s.mask == "bool_mask":
            mask_nodes = [s.mask_node]
        elif s.mask == "block_mask":
            bm = s.block_mask
            kvn, kvi, fkn, fki = bm["tensors"]
            has_full = isinstance(fkn, fx.Node) and isinstance(fki, fx.Node)
            mask_nodes = [kvn, kvi] + ([fkn, fki] if has_full else []) + list(bm["buffers"])
            info = {"q_len": bm["q_len"], "kv_len": bm["kv_len"], "q_block": bm["q_block"], "kv_block": bm["kv_block"],
                    "has_full": has_full, "mask_mod": bm["mask_mod"]}
        spec = SiteSpec(key=f"{s.name}-{uuid.uuid4().hex[:12]}", name=s.name, op=s.op, mask=s.mask,
                        q_shape=s.q_shape, kv_shape=s.kv_shape, dtype=s.dtype, scale=scale, options=options,
                        block_mask=info, sync_key=f"g{graph_index}-{s.name}")
        register(spec)
        specs.append(spec)
        with graph.inserting_before(s.node):
            res = graph.call_function(torch.ops.ultraattn.site_attention.default,
                                      (s.q, s.k, s.v, mask_nodes, spec.key))
            out = graph.call_function(operator.getitem, (res, 0))
            if s.op == "sdpa":
                s.node.replace_all_uses_with(out)
            else:
                lse = None
                for user in list(s.node.users):
                    idx = user.args[1]
                    if not user.users:  # an unused output (checkpoint bodies unpack all three)
                        pass
                    elif idx == 0:
                        user.replace_all_uses_with(out)
                    else:  # idx == 1 (capture refused max): the HOP's lse is in log2 units
                        if lse is None:
                            with graph.inserting_before(user):
                                lse_nat = graph.call_function(operator.getitem, (res, 1))
                                lse = graph.call_function(operator.mul, (lse_nat, _INV_LN2))
                        user.replace_all_uses_with(lse)
                    graph.erase_node(user)
        graph.erase_node(s.node)
    for mod in touched.values():
        mod.graph.eliminate_dead_code()
        mod.graph.lint()
        mod.recompile()
    if touched:
        gm.recompile()
    return specs
