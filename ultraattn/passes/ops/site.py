"""The ops a rewritten attention site calls: ``ultraattn::site_attention`` (global view) and
``ultraattn::site_attention_local`` (a sequence-sharded graph's local tokens), each with a backward op.

Global view: ``site_attention`` takes the full-sequence q, k, v every rank holds, runs this
rank's share by the plan (``dispatch`` -> executor) and all-gathers out and lse; its backward
slices the replicated dout/dlse, runs the plan's backward and all-gathers dq, dk, dv, so every
rank holds exactly the single-device gradients. At world size 1 the site runs the block-sparse
kernels alone.

Local tokens: ``site_attention_local`` takes and returns this rank's tokens in the graph's
layout; no dispatch, no gather.

The site's static description and run-time state are in the side table under the ``site`` key
(``passes/state.py``); the mask's content arrives as ``mask_tensors``, followed by a flex site's score_mod
buffers (``SiteSpec.split_inputs``). The backward ops take those buffers as ``score`` and return, after dq,
dk, dv, the gradient of each buffer that wants one (``SiteSpec.score_wanted``), summed over the ranks: the
buffers are replicated, like a weight.

State between a forward and its backward (what the runtime received from other ranks) is kept in the
site's stash under an int64 ticket the forward returns: custom-op bodies run below autograd, so that
state cannot ride on the autograd graph; the ticket is an ordinary saved activation for AOT autograd.

``after`` (data never read): orders a communicating call after another one in graphs AOT
autograd made (``explicit/order.py``).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.library import custom_op

from ultraattn.kernels import BlockLists
from ultraattn.kernels.block_lists import dense_block_kinds
from ultraattn.kernels.reference import softmax_delta
from ultraattn.passes.site import check_same_inputs, global_shapes, runner_for
from ultraattn.passes.state import side_table
from ultraattn.runtime.api import check_consistent
from ultraattn.runtime.tokens import dispatch, gather_tokens


def kernel_site_backward(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor, dlse: Tensor,
                         lists: list[Tensor] | tuple[Tensor, ...], q_block: int, kv_block: int, scale: float):
    """World-1 gradients on the block-sparse kernel op (delta from out and dout; the op folds dLSE in)."""
    dout = dout.to(out.dtype)
    delta = softmax_delta(out, dout)
    return torch.ops.ultraattn.bsa_bwd(q, k, v, dout, lse, delta, dlse.float(), *lists, q_block, kv_block, scale)


def _grads_like(grads, inputs) -> list[Tensor]:
    """Each gradient in its input's dtype, contiguous like the fake kernel says (Inductor checks strides);
    zeros where a rank computed none."""
    return [x.new_zeros(x.shape) if g is None else g.to(x.dtype).contiguous() for g, x in zip(grads, inputs,
                                                                                               strict=True)]


def _wanted(spec, score: list[Tensor]) -> list[Tensor]:
    """The score_mod buffers whose gradients the backward returns."""
    return [score[n] for n in spec.score_wanted]


@custom_op("ultraattn::int_tensor", mutates_args=())
def int_tensor(x: int) -> Tensor:
    """A mask_mod's int input (a SymInt in the graph) as the 0-d int64 CPU tensor the site op takes. An op, not
    ``aten.scalar_tensor``: Inductor would generate a host (C++) kernel for that in a CUDA graph, at a compiler
    run's cost on the first step (``ultraattn::cp_token`` says how much that was)."""
    return torch.tensor(x, dtype=torch.int64)


@int_tensor.register_fake
def _(x):
    return torch.empty((), dtype=torch.int64)


@custom_op("ultraattn::float_tensor", mutates_args=())
def float_tensor(x: float) -> Tensor:
    """A mask_mod's float input as a 0-d float64 CPU tensor (``int_tensor``'s reason)."""
    return torch.tensor(x, dtype=torch.float64)


@float_tensor.register_fake
def _(x):
    return torch.empty((), dtype=torch.float64)


