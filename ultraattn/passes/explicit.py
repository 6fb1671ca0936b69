"""Expand rewritten sites into explicit per-rank graphs: dispatch, one node pair per transfer stage, tiles, merges.

Where it runs: on the forward and backward graphs that AOT autograd hands to Inductor (the
backend passes ``inner_compile=``), so both directions of the schedule appear as nodes in
the graphs Inductor compiles. A ``ultraattn::site_attention`` node (and its
``site_attention_bwd``) is replaced by the plan's program for this rank:

* dispatch: this rank's chunks of q, k, v (and, in the backward, of out, lse, dout, dlse) as
  ``slice``/``cat`` nodes;
* communication: per stage of the schedule (each level of input exchange, of the partial
  reduction tree, the final hand-back) a ``cp_start`` node posting its sends and receives
  and a ``cp_wait`` node returning the received pieces, with the tiles whose inputs are
  present placed between them (the executor's overlap); a token threads every
  communication node so that all ranks post stages in the same order and none is dropped;
* tiles: ``cp_tile_fwd`` / ``cp_tile_bwd`` per (head group, q chunk) over its kv chunks
  (Triton block-sparse kernels on GPU, the torch tile path on CPU);
* merges: the stable LSE merge and the gradient sums as ordinary aten nodes Inductor fuses;
* the global view: ``cp_gather`` all-gathers the outputs (and, in the backward, dq/dk/dv).

The schedule code is the runtime executor's own (``Executor.forward``/``backward``): the
expansion runs it under ``make_fx`` with an IO whose primitives emit these ops, so the graph
and the eager runtime cannot drift apart. Tensors the backward reuses from the forward
(units a rank received and keeps, per the plan) pass through a bounded stash keyed by the
ticket the forward returns, as in the opaque op.

Only sites whose plan is known when the graph is compiled are expanded: masks without run-time
content (SDPA ``is_causal`` or no mask) and static shapes. Sites whose mask arrives as graph
input (a document mask of each batch) keep the opaque op, which plans per mask content at run
time; the report says which form each site took.
"""

from __future__ import annotations

import copy
import itertools
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
import torch.fx as fx
from torch import Tensor
from torch.library import custom_op

from ultraattn.passes.site_op import MAX_PENDING, SITES, SiteSpec, kernel_site_backward, state_gone

_LOCK = threading.Lock()
_IDS = itertools.count(1)


@dataclass
class ExplicitSite:
    """What the expanded nodes of one site look up at run time (plan, stage and tile tables)."""

    key: str
    spec: SiteSpec
    runner: object  # AttentionPlan
    stages: list = field(default_factory=list)
    """stage id -> (phase, first of its phase, sends [(tag, transfer, n pieces)], recvs [(tag, transfer)])."""
    tiles: list = field(default_factory=list)
    """tile id -> (head group, q chunk, kv chunks, scale)."""
    saved_layout: list | None = None
    """(kind, unit, n tensors) of the stash, in order, with each tensor's (shape, dtype)."""
    handles: dict = field(default_factory=dict)
    stash: OrderedDict = field(default_factory=OrderedDict)

    @property
    def executor(self):
        return self.runner.executor


EXPLICIT: dict[str, ExplicitSite] = {}


def _new_token() -> Tensor:
    return torch.zeros((), dtype=torch.int64)


# ----------------------------------------------------------------------------- the ops
@custom_op("ultraattn::cp_start", mutates_args=())
def cp_start(token: Tensor, pieces: list[Tensor], site: str, stage: int) -> Tensor:
    """Post one schedule stage's sends (``pieces``, message after message) and receives; returns a handle."""
    e = EXPLICIT[site]
    phase, first, sends, recvs = e.stages[stage]
    io = e.executor.io
    if first:
        io.begin(phase)
        if phase == "fwd":
            e.spec.stats["calls"] += 1
    it = iter(pieces)
    msgs = [(tag, t, [next(it) for _ in range(n)]) for tag, t, n in sends]
    hid = next(_IDS)
    e.handles[hid] = io.start(phase, msgs, recvs, _device(e))
    return torch.tensor(hid, dtype=torch.int64)


