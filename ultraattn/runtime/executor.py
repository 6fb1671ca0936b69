"""Execute a ``TilePlan`` on one rank: forward, backward, and the autograd function.

Static part (``RankProgram``, built once per plan and rank): what the rank keeps from the forward for the backward,
and each phase's steps (``planner.program.rank_program``): posts, waits and launches in the plan's run order, the
order the planner replayed. A launch runs once its own inputs are here, a relay leaves when its unit lands, a
partial when its rank's launches of that row (or column) are done; every rank posts in one global order, so the
exchange cannot deadlock (``planner/program.py``).

Dynamic part: ``forward`` / ``backward`` walk the steps and move real data through the IO (``EagerIO`` here; the
graph-building IO of ``ultraattn.passes.explicit``), count the bytes of every message (``CommLog``) and check each
against the planner's prediction. On a GPU the messages move on a communication stream (``streams.CommStreams``),
so a relay leaves when its unit lands, not behind the launches enqueued before its post.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..kernels.reference import softmax_delta
from ..planner.plan import TilePlan, Transfer, input_levels, kernel_rows, partial_levels
from ..planner.program import Launch, Post, ProgramError, Step, Wait, kept_from_forward, order_of, rank_program
from .comm import CommLog, pack, spec_bytes, unpack
from .streams import CommStreams
from .tiles import TileGeometry, merge_partial, row_backward, row_forward
from .transport import Recv, Send, Transport

INPUT_TENSORS = {"fwd": ("q", "kv"), "bwd": ("qdo", "do", "kv")}
PARTIAL_TENSORS = {"fwd": ("o",), "bwd": ("dq", "dkv")}
FINAL_TENSORS = {"fwd": ("out",), "bwd": ("dq_out", "dkv_out")}
_FINAL_OF = {"o": "out", "dq": "dq_out", "dkv": "dkv_out"}


class PlanExecutionError(ValueError):
    """The plan cannot be executed as written (a rank would send data it never has, ...)."""

    def __init__(self, msg: str):
        super().__init__(f"ultraattn: {msg}")


Message = tuple[int, Transfer]  # (index in plan.transfers: the message tag, transfer)


@dataclass(slots=True)
class RankProgram:
    rank: int
    steps: dict[str, list[Step]]
    """Per phase, the rank's steps (``planner.program.rank_program``)."""
    finisher: dict[tuple[str, int, int], int]
    """(partial tensor, chunk, group) -> the rank where its reduction ends."""
    keep_q: set[tuple[int, int]] = field(default_factory=set)
    keep_lse: set[tuple[int, int]] = field(default_factory=set)
    keep_kv: set[tuple[int, int]] = field(default_factory=set)


def _check_inputs(steps: list[Message], have: set[tuple[str, int, int, int]]) -> None:
    """Every input message leaves a rank that holds its unit by then (``plan.input_levels``)."""
    _level, stuck = input_levels(steps, have)
    if stuck:
        idx, t = stuck[0]
        raise PlanExecutionError(
            f"transfer #{idx} ({t.phase} {t.tensor} chunk {t.chunk} group {t.head_group}) leaves rank {t.src}, "
            f"which never holds that unit"
        )


def _check_partials(steps: list[Message]) -> None:
    """The partial messages form reduction trees, not a cycle (``plan.partial_levels``)."""
    try:
        partial_levels(steps)
    except ValueError as exc:
        raise PlanExecutionError(str(exc).removeprefix("ultraattn: ")) from exc


def _finishers(plan: TilePlan, by: dict) -> dict[tuple[str, int, int], int]:
    """(partial tensor, chunk, head group) -> the rank that finishes the unit: its owner, unless a final
    transfer of the unit is sent from elsewhere (the sender finished it)."""
    finisher: dict[tuple[str, int, int], int] = {}
    for part, fin in _FINAL_OF.items():
        for c in range(plan.num_chunks):
            for g in range(plan.num_head_groups):
                finisher[(part, c, g)] = plan.owner[c]
        for ph in ("fwd", "bwd"):
            for _, t in by[(ph, fin)]:
                finisher[(part, t.chunk, t.head_group)] = t.src
    return finisher