@custom_op("ultraattn::mask_block_kinds", mutates_args=())
def mask_block_kinds(mask: Tensor, block: int) -> Tensor:
    """A boolean mask's block table (int8 EMPTY / PARTIAL / FULL per block of every batch entry and head,
    ``kernels.block_lists.dense_block_kinds``), reduced where the mask lives and brought to the host: the one
    device-to-host transfer a run-time boolean mask costs per step, of (S / block)^2 bytes, computed once in the
    graph for every site that reads the mask (``rewrite.py``)."""
    return dense_block_kinds(mask, block, block).cpu()


@mask_block_kinds.register_fake
def _(mask, block):
    *lead, q, k = mask.shape
    lead = ([1] * (2 - len(lead)) + list(lead))[-2:] if len(lead) < 2 else list(lead)
    return torch.empty(*lead, -(-q // block), -(-k // block), dtype=torch.int8, device="cpu")


@custom_op("ultraattn::site_attention", mutates_args=())
def site_attention(q: Tensor, k: Tensor, v: Tensor, mask_tensors: list[Tensor], site: str,
                   after: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Attention of one rewritten site on the full-sequence q, k, v: (out, lse fp32, ticket int64)."""
    state = side_table().site(site)
    state.calls += 1
    spec = state.spec
    if spec.options.debug and spec.options.world_size > 1:
        check_same_inputs(state, (q, k, v, *mask_tensors))
    mask_tensors, score = spec.split_inputs(mask_tensors)
    runner = runner_for(state, tuple(q.shape), tuple(k.shape), q.dtype, q.device, mask_tensors)
    if isinstance(runner, BlockLists):
        out, lse = torch.ops.ultraattn.bsa_fwd(q, k, v, *runner.bwd_tensors(), runner.q_block, runner.kv_block,
                                               spec.scale)
        # q, k, v, out, lse belong to the compiled graph (Inductor may reuse their buffers once it thinks they
        # are dead): the backward op receives them as saved activations instead
        ticket = state.put_state((runner, None))
    else:
        check_consistent(runner)
        ql, kl, vl = (dispatch(x, runner) for x in (q, k, v))
        out_l, lse_l, saved = runner.executor.forward(ql, kl, vl, spec.scale, score)
        out_l = out_l.to(q.dtype)
        out, lse = gather_tokens(out_l, runner), gather_tokens(lse_l, runner)
        ticket = state.put_state((runner, (ql, kl, vl, out_l, lse_l, saved)))
    return out.contiguous(), lse.contiguous(), torch.tensor(ticket, dtype=torch.int64)


def _site_fake(q, k, v, mask_tensors, site, after=None):
    """out like q, lse fp32 [B, H, S], the ticket (a cpu int64 scalar): global or local alike."""
    B, H, S, _ = q.shape
    return (q.new_empty(q.shape), q.new_empty(B, H, S, dtype=torch.float32),
            torch.empty((), dtype=torch.int64, device="cpu"))


site_attention.register_fake(_site_fake)


@custom_op("ultraattn::site_attention_bwd", mutates_args=())
def site_attention_bwd(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor, dlse: Tensor,
                       ticket: Tensor, score: list[Tensor], site: str, after: Tensor | None = None) -> list[Tensor]:
    """Gradients of ``site_attention`` for the full-sequence q, k, v (identical on every rank), then the score_mod
    buffers' (module docstring)."""
    state = side_table().site(site)
    runner, fwd = state.take_state(int(ticket))
    spec = state.spec
    if fwd is None:  # world size 1: the kernels
        grads = kernel_site_backward(q, k, v, out, lse, dout, dlse, runner.bwd_tensors(), runner.q_block,
                                     runner.kv_block, spec.scale)
    else:
        ql, kl, vl, out_l, lse_l, saved = fwd
        do_l = dispatch(dout.to(out_l.dtype), runner)
        dl_l = dispatch(dlse.float(), runner)
        *grads, dscore = runner.executor.backward(ql, kl, vl, out_l, lse_l, saved, do_l, dl_l, spec.scale,
                                                  list(score))
        grads = [gather_tokens(g, runner) for g in grads] + dscore
    return _grads_like(grads, (q, k, v, *_wanted(spec, score)))


def _grads_fake(q, k, v, out, lse, dout, dlse, ticket, score, site, after=None):
    spec = side_table().site(site).spec
    return [x.new_empty(x.shape) for x in (q, k, v, *_wanted(spec, score))]


site_attention_bwd.register_fake(_grads_fake)


@custom_op("ultraattn::site_attention_local", mutates_args=())
def site_attention_local(q: Tensor, k: Tensor, v: Tensor, mask_tensors: list[Tensor], site: str,
                         after: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """A site of a sequence-sharded graph: this rank's tokens of q, k, v (the graph's layout) in, this rank's
    tokens of (out, lse fp32) out, plus the ticket of the state its backward needs. No dispatch, no gather:
    the tokens stay where the plan (made in the graph's layout) keeps them."""
    state = side_table().site(site)
    state.calls += 1
    spec = state.spec
    if spec.options.debug and spec.options.world_size > 1:
        check_same_inputs(state, list(mask_tensors))  # q, k, v differ per rank by design
    mask_tensors, score = spec.split_inputs(mask_tensors)
    runner = runner_for(state, *global_shapes(spec), q.dtype, q.device, mask_tensors)
    check_consistent(runner)
    out_l, lse_l, saved = runner.executor.forward(q, k, v, spec.scale, score)
    # q, k, v, out, lse come back to the backward as saved activations (the graph owns their buffers);
    # the units received from other ranks stay here
    ticket = state.put_state((runner, saved))
    return out_l.to(q.dtype).contiguous(), lse_l.contiguous(), torch.tensor(ticket, dtype=torch.int64)


site_attention_local.register_fake(_site_fake)


@custom_op("ultraattn::site_attention_local_bwd", mutates_args=())
def site_attention_local_bwd(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor,
                             dlse: Tensor, ticket: Tensor, score: list[Tensor], site: str,
                             after: Tensor | None = None) -> list[Tensor]:
    """Gradients of ``site_attention_local``: this rank's tokens of dq, dk, dv, then the score_mod buffers'
    (summed over the ranks)."""
    state = side_table().site(site)
    runner, saved = state.take_state(int(ticket))
    grads = runner.executor.backward(q, k, v, out, lse, saved, dout.to(out.dtype), dlse.float(), state.spec.scale,
                                     list(score))
    return _grads_like([*grads[:3], *grads[3]], (q, k, v, *_wanted(state.spec, score)))


site_attention_local_bwd.register_fake(_grads_fake)


# ----------------------------------------------------------------------------- autograd
def _setup(ctx, inputs, output):
    q, k, v, mask_tensors, site = inputs[:5]  # (``after``: never passed where autograd applies, see ops/seq.py)
    ctx.site = site
    ctx.n_mask = len(mask_tensors)
    _mask, score = side_table().site(site).spec.split_inputs(mask_tensors)
    ctx.n_score = len(score)
    ctx.save_for_backward(q, k, v, output[0], output[1], output[2], *score)


def _backward_with(op):
    def backward(ctx, dout, dlse, _dticket):
        q, k, v, out, lse, ticket, *score = ctx.saved_tensors
        dq, dk, dv, *dscore = op(q, k, v, out, lse, dout, dlse, ticket, score, ctx.site)
        per_tensor: list[Tensor | None] = [None] * ctx.n_mask
        first = ctx.n_mask - ctx.n_score
        for n, g in zip(side_table().site(ctx.site).spec.score_wanted, dscore, strict=True):
            per_tensor[first + n] = g
        return dq, dk, dv, per_tensor, None

    return backward


site_attention.register_autograd(_backward_with(torch.ops.ultraattn.site_attention_bwd), setup_context=_setup)
site_attention_local.register_autograd(_backward_with(torch.ops.ultraattn.site_attention_local_bwd),
                                       setup_context=_setup)

SITE_OPS = (torch.ops.ultraattn.site_attention.default, torch.ops.ultraattn.site_attention_local.default)
SITE_BWD_OPS = (torch.ops.ultraattn.site_attention_bwd.default, torch.ops.ultraattn.site_attention_local_bwd.default)
LOCAL_OPS = (torch.ops.ultraattn.site_attention_local.default, torch.ops.ultraattn.site_attention_local_bwd.default)
