"""Chain every communicating node of a graph in graph order, so that every rank runs them in one order.

[Note] Inductor schedules nodes by their data dependencies alone. The graph is the same on every
rank except inside the explicit sites' programs (per-rank schedules), so two independent
collectives, say a weight-gradient all-reduce and a site's backward exchange, could run in
different orders on different ranks and wait on each other forever. Rewrites::

    g = sp_weight_grad(dw, key)               g = sp_weight_grad(dw, key, after=prev)
    h = cp_start(token0, pieces, site, 0)     h = cp_start(g, pieces, site, 0)

Each communicating node outside a program gets the previous one's output as its ``after``
argument, and each program's first token is replaced by it (a program's own nodes are already
chained by its token), so the order is total and the same everywhere.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ultraattn.passes.fx_util import set_input, set_value, ultraattn_op
from ultraattn.passes.opinfo import AFTER_OPS, TOKEN_OPS, WAIT_OPS


def _chained(tok) -> bool:
    """Whether a program's token already comes from an ultraattn op (directly or as element 0 of its outputs) other
    than ``cp_token``, which starts a program's chain."""
    if not isinstance(tok, fx.Node):
        return False
    op = ultraattn_op(tok)
    if op is not None:
        return op != "cp_token"
    return tok.target is operator.getitem and ultraattn_op(tok.args[0]) is not None


def _first_output(gm: fx.GraphModule, n: fx.Node) -> fx.Node:
    """``n`` itself for a tensor output, else the node of its element 0 (a token, or an output produced when
    the op ends), created if no user takes it yet."""
    val = n.meta.get("val")
    if isinstance(val, torch.Tensor):
        return n
    first = next((u for u in n.users if u.target is operator.getitem and u.args[1] == 0), None)
    if first is None:
        with gm.graph.inserting_after(n):
            first = gm.graph.call_function(operator.getitem, (n, 0))
        set_value(first, val[0])
    return first


def order_comm(gm: fx.GraphModule) -> int:
    """Rewrites ``gm`` in place (module docstring); returns the number of communicating nodes chained."""
    prev = None
    count = 0
    for n in list(gm.graph.nodes):
        op = ultraattn_op(n)
        if op in AFTER_OPS:
            if prev is not None:
                set_input(n, "after", prev)
        elif op in TOKEN_OPS:
            if not _chained(n.args[0]) and prev is not None:
                set_input(n, 0, prev)
        elif op not in WAIT_OPS:
            continue
        count += 1
        prev = _first_output(gm, n)
    if count:
        gm.graph.lint()
        gm.recompile()
    return count