def build_program(plan: TilePlan, rank: int) -> RankProgram:
    """The static per-rank program (module docstring); raises ``PlanExecutionError`` on an inconsistent plan."""
    owner = plan.owner
    g_count = plan.num_head_groups
    by = defaultdict(list)
    for idx, t in enumerate(plan.transfers):
        by[(t.phase, t.tensor)].append((idx, t))
    known = {tn for ph in ("fwd", "bwd") for group in (INPUT_TENSORS, PARTIAL_TENSORS, FINAL_TENSORS)
             for tn in group[ph]}
    for ph, tn in by:
        if tn not in known:
            raise PlanExecutionError(f"unknown transfer tensor {tn!r} in phase {ph}")
    rows_of_rank = [(g, i) for r, g, i, _js in kernel_rows(plan.kernels) if r == rank]
    finisher = _finishers(plan, by)
    owned_units = {(c, g) for c in range(plan.num_chunks) for g in range(g_count)}

    def recv_of(phase: str, tensor: str, r: int) -> set[tuple[int, int]]:
        return {(t.chunk, t.head_group) for _, t in by[(phase, tensor)] if t.dst == r}

    # forward inputs
    have_f = {(tn, c, g, owner[c]) for tn in ("q", "kv") for (c, g) in owned_units}
    _check_inputs(by[("fwd", "q")] + by[("fwd", "kv")], have_f)
    # backward inputs: owners hold everything; other ranks keep what the forward brought them and the
    # backward does not bring again (Ulysses keeps q, k, v and the LSE at the computing rank)
    have_b = {(tn, c, g, owner[c]) for tn in ("qdo", "do", "kv") for (c, g) in owned_units}
    kept = kept_from_forward(plan)
    kq, kkv = kept[rank]
    kl = set(kq)
    for r, (_rows, cols) in enumerate(kept):
        have_b |= {("kv", c, g, r) for c, g in cols}
    _check_inputs(by[("bwd", "qdo")] + by[("bwd", "do")] + by[("bwd", "kv")], have_b)
    for (c, g) in kl:
        if finisher[("o", c, g)] != rank:
            raise PlanExecutionError(
                f"rank {rank} computes the backward of row {c} (group {g}) from kept data but did not finish its "
                f"forward, so it lacks the global LSE"
            )
    # every bwd row a rank computes must have (q, do, lse, delta) from somewhere
    for (g, i) in rows_of_rank:
        u = (i, g)
        if not (owner[i] == rank or u in recv_of("bwd", "qdo", rank) or (u in kq and u in recv_of("bwd", "do", rank))):
            raise PlanExecutionError(f"rank {rank} computes row {i} (group {g}) in the backward without its dO")
    for ph in ("fwd", "bwd"):
        _check_partials([s for tn in PARTIAL_TENSORS[ph] for s in by[(ph, tn)]])
    try:
        steps = {ph: rank_program(plan, rank, ph, order_of(plan, ph)) for ph in ("fwd", "bwd")}
    except ProgramError as exc:
        raise PlanExecutionError(str(exc).removeprefix("ultraattn: ")) from exc
    return RankProgram(rank=rank, steps=steps, finisher=finisher, keep_q=kq, keep_lse=kl, keep_kv=kkv)


# ----------------------------------------------------------------------------- message pieces
def message_pieces(tensor: str, geo: TileGeometry, dtype: torch.dtype) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """(shape, dtype) of the pieces of one unit message, in packing order (plan.py's byte table)."""
    b, c, d, hq, hk = geo.batch, geo.chunk, geo.head_dim, geo.hq, geo.hk
    f32 = torch.float32
    row, col, rowv = (b, hq, c, d), (b, hk, c, d), (b, hq, c)
    return {
        "q": [(row, dtype)],
        "kv": [(col, dtype), (col, dtype)],
        "o": [(row, f32), (rowv, f32)],
        "out": [(row, dtype), (rowv, f32)],
        "qdo": [(row, dtype), (row, dtype), (rowv, f32), (rowv, f32)],
        "do": [(row, dtype), (rowv, f32)],
        "dq": [(row, f32)],
        "dkv": [(col, f32), (col, f32)],
        "dq_out": [(row, dtype)],
        "dkv_out": [(col, dtype), (col, dtype)],
    }[tensor]


def _record(t: Transfer) -> tuple:
    """A transfer's ``CommLog`` record: (phase, tensor, chunk, head group, src, dst)."""
    return (t.phase, t.tensor, t.chunk, t.head_group, t.src, t.dst)