@cp_start.register_fake
def _(token, pieces, site, stage):
    return torch.empty((), dtype=torch.int64, device="cpu")


@custom_op("ultraattn::cp_wait", mutates_args=())
def cp_wait(handle: Tensor, site: str, stage: int) -> list[Tensor]:
    """Wait for a stage's receives: [token, pieces of each received message in order]."""
    e = EXPLICIT[site]
    got = e.executor.io.wait(e.handles.pop(int(handle)))
    return [_new_token()] + [p.clone() for _t, pieces in got for p in pieces]


@cp_wait.register_fake
def _(handle, site, stage):
    e = EXPLICIT[site]
    return [torch.empty((), dtype=torch.int64, device="cpu")] + [
        torch.empty(shape, dtype=dt, device=_device(e)) for shape, dt in _recv_specs(e, stage)]


@custom_op("ultraattn::cp_finish", mutates_args=())
def cp_finish(token: Tensor, site: str, phase: str) -> Tensor:
    """Wait until this rank's sends of ``phase`` are delivered (their buffers live until then)."""
    EXPLICIT[site].executor.io.finish(phase)
    return _new_token()


@cp_finish.register_fake
def _(token, site, phase):
    return torch.empty((), dtype=torch.int64, device="cpu")


@custom_op("ultraattn::cp_check_inputs", mutates_args=())
def cp_check_inputs(token: Tensor, tensors: list[Tensor], site: str) -> Tensor:
    """The ``debug`` option: every rank must call this site with the same inputs (``site_op._check_same_inputs``)."""
    from ultraattn.passes.site_op import _check_same_inputs

    spec = EXPLICIT[site].spec
    _check_same_inputs(spec, tensors)
    return _new_token()


@cp_check_inputs.register_fake
def _(token, tensors, site):
    return torch.empty((), dtype=torch.int64, device="cpu")


@custom_op("ultraattn::cp_tile_layout", mutates_args=())
def cp_tile_layout(site: str, tile: int) -> list[Tensor]:
    """The kernel layout of one tile row (``runtime.tiles.kernel_layout``, cached), copied like ``cp_layout``."""
    return [t.clone() for t in _tile_layout(EXPLICIT[site], tile).bwd_tensors()]


@cp_tile_layout.register_fake
def _(site, tile):
    return [torch.empty(t.shape, dtype=t.dtype, device=t.device)
            for t in _tile_layout(EXPLICIT[site], tile).bwd_tensors()]


def _tile_layout(e: ExplicitSite, tile: int):
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from ultraattn.runtime.tiles import kernel_layout

    g, i, js, _ = e.tiles[tile]
    with unset_fake_temporarily():
        return kernel_layout(e.executor.geo, g, i, js, _device(e))


@custom_op("ultraattn::cp_tile_fwd", mutates_args=())
def cp_tile_fwd(q: Tensor, ks: list[Tensor], vs: list[Tensor], site: str, tile: int) -> tuple[Tensor, Tensor]:
    """Partial attention of one (head group, q chunk) over its kv chunks: (o fp32, lse fp32)."""
    from ultraattn.runtime.tiles import row_forward

    e = EXPLICIT[site]
    g, i, js, scale = e.tiles[tile]
    o, lse = row_forward(e.executor.geo, g, i, js, q, list(zip(ks, vs)), scale)
    return o.contiguous(), lse.contiguous()


@cp_tile_fwd.register_fake
def _(q, ks, vs, site, tile):
    return q.new_empty(q.shape, dtype=torch.float32), q.new_empty(q.shape[:-1], dtype=torch.float32)


@custom_op("ultraattn::cp_tile_bwd", mutates_args=())
def cp_tile_bwd(q: Tensor, do: Tensor, lse: Tensor, delta: Tensor, ks: list[Tensor], vs: list[Tensor], site: str,
                tile: int) -> list[Tensor]:
    """Gradients of one tile row (global lse and delta): [dq, dk per kv chunk..., dv per kv chunk...], fp32."""
    from ultraattn.runtime.tiles import row_backward

    e = EXPLICIT[site]
    g, i, js, scale = e.tiles[tile]
    dq, per_col = row_backward(e.executor.geo, g, i, js, q, do, lse, delta, list(zip(ks, vs)), scale)
    # the per-column gradients are slices of one buffer: a custom op's outputs must not share storage
    own = (lambda t: t.clone()) if len(per_col) > 1 else (lambda t: t.contiguous())
    return [dq.contiguous()] + [own(dk) for dk, _ in per_col] + [own(dv) for _, dv in per_col]


