"""A site's explicit per-rank program: its tables, the IO that emits its ops, and the traced programs.

The schedule code is the runtime executor's own (``runtime.executor.Executor.forward`` /
``backward``): ``forward_program`` / ``backward_program`` run it with ``TracedIO``, whose
primitives emit the ``ultraattn::cp_*`` ops (``passes/ops/program.py``) instead of moving data,
so the graph and the eager runtime cannot drift apart. While it runs, ``TracedIO`` records each
communication stage and tile row in the program's tables, which the ops read by index at run
time (see the [Note] in ``ops/program.py``).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import Tensor

from ultraattn.kernels import config, uses_triton
from ultraattn.passes.opinfo import TILE_ROW_OPS
from ultraattn.passes.ops.site import kernel_site_backward
from ultraattn.passes.site import Runner, SiteState
from ultraattn.runtime.executor import TileSets, message_pieces
from ultraattn.runtime.tile_kernels import flex_tiles_on, kernel_row_backward, kernel_row_forward
from ultraattn.runtime.tiles import row_backward, row_forward
from ultraattn.runtime.tokens import gather_tokens

ops = torch.ops.ultraattn


@dataclass(frozen=True, slots=True)
class Stage:
    """One communication stage of a schedule (a ``cp_start`` / ``cp_wait`` pair)."""

    phase: str
    """'fwd' or 'bwd'."""
    first: bool
    """The first stage of its phase in this trace (the IO begins the phase there)."""
    sends: tuple
    """(tag, transfer, number of pieces) per message sent."""
    recvs: tuple
    """(tag, transfer) per message received."""
    recv_specs: tuple
    """(shape, dtype) of every received piece, in order: what ``cp_wait`` returns."""


@dataclass(frozen=True, slots=True)
class TileRow:
    """One tile node: a (head group, q chunk) row over its kv chunks."""

    group: int
    q_chunk: int
    kv_chunks: tuple[int, ...]
    scale: float


@dataclass(frozen=True, slots=True)
class TileSet:
    """One tile node over several rows (``TracedIO.tiles_fwd`` / ``tiles_bwd`` for a per-mask program): its rows, and
    the (kv chunk, group) of each K/V the node takes, every one once."""

    rows: tuple[TileRow, ...]
    cols: tuple[tuple[int, int], ...]


@dataclass(eq=False)
class ExplicitProgram:
    """What the expanded nodes of one site look up at run time (``SiteState.program``)."""

    # A site whose mask arrives at run time (``SiteForm.PROGRAM_PER_MASK``) has a ``PerMaskProgram``: the same program
    # over a fixed plan, with the call's mask as data (the ``plan`` argument of its ops). Shared code never asks which
    # class it holds: what differs is a method (``traced_io``, ``begin_forward``, ``resume_backward``,
    # ``counts_calls_on_post``, ``describe``).
    counts_calls_on_post: ClassVar[bool] = True
    """Whether posting the forward's first stage counts a call (a per-mask program counts calls when it plans)."""

    state: SiteState
    runner: Runner
    stages: list[Stage] = field(default_factory=list)
    tiles: list[TileRow | TileSet] = field(default_factory=list)
    saved_shapes: list | None = None
    """(kind, unit, [(shape, dtype) per tensor]) of the stash, in order (the same on every trace of the site)."""
    handles: dict = field(default_factory=dict)
    """Posted stages not yet waited for, by handle id."""

    @property
    def key(self) -> str:
        return self.state.spec.key

    @property
    def device(self) -> torch.device:
        return self.state.device

    @property
    def executor(self):
        return self.runner.executor

    @property
    def seq_len(self) -> int:
        return self.runner.seq_len

    # ------------------------------------------------------------------ what the ops do (ops/program.py)
    # A ``PerMaskProgram`` (explicit/per_mask.py) answers the same calls with its mask as data: the ``plan``
    # argument, which a static program has none of.
    def posts(self, sends: list, recvs: list, plan: Tensor | None) -> tuple[list, list]:
        """The messages of a stage that are posted for this call: all of a static plan's."""
        return sends, recvs

    def start(self, stage: int, pieces: list[Tensor], plan: Tensor | None = None) -> int:
        """Post stage ``stage`` of the traced schedule (``pieces``: its messages' tensors in order); a handle id.
        ``plan``: the call's plan id (a ``PerMaskProgram``'s mask data; None for a static plan)."""
        st = self.stages[stage]
        io = self.executor.io
        if st.first:
            io.begin(st.phase)
            if st.phase == "fwd" and self.counts_calls_on_post:
                self.state.calls += 1
        it = iter(pieces)
        sends, recvs = self.posts([(tag, t, [next(it) for _ in range(n)]) for tag, t, n in st.sends], list(st.recvs),
                                  plan)
        hid = self.state.next_id()
        self.handles[hid] = io.start(st.phase, sends, recvs, self.device)
        return hid

    def wait(self, hid: int, stage: int, plan: Tensor | None = None) -> list[Tensor]:
        """The stage's received tensors, in order (a ``PerMaskProgram`` assembles them from the messages it posted)."""
        return [p for _t, pieces in self.executor.io.wait(self.handles.pop(hid), copy=True) for p in pieces]

    def received(self, stage: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """(shape, dtype) of what ``wait`` returns for ``stage`` (fake kernels)."""
        return list(self.stages[stage].recv_specs)

    def dispatcher(self, plan: Tensor | None):
        """fn(global tensor) -> this rank's tokens (traced into the graph)."""
        return lambda x: local_shard(x, self.runner)

    def gather(self, x: Tensor, plan: Tensor | None = None) -> Tensor:
        return gather_tokens(x, self.runner)

    def stash(self, tensors: list[Tensor], plan: Tensor | None = None) -> int:
        return self.state.put_state(tensors)

    # ------------------------------------------------------------------ what the traced programs ask of the form
    def traced_io(self) -> TracedIO:
        """The IO the program's trace runs with (a per-mask program's emits its tile sets)."""
        return TracedIO(self)

    def begin_forward(self, io: TracedIO, q: Tensor, k: Tensor, v: Tensor, mask: list[Tensor], local: bool) -> None:
        """What the traced forward does first: with ``options['debug']``, check that every rank got the same
        inputs (a per-mask program plans the call's mask there instead)."""
        if self.state.spec.options.debug and not local:
            io.token = ops.cp_check_inputs(io.token, [q, k, v], self.key)

    def resume_backward(self, io: TracedIO, flat: list[Tensor]) -> list[Tensor]:
        """The traced backward's start: the stash the forward kept (a per-mask program takes its plan id off first)."""
        return flat

    def describe(self, n, op: str) -> tuple[str, int]:
        """(what an ultraattn node of this program's graphs does, bytes it sends), for reports."""
        if op == "cp_start":
            st = self.stages[stage_of(n)]
            what = "; ".join([f"send {t.tensor} c{t.chunk}g{t.head_group}→r{t.dst}" for _, t, _ in st.sends] +
                             [f"recv {t.tensor} c{t.chunk}g{t.head_group}←r{t.src}" for _, t in st.recvs]) or "(none)"
            return what, sum(t.nbytes for _, t, _ in st.sends)
        if op == "cp_wait":
            return f"stage {stage_of(n)}", 0
        if op in TILE_ROW_OPS:
            row = self.tiles[stage_of(n)]
            return f"q chunk {row.q_chunk}, group {row.group} × kv chunks {list(row.kv_chunks)}", 0
        return describe_op(n, op)


    def unstash(self, ticket: int) -> list[Tensor]:
        return self.state.take_state(ticket)

    def stashed(self) -> list[tuple[tuple[int, ...], torch.dtype, torch.device]]:
        """(shape, dtype, device) of what ``unstash`` returns (fake kernels)."""
        return [(shape, dt, self.device) for _kind, _u, specs in self.saved_shapes for shape, dt in specs]

    def tiles_fwd(self, tile: int, qs: list[Tensor], ks: list[Tensor], vs: list[Tensor], score: list[Tensor] = (),
                  plan: Tensor | None = None) -> list[tuple[Tensor, Tensor]]:
        """``cp_tiles_fwd``: partial attention of tile row ``tile`` (one row: ``runtime.tiles.row_forward``),
        [(o, lse)] fp32. (A ``PerMaskProgram``'s tile is a set of rows planned per mask.)"""
        row, (q,) = self.tiles[tile], qs
        return [row_forward(self.executor.geo, row.group, row.q_chunk, list(row.kv_chunks), q, list(zip(ks, vs)),
                            row.scale, score)]

    def tiles_bwd(self, tile: int, qs: list[Tensor], dos: list[Tensor], lses: list[Tensor], deltas: list[Tensor],
                  ks: list[Tensor], vs: list[Tensor], score: list[Tensor] = (), plan: Tensor | None = None):
        """``cp_tiles_bwd``: gradients of tile row ``tile`` (``runtime.tiles.row_backward``): ([dq], [dk per
        column], [dv per column], [score_mod buffers' part]) fp32, each its own tensor (an op's outputs must not
        share storage, and the row's per-column gradients are slices of one buffer)."""
        row, (q,), (do,), (lse,), (delta,) = self.tiles[tile], qs, dos, lses, deltas
        dq, per_col, dscore = row_backward(self.executor.geo, row.group, row.q_chunk, list(row.kv_chunks), q, do,
                                           lse, delta, list(zip(ks, vs)), row.scale, score)
        own = (lambda t: t.clone()) if len(per_col) > 1 else (lambda t: t)
        return [dq], [own(dk) for dk, _ in per_col], [own(dv) for _, dv in per_col], list(dscore)


def stage_of(n) -> int:
    """The stage (or tile) index of a stage or tile node: the argument after its site key (``ops/program.py``'s
    signatures)."""
    site = next(a for a in n.args if isinstance(a, str))
    return n.args[n.args.index(site) + 1]


def describe_op(n, op: str) -> tuple[str, int]:
    """(what an ultraattn node does, bytes) for a node no program describes."""
    return {"cp_gather": "all-gather to the global view", "bsa_fwd": "block-sparse kernel",
            "bsa_bwd": "block-sparse kernel"}.get(op, f"{n.args[2]} sends delivered" if op == "cp_finish" else ""), 0


# ----------------------------------------------------------------------------- the graph-building IO
class TracedIO(TileSets):
    """The executor's IO (``runtime.executor.EagerIO``'s interface) emitting the program's ops."""

    def __init__(self, prog: ExplicitProgram):
        self.prog = prog
        self.token = ops.cp_token()
        self.plan: Tensor | None = None
        """The call's plan id (a graph value) for a per-mask program; None for a static one."""
        self.begun: set[str] = set()

    @property
    def data(self) -> tuple:
        """The ops' trailing ``plan`` argument: (the plan id,) for a per-mask program, () for a static one."""
        return () if self.plan is None else (self.plan,)

    def begin(self, phase: str) -> None:
        pass

    def start(self, phase, sends, recvs, device):
        prog = self.prog
        ex = prog.executor
        sid = len(prog.stages)
        specs = tuple(s for _tag, t in recvs for s in message_pieces(t.tensor, ex.geo, ex.dtype))
        prog.stages.append(Stage(phase, phase not in self.begun, tuple((tag, t, len(p)) for tag, t, p in sends),
                                 tuple(recvs), specs))
        self.begun.add(phase)
        # a piece sent to several ranks (a unit every peer needs) is made contiguous once
        once: dict[int, Tensor] = {}
        for _tag, _t, pieces in sends:
            for p in pieces:
                if id(p) not in once:
                    once[id(p)] = p.contiguous()
        flat = [once[id(p)] for _tag, _t, pieces in sends for p in pieces]
        h = ops.cp_start(self.token, flat, prog.key, sid, *self.data)
        self.token = h   # the next communicating op comes after this post
        return sid, h

    def wait(self, handle):
        sid, h = handle
        prog = self.prog
        outs = ops.cp_wait(self.token, h, prog.key, sid, *self.data)
        self.token, it = outs[0], iter(outs[1:])
        ex = prog.executor
        return [(t, [next(it) for _ in message_pieces(t.tensor, ex.geo, ex.dtype)])
                for _tag, t in prog.stages[sid].recvs]

    def finish(self, phase: str) -> None:
        self.token = ops.cp_finish(self.token, self.prog.key, phase)

    def _tile(self, g, i, js, q, scale) -> tuple[int, bool]:
        """A tile id, and whether the tile is the Triton op in the graph: on CUDA (``kernels.uses_triton``), or on
        CPU with ``ULTRAATTN_KERNELS=triton`` under the interpreter when the graph runs uncompiled (aot_eager);
        never with a score_mod, whose tiles are ``cp_tiles_fwd`` ops (a generated score_mod function is no op argument;
        inside the op, ``runtime.tiles`` runs the kernels with it on CUDA). (A per-mask program's tiles are tile sets,
        ``tiles_fwd``: their block lists change with the mask.)"""
        tid = len(self.prog.tiles)
        self.prog.tiles.append(TileRow(g, i, tuple(js), scale))
        if self.prog.executor.geo.score_mod is not None or flex_tiles_on(self.prog.executor.geo):
            return tid, False
        if q.device.type == "cuda":
            return tid, uses_triton(q)
        return tid, (config.kernel_mode() == "triton" and config.interpret()
                     and self.prog.state.spec.options.compiler != "inductor")

    def tile_fwd(self, g, i, js, q, kvs, scale, score=()):
        tid, kernels = self._tile(g, i, js, q, scale)
        if kernels:  # the block-sparse Triton op itself, on the row's concatenated kv chunks
            lay = ops.cp_tile_lists(self.prog.key, tid)
            return kernel_row_forward(self.prog.executor.geo, lay, q, kvs, scale)
        o, lse = ops.cp_tiles_fwd([q], [k for k, _ in kvs], [v for _, v in kvs], list(score), self.prog.key, tid)
        return o, lse

    def tile_bwd(self, g, i, js, q, do, lse, delta, kvs, scale, score=()):
        tid, kernels = self._tile(g, i, js, q, scale)
        n = len(js)
        if kernels:
            lay = ops.cp_tile_lists(self.prog.key, tid)
            return kernel_row_backward(self.prog.executor.geo, lay, q, do, lse, delta, kvs, scale)
        outs = ops.cp_tiles_bwd([q], [do], [lse], [delta], [k for k, _ in kvs], [v for _, v in kvs], list(score),
                                self.prog.key, tid)
        return outs[0], list(zip(outs[1:1 + n], outs[1 + n:1 + 2 * n])), list(outs[1 + 2 * n:])

    def all_reduce(self, tensors: list[Tensor]) -> list[Tensor]:
        self.token, *sums = ops.cp_all_reduce(self.token, tensors, self.prog.key)
        return sums

    def gather(self, x: Tensor) -> Tensor:
        self.token, full = ops.cp_gather(self.token, x, self.prog.key, *self.data)
        return full


def _traced_executor(prog: ExplicitProgram):
    ex = copy.copy(prog.executor)
    ex.io = prog.traced_io()
    return ex


def local_shard(x: Tensor, plan) -> Tensor:
    """This rank's tokens of ``x`` (sequence on dim 2) by slicing and concatenation (no index constants)."""
    pad = plan.padded_len - plan.seq_len
    if pad:
        x = torch.nn.functional.pad(x, [0, 0] * (x.dim() - 3) + [0, pad])
    cs = plan.tile_plan.chunk_size
    return torch.cat([x[:, :, c * cs:(c + 1) * cs] for c in plan.tile_plan.local_chunks(plan.rank)], dim=2)


_SAVED_KINDS = ("q", "kv", "lse")


def _flatten_saved(saved: dict) -> tuple[list[Tensor], list]:
    flat, lay = [], []
    for kind in _SAVED_KINDS:
        for u in sorted(saved[kind]):
            ts = saved[kind][u]
            ts = list(ts) if isinstance(ts, tuple) else [ts]
            flat.extend(t.contiguous() for t in ts)
            lay.append((kind, u, [(tuple(t.shape), t.dtype) for t in ts]))
    return flat, lay


def _unflatten_saved(flat: list[Tensor], lay: list) -> dict:
    saved = {k: {} for k in _SAVED_KINDS}
    it = iter(flat)
    for kind, u, specs in lay:
        ts = [next(it) for _ in specs]
        saved[kind][u] = tuple(ts) if kind == "kv" else ts[0]
    return saved


# ----------------------------------------------------------------------------- the programs
def forward_program(prog: ExplicitProgram, local: bool = False):
    """fn(q, k, v, *mask tensors) -> (out, lse fp32, ticket): the site's forward as this rank's explicit program
    (the mask tensors: a per-mask program's, planned in the graph's first node).

    ``local``: q, k, v are already this rank's tokens (a sequence-sharded graph) and so are out, lse:
    no dispatch, no gather."""

    def fn(q, k, v, *inputs):
        spec = prog.state.spec
        mask, score = spec.split_inputs(list(inputs))
        ex = _traced_executor(prog)
        io = ex.io
        prog.begin_forward(io, q, k, v, list(mask), local)
        shard = None if local else prog.dispatcher(io.plan)
        qkv = (q, k, v) if local else (shard(q), shard(k), shard(v))
        out_l, lse_l, saved = ex.forward(*qkv, spec.scale, score)
        flat, prog.saved_shapes = _flatten_saved(saved)
        if local:
            out, lse = out_l.to(q.dtype), lse_l
        else:
            out = io.gather(out_l.to(q.dtype))
            lse = io.gather(lse_l)
        ticket = ops.cp_stash(io.token, flat, prog.key, *io.data)
        return out, lse, ticket

    return fn


def backward_program(prog: ExplicitProgram, local: bool = False):
    """fn(q, k, v, out, lse, dout, dlse, ticket, *score_mod buffers) -> (dq, dk, dv, *buffer gradients) (``local``:
    all on this rank's tokens; the buffers' gradients are summed over the ranks)."""

    def fn(q, k, v, out, lse, dout, dlse, ticket, *score):
        spec = prog.state.spec
        ex = _traced_executor(prog)
        io = ex.io
        flat = prog.resume_backward(io, ops.cp_unstash(ticket, prog.key))
        saved = _unflatten_saved(flat, prog.saved_shapes)
        xs = (q, k, v, out, lse, dout.to(out.dtype), dlse.float())
        if not local:
            shard = prog.dispatcher(io.plan)
            xs = tuple(shard(x) for x in xs)
        dq, dk, dv, dscore = ex.backward(*xs[:5], saved, xs[5], xs[6], spec.scale, list(score))
        dscore = tuple(g.to(score[n].dtype) for g, n in zip(dscore, spec.score_wanted, strict=True))
        if local:
            return tuple(g.to(x.dtype) for g, x in zip((dq, dk, dv), (q, k, v))) + dscore
        return tuple(io.gather(g).to(x.dtype) for g, x in zip((dq, dk, dv), (q, k, v))) + dscore

    return fn


def kernel_forward_program(prog: ExplicitProgram):
    """World size 1: the site is the block-sparse kernel op itself; its block lists come from ``cp_block_lists``."""

    def fn(q, k, v):
        lay = ops.cp_block_lists(prog.key)
        out, lse = ops.bsa_fwd(q, k, v, *lay, prog.runner.q_block, prog.runner.kv_block, prog.state.spec.scale)
        return out, lse, ops.cp_token()

    return fn


def kernel_backward_program(prog: ExplicitProgram):
    def fn(q, k, v, out, lse, dout, dlse, ticket):
        return kernel_site_backward(q, k, v, out, lse, dout, dlse, ops.cp_block_lists(prog.key), prog.runner.q_block,
                                    prog.runner.kv_block, prog.state.spec.scale)

    return fn
