"""Expand rewritten sites into explicit per-rank programs in the graphs AOT autograd hands the compiler.

Rewrites (forward and backward graphs alike)::

    out, lse, ticket = site_attention(q, k, v, masks, key)        # one opaque op
    dq, dk, dv = site_attention_bwd(q, k, v, out, lse, do, dlse, ticket, [], key)

into this rank's program, traced from the executor's schedule (``explicit/program.py``)::

    q_l = cat(q[:, :, c0], q[:, :, c3])                            # dispatch (no index constants)
    h0 = cp_start(token, [q_l chunk for rank 1], key, 0)           # post 0: sends and receives (run order)
    o0, l0 = cp_tile_fwd(q_l, [k_l], [v_l], key, 0)                # launches whose turn came first
    token, k1, v1 = cp_wait(h0, h0, key, 0)                        # post 0 received (token: the last post)
    ...                                                            # LSE merges as aten nodes
    out = cp_gather(token, out_l, key)                             # the global view (not when sharded)

A ``site_attention_local`` node (a sequence-sharded graph) expands the same way without the
dispatch and the gathers. At world size 1 the site becomes the ``bsa_fwd`` / ``bsa_bwd``
kernel op itself.

Only sites whose plan is known at compile time are expanded (``explicit_reason``): masks
without run-time content (SDPA ``is_causal`` or no mask) and static shapes. Their plan is made
by ``prepare`` in the backend call, before the compiler runs.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch._inductor.decomposition import select_decomp_table
from torch.fx.experimental.proxy_tensor import make_fx

from ultraattn.passes.explicit.dynamic import dynamic_program
from ultraattn.passes.explicit.program import (
    ExplicitProgram,
    backward_program,
    forward_program,
    kernel_backward_program,
    kernel_forward_program,
)
from ultraattn.passes.fx_util import splice, ultraattn_op
from ultraattn.passes.opinfo import COMM_OPS, TILE_ROW_OPS
from ultraattn.passes.ops.site import LOCAL_OPS, SITE_BWD_OPS, SITE_OPS
from ultraattn.passes.records import ScheduleRow
from ultraattn.passes.site import SiteState, runner_for
from ultraattn.passes.state import SideTable
from ultraattn.runtime.api import AttentionPlan, check_consistent


def explicit_reason(state: SiteState) -> str | None:
    """Why a site keeps the opaque op (None: it can be expanded)."""
    spec = state.spec
    if not spec.options.explicit:
        return "options['explicit'] is False"
    if not all(isinstance(d, int) for d in (*spec.q_shape, *spec.kv_shape)):
        return "dynamic shapes"
    if not spec.static_mask and spec.options.world_size == 1:
        return "world size 1 with a run-time mask: the block-sparse kernel op runs with each mask's layout"
    return None


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
    if not spec.static_mask:  # the plan is run-time data: only the skeleton's geometry is fixed now
        state.program = dynamic_program(state, device)
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
    if state.spec.options.world_size == 1 and not prog.dynamic:
        return kernel_backward_program(prog) if backward else kernel_forward_program(prog)
    return backward_program(prog, local) if backward else forward_program(prog, local)


def expand_sites(gm: fx.GraphModule, table: SideTable) -> list[str]:
    """Expand every eligible site node of ``gm`` (a forward or backward graph) in place; returns the site names."""
    done = []
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in SITE_OPS + SITE_BWD_OPS:
            continue
        state = table.sites.get(next(a for a in node.args if isinstance(a, str)))
        if state is None or explicit_reason(state) is not None:
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


_DYNAMIC_WORDS = {
    "cp_dyn_plan": "plan this call's mask (run-time data: bytes per step in the planning table)",
    "cp_dyn_index": "this rank's token positions under the plan",
    ("cp_start", "fwd"): "stage: post the K/V chunks each rank needs (of {n} possible messages)",
    ("cp_wait", "fwd"): "stage received: other ranks' K/V chunks (zeros for those the mask needs none of)",
    ("cp_start", "bwd"): "stage: post the dK/dV partials of received chunks to their owners (of {n} possible)",
    ("cp_wait", "bwd"): "stage received: partials for this rank's chunks, summed",
    "cp_gather": "all-gather to the global view (the plan's owners)",
    "cp_stash": "keep the plan and the received K/V for the backward",
    "cp_unstash": "the forward's plan and received K/V",
}


def _stage_of(n: fx.Node, op: str) -> int:
    """The stage (or tile) index of a stage or tile node: the argument after its site key (``ops/program.py``'s
    signatures)."""
    site = next(a for a in n.args if isinstance(a, str))
    return n.args[n.args.index(site) + 1]


def _describe(n: fx.Node, op: str, prog: ExplicitProgram | None) -> tuple[str, int]:
    """(what the node does, bytes it sends) for reports."""
    if prog is not None and prog.dynamic:  # which messages move (and their bytes) is the mask's: per step
        if op in ("cp_start", "cp_wait"):
            st = prog.stages[_stage_of(n, op)]
            if not st.sends and not st.recvs:
                return "(none)", 0
            return _DYNAMIC_WORDS[(op, st.phase)].format(n=len(st.sends) + len(st.recvs)), 0
        if op in ("cp_tiles_fwd", "cp_tiles_bwd"):
            ts = prog.tiles[_stage_of(n, op)]
            return (f"{len(ts.rows)} q chunks × {len(ts.cols)} kv chunks (virtual: the mask's owners say which, "
                    f"its blocks which cells)"), 0
        return _DYNAMIC_WORDS.get(op, ""), 0
    if prog is not None and op == "cp_start":
        st = prog.stages[_stage_of(n, op)]
        what = "; ".join([f"send {t.tensor} c{t.chunk}g{t.head_group}→r{t.dst}" for _, t, _ in st.sends] +
                         [f"recv {t.tensor} c{t.chunk}g{t.head_group}←r{t.src}" for _, t in st.recvs]) or "(none)"
        return what, sum(t.nbytes for _, t, _ in st.sends)
    if prog is not None and op == "cp_wait":
        return f"stage {_stage_of(n, op)}", 0
    if prog is not None and op in TILE_ROW_OPS:
        row = prog.tiles[_stage_of(n, op)]
        return f"q chunk {row.q_chunk}, group {row.group} × kv chunks {list(row.kv_chunks)}", 0
    return {"cp_gather": "all-gather to the global view", "bsa_fwd": "block-sparse kernel",
            "bsa_bwd": "block-sparse kernel"}.get(op, f"{n.args[2]} sends delivered" if op == "cp_finish" else ""), 0


def schedule_rows(gm: fx.GraphModule, table: SideTable) -> tuple[ScheduleRow, ...]:
    """The ultraattn nodes of an expanded graph in execution order, described for reports."""
    rows = []
    for n in gm.graph.nodes:
        op = ultraattn_op(n)
        if op is None:
            continue
        state = next((table.sites[a] for a in n.args if isinstance(a, str) and a in table.sites), None)
        prog = state.program if state is not None else None
        what, nbytes = _describe(n, op, prog)
        rows.append(ScheduleRow(node=n.name, op=op, site=state.spec.name if state is not None else "",
                                comm=op in COMM_OPS, what=what, bytes=nbytes))
    return tuple(rows)