@cp_tile_bwd.register_fake
def _(q, do, lse, delta, ks, vs, site, tile):
    f32 = torch.float32
    return [q.new_empty(q.shape, dtype=f32)] + [k.new_empty(k.shape, dtype=f32) for k in ks] + \
        [v.new_empty(v.shape, dtype=f32) for v in vs]


@custom_op("ultraattn::cp_gather", mutates_args=())
def cp_gather(token: Tensor, x: Tensor, site: str) -> list[Tensor]:
    """All-gather this rank's tokens (dim 2) into the global tensor: [token, global x]."""
    from ultraattn.runtime.api import _gather

    e = EXPLICIT[site]
    return [_new_token(), _gather(x, e.runner, 2).contiguous()]


@cp_gather.register_fake
def _(token, x, site):
    e = EXPLICIT[site]
    shape = list(x.shape)
    shape[2] = e.runner.seq_len
    return [torch.empty((), dtype=torch.int64, device="cpu"), x.new_empty(shape)]


@custom_op("ultraattn::cp_stash", mutates_args=())
def cp_stash(token: Tensor, tensors: list[Tensor], site: str) -> Tensor:
    """Keep the units the backward reuses (received in the forward); returns their ticket."""
    e = EXPLICIT[site]
    with _LOCK:
        ticket = next(_IDS)
        # copies: the tensors are the graph's buffers, which Inductor reuses once the graph no longer reads them
        e.stash[ticket] = [t.clone() for t in tensors]
        while len(e.stash) > MAX_PENDING:
            e.stash.popitem(last=False)
    return torch.tensor(ticket, dtype=torch.int64)


@cp_stash.register_fake
def _(token, tensors, site):
    return torch.empty((), dtype=torch.int64, device="cpu")


@custom_op("ultraattn::cp_unstash", mutates_args=())
def cp_unstash(ticket: Tensor, site: str) -> list[Tensor]:
    e = EXPLICIT[site]
    with _LOCK:
        got = e.stash.pop(int(ticket), None)
    if got is None:
        raise state_gone(e.spec)
    return got


@cp_unstash.register_fake
def _(ticket, site):
    e = EXPLICIT[site]
    return [torch.empty(shape, dtype=dt, device=_device(e)) for _kind, _u, specs in e.saved_layout
            for shape, dt in specs]


def _device(e: ExplicitSite) -> torch.device:
    return e.spec.device


def _recv_specs(e: ExplicitSite, stage: int):
    from ultraattn.runtime.executor import layout

    ex = e.executor
    return [s for _tag, t in e.stages[stage][3] for s in layout(t.tensor, ex.geo, ex.dtype)]


