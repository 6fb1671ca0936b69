"""The op a rewritten attention site calls: ``ultraattn::site_attention`` (+ its backward op).

A site's static description (mask kind, block sizes, mask_mod submodule, scale, backend
options) lives in a registry under a string key baked into the graph; the mask's *content*
(BlockMask tensors, mask_mod buffers such as document ids, a boolean attn_mask) arrives as op
inputs at run time. Plans and kernel layouts are cached per site on a hash of that content,
so a new batch's document mask is planned again without recompiling, and the planning time
is recorded for reports.

Global view (this issue's "outputs stay replicated"): the op takes the full-sequence q, k, v
every rank holds, runs this rank's share by the plan (``dispatch`` -> ``dist_attention``) and
all-gathers out and lse; its backward slices the replicated dout/dlse, runs the plan's
backward and all-gathers dq, dk, dv, so every rank holds exactly the single-device gradients
(no extra collective in the user's script). At world size 1 the site runs the block-sparse
kernels alone.

Autograd state between the two ops (the tensors the runtime received in the forward) is kept
in a bounded per-site registry under an int64 "ticket" the forward op returns and the
backward op consumes; the ticket is an ordinary saved activation for AOT autograd.
"""

from __future__ import annotations

import hashlib
import itertools
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.library import custom_op

from ultraattn.passes.options import BackendOptions

MAX_PENDING = 8
"""Forwards of one site that may await their backward (gradient accumulation, checkpointing)."""


@dataclass
class SiteSpec:
    key: str
    name: str
    op: str
    mask: str
    q_shape: tuple
    kv_shape: tuple
    dtype: torch.dtype
    scale: float
    options: BackendOptions
    sync_key: str = ""
    """Identical on every rank (graph index and site name), for store exchanges; ``key`` is process-unique."""
    block_mask: dict = field(default_factory=dict)
    """flex: q_len, kv_len, q_block, kv_block, has_full (bool), mask_mod (GraphModule)."""
    device: object = None
    """The graph's device (set when the site is expanded into explicit nodes)."""
    layout: object = None
    """The graph's ``TokenLayout`` when the sequence-sharding pass runs the site on local tokens: every
    plan of the site keeps it (None: the planner chooses)."""
    plans: OrderedDict = field(default_factory=OrderedDict)
    pending: dict = field(default_factory=dict)
    order: deque = field(default_factory=deque)
    stats: dict = field(default_factory=lambda: {"calls": 0, "plans": 0, "planning_seconds": 0.0, "cache_hits": 0})


SITES: dict[str, SiteSpec] = {}
_TICKETS = itertools.count(1)
_LOCK = threading.Lock()
_PLAN_CACHE_SIZE = 16


def register(spec: SiteSpec) -> str:
    SITES[spec.key] = spec
    return spec.key


