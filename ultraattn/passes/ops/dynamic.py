"""The ops of an explicit program whose plan is run-time data (a mask that arrives with each batch).

The graph is a fixed skeleton (``passes/explicit/dynamic.py``); each op finds the site's
``DynamicProgram`` in the side table (``side_table().site(site).program``) and the call's plan by
the ``plan`` id that ``cp_dyn_plan`` returns (an int64 scalar that flows through the graph like any
activation, into the backward through the stash). Shapes are static: they depend on the site's
shapes, mesh and chunking only (the program's fields), never on the mask.

    token, plan = cp_dyn_plan(token, mask_tensors, site)        # read the mask, plan it (or reuse)
    index = cp_dyn_index(plan, site)                            # this rank's token positions
    o, lse = cp_dyn_tile_fwd(q_l, k_l, v_l, plan, site, part)   # part 0: own keys, 1: received keys
    dq, dk, dv = cp_dyn_tile_bwd(..., plan, site, part)

Its stages, gathers and stash are the stage ops every explicit program uses (``program.py``: ``cp_start``,
``cp_wait``, ``cp_gather``, ``cp_stash``, ``cp_unstash``), given the plan id as their ``plan`` argument.
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