# ----------------------------------------------------------------------------- the graph-building IO
class TracedIO:
    """The executor's IO (``runtime.executor.EagerIO``'s interface) emitting the ops above."""

    def __init__(self, e: ExplicitSite):
        self.e = e
        self.token = _new_token()
        self.first: set[str] = set()

    def begin(self, phase: str) -> None:
        pass

    def start(self, phase, sends, recvs, device):
        e = self.e
        sid = len(e.stages)
        e.stages.append((phase, phase not in self.first, [(tag, t, len(p)) for tag, t, p in sends], list(recvs)))
        self.first.add(phase)
        flat = [p.contiguous() for _tag, _t, pieces in sends for p in pieces]
        return sid, torch.ops.ultraattn.cp_start(self.token, flat, e.key, sid)

    def wait(self, handle):
        from ultraattn.runtime.executor import layout

        sid, h = handle
        e = self.e
        outs = torch.ops.ultraattn.cp_wait(h, e.key, sid)
        self.token, it = outs[0], iter(outs[1:])
        ex = e.executor
        return [(t, [next(it) for _ in layout(t.tensor, ex.geo, ex.dtype)]) for _tag, t in e.stages[sid][3]]

    def finish(self, phase: str) -> None:
        self.token = torch.ops.ultraattn.cp_finish(self.token, self.e.key, phase)

    def _tile(self, g, i, js, q, scale) -> tuple[int, bool]:
        """A tile id, and whether the tile is the Triton op: on CUDA (``kernels.ops._use_triton``), or on CPU
        with ``ULTRAATTN_KERNELS=triton`` under the interpreter when the graph runs uncompiled (aot_eager)."""
        from ultraattn.kernels import config
        from ultraattn.kernels.ops import _use_triton

        tid = len(self.e.tiles)
        self.e.tiles.append((g, i, list(js), scale))
        if q.device.type == "cuda":
            return tid, _use_triton(q)
        return tid, (config.kernel_mode() == "triton" and config.interpret()
                     and self.e.spec.options.compiler != "inductor")

    def tile_fwd(self, g, i, js, q, kvs, scale):
        from ultraattn.runtime.tiles import kernel_row_forward

        tid, kernels = self._tile(g, i, js, q, scale)
        if kernels:  # the block-sparse Triton op itself, on the row's concatenated kv chunks
            lay = torch.ops.ultraattn.cp_tile_layout(self.e.key, tid)
            return kernel_row_forward(self.e.executor.geo, lay, q, kvs, scale)
        return torch.ops.ultraattn.cp_tile_fwd(q, [k for k, _ in kvs], [v for _, v in kvs], self.e.key, tid)

    def tile_bwd(self, g, i, js, q, do, lse, delta, kvs, scale):
        from ultraattn.runtime.tiles import kernel_row_backward

        tid, kernels = self._tile(g, i, js, q, scale)
        n = len(js)
        if kernels:
            lay = torch.ops.ultraattn.cp_tile_layout(self.e.key, tid)
            return kernel_row_backward(self.e.executor.geo, lay, q, do, lse, delta, kvs, scale)
        outs = torch.ops.ultraattn.cp_tile_bwd(q, do, lse, delta, [k for k, _ in kvs], [v for _, v in kvs],
                                               self.e.key, tid)
        return outs[0], list(zip(outs[1:1 + n], outs[1 + n:]))

    def gather(self, x: Tensor) -> Tensor:
        self.token, full = torch.ops.ultraattn.cp_gather(self.token, x, self.e.key)
        return full


def _traced_executor(e: ExplicitSite):
    ex = copy.copy(e.executor)
    ex.io = TracedIO(e)
    return ex


def local_shard(x: Tensor, ap) -> Tensor:
    """This rank's tokens of ``x`` (sequence on dim 2) by slicing and concatenation (no index constants)."""
    pad = ap.padded_len - ap.seq_len
    if pad:
        x = torch.nn.functional.pad(x, [0, 0] * (x.dim() - 3) + [0, pad])
    cs = ap.tile_plan.chunk_size
    return torch.cat([x[:, :, c * cs:(c + 1) * cs] for c in ap.tile_plan.local_chunks(ap.rank)], dim=2)


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


def forward_program(e: ExplicitSite, local: bool = False):
    """fn(q, k, v) -> (out, lse fp32, ticket): the site's forward as this rank's explicit program.

    ``local``: q, k, v are already this rank's tokens (a sequence-sharded graph) and so are out, lse:
    no dispatch, no gather."""

    def fn(q, k, v):
        ap, spec = e.runner, e.spec
        ex = _traced_executor(e)
        if spec.options.debug and not local:
            ex.io.token = torch.ops.ultraattn.cp_check_inputs(ex.io.token, [q, k, v], e.key)
        qkv = (q, k, v) if local else (local_shard(q, ap), local_shard(k, ap), local_shard(v, ap))
        out_l, lse_l, saved = ex.forward(*qkv, spec.scale)
        flat, e.saved_layout = _flatten_saved(saved)  # the same on every trace of this site
        if local:
            out, lse = out_l.to(q.dtype), lse_l
        else:
            out = ex.io.gather(out_l.to(q.dtype))
            lse = ex.io.gather(lse_l)
        ticket = torch.ops.ultraattn.cp_stash(ex.io.token, flat, e.key)
        return out, lse, ticket

    return fn


