"""The ops of an explicit per-rank program (``passes/explicit/``): communication stages, tiles, stash, gather.

Each op names its site by the ``site`` key and finds the site's ``ExplicitProgram`` in the side
table (``side_table().site(site).program``): the plan, and two tables that tracing the
program filled, ``stages`` (what each communication stage sends and receives) and ``tiles``
(which kv chunks each tile row covers).

[Note] Table order. ``TracedIO`` appends a stage (or tile) to its table *before* it emits the op
that refers to it by index, and the tables are append-only; so every op node, and every fake
kernel that runs while the graph is traced or re-traced by Inductor, finds its entry. The fake
kernel of ``cp_wait`` reads the shapes it returns from ``Stage.recv_specs``.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.library import custom_op

from ultraattn.passes.site import check_same_inputs
from ultraattn.passes.state import side_table
from ultraattn.runtime.tile_kernels import row_block_lists


def _program(site: str):
    program = side_table().site(site).program
    if program is None:
        raise RuntimeError(f"ultraattn: site {site!r} has no explicit program (it was not prepared at compile time)")
    return program


def new_token() -> Tensor:
    """A fresh communication token: every communicating op takes the previous one, so all ranks post in one order."""
    return torch.zeros((), dtype=torch.int64)


def _fake_token() -> Tensor:
    return torch.empty((), dtype=torch.int64, device="cpu")


@custom_op("ultraattn::cp_token", mutates_args=())
def cp_token() -> Tensor:
    """A program's first token, in a graph. An op, not ``torch.zeros``: Inductor would generate a host (C++) kernel
    for a traced CPU factory in a CUDA graph, and building that one costs a compiler run on the first step (it took
    70 s of an H200 machine's first compiled step, Inductor probing the CPU's vector ISA)."""
    return new_token()


@cp_token.register_fake
def _():
    return _fake_token()


@custom_op("ultraattn::cp_start", mutates_args=())
def cp_start(token: Tensor, pieces: list[Tensor], site: str, stage: int, plan: Tensor | None = None) -> Tensor:
    """Post one stage's sends (``pieces``, message after message) and receives; returns a handle. ``plan``: the
    call's plan id, for a program whose plan is run-time data (``PerMaskProgram``); None for a static one."""
    return torch.tensor(_program(site).start(stage, pieces, plan), dtype=torch.int64)


@cp_start.register_fake
def _(token, pieces, site, stage, plan=None):
    return _fake_token()


@custom_op("ultraattn::cp_wait", mutates_args=())
def cp_wait(token: Tensor, handle: Tensor, site: str, stage: int, plan: Tensor | None = None) -> list[Tensor]:
    """Wait for a stage's receives: [token, the received tensors in order]. ``token``: the program's chain (a stage
    may be waited for after later stages were posted)."""
    return [new_token()] + _program(site).wait(int(handle), stage, plan)


@cp_wait.register_fake
def _(token, handle, site, stage, plan=None):
    prog = _program(site)
    return [_fake_token()] + [torch.empty(shape, dtype=dt, device=prog.device) for shape, dt in prog.received(stage)]


@custom_op("ultraattn::cp_finish", mutates_args=())
def cp_finish(token: Tensor, site: str, phase: str) -> Tensor:
    """Wait until this rank's sends of ``phase`` are delivered (their buffers live until then)."""
    _program(site).executor.io.finish(phase)
    return new_token()


@cp_finish.register_fake
def _(token, site, phase):
    return _fake_token()


@custom_op("ultraattn::cp_check_inputs", mutates_args=())
def cp_check_inputs(token: Tensor, tensors: list[Tensor], site: str) -> Tensor:
    """The ``debug`` option: every rank must call this site with the same inputs (``site.check_same_inputs``)."""
    check_same_inputs(_program(site).state, tensors)
    return new_token()


@cp_check_inputs.register_fake
def _(token, tensors, site):
    return _fake_token()


def _tile_lists(site: str, tile: int):
    prog = _program(site)
    row = prog.tiles[tile]
    with unset_fake_temporarily():
        return row_block_lists(prog.executor.geo, row.group, row.q_chunk, list(row.kv_chunks), prog.device)


@custom_op("ultraattn::cp_tile_lists", mutates_args=())
def cp_tile_lists(site: str, tile: int) -> list[Tensor]:
    """The block lists of one tile row (``runtime.tile_kernels.row_block_lists``, cached), copied like
    ``cp_block_lists``."""
    return [t.clone() for t in _tile_lists(site, tile).bwd_tensors()]


@cp_tile_lists.register_fake
def _(site, tile):
    return [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in _tile_lists(site, tile).bwd_tensors()]


def _score_grads_fake(site: str, score: list[Tensor]) -> list[Tensor]:
    """Fake gradients of the score_mod buffers that want one (fp32, the buffers' shapes)."""
    return [score[n].new_empty(score[n].shape, dtype=torch.float32) for n in _program(site).state.spec.score_wanted]


