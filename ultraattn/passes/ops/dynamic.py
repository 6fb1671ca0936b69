"""The ops of an explicit program whose plan is run-time data (a mask that arrives with each batch).

The graph is a fixed skeleton (``passes/explicit/dynamic.py``); each op finds the site's
``DynamicProgram`` in the side table (``side_table().site(site).program``) and the call's plan by
the ``plan`` id that ``cp_dyn_plan`` returns (an int64 scalar that flows through the graph like any
activation, into the backward through the stash). Shapes are static: they depend on the site's
shapes, mesh and chunking only (the program's fields), never on the mask.

    token, plan = cp_dyn_plan(token, mask_tensors, site)        # read the mask, plan it (or reuse)
    index = cp_dyn_index(plan, site)                            # this rank's token positions
    handle = cp_dyn_kv_start(token, plan, k_l, v_l, site)       # the forward exchange stage: post
    o, lse = cp_dyn_tile_fwd(q_l, k_l, v_l, plan, site, part)   # part 0: own keys, 1: received keys
    token, k_in, v_in = cp_dyn_kv_wait(handle, plan, site)      # received chunks by slot
    handle = cp_dyn_dkv_start(token, plan, dk_in, dv_in, site)  # the backward exchange stage
    token, dk, dv = cp_dyn_dkv_wait(handle, plan, site)         # partials for this rank's chunks, summed
    token, x = cp_dyn_gather(token, x_l, plan, site)            # the global view
    ticket = cp_dyn_stash(token, plan, [k_in, v_in], site); plan, k_in, v_in = cp_dyn_unstash(ticket, site)
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.library import custom_op

from ultraattn.passes.ops.program import new_token
from ultraattn.passes.state import side_table


def _program(site: str):
    program = side_table().site(site).program
    if program is None or not program.dynamic:
        raise RuntimeError(f"ultraattn: site {site!r} has no run-time program (it was not prepared at compile time)")
    return program


def _fake_scalar() -> Tensor:
    return torch.empty((), dtype=torch.int64, device="cpu")


def _fake_token_and_pair(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> list[Tensor]:
    """[scalar, two tensors of ``shape``]: the fake of the ops that return a token (or id) and a K/V-like pair."""
    return [_fake_scalar()] + [torch.empty(shape, dtype=dtype, device=device) for _ in range(2)]


@custom_op("ultraattn::cp_dyn_plan", mutates_args=())
def cp_dyn_plan(token: Tensor, mask_tensors: list[Tensor], site: str) -> list[Tensor]:
    """Plan this call's mask (an ``ExchangePlan``, cached on its content): [token, plan id]."""
    return [new_token(), torch.tensor(_program(site).plan(mask_tensors), dtype=torch.int64)]


@cp_dyn_plan.register_fake
def _(token, mask_tensors, site):
    return [_fake_scalar(), _fake_scalar()]


@custom_op("ultraattn::cp_dyn_index", mutates_args=())
def cp_dyn_index(plan: Tensor, site: str) -> Tensor:
    """int64 [local_len]: the global (padded) positions of this rank's tokens under the plan."""
    return _program(site).run_of(plan).index.clone()


@cp_dyn_index.register_fake
def _(plan, site):
    prog = _program(site)
    return torch.empty(prog.local_len, dtype=torch.int64, device=prog.device)


@custom_op("ultraattn::cp_dyn_kv_start", mutates_args=())
def cp_dyn_kv_start(token: Tensor, plan: Tensor, k: Tensor, v: Tensor, site: str) -> Tensor:
    """Post the forward exchange (the K/V chunks every other rank needs from this one, its receives): a handle."""
    prog = _program(site)
    return torch.tensor(prog.post_kv(plan, k, v), dtype=torch.int64)


@cp_dyn_kv_start.register_fake
def _(token, plan, k, v, site):
    return _fake_scalar()


@custom_op("ultraattn::cp_dyn_kv_wait", mutates_args=())
def cp_dyn_kv_wait(handle: Tensor, plan: Tensor, site: str) -> list[Tensor]:
    """Wait for the forward exchange: [token, K buffer, V buffer] (other ranks' chunks by slot)."""
    return [new_token(), *_program(site).wait_kv(handle, plan)]


@cp_dyn_kv_wait.register_fake
def _(handle, plan, site):
    prog = _program(site)
    return _fake_token_and_pair(prog.buffer_shape, prog.dtype, prog.device)