def backward_program(e: ExplicitSite, local: bool = False):
    """fn(q, k, v, out, lse, dout, dlse, ticket) -> (dq, dk, dv) (``local``: all on this rank's tokens)."""

    def fn(q, k, v, out, lse, dout, dlse, ticket):
        ap, spec = e.runner, e.spec
        ex = _traced_executor(e)
        saved = _unflatten_saved(torch.ops.ultraattn.cp_unstash(ticket, e.key), e.saved_layout)
        sh = [x if local else local_shard(x, ap) for x in (q, k, v, out, lse, dout.to(out.dtype), dlse.float())]
        dq, dk, dv = ex.backward(*sh[:5], saved, sh[5], sh[6], spec.scale)
        if local:
            return tuple(g.to(x.dtype) for g, x in zip((dq, dk, dv), (q, k, v)))
        return tuple(ex.io.gather(g).to(x.dtype) for g, x in zip((dq, dk, dv), (q, k, v)))

    return fn


def kernel_forward_program(e: ExplicitSite):
    """World size 1: the site is the block-sparse kernel op itself; its layout comes from ``cp_layout``."""

    def fn(q, k, v):
        lay = torch.ops.ultraattn.cp_layout(e.key)
        out, lse = torch.ops.ultraattn.bsa_fwd(q, k, v, *lay, e.runner.q_block, e.runner.kv_block, e.spec.scale)
        return out, lse, torch.zeros((), dtype=torch.int64)

    return fn


def kernel_backward_program(e: ExplicitSite):
    def fn(q, k, v, out, lse, dout, dlse, ticket):
        return kernel_site_backward(q, k, v, out, lse, dout, dlse, torch.ops.ultraattn.cp_layout(e.key),
                                    e.runner.q_block, e.runner.kv_block, e.spec.scale)

    return fn


@custom_op("ultraattn::cp_layout", mutates_args=())
def cp_layout(site: str) -> list[Tensor]:
    """The block-sparse layout of a world-1 site (copies: the graph may reuse its buffers after the kernel).

    A graph constant would be simpler, but Inductor's fake-tensor passes refuse real constant
    tensors as arguments of an op; the layout is small (2 KiB per partially masked block).
    """
    return [t.clone() for t in EXPLICIT[site].runner.bwd_tensors()]


@cp_layout.register_fake
def _(site):
    return [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in EXPLICIT[site].runner.bwd_tensors()]


# ----------------------------------------------------------------------------- the pass
_COMM_OPS = ("cp_start", "cp_wait", "cp_finish", "cp_gather", "cp_check_inputs")


def schedule_rows(gm: fx.GraphModule) -> list[dict]:
    """The ultraattn nodes of an expanded graph in execution order, described for reports."""
    rows = []
    for n in gm.graph.nodes:
        if n.op != "call_function" or getattr(n.target, "namespace", None) != "ultraattn":
            continue
        op = n.target._opname
        e = next((EXPLICIT[a] for a in n.args if isinstance(a, str) and a in EXPLICIT), None)
        what, nbytes = "", 0
        if e is not None and op == "cp_start":
            phase, _first, sends, recvs = e.stages[n.args[3]]
            nbytes = sum(t.nbytes for _, t, _ in sends)
            what = "; ".join([f"send {t.tensor} c{t.chunk}g{t.head_group}→r{t.dst}" for _, t, _ in sends] +
                             [f"recv {t.tensor} c{t.chunk}g{t.head_group}←r{t.src}" for _, t in recvs]) or "(none)"
        elif e is not None and op == "cp_wait":
            what = f"stage {n.args[2]}"
        elif e is not None and op in ("cp_tile_fwd", "cp_tile_bwd", "cp_tile_layout"):
            g, i, js, _ = e.tiles[n.args[-1]]
            what = f"q chunk {i}, group {g} × kv chunks {js}"
        elif op == "cp_gather":
            what = "all-gather to the global view"
        elif op == "cp_finish":
            what = f"{n.args[2]} sends delivered"
        elif op in ("bsa_fwd", "bsa_bwd"):
            what = "block-sparse kernel"
        rows.append({"node": n.name, "op": op, "site": e.spec.name if e is not None else "",
                     "comm": op in _COMM_OPS, "what": what, "bytes": nbytes})
    return rows


