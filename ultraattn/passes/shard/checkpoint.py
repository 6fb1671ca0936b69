"""Inline activation-checkpoint regions so the sharding analysis sees one flat graph, checkpointing kept."""

from __future__ import annotations

import operator
from collections.abc import Callable

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from ultraattn.passes.fx_util import splice

AC_ID_BASE = 1 << 20
"""Inlined regions' ``ac_graph_id`` start here, apart from torch's own (which start at 1)."""


def _inlinable(gm: fx.GraphModule, n: fx.Node, hop) -> bool:
    if hop is None or n.op != "call_function" or n.target is not hop or n.args[0].op != "get_attr":
        return False
    body = getattr(gm, n.args[0].target)
    if "_checkpoint_context_fn" in getattr(body, "meta", {}) or set(n.kwargs) - {"use_reentrant"}:
        return False  # a selective-checkpoint policy
    if any(b.op not in ("placeholder", "output", "call_function", "call_method") or
           isinstance(b.target, torch._ops.HigherOrderOperator) for b in body.graph.nodes):
        return False  # nested higher-order ops
    return all(u.op == "call_function" and u.target is operator.getitem for u in n.users)


def inline_checkpoints(gm: fx.GraphModule, next_id: Callable[[], int]) -> int:
    """Rewrites each activation-checkpoint region (``torch.utils.checkpoint`` under Dynamo)::

        out = tag_activation_checkpoint(body, x, w)          y = linear(x, w)   # recompute=PREFER_RECOMPUTE,
        y = out[0]                                                              # ac_graph_id=<region id>

    so the analysis sees one flat graph. Checkpointing is kept: each inlined node carries the tags the
    higher-order op would have given it when AOT autograd traced it (``recompute = PREFER_RECOMPUTE`` and one
    ``ac_graph_id`` per region, ``AC_ID_BASE + next_id()``), which make_fx copies onto the aten nodes, so the
    partitioner recomputes the region in the backward exactly as before. Regions with a selective-checkpoint
    policy (``context_fn``) or nested higher-order ops stay as they are (run on gathered data, reported as
    fallbacks). Returns how many regions were inlined.
    """
    hop = getattr(torch.ops.higher_order, "tag_activation_checkpoint", None)
    g = gm.graph
    done = 0
    for n in list(g.nodes):
        if not _inlinable(gm, n, hop):
            continue
        region = AC_ID_BASE + next_id()
        outs = splice(gm, n, getattr(gm, n.args[0].target), n.args[1:],
                      meta=lambda old, new, r=region: dict(old.meta, recompute=CheckpointPolicy.PREFER_RECOMPUTE,
                                                           ac_graph_id=r))
        outs = outs if isinstance(outs, tuple | list) else (outs,)
        for u in list(n.users):
            u.replace_all_uses_with(outs[u.args[1]])
            g.erase_node(u)
        attr = n.args[0]
        g.erase_node(n)
        if not attr.users:
            g.erase_node(attr)
        done += 1
    if done:
        g.lint()
        gm.delete_all_unused_submodules()
        gm.recompile()
    return done