class TileSets:
    """The executor's tile calls: every ready tile of one step at once (``tiles_fwd`` / ``tiles_bwd``), by default one
    row at a time through the IO's ``tile_fwd`` / ``tile_bwd``. An IO may run a whole set as one call instead (a
    per-mask program's ``TracedIO``: one graph node per set)."""

    def tiles_fwd(self, items: list, scale: float, score: list[Tensor] = ()) -> list[tuple[Tensor, Tensor]]:
        """The tiles whose inputs are here, ``items`` = [(group, row, kv chunks, q, [(k, v) per chunk])]: each row's
        partial (o, lse). ``score``: the score_mod's buffers (``tiles.ScoreMod``), none without one."""
        return [self.tile_fwd(g, i, js, q, kvs, scale, score) for g, i, js, q, kvs in items]

    def tiles_bwd(self, items: list, scale: float, score: list[Tensor] = ()) -> tuple[list[Tensor], dict, list]:
        """Backward tiles, ``items`` = [(group, row, kv chunks, q, dO, lse, delta, [(k, v) per chunk])]: each row's
        dQ, per (kv chunk, group) the dK, dV summed over the rows, and the score_mod buffers' gradients summed."""
        return sum_columns(items, [self.tile_bwd(g, i, js, *row, kvs, scale, score)
                                   for g, i, js, *row, kvs in items])


class EagerIO(TileSets):
    """The executor's message and tile primitives, run directly (``dist_attention`` and opaque sites).

    ``ultraattn.passes.explicit`` swaps in an IO whose primitives are graph nodes; the executor's
    schedule code is shared by both.
    """

    def __init__(self, ex: Executor):
        self.ex = ex
        self.posted: list = []
        self.streams: CommStreams | None = None
        """This rank's communication stream (``streams.CommStreams``), made at the first post on its device."""

    def begin(self, phase: str) -> None:
        if self.ex.transport is not None:
            self.ex.transport.log = CommLog()

    def start(self, phase: str, sends: list[tuple[int, Transfer, list[Tensor]]], recvs: list[Step], device):
        """Post this stage's sends and receives through the transport (nothing waits), on the communication stream
        where there is one (``streams.CommStreams.post``)."""
        ex = self.ex
        if self.streams is None:
            self.streams = CommStreams(torch.device(device))
        specs = [(t, message_pieces(t.tensor, ex.geo, ex.dtype)) for _idx, t in recvs]
        if ex.transport is None:  # one rank: a plan with no messages
            assert not sends and not recvs, "a one-rank plan with messages"
            return None, []

        def post():
            out = []
            for idx, t, pieces in sends:
                buf = pack(pieces)
                if buf.numel() != t.nbytes:
                    raise PlanExecutionError(
                        f"{t.phase} {t.tensor} chunk {t.chunk}: the message holds {buf.numel()} bytes, the plan says "
                        f"{t.nbytes}; plan and runtime disagree on the byte table"
                    )
                out.append(Send(buf, t.dst, idx, _record(t), f"{t.phase} {t.tensor} message for chunk {t.chunk}"))
            expect = [Recv(spec_bytes(spec), t.src, idx, device, _record(t),
                           f"{t.phase} {t.tensor} message for chunk {t.chunk} group {t.head_group}")
                      for (idx, t), (_t, spec) in zip(recvs, specs, strict=True)]
            return ex.transport.post(out, expect)

        handle = self.streams.post([p for _idx, _t, pieces in sends for p in pieces], post)
        self.posted.append(handle)
        return handle, specs

    def wait(self, handle, copy: bool = False) -> list[tuple[Transfer, list[Tensor]]]:
        """Wait for a stage's receives: (transfer, pieces) in posting order, taken on the communication stream where
        there is one (``streams.CommStreams.take``). ``copy``: each piece its own tensor (an op's outputs)."""
        posted, specs = handle
        if posted is None:
            return []

        def take():
            bufs = self.ex.transport.wait(posted)
            got = [(t, unpack(buf, spec)) for (t, spec), buf in zip(specs, bufs, strict=True)]
            return [(t, [p.clone() for p in pieces]) for t, pieces in got] if copy else got

        return self.streams.take(take)

    def finish(self, phase: str) -> None:
        """Wait for every send of the phase, then keep its message log."""
        ex = self.ex
        for handle in self.posted:
            ex.transport.settle(handle)
        self.posted.clear()
        ex.log[phase] = ex.transport.log if ex.transport is not None else CommLog()

    def tile_fwd(self, g: int, i: int, js: list[int], q: Tensor, kvs: list[tuple[Tensor, Tensor]], scale: float,
                 score: list[Tensor] = ()):
        return row_forward(self.ex.geo, g, i, js, q, kvs, scale, score)

    def tile_bwd(self, g: int, i: int, js: list[int], q, do, lse, delta, kvs, scale: float, score: list[Tensor] = ()):
        return row_backward(self.ex.geo, g, i, js, q, do, lse, delta, kvs, scale, score)

    def all_reduce(self, tensors: list[Tensor]) -> list[Tensor]:
        """Each tensor summed over the plan's ranks (the score_mod buffers' gradients)."""
        tr = self.ex.transport
        if tr is None:
            return list(tensors)
        return [tr.all_reduce(x, "the score_mod buffers' gradient all-reduce") for x in tensors]