_AFTER_OPS = ("sp_gather", "sp_all_reduce", "sp_weight_grad", "site_attention", "site_attention_bwd",
              "site_attention_local", "site_attention_local_bwd")
"""Communicating ops that take an ``after`` argument (their position in the order)."""
_TOKEN_OPS = ("cp_start", "cp_finish", "cp_gather", "cp_check_inputs", "cp_stash")
"""Ops of an explicit site's program whose first argument is the program's communication token."""


def _set_input(n: fx.Node, where: int | str, value: fx.Node) -> None:
    """Set argument ``where`` (position or keyword) of ``n``, and the fake input Inductor keeps for it
    (``eager_input_vals``: it lays a custom op's inputs out by those fakes' strides)."""
    if isinstance(where, int):
        n.update_arg(where, value)
    else:
        n.update_kwarg(where, value)
    vals = n.meta.get("eager_input_vals")
    if vals is not None:
        args, kwargs = list(vals[0]), dict(vals[1])
        if isinstance(where, int):
            args[where] = value.meta.get("val")
        else:
            kwargs[where] = value.meta.get("val")
        n.meta["eager_input_vals"] = (tuple(args), kwargs)


def order_comm(gm: fx.GraphModule) -> int:
    """Chain every communicating node of ``gm`` in graph order, so that every rank runs them in one order.

    [Note] Inductor schedules nodes by their data dependencies alone. The graph is the same on every
    rank except inside the explicit sites' programs (per-rank schedules), so two independent
    collectives, say a weight-gradient all-reduce and a site's backward exchange, could run in
    different orders on different ranks and wait on each other forever. Each communicating node
    outside a program gets the previous one's output as its ``after`` argument, and each program's
    first token is replaced by it (a program's own nodes are already chained by its token), so the
    order is total and the same everywhere. Returns the number of nodes chained.
    """
    import operator

    prev = None
    count = 0
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or getattr(n.target, "namespace", None) != "ultraattn":
            continue
        op = n.target._opname
        if op in _AFTER_OPS:
            if prev is not None:
                _set_input(n, "after", prev)
        elif op in _TOKEN_OPS:
            tok = n.args[0]
            chained = isinstance(tok, fx.Node) and (
                getattr(tok.target, "namespace", None) == "ultraattn" or
                (tok.target is operator.getitem and getattr(tok.args[0].target, "namespace", None) == "ultraattn"))
            if not chained and prev is not None:
                _set_input(n, 0, prev)
        elif op != "cp_wait":
            continue
        count += 1
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor):
            prev = n
        else:  # a list or tuple: its first element (a token, or an output produced when the op ends)
            first = next((u for u in n.users if u.target is operator.getitem and u.args[1] == 0), None)
            if first is None:
                with gm.graph.inserting_after(n):
                    first = gm.graph.call_function(operator.getitem, (n, 0))
                    first.meta["val"] = val[0]
            prev = first
    if count:
        gm.graph.lint()
        gm.recompile()
    return count


def explicit_reason(spec: SiteSpec) -> str | None:
    """Why ``spec`` keeps the opaque op (None: it can be expanded)."""
    if not spec.options.explicit:
        return "options['explicit'] is False"
    if spec.mask not in ("causal", "full"):
        return "the mask's content is a run-time input: planned per content at run time"
    if not all(isinstance(d, int) for d in (*spec.q_shape, *spec.kv_shape)):
        return "dynamic shapes"
    return None