@custom_op("ultraattn::cp_dyn_tile_fwd", mutates_args=())
def cp_dyn_tile_fwd(q: Tensor, k: Tensor, v: Tensor, plan: Tensor, site: str, part: int) -> tuple[Tensor, Tensor]:
    """This rank's queries against its own keys (``part`` 0) or the received ones (1): (o fp32, lse fp32); rows
    without keys there: o = 0, lse = -inf. The block-sparse kernel op with the plan's tile layout."""
    return _program(site).tile_fwd(q, k, v, plan, part)


@cp_dyn_tile_fwd.register_fake
def _(q, k, v, plan, site, part):
    return q.new_empty(q.shape, dtype=torch.float32), q.new_empty(q.shape[:-1], dtype=torch.float32)


@custom_op("ultraattn::cp_dyn_tile_bwd", mutates_args=())
def cp_dyn_tile_bwd(q: Tensor, k: Tensor, v: Tensor, do: Tensor, lse: Tensor, delta: Tensor, dlse: Tensor,
                   plan: Tensor, site: str, part: int) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of one tile from the merged lse and delta = rowsum(dO * O): (dq, dk, dv) fp32."""
    return _program(site).tile_bwd(q, k, v, do, lse, delta, dlse, plan, part)


@cp_dyn_tile_bwd.register_fake
def _(q, k, v, do, lse, delta, dlse, plan, site, part):
    f32 = torch.float32
    return q.new_empty(q.shape, dtype=f32), k.new_empty(k.shape, dtype=f32), v.new_empty(v.shape, dtype=f32)


@custom_op("ultraattn::cp_dyn_dkv_start", mutates_args=())
def cp_dyn_dkv_start(token: Tensor, plan: Tensor, dk: Tensor, dv: Tensor, site: str) -> Tensor:
    """Post the backward exchange (the partial dK/dV of received chunks back to their owners): a handle."""
    return torch.tensor(_program(site).post_dkv(plan, dk, dv), dtype=torch.int64)


@cp_dyn_dkv_start.register_fake
def _(token, plan, dk, dv, site):
    return _fake_scalar()


@custom_op("ultraattn::cp_dyn_dkv_wait", mutates_args=())
def cp_dyn_dkv_wait(handle: Tensor, plan: Tensor, site: str) -> list[Tensor]:
    """Wait for the backward exchange: [token, dK, dV] fp32 on this rank's tokens (other ranks' partials, summed)."""
    return [new_token(), *_program(site).wait_dkv(handle, plan)]


@cp_dyn_dkv_wait.register_fake
def _(handle, plan, site):
    prog = _program(site)
    return _fake_token_and_pair(prog.local_kv_shape, torch.float32, prog.device)


@custom_op("ultraattn::cp_dyn_gather", mutates_args=())
def cp_dyn_gather(token: Tensor, x: Tensor, plan: Tensor, site: str) -> list[Tensor]:
    """All-gather this rank's tokens (dim 2) into the global tensor under the plan's owners: [token, x]."""
    return [new_token(), _program(site).gather(x, plan).contiguous()]


@cp_dyn_gather.register_fake
def _(token, x, plan, site):
    shape = list(x.shape)
    shape[2] = _program(site).seq_len
    return [_fake_scalar(), x.new_empty(shape)]


@custom_op("ultraattn::cp_dyn_stash", mutates_args=())
def cp_dyn_stash(token: Tensor, plan: Tensor, tensors: list[Tensor], site: str) -> Tensor:
    """Keep the plan and the received K/V for the backward; returns their ticket."""
    prog = _program(site)
    # copies: the tensors are the graph's buffers, which Inductor reuses once the graph no longer reads them
    ticket = prog.state.put_state((prog.run_of(plan), [t.clone() for t in tensors]))
    return torch.tensor(ticket, dtype=torch.int64)


@cp_dyn_stash.register_fake
def _(token, plan, tensors, site):
    return _fake_scalar()


@custom_op("ultraattn::cp_dyn_unstash", mutates_args=())
def cp_dyn_unstash(ticket: Tensor, site: str) -> list[Tensor]:
    """[plan id, K buffer, V buffer] of the forward that returned ``ticket``."""
    prog = _program(site)
    run, tensors = prog.state.take_state(int(ticket))
    return [torch.tensor(prog.keep(run), dtype=torch.int64), *tensors]


@cp_dyn_unstash.register_fake
def _(ticket, site):
    prog = _program(site)
    return _fake_token_and_pair(prog.buffer_shape, prog.dtype, prog.device)