def _add_into(store: dict, key, pieces) -> None:
    """``store[key]`` += ``pieces`` (a tuple of tensors, summed piecewise; the first arrival is kept as it is)."""
    prev = store.get(key)
    store[key] = tuple(pieces) if prev is None else tuple(a + b for a, b in zip(prev, pieces, strict=True))


def sum_columns(items: list, results: list) -> tuple[list[Tensor], dict, list[Tensor]]:
    """(each item's dQ, {(kv chunk, group): (dK, dV) summed over the items}, the score_mod buffers' gradients
    summed over the items) from per-row backward results ``(dq, per column (dK, dV), buffer gradients)``."""
    dkvs: dict[tuple[int, int], tuple[Tensor, Tensor]] = {}
    dbufs: dict[int, tuple[Tensor, ...]] = {}
    for (g, _i, js, *_), (_dq, per_col, dscore) in zip(items, results, strict=True):
        for j, dkv in zip(js, per_col, strict=True):
            _add_into(dkvs, (j, g), dkv)
        _add_into(dbufs, 0, dscore)
    return [dq for dq, *_ in results], dkvs, list(dbufs.get(0, ()))


class Executor:
    """Runs one plan on one rank (module docstring). ``log`` holds the last call's messages per phase.

    The schedule (which messages leave at which stage, which tiles run between a stage's posts and
    its waits, how partials merge) is plain Python over the static ``RankProgram``; the data moves
    through ``self.io`` (``EagerIO``, or the graph-building IO of ``ultraattn.passes.explicit``).
    """

    def __init__(self, plan: TilePlan, rank: int, geo: TileGeometry, transport: Transport | None, dtype: torch.dtype):
        self.plan = plan
        self.rank = rank
        self.geo = geo
        self.transport = transport
        self.dtype = dtype
        self.program = build_program(plan, rank)
        self.local_chunks = plan.local_chunks(rank)
        self.local_pos = {c: n for n, c in enumerate(self.local_chunks)}
        self.log: dict[str, CommLog] = {}
        self.io = EagerIO(self)

    # -- helpers ---------------------------------------------------------------------------
    def _row_slice(self, x: Tensor, c: int, g: int, heads: int) -> Tensor:
        n, cs = self.local_pos[c], self.geo.chunk
        return x[:, g * heads:(g + 1) * heads, n * cs:(n + 1) * cs]

    def _assemble(self, units: dict[tuple[int, int], Tensor]) -> Tensor:
        """This rank's local tensor from its (chunk, group) units: groups along heads, chunks along tokens."""
        g_count = self.geo.head_groups
        return torch.cat([torch.cat([units[(c, g)] for g in range(g_count)], dim=1) for c in self.local_chunks],
                         dim=2)


    # -- forward ---------------------------------------------------------------------------
    def forward(self, q: Tensor, k: Tensor, v: Tensor, scale: float, score: list[Tensor] = ()):
        """This rank's (out, lse, saved for the backward). ``score``: the score_mod's buffers (``geo.score_mod``)."""
        geo, prog, io = self.geo, self.program, self.io
        hq, hk, g_count = geo.hq, geo.hk, geo.head_groups
        io.begin("fwd")
        rows: dict[tuple[int, int], Tensor] = {}
        cols: dict[tuple[int, int], tuple[Tensor, Tensor]] = {}
        for c in self.local_chunks:
            for g in range(g_count):
                rows[(c, g)] = self._row_slice(q, c, g, hq)
                cols[(c, g)] = (self._row_slice(k, c, g, hk), self._row_slice(v, c, g, hk))
        acc: dict[tuple[int, int], tuple[Tensor, Tensor]] = {}
        finals: dict[tuple[int, int], tuple[Tensor, Tensor]] = {}
        keep_lse = {}

        def payload(t: Transfer) -> list[Tensor]:
            u = (t.chunk, t.head_group)
            if t.tensor == "q":
                return [rows[u]]
            if t.tensor == "kv":
                return list(cols[u])
            o, lse = self._acc_or_empty(acc, u, "o", q.device)
            if t.tensor == "o":
                acc.pop(u, None)
                return [o, lse]
            keep_lse[u] = lse
            return [o.to(self.dtype), lse]

        def arrive(t: Transfer, pieces: list[Tensor]) -> None:
            u = (t.chunk, t.head_group)
            if t.tensor == "q":
                rows[u] = pieces[0]
            elif t.tensor == "kv":
                cols[u] = (pieces[0], pieces[1])
            elif t.tensor == "o":
                acc[u] = merge_partial(acc.get(u), (pieces[0], pieces[1]))
            else:
                finals[u] = (pieces[0].float(), pieces[1])

        def launch(step: Launch) -> None:
            items = [(g, i, list(js), rows[(i, g)], [cols[(j, g)] for j in js]) for g, i, js in step.rows]
            for (g, i, *_), part in zip(items, io.tiles_fwd(items, scale, score), strict=True):
                acc[(i, g)] = merge_partial(acc.get((i, g)), part)

        self._walk("fwd", payload, arrive, launch, q.device)
        io.finish("fwd")
        # assemble this rank's rows
        units = {}
        for c in self.local_chunks:
            for g in range(g_count):
                u = (c, g)
                units[u] = finals[u] if u in finals else self._acc_or_empty(acc, u, "o", q.device)
        out = self._assemble({u: o for u, (o, _) in units.items()})
        lse_all = self._assemble({u: lse for u, (_, lse) in units.items()})
        saved = {
            "q": {u: rows[u] for u in prog.keep_q},
            "kv": {u: cols[u] for u in prog.keep_kv},
            "lse": {u: keep_lse.get(u, acc.get(u, (None, None))[1]) for u in prog.keep_lse},
        }
        return out, lse_all, saved

    def _acc_or_empty(self, acc: dict, u: tuple[int, int], kind: str, device) -> tuple[Tensor, ...]:
        if u in acc:
            return acc[u]
        geo = self.geo
        if kind == "o":
            return (torch.zeros(geo.batch, geo.hq, geo.chunk, geo.head_dim, device=device),
                    torch.full((geo.batch, geo.hq, geo.chunk), float("-inf"), device=device))
        if kind == "dq":
            return (torch.zeros(geo.batch, geo.hq, geo.chunk, geo.head_dim, device=device),)
        z = torch.zeros(geo.batch, geo.hk, geo.chunk, geo.head_dim, device=device)
        return (z, z.clone())

    def _walk(self, phase: str, payload, arrive, launch, device) -> None:
        """Run the phase's steps: post each send's ``payload(t)``, hand each receive to ``arrive(t, pieces)``, run
        each ``Launch`` with ``launch``."""
        io = self.io
        handles = {}
        for n, step in enumerate(self.program.steps[phase]):
            if isinstance(step, Post):
                sends = [(idx, t, payload(t)) for idx, t in step.sends]
                handles[n] = io.start(phase, sends, list(step.recvs), device)
            elif isinstance(step, Wait):
                for t, pieces in io.wait(handles.pop(step.post)):
                    arrive(t, pieces)
            else:
                launch(step)

    # -- backward --------------------------------------------------------------------------
    def backward(self, q, k, v, out, lse, saved, dout, dlse, scale: float, score: list[Tensor] = ()):
        """This rank's (dq, dk, dv, the score_mod buffers' gradients summed over every rank: one per
        ``ScoreMod.wanted``)."""
        geo, io = self.geo, self.io
        hq, hk, g_count = geo.hq, geo.hk, geo.head_groups
        io.begin("bwd")
        delta_all = softmax_delta(out, dout, dlse)
        rows: dict[tuple[int, int], tuple[Tensor, Tensor, Tensor, Tensor]] = {}
        cols: dict[tuple[int, int], tuple[Tensor, Tensor]] = {}
        for c in self.local_chunks:
            for g in range(g_count):
                rows[(c, g)] = (self._row_slice(q, c, g, hq), self._row_slice(dout, c, g, hq),
                                self._row_slice(lse, c, g, hq), self._row_slice(delta_all, c, g, hq))
                cols[(c, g)] = (self._row_slice(k, c, g, hk), self._row_slice(v, c, g, hk))
        cols.update(saved["kv"])
        accs: dict[str, dict] = {"dq": {}, "dkv": {}, "score": {}}
        finals: dict[tuple[str, int, int], tuple] = {}

        def payload(t: Transfer) -> list[Tensor]:
            u = (t.chunk, t.head_group)
            if t.tensor == "kv":
                return list(cols[u])
            if t.tensor == "qdo":
                return [x.contiguous() for x in rows[u]]
            if t.tensor == "do":   # dO + delta (the computing rank kept q and the LSE)
                return [rows[u][1], rows[u][3]]
            kind = "dq" if t.tensor in ("dq", "dq_out") else "dkv"
            pieces = self._acc_or_empty(accs[kind], u, kind, q.device)
            if t.tensor == kind:
                accs[kind].pop(u, None)
                return list(pieces)
            return [p.to(self.dtype) for p in pieces]

        def arrive(t: Transfer, pieces: list[Tensor]) -> None:
            u = (t.chunk, t.head_group)
            if t.tensor == "kv":
                cols[u] = (pieces[0], pieces[1])
            elif t.tensor == "qdo":
                rows[u] = tuple(pieces)
            elif t.tensor == "do":
                if u in saved["q"]:
                    rows[u] = (saved["q"][u], pieces[0], saved["lse"][u], pieces[1])
                # else: dO of a row this rank computes nothing for (e.g. an all-padding chunk) -- moved, unused
            elif t.tensor in ("dq", "dkv"):
                _add_into(accs[t.tensor], u, pieces)
            else:
                finals[(t.tensor, t.chunk, t.head_group)] = tuple(pieces)

        def launch(step: Launch) -> None:
            items = [(g, i, list(js), *rows[(i, g)], [cols[(j, g)] for j in js]) for g, i, js in step.rows]
            dqs, dkvs, dscore = io.tiles_bwd(items, scale, score)
            for (g, i, *_), dq in zip(items, dqs, strict=True):
                _add_into(accs["dq"], (i, g), (dq,))
            for u, dkv in dkvs.items():
                _add_into(accs["dkv"], u, dkv)
            if dscore:
                _add_into(accs["score"], 0, dscore)

        self._walk("bwd", payload, arrive, launch, q.device)
        io.finish("bwd")
        dq_u, dk_u, dv_u = {}, {}, {}
        for c in self.local_chunks:
            for g in range(g_count):
                u = (c, g)
                got = finals.get(("dq_out", c, g)) or self._acc_or_empty(accs["dq"], u, "dq", q.device)
                dq_u[u] = got[0].to(q.dtype)
                got = finals.get(("dkv_out", c, g)) or self._acc_or_empty(accs["dkv"], u, "dkv", q.device)
                dk_u[u], dv_u[u] = got[0].to(k.dtype), got[1].to(v.dtype)
        wanted = geo.score_mod.wanted if geo.score_mod is not None else []
        dscore = accs["score"].get(0) or tuple(torch.zeros(score[n].shape, device=q.device) for n in wanted)
        dscore = io.all_reduce(list(dscore)) if dscore else []   # every rank, tiles or not: a collective
        return self._assemble(dq_u), self._assemble(dk_u), self._assemble(dv_u), dscore


class _DistAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, executor: Executor, scale: float):
        out, lse, saved = executor.forward(q, k, v, scale)
        ctx.executor, ctx.scale, ctx.saved = executor, scale, saved
        ctx.save_for_backward(q, k, v, out, lse)
        return out.to(q.dtype), lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(q)
        dq, dk, dv, _ = ctx.executor.backward(q, k, v, out, lse, ctx.saved, dout, dlse, ctx.scale)
        return dq, dk, dv, None, None


def run(executor: Executor, q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """Differentiable distributed attention on this rank's shards: (out in q's dtype, lse fp32)."""
    return _DistAttention.apply(q, k, v, executor, scale)
