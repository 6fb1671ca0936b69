"""Expand rewritten sites into explicit per-rank programs in the graphs AOT autograd hands the compiler.

Rewrites (forward and backward graphs alike)::

    out, lse, ticket = site_attention(q, k, v, masks, key)        # one opaque op
    dq, dk, dv = site_attention_bwd(q, k, v, out, lse, do, dlse, ticket, [], key)

into this rank's program, traced from the executor's schedule (``explicit/program.py``)::

    q_l = cat(q[:, :, c0], q[:, :, c3])                            # dispatch (no index constants)
    h0 = cp_start(token, [q_l chunk for rank 1], key, 0)           # post 0: sends and receives (run order)
    o0, l0 = cp_tiles_fwd([q_l], [k_l], [v_l], key, 0)             # launches whose turn came first
    token, k1, v1 = cp_wait(h0, h0, key, 0)                        # post 0 received (token: the last post)
    ...                                                            # LSE merges as aten nodes
    out = cp_gather(token, out_l, key)                             # the global view (not when sharded)

A ``site_attention_local`` node (a sequence-sharded graph) expands the same way without the
dispatch and the gathers. At world size 1 the site becomes the ``bsa_fwd`` / ``bsa_bwd``
kernel op itself.

What a site becomes is its ``SiteForm``, decided once by ``passes.forms.form_for`` and kept in its
state: a program planned at compile time (``PROGRAM``: a mask without run-time content and static shapes;
planned by ``prepare`` in the backend call, before the compiler runs), a program over a fixed skeleton planned
per mask (``PROGRAM_PER_MASK``), the kernel op (``KERNEL``, world size 1), or one opaque op (``ONE_OP``, not
expanded).
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch._inductor.decomposition import select_decomp_table
from torch.fx.experimental.proxy_tensor import make_fx

from ultraattn.passes.explicit.per_mask import per_mask_program
from ultraattn.passes.explicit.program import (
    ExplicitProgram,
    backward_program,
    describe_op,
    forward_program,
    kernel_backward_program,
    kernel_forward_program,
)
from ultraattn.passes.fx_util import splice, ultraattn_op
from ultraattn.passes.opinfo import COMM_OPS
from ultraattn.passes.ops.site import LOCAL_OPS, SITE_BWD_OPS, SITE_OPS
from ultraattn.passes.records import ScheduleRow, SiteForm
from ultraattn.passes.site import SiteState, runner_for
from ultraattn.passes.state import SideTable
from ultraattn.runtime.api import AttentionPlan, check_consistent


def prepare(state: SiteState, device: torch.device) -> None:
    """Plan an expandable site now, in the backend call (every rank compiles the same graphs in order).

    Not later, inside Inductor's compile: planning across ranks is collective (rank 0's plan is
    broadcast and checked), and Inductor holds cross-process cache locks while it compiles, so a
    rank waiting there for a peer could wait on a peer that waits for its lock.
    """
    if state.program is not None:
        return
    state.device = device
    spec = state.spec
    if state.form is SiteForm.PROGRAM_PER_MASK:  # the plan is run-time data: only the skeleton's geometry now
        state.program = per_mask_program(state, device)
        return
    runner = runner_for(state, spec.q_shape, spec.kv_shape, spec.dtype, device, [])
    if isinstance(runner, AttentionPlan):
        check_consistent(runner)
        _ = runner.executor  # build the program now: errors surface at compile time
    state.program = ExplicitProgram(state=state, runner=runner)


def _trace(fn, vals: list) -> fx.GraphModule:
    # Inductor's decompositions: the graphs it receives hold no op it lowers by decomposing
    with detect_fake_mode(vals):
        return make_fx(fn, select_decomp_table(), tracing_mode="real")(*vals)


def _replace_outputs(node: fx.Node, outs: list[fx.Node]) -> None:
    for user in list(node.users):
        if user.op == "call_function" and user.target is operator.getitem:
            user.replace_all_uses_with(outs[user.args[1]])
            user.graph.erase_node(user)
        else:
            raise RuntimeError(f"ultraattn: unexpected use {user.format_node()} of {node.format_node()}")
    node.graph.erase_node(node)


def _program_of(state: SiteState, backward: bool, local: bool):
    prog = state.program
    if prog is None:
        what = "backward of site" if backward else "site"
        raise RuntimeError(f"ultraattn: {what} {state.spec.name} reached the compiler without its compile-time plan")
    if state.form is SiteForm.KERNEL:
        return kernel_backward_program(prog) if backward else kernel_forward_program(prog)
    return backward_program(prog, local) if backward else forward_program(prog, local)


def expand_sites(gm: fx.GraphModule, table: SideTable) -> list[str]:
    """Expand every eligible site node of ``gm`` (a forward or backward graph) in place; returns the site names."""
    done = []
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in SITE_OPS + SITE_BWD_OPS:
            continue
        state = table.sites.get(next(a for a in node.args if isinstance(a, str)))
        if state is None or state.form is SiteForm.ONE_OP:
            continue
        backward = node.target in SITE_BWD_OPS
        args = list(node.args[:8] if backward else node.args[:3])
        if backward:
            args += list(node.args[8])  # the score_mod's buffers
        else:  # the mask's tensors (a run-time plan's input) and the score_mod's buffers
            args += list(node.args[3])
        sub = _trace(_program_of(state, backward, node.target in LOCAL_OPS), [a.meta["val"] for a in args])
        outs = splice(gm, node, sub, args, attr_name=lambda: f"_ultraattn_const_{table.next_id()}")
        _replace_outputs(node, list(outs))
        done.append(state.spec.name)
    if done:
        table.bump("expanded_sites", len(done))
        gm.graph.lint()
        gm.recompile()
    return done




def schedule_rows(gm: fx.GraphModule, table: SideTable) -> tuple[ScheduleRow, ...]:
    """The ultraattn nodes of an expanded graph in execution order, described for reports."""
    rows = []
    for n in gm.graph.nodes:
        op = ultraattn_op(n)
        if op is None:
            continue
        state = next((table.sites[a] for a in n.args if isinstance(a, str) and a in table.sites), None)
        prog = state.program if state is not None else None
        what, nbytes = prog.describe(n, op) if prog is not None else describe_op(n, op)
        rows.append(ScheduleRow(node=n.name, op=op, site=state.spec.name if state is not None else "",
                                comm=op in COMM_OPS, what=what, bytes=nbytes))
    return tuple(rows)

