"""The ops of an explicit program whose plan is run-time data (a mask that arrives with each batch).

The graph is a fixed skeleton (``passes/explicit/per_mask.py``); each op finds the site's
``PerMaskProgram`` in the side table (``side_table().site(site).program``) and the call's plan by
the ``plan`` id that ``cp_mask_plan`` returns (an int64 scalar that flows through the graph like any
activation, into the backward through the stash). Shapes are static: they depend on the site's
shapes, mesh and chunking only (the program's fields), never on the mask.

    token, plan = cp_mask_plan(token, mask_tensors, site)        # read the mask, plan it (or reuse)
    index = cp_mask_index(plan, site)                            # this rank's token positions

Everything else (stages, tiles, gathers, stash) is the ops every explicit program uses (``program.py``),
given the plan id as their ``plan`` argument.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.library import custom_op

from ultraattn.passes.ops.program import new_token
from ultraattn.passes.records import SiteForm
from ultraattn.passes.state import side_table


def _program(site: str):
    state = side_table().site(site)
    program = state.program
    if program is None or state.form is not SiteForm.PROGRAM_PER_MASK:
        raise RuntimeError(f"ultraattn: site {site!r} has no run-time program (it was not prepared at compile time)")
    return program


def _fake_scalar() -> Tensor:
    return torch.empty((), dtype=torch.int64, device="cpu")


@custom_op("ultraattn::cp_mask_plan", mutates_args=())
def cp_mask_plan(token: Tensor, mask_tensors: list[Tensor], site: str) -> list[Tensor]:
    """Plan this call's mask (an ``ExchangePlan``, cached on its content): [token, plan id]."""
    return [new_token(), torch.tensor(_program(site).plan(mask_tensors), dtype=torch.int64)]


@cp_mask_plan.register_fake
def _(token, mask_tensors, site):
    return [_fake_scalar(), _fake_scalar()]


@custom_op("ultraattn::cp_mask_index", mutates_args=())
def cp_mask_index(plan: Tensor, site: str) -> Tensor:
    """int64 [local_len]: the global (padded) positions of this rank's tokens under the plan."""
    return _program(site).run_of(plan).index.clone()


@cp_mask_index.register_fake
def _(plan, site):
    prog = _program(site)
    return torch.empty(prog.local_len, dtype=torch.int64, device=prog.device)