def prepare(spec: SiteSpec, device: torch.device) -> None:
    """Plan an expandable site now, in the backend call (every rank compiles the same graphs in order).

    Not later, inside Inductor's compile: planning across ranks is collective (rank 0's plan is
    broadcast and checked), and Inductor holds cross-process cache locks while it compiles, so a
    rank waiting there for a peer could wait on a peer that waits for its lock.
    """
    from ultraattn.passes.site_op import _runner
    from ultraattn.runtime.api import check_consistent

    if spec.key in EXPLICIT:
        return
    spec.device = device
    # _runner reads only shape, dtype and device of q and k
    q, k = (SimpleNamespace(shape=tuple(shape), dtype=spec.dtype, device=device)
            for shape in (spec.q_shape, spec.kv_shape))
    kind, runner = _runner(spec, q, k, [])
    if kind == "plan":
        check_consistent(runner)
        runner.executor  # build the program now: errors surface at compile time
    EXPLICIT[spec.key] = ExplicitSite(key=spec.key, spec=spec, runner=runner)


def _splice(gm: fx.GraphModule, node: fx.Node, sub: fx.GraphModule, args: list) -> list[fx.Node]:
    """Copy ``sub``'s nodes before ``node`` (placeholders bound to ``args``); returns its output nodes."""
    graph = gm.graph
    env: dict[fx.Node, object] = {}
    phs = [n for n in sub.graph.nodes if n.op == "placeholder"]
    env.update(zip(phs, args))
    outs = None
    with graph.inserting_before(node):
        for n in sub.graph.nodes:
            if n.op == "placeholder":
                continue
            if n.op == "output":
                outs = fx.map_arg(n.args[0], lambda a: env[a])
                continue
            if n.op == "get_attr":
                name = f"_ultraattn_const_{next(_IDS)}"
                setattr(gm, name, getattr(sub, n.target))
                new = graph.get_attr(name)
                new.meta = dict(n.meta)
            else:
                new = graph.node_copy(n, lambda a: env[a])
            env[n] = new
    return list(outs)


def _trace(fn, vals: list):
    from torch._guards import detect_fake_mode
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx

    # Inductor's decompositions: the graphs it receives hold no op it lowers by decomposing
    with detect_fake_mode(vals):
        return make_fx(fn, select_decomp_table(), tracing_mode="real")(*vals)


def _replace_outputs(node: fx.Node, outs: list[fx.Node]) -> None:
    import operator

    for user in list(node.users):
        if user.op == "call_function" and user.target is operator.getitem:
            user.replace_all_uses_with(outs[user.args[1]])
            user.graph.erase_node(user)
        else:
            raise RuntimeError(f"ultraattn: unexpected use {user.format_node()} of {node.format_node()}")
    node.graph.erase_node(node)


def expand_sites(gm: fx.GraphModule) -> list[str]:
    """Expand every eligible site node of ``gm`` (a forward or backward graph) in place; returns the site names."""
    ops = torch.ops.ultraattn
    fwd_ops = (ops.site_attention.default, ops.site_attention_local.default)
    bwd_ops = (ops.site_attention_bwd.default, ops.site_attention_local_bwd.default)
    done = []
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in fwd_ops + bwd_ops:
            continue
        key = node.args[-1]
        spec = SITES.get(key)
        if spec is None or explicit_reason(spec) is not None:
            continue
        local = node.target in (ops.site_attention_local.default, ops.site_attention_local_bwd.default)
        if node.target in fwd_ops:
            q, k, v = node.args[:3]
            vals = [a.meta["val"] for a in (q, k, v)]
            e = EXPLICIT.get(key)
            if e is None:
                raise RuntimeError(f"ultraattn: site {spec.name} reached Inductor without its compile-time plan")
            world1 = spec.options.world_size == 1
            sub = _trace(kernel_forward_program(e) if world1 else forward_program(e, local), vals)
            outs = _splice(gm, node, sub, [q, k, v])
        else:
            e = EXPLICIT.get(key)
            if e is None:
                raise RuntimeError(f"ultraattn: backward of site {spec.name} compiled before its forward was expanded")
            args = list(node.args[:8])
            world1 = spec.options.world_size == 1
            sub = _trace(kernel_backward_program(e) if world1 else backward_program(e, local),
                         [a.meta["val"] for a in args])
            outs = _splice(gm, node, sub, args)
        _replace_outputs(node, outs)
        done.append(spec.name)
    if done:
        gm.graph.lint()
        gm.recompile()
    return done
