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
from ultraattn.passes.ops.program import new_token
from ultraattn.passes.ops.site import kernel_site_backward
from ultraattn.passes.site import Runner, SiteState
from ultraattn.runtime.api import gather_tokens
from ultraattn.runtime.executor import layout as unit_layout
from ultraattn.runtime.tiles import kernel_row_backward, kernel_row_forward

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


@dataclass(eq=False)
class ExplicitProgram:
    """What the expanded nodes of one site look up at run time (``SiteState.program``)."""

    dynamic: ClassVar[bool] = False
    """A site whose mask arrives at run time has a ``DynamicProgram`` (``dynamic`` True) instead."""

    state: SiteState
    runner: Runner
    stages: list[Stage] = field(default_factory=list)
    tiles: list[TileRow] = field(default_factory=list)
    saved_layout: list | None = None
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

    # ------------------------------------------------------------------ what the stage ops do (ops/program.py)
    # A ``DynamicProgram`` (explicit/dynamic.py) answers the same calls with its plan as data: the ``plan``
    # argument, which a static program has none of.
    def start(self, stage: int, pieces: list[Tensor], plan: Tensor | None = None) -> int:
        """Post stage ``stage`` of the traced schedule (``pieces``: its messages' tensors in order); a handle id."""
        st = self.stages[stage]
        io = self.executor.io
        if st.first:
            io.begin(st.phase)
            if st.phase == "fwd":
                self.state.calls += 1
        it = iter(pieces)
        msgs = [(tag, t, [next(it) for _ in range(n)]) for tag, t, n in st.sends]
        hid = self.state.next_id()
        self.handles[hid] = io.start(st.phase, msgs, st.recvs, self.device)
        return hid

    def wait(self, hid: int, stage: int, plan: Tensor | None = None) -> list[Tensor]:
        """The stage's received tensors, in order."""
        got = self.executor.io.wait(self.handles.pop(hid))
        return [p.clone() for _t, pieces in got for p in pieces]

    def received(self, stage: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """(shape, dtype) of what ``wait`` returns for ``stage`` (fake kernels)."""
        return list(self.stages[stage].recv_specs)

    def gather(self, x: Tensor, plan: Tensor | None = None) -> Tensor:
        return gather_tokens(x, self.runner)

    def stash(self, tensors: list[Tensor], plan: Tensor | None = None) -> int:
        return self.state.put_state(tensors)

    def unstash(self, ticket: int) -> list[Tensor]:
        return self.state.take_state(ticket)

    def stashed(self) -> list[tuple[tuple[int, ...], torch.dtype, torch.device]]:
        """(shape, dtype, device) of what ``unstash`` returns (fake kernels)."""
        return [(shape, dt, self.device) for _kind, _u, specs in self.saved_layout for shape, dt in specs]


# ----------------------------------------------------------------------------- the graph-building IO
class TracedIO:
    """The executor's IO (``runtime.executor.EagerIO``'s interface) emitting the program's ops."""

    def __init__(self, prog: ExplicitProgram):
        self.prog = prog
        self.token = new_token()
        self.begun: set[str] = set()

    def begin(self, phase: str) -> None:
        pass

    def start(self, phase, sends, recvs, device):
        prog = self.prog
        ex = prog.executor
        sid = len(prog.stages)
        specs = tuple(s for _tag, t in recvs for s in unit_layout(t.tensor, ex.geo, ex.dtype))
        prog.stages.append(Stage(phase, phase not in self.begun, tuple((tag, t, len(p)) for tag, t, p in sends),
                                 tuple(recvs), specs))
        self.begun.add(phase)
        flat = [p.contiguous() for _tag, _t, pieces in sends for p in pieces]
        return sid, ops.cp_start(self.token, flat, prog.key, sid)

    def wait(self, handle):
        sid, h = handle
        prog = self.prog
        outs = ops.cp_wait(h, prog.key, sid)
        self.token, it = outs[0], iter(outs[1:])
        ex = prog.executor
        return [(t, [next(it) for _ in unit_layout(t.tensor, ex.geo, ex.dtype)]) for _tag, t in prog.stages[sid].recvs]

    def finish(self, phase: str) -> None:
        self.token = ops.cp_finish(self.token, self.prog.key, phase)

    def _tile(self, g, i, js, q, scale) -> tuple[int, bool]:
        """A tile id, and whether the tile is the Triton op: on CUDA (``kernels.uses_triton``), or on CPU with
        ``ULTRAATTN_KERNELS=triton`` under the interpreter when the graph runs uncompiled (aot_eager)."""
        tid = len(self.prog.tiles)
        self.prog.tiles.append(TileRow(g, i, tuple(js), scale))
        if q.device.type == "cuda":
            return tid, uses_triton(q)
        return tid, (config.kernel_mode() == "triton" and config.interpret()
                     and self.prog.state.spec.options.compiler != "inductor")

    def tile_fwd(self, g, i, js, q, kvs, scale):
        tid, kernels = self._tile(g, i, js, q, scale)
        if kernels:  # the block-sparse Triton op itself, on the row's concatenated kv chunks
            lay = ops.cp_tile_layout(self.prog.key, tid)
            return kernel_row_forward(self.prog.executor.geo, lay, q, kvs, scale)
        return ops.cp_tile_fwd(q, [k for k, _ in kvs], [v for _, v in kvs], self.prog.key, tid)

    def tile_bwd(self, g, i, js, q, do, lse, delta, kvs, scale):
        tid, kernels = self._tile(g, i, js, q, scale)
        n = len(js)
        if kernels:
            lay = ops.cp_tile_layout(self.prog.key, tid)
            return kernel_row_backward(self.prog.executor.geo, lay, q, do, lse, delta, kvs, scale)
        outs = ops.cp_tile_bwd(q, do, lse, delta, [k for k, _ in kvs], [v for _, v in kvs], self.prog.key, tid)
        return outs[0], list(zip(outs[1:1 + n], outs[1 + n:]))

    def gather(self, x: Tensor) -> Tensor:
        self.token, full = ops.cp_gather(self.token, x, self.prog.key)
        return full


def _traced_executor(prog: ExplicitProgram):
    ex = copy.copy(prog.executor)
    ex.io = TracedIO(prog)
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
    """fn(q, k, v) -> (out, lse fp32, ticket): the site's forward as this rank's explicit program.

    ``local``: q, k, v are already this rank's tokens (a sequence-sharded graph) and so are out, lse:
    no dispatch, no gather."""

    def fn(q, k, v):
        plan, spec = prog.runner, prog.state.spec
        ex = _traced_executor(prog)
        if spec.options.debug and not local:
            ex.io.token = ops.cp_check_inputs(ex.io.token, [q, k, v], prog.key)
        qkv = (q, k, v) if local else (local_shard(q, plan), local_shard(k, plan), local_shard(v, plan))
        out_l, lse_l, saved = ex.forward(*qkv, spec.scale)
        flat, prog.saved_layout = _flatten_saved(saved)
        if local:
            out, lse = out_l.to(q.dtype), lse_l
        else:
            out = ex.io.gather(out_l.to(q.dtype))
            lse = ex.io.gather(lse_l)
        ticket = ops.cp_stash(ex.io.token, flat, prog.key)
        return out, lse, ticket

    return fn


def backward_program(prog: ExplicitProgram, local: bool = False):
    """fn(q, k, v, out, lse, dout, dlse, ticket) -> (dq, dk, dv) (``local``: all on this rank's tokens)."""

    def fn(q, k, v, out, lse, dout, dlse, ticket):
        plan, spec = prog.runner, prog.state.spec
        ex = _traced_executor(prog)
        saved = _unflatten_saved(ops.cp_unstash(ticket, prog.key), prog.saved_layout)
        sh = [x if local else local_shard(x, plan) for x in (q, k, v, out, lse, dout.to(out.dtype), dlse.float())]
        dq, dk, dv = ex.backward(*sh[:5], saved, sh[5], sh[6], spec.scale)
        if local:
            return tuple(g.to(x.dtype) for g, x in zip((dq, dk, dv), (q, k, v)))
        return tuple(ex.io.gather(g).to(x.dtype) for g, x in zip((dq, dk, dv), (q, k, v)))

    return fn


def kernel_forward_program(prog: ExplicitProgram):
    """World size 1: the site is the block-sparse kernel op itself; its layout comes from ``cp_layout``."""

    def fn(q, k, v):
        lay = ops.cp_layout(prog.key)
        out, lse = ops.bsa_fwd(q, k, v, *lay, prog.runner.q_block, prog.runner.kv_block, prog.state.spec.scale)
        return out, lse, torch.zeros((), dtype=torch.int64)

    return fn


def kernel_backward_program(prog: ExplicitProgram):
    def fn(q, k, v, out, lse, dout, dlse, ticket):
        return kernel_site_backward(q, k, v, out, lse, dout, dlse, ops.cp_layout(prog.key), prog.runner.q_block,
                                    prog.runner.kv_block, prog.state.spec.scale)

    return fn