def _digest(tensors: list[Tensor], extra: tuple) -> str:
    h = hashlib.blake2b(repr(extra).encode(), digest_size=16)
    for t in tensors:
        t = t.detach()
        h.update(repr((tuple(t.shape), str(t.dtype))).encode())
        h.update(t.cpu().contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _plan_key(spec: SiteSpec, q, k, mask_tensors: list[Tensor]) -> str:
    return _digest(mask_tensors, (spec.mask, tuple(q.shape), tuple(k.shape), str(q.dtype), str(q.device),
                                  repr(spec.layout)))


def seed_plan(spec: SiteSpec, dtype: torch.dtype, device, mask_tensors: list[Tensor]):
    """Plan ``spec`` now (a collective), letting the planner choose the token layout, and make that layout the
    site's: a sequence-sharded graph takes its layout from its first attention. The plan stays cached under it."""
    from types import SimpleNamespace

    q, k = (SimpleNamespace(shape=tuple(sh), dtype=dtype, device=device) for sh in (spec.q_shape, spec.kv_shape))
    spec.layout = None
    kind, runner = _runner(spec, q, k, mask_tensors)
    assert kind == "plan", kind
    spec.layout = runner.layout
    spec.plans[_plan_key(spec, q, k, mask_tensors)] = (kind, runner)
    return runner


def _mask_object(spec: SiteSpec, mask_tensors: list[Tensor], batch: int, heads: int):
    """(mask, mask_mod) for plan_attention / make_layout from the site's static spec and run-time content."""
    from torch.nn.attention.flex_attention import BlockMask

    if spec.mask in ("causal", "full"):
        return spec.mask, None
    if spec.mask == "bool_mask":
        m = mask_tensors[0].detach().to(torch.bool)
        while m.dim() < 4:
            m = m.unsqueeze(0)
        m = m.cpu()
        bm, hm = m.shape[0], m.shape[1]

        def dense_mask(b, h, q_idx, kv_idx):
            return m[b if bm > 1 else b * 0, h if hm > 1 else h * 0, q_idx, kv_idx]

        from ultraattn.masks.convert import pattern_from_mask_mod

        sq, sk = spec.q_shape[2], spec.kv_shape[2]
        pat = pattern_from_mask_mod(dense_mask, sq, sk, block_size=spec.options.block_size,
                                    batch=batch if bm > 1 else 1, num_heads=heads if hm > 1 else 1)
        return pat, dense_mask
    info = spec.block_mask
    kvn, kvi = mask_tensors[0], mask_tensors[1]
    fkn, fki = (mask_tensors[2], mask_tensors[3]) if info["has_full"] else (None, None)
    buffers = [t.detach().cpu() for t in mask_tensors[4 if info["has_full"] else 2:]]
    gm = info["mask_mod"]

    def mask_mod(b, h, q_idx, kv_idx):
        return gm(b, h, q_idx, kv_idx, *buffers)

    # A BlockMask without its transposed (q-side) tensors: BlockMask's constructors compute them
    # with vmap, which is unavailable below the autograd dispatch key where custom ops run; only
    # the kv side is read by ultraattn.
    bmask = object.__new__(BlockMask)
    for name, val in (("seq_lengths", (info["q_len"], info["kv_len"])), ("kv_num_blocks", kvn.cpu()),
                      ("kv_indices", kvi.cpu()), ("full_kv_num_blocks", None if fkn is None else fkn.cpu()),
                      ("full_kv_indices", None if fki is None else fki.cpu()),
                      ("BLOCK_SIZE", (info["q_block"], info["kv_block"])), ("mask_mod", mask_mod)):
        object.__setattr__(bmask, name, val)
    return bmask, mask_mod


def _runner(spec: SiteSpec, q: Tensor, k: Tensor, mask_tensors: list[Tensor]):
    """The cached plan (world > 1) or kernel layout (world 1) for this call's mask content.

    ``q`` and ``k`` only give the (global) shapes, dtype and device."""
    B, H, S, D = q.shape
    Hk = k.shape[1]
    key = _plan_key(spec, q, k, mask_tensors)
    hit = spec.plans.get(key)
    if hit is not None:
        spec.plans.move_to_end(key)
        spec.stats["cache_hits"] += 1
        return hit
    t0 = time.perf_counter()
    mask, mask_mod = _mask_object(spec, mask_tensors, B, H)
    opts = spec.options
    if opts.world_size == 1:
        from ultraattn.kernels import make_layout

        runner = ("kernels", make_layout(mask, q_len=S, kv_len=k.shape[2], batch=B, num_heads=H, mask_mod=mask_mod,
                                         block_size=opts.block_size, device=q.device))
    else:
        from ultraattn.runtime.api import plan_attention

        plan = plan_attention(mask, seqlen=S, num_heads=H, head_dim=D, num_kv_heads=Hk, batch=B, mesh=opts.mesh,
                              dtype=q.dtype, block_size=opts.block_size, mask_mod=mask_mod, method=opts.method,
                              options=opts.planner_options(), cost=opts.cost_model(), timeout=opts.timeout,
                              layout=spec.layout)
        runner = ("plan", plan)
    spec.stats["plans"] += 1
    spec.stats["planning_seconds"] += time.perf_counter() - t0
    spec.plans[key] = runner
    _report_plan(spec, runner, time.perf_counter() - t0)
    if len(spec.plans) > _PLAN_CACHE_SIZE:
        spec.plans.popitem(last=False)
    return runner


def _check_same_inputs(spec: SiteSpec, tensors) -> None:
    """debug option: every rank of the group must call this site with the same q, k, v and mask (a fingerprint
    through the process group's store); ranks that differ from rank 0 are named."""
    import torch.distributed as dist

    from ultraattn.runtime.comm import ranks_differing

    call = spec.stats["calls"]
    bad = ranks_differing(f"ultraattn/debug/{spec.sync_key}/{call}", tensors, rank=dist.get_rank(),
                          world=dist.get_world_size(), timeout=spec.options.timeout)
    if bad:
        raise RuntimeError(
            f"ultraattn site {spec.name} (call {call}): rank(s) {bad} got different q/k/v or mask than rank 0. "
            f"Every rank of a context-parallel group must run the same batch: give all of them the same data "
            f"(same seed, no DistributedSampler across the CP group)"
        )


PLANS: dict[str, dict] = {}
"""site name -> the latest plan's summary (rank 0), for saved reports."""


def _report_plan(spec: SiteSpec, runner, seconds: float) -> None:
    """Record (and print, per the report option) a plan made at run time, on rank 0 only."""
    kind, obj = runner
    opts = spec.options
    if kind == "plan" and obj.rank != 0:
        return
    info = {"seconds": seconds, "world": opts.world_size}
    if kind == "plan":
        info.update(hash=obj.tile_plan.content_hash()[:16], structure=obj.tile_plan.meta.get("structure"),
                    method=obj.tile_plan.method)
        res = obj.planner_result
        if res is not None:
            from ultraattn.report.plan_report import comparison

            info["comparison"] = comparison(res)
    else:
        info.update(hash="kernels", structure=repr(obj))
    PLANS[spec.name] = info
    if opts.report != "off":
        from ultraattn.passes.report import report_console

        console = report_console()
        console.print(f"[bold]ultraattn[/bold] {spec.name}: planned in {seconds:.2f} s "
                      f"({info['structure']}, plan {info['hash']}, {opts.world_size} ranks)")
        if opts.report == "full" and kind == "plan" and obj.planner_result is not None:
            from ultraattn.planner.plan import Mesh
            from ultraattn.report.plan_report import print_plan_result

            m = obj.tile_plan.mesh
            print_plan_result(console, obj.planner_result, Mesh(nodes=m.nodes, devices=m.devices),
                              title=f"{spec.name} · run-time plan")
    if opts.report_file:
        from ultraattn.passes.report import save_report

        save_report(opts.report_file)


def _put(spec: SiteSpec, state) -> int:
    with _LOCK:
        ticket = next(_TICKETS)
        spec.pending[ticket] = state
        spec.order.append(ticket)
        while len(spec.order) > MAX_PENDING:
            spec.pending.pop(spec.order.popleft(), None)
    return ticket


def _take(spec: SiteSpec, ticket: int):
    with _LOCK:
        state = spec.pending.pop(ticket, None)
        try:
            spec.order.remove(ticket)
        except ValueError:
            pass
    if state is None:
        raise state_gone(spec)
    return state


def state_gone(spec: SiteSpec) -> RuntimeError:
    """The error when a backward finds no state of its forward (also for explicit graphs' stash)."""
    return RuntimeError(
        f"ultraattn site {spec.name}: the backward's forward state is gone (more than {MAX_PENDING} forwards "
        f"of this attention ran before its backward, or backward ran twice); raise "
        f"ultraattn.passes.site_op.MAX_PENDING or call backward sooner"
    )


def kernel_site_backward(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor, dlse: Tensor,
                         lay: tuple[Tensor, ...], q_block: int, kv_block: int, scale: float):
    """World-1 gradients on the block-sparse kernel op (delta from out and dout, dLSE folded in by the op)."""
    dout = dout.to(out.dtype)
    delta = (dout.float() * out.float()).sum(-1)
    return torch.ops.ultraattn.bsa_bwd(q, k, v, dout, lse, delta, dlse.float(), *lay, q_block, kv_block, scale)


@custom_op("ultraattn::site_attention", mutates_args=())
def site_attention(q: Tensor, k: Tensor, v: Tensor, mask_tensors: list[Tensor], site: str, after: Tensor | None = None) -> tuple[Tensor, Tensor,
                                                                                                    Tensor]:
    """Attention of one rewritten site on the full-sequence q, k, v: (out, lse fp32, ticket int64)."""
    spec = SITES[site]
    spec.stats["calls"] += 1
    if spec.options.debug and spec.options.world_size > 1:
        _check_same_inputs(spec, (q, k, v, *mask_tensors))
    kind, runner = _runner(spec, q, k, mask_tensors)
    # Custom-op bodies run below autograd, so the state for the backward is kept explicitly.
    if kind == "kernels":
        out, lse = torch.ops.ultraattn.bsa_fwd(q, k, v, *runner.bwd_tensors(), runner.q_block, runner.kv_block,
                                               spec.scale)
        # q, k, v, out, lse belong to the compiled graph (Inductor may reuse their buffers once it
        # thinks they are dead): the backward op receives them as saved activations instead.
        state = (kind, runner, None, None, None, None, None, None)
    else:
        from ultraattn.runtime.api import _gather, check_consistent, dispatch

        check_consistent(runner)
        ql, kl, vl = (dispatch(x, runner) for x in (q, k, v))
        out_l, lse_l, saved = runner.executor.forward(ql, kl, vl, spec.scale)
        out_l = out_l.to(q.dtype)
        out, lse = _gather(out_l, runner, 2), _gather(lse_l, runner, 2)
        state = (kind, runner, ql, kl, vl, out_l, lse_l, saved)
    ticket = _put(spec, state)
    return out.contiguous(), lse.contiguous(), torch.tensor(ticket, dtype=torch.int64)


def _site_fake(q, k, v, mask_tensors, site, after=None):
    """out like q, lse fp32 [B, H, S], the ticket (a cpu int64 scalar): global or local alike."""
    B, H, S, _ = q.shape
    return q.new_empty(q.shape), q.new_empty(B, H, S, dtype=torch.float32), torch.empty((), dtype=torch.int64,
                                                                                         device="cpu")


site_attention.register_fake(_site_fake)


@custom_op("ultraattn::site_attention_bwd", mutates_args=())
def site_attention_bwd(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor, dlse: Tensor,
                       ticket: Tensor, site: str, after: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of ``site_attention`` for the full-sequence q, k, v (identical on every rank)."""
    spec = SITES[site]
    kind, runner, ql, kl, vl, out_l, lse_l, saved = _take(spec, int(ticket))
    if kind == "kernels":
        dq, dk, dv = kernel_site_backward(q, k, v, out, lse, dout, dlse, runner.bwd_tensors(), runner.q_block,
                                          runner.kv_block, spec.scale)
    else:
        from ultraattn.runtime.api import _gather, dispatch

        do_l = dispatch(dout.to(out_l.dtype), runner)
        dl_l = dispatch(dlse.float(), runner)
        dq, dk, dv = runner.executor.backward(ql, kl, vl, out_l, lse_l, saved, do_l, dl_l, spec.scale)
        dq, dk, dv = (_gather(g, runner, 2) for g in (dq, dk, dv))
    # contiguous, like the fake kernel says (Inductor checks strides)
    return tuple(x.new_zeros(x.shape) if g is None else g.to(x.dtype).contiguous() for g, x in zip((dq, dk, dv),
                                                                                                   (q, k, v)))


@site_attention_bwd.register_fake
def _(q, k, v, out, lse, dout, dlse, ticket, site, after=None):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


# ----------------------------------------------------------------------------- on local tokens
def _global_shapes(spec: SiteSpec, q: Tensor):
    from types import SimpleNamespace

    return (SimpleNamespace(shape=tuple(sh), dtype=q.dtype, device=q.device) for sh in (spec.q_shape, spec.kv_shape))


@custom_op("ultraattn::site_attention_local", mutates_args=())
def site_attention_local(q: Tensor, k: Tensor, v: Tensor, mask_tensors: list[Tensor], site: str, after: Tensor | None = None
                         ) -> tuple[Tensor, Tensor, Tensor]:
    """A site of a sequence-sharded graph: this rank's tokens of q, k, v (the graph's layout) in, this rank's
    tokens of (out, lse fp32) out, plus the ticket of the state its backward needs. No dispatch, no gather:
    the tokens stay where the plan (made in the graph's layout) keeps them."""
    spec = SITES[site]
    spec.stats["calls"] += 1
    if spec.options.debug and spec.options.world_size > 1:
        _check_same_inputs(spec, list(mask_tensors))  # q, k, v differ per rank by design
    kind, runner = _runner(spec, *_global_shapes(spec, q), mask_tensors)
    from ultraattn.runtime.api import check_consistent

    check_consistent(runner)
    out_l, lse_l, saved = runner.executor.forward(q, k, v, spec.scale)
    # q, k, v, out, lse come back to the backward as saved activations (the graph owns their buffers);
    # the units received from other ranks stay here
    ticket = _put(spec, (kind, runner, None, None, None, None, None, saved))
    return out_l.to(q.dtype).contiguous(), lse_l.contiguous(), torch.tensor(ticket, dtype=torch.int64)


site_attention_local.register_fake(_site_fake)


@custom_op("ultraattn::site_attention_local_bwd", mutates_args=())
def site_attention_local_bwd(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor, dlse: Tensor,
                             ticket: Tensor, site: str, after: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of ``site_attention_local``: this rank's tokens of dq, dk, dv."""
    spec = SITES[site]
    _kind, runner, *_unused, saved = _take(spec, int(ticket))
    dq, dk, dv = runner.executor.backward(q, k, v, out, lse, saved, dout.to(out.dtype), dlse.float(), spec.scale)
    return tuple(x.new_zeros(x.shape) if g is None else g.to(x.dtype).contiguous() for g, x in zip((dq, dk, dv),
                                                                                                   (q, k, v)))


@site_attention_local_bwd.register_fake
def _(q, k, v, out, lse, dout, dlse, ticket, site, after=None):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _backward_local(ctx, dout, dlse, _dticket):
    q, k, v, out, lse, ticket = ctx.saved_tensors
    dq, dk, dv = torch.ops.ultraattn.site_attention_local_bwd(q, k, v, out, lse, dout, dlse, ticket, ctx.site)
    return dq, dk, dv, [None] * ctx.n_mask, None


def _setup(ctx, inputs, output):
    q, k, v, mask_tensors, site = inputs[:5]  # (``after``: never passed where autograd applies, see seq_ops)
    ctx.site = site
    ctx.n_mask = len(mask_tensors)
    ctx.save_for_backward(q, k, v, output[0], output[1], output[2])


def _backward(ctx, dout, dlse, _dticket):
    q, k, v, out, lse, ticket = ctx.saved_tensors
    dq, dk, dv = torch.ops.ultraattn.site_attention_bwd(q, k, v, out, lse, dout, dlse, ticket, ctx.site)
    return dq, dk, dv, [None] * ctx.n_mask, None


site_attention.register_autograd(_backward, setup_context=_setup)
site_attention_local.register_autograd(_backward_local, setup_context=_setup)