@custom_op("ultraattn::cp_tiles_fwd", mutates_args=())
def cp_tiles_fwd(qs: list[Tensor], ks: list[Tensor], vs: list[Tensor], score: list[Tensor], site: str, tile: int,
                 plan: Tensor | None = None) -> list[Tensor]:
    """Partial attention of a set of tile rows (``plan``: a per-mask program's ``TileSet``, each row's queries and
    every column's K/V once; a static program's tile row, one q and its row's K/V): [o, lse] per row, fp32.
    ``score``: the site's score_mod buffers (none without a score_mod)."""
    return [t.contiguous() for o, lse in _program(site).tiles_fwd(tile, qs, ks, vs, score, plan) for t in (o, lse)]


@cp_tiles_fwd.register_fake
def _(qs, ks, vs, score, site, tile, plan=None):
    return [t for q in qs for t in (q.new_empty(q.shape, dtype=torch.float32),
                                     q.new_empty(q.shape[:-1], dtype=torch.float32))]


@custom_op("ultraattn::cp_tiles_bwd", mutates_args=())
def cp_tiles_bwd(qs: list[Tensor], dos: list[Tensor], lses: list[Tensor], deltas: list[Tensor], ks: list[Tensor],
                 vs: list[Tensor], score: list[Tensor], site: str, tile: int, plan: Tensor | None = None
                 ) -> list[Tensor]:
    """Gradients of a set of tile rows (global lse and delta): [dq per row..., dk per column..., dv per column...,
    score_mod buffer gradients (``SiteSpec.score_wanted``)...], fp32; a column's dK and dV, and the buffers'
    gradients, summed over the rows."""
    dqs, dks, dvs, dscore = _program(site).tiles_bwd(tile, qs, dos, lses, deltas, ks, vs, score, plan)
    return [t.contiguous() for t in (*dqs, *dks, *dvs, *dscore)]


@cp_tiles_bwd.register_fake
def _(qs, dos, lses, deltas, ks, vs, score, site, tile, plan=None):
    f32 = torch.float32
    return [q.new_empty(q.shape, dtype=f32) for q in qs] + [k.new_empty(k.shape, dtype=f32) for k in ks] + \
        [v.new_empty(v.shape, dtype=f32) for v in vs] + _score_grads_fake(site, score)


@custom_op("ultraattn::cp_all_reduce", mutates_args=())
def cp_all_reduce(token: Tensor, tensors: list[Tensor], site: str) -> list[Tensor]:
    """[token, each tensor summed over the site's ranks] (the score_mod buffers' gradients)."""
    return [new_token()] + [t.contiguous() for t in _program(site).executor.io.all_reduce(tensors)]


@cp_all_reduce.register_fake
def _(token, tensors, site):
    return [_fake_token()] + [torch.empty_like(t) for t in tensors]


@custom_op("ultraattn::cp_gather", mutates_args=())
def cp_gather(token: Tensor, x: Tensor, site: str, plan: Tensor | None = None) -> list[Tensor]:
    """All-gather this rank's tokens (dim 2) into the global tensor: [token, global x]."""
    return [new_token(), _program(site).gather(x, plan).contiguous()]


@cp_gather.register_fake
def _(token, x, site, plan=None):
    shape = list(x.shape)
    shape[2] = _program(site).seq_len
    return [_fake_token(), x.new_empty(shape)]


@custom_op("ultraattn::cp_stash", mutates_args=())
def cp_stash(token: Tensor, tensors: list[Tensor], site: str, plan: Tensor | None = None) -> Tensor:
    """Keep what the backward reuses (the units received in the forward; a per-mask program's plan too); returns
    their ticket."""
    # copies: the tensors are the graph's buffers, which Inductor reuses once the graph no longer reads them
    return torch.tensor(_program(site).stash([t.clone() for t in tensors], plan), dtype=torch.int64)


@cp_stash.register_fake
def _(token, tensors, site, plan=None):
    return _fake_token()


@custom_op("ultraattn::cp_unstash", mutates_args=())
def cp_unstash(ticket: Tensor, site: str) -> list[Tensor]:
    """What the forward that returned ``ticket`` stashed (a per-mask program's plan id first)."""
    return _program(site).unstash(int(ticket))


@cp_unstash.register_fake
def _(ticket, site):
    prog = _program(site)
    return [torch.empty(shape, dtype=dt, device=dev) for shape, dt, dev in prog.stashed()]


@custom_op("ultraattn::cp_block_lists", mutates_args=())
def cp_block_lists(site: str) -> list[Tensor]:
    """The block lists of a world-1 site (copies: the graph may reuse its buffers after the kernel).

    A graph constant would be simpler, but Inductor's fake-tensor passes refuse real constant tensors as
    arguments of an op; the block lists are small (2 KiB per partially masked block).
    """
    return [t.clone() for t in _program(site).runner.bwd_tensors()]


@cp_block_lists.register_fake
def _(site):
    return [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in _program(site).runner.bwd_tensors()]
