"""``ultraattn::kept_flex`` and its backward: a kept flex_attention site run by PyTorch's eager flex_attention.

Why and where: ``passes/kept.py``. The forward calls the flex_attention higher-order op eagerly. The backward
recomputes that forward with autograd on and differentiates it (``torch.autograd.grad``): the same gradients
as eager PyTorch, for q, k, v and the score_mod's floating-point buffers, at the cost of a second forward.
Both run inside a compiled graph's op call, below autograd, so they take eager dispatch back first
(``ultraattn.eager``).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.library import custom_op

from ultraattn.eager import eager_dispatch
from ultraattn.passes.state import side_table


@custom_op("ultraattn::kept_flex", mutates_args=())
def kept_flex(q: Tensor, k: Tensor, v: Tensor, tensors: list[Tensor], key: str) -> tuple[Tensor, Tensor, Tensor]:
    """(out, lse in log2 units, max) of the kept site ``key`` (flex_attention's own outputs)."""
    with eager_dispatch(), torch.no_grad():
        out, lse, mx = side_table().kept_site(key).call(q, k, v, tensors)
    return out.contiguous(), lse.contiguous(), mx.contiguous()


@kept_flex.register_fake
def _(q, k, v, tensors, key):
    B, H, S, _ = q.shape
    return (q.new_empty(B, H, S, v.shape[-1]), q.new_empty(B, H, S, dtype=torch.float32),
            q.new_empty(B, H, S, dtype=torch.float32))


@custom_op("ultraattn::kept_flex_bwd", mutates_args=())
def kept_flex_bwd(q: Tensor, k: Tensor, v: Tensor, tensors: list[Tensor], dout: Tensor, dlse: Tensor,
                  key: str) -> list[Tensor]:
    """[dq, dk, dv, then one gradient per ``KeptFlex.grad_slots``] of the kept site ``key``."""
    kept = side_table().kept_site(key)
    with eager_dispatch(), torch.enable_grad():
        qkv = [x.detach().requires_grad_() for x in (q, k, v)]
        tens = [t.detach() for t in tensors]
        for i in kept.grad_slots:
            tens[i].requires_grad_()
        out, lse, _ = kept.call(*qkv, tens)
        wrt = qkv + [tens[i] for i in kept.grad_slots]
        grads = torch.autograd.grad((out, lse), wrt, (dout.to(out.dtype), dlse.to(lse.dtype)), allow_unused=True)
    return [torch.zeros_like(x) if g is None else g.to(x.dtype).contiguous() for g, x in zip(grads, wrt)]


@kept_flex_bwd.register_fake
def _(q, k, v, tensors, dout, dlse, key):
    grad_slots = side_table().kept_site(key).grad_slots
    return [x.new_empty(x.shape) for x in (q, k, v, *(tensors[i] for i in grad_slots))]


def _setup(ctx, inputs, output):
    q, k, v, tensors, key = inputs
    ctx.key, ctx.n = key, len(tensors)
    ctx.save_for_backward(q, k, v, *tensors)


def _backward(ctx, dout, dlse, _dmax):
    q, k, v, *tensors = ctx.saved_tensors
    dout = q.new_zeros(*q.shape[:-1], v.shape[-1]) if dout is None else dout
    dlse = q.new_zeros(q.shape[:-1], dtype=torch.float32) if dlse is None else dlse
    dq, dk, dv, *rest = torch.ops.ultraattn.kept_flex_bwd(q, k, v, tensors, dout, dlse, ctx.key)
    per_tensor: list[Tensor | None] = [None] * ctx.n
    for i, g in zip(side_table().kept_site(ctx.key).grad_slots, rest):
        per_tensor[i] = g
    return dq, dk, dv, per_tensor, None


kept_flex.register_autograd(_backward, setup_context=_setup)
