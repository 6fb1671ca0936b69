"""The ops a sequence-sharded graph calls to move data between the global view and this rank's tokens.

Each op names a layout by a string key (the side table's ``layouts``: a ``runtime.sequence.SequenceShards`` per
token layout and group, shared by the graphs of a run) and, where a dimension carries the sequence, that
dimension, the coordinate's ``length`` and the ``inner`` elements per position (``runtime/sequence.py``).

Gradient invariant (what makes every rank's gradients the single-device ones):

* a replicated tensor has the same gradient on every rank;
* a sharded tensor's gradient holds this rank's tokens.

So each op's backward is its dual:

    sp_dispatch   global -> local (slices)        backward: sp_gather (all-gather the local grads)
    sp_gather     local -> global (all-gather)    backward: sp_dispatch_grad (this rank's slice, zeros at
                                                            the padding)
    sp_all_reduce partial sums -> total           backward: identity (each partial's grad is the total's)
    sp_enter      a replicated weight enters      backward: sp_all_reduce (each rank's tokens contribute
                  sharded ops (identity)                    a part of the weight's gradient)

``sp_enter`` is an ``autograd.Function`` around a view, so the forward graph Inductor receives
holds no copy of the weight; only its backward calls the all-reduce op.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.library import custom_op

from ultraattn.passes.state import side_table


def _shards(key: str):
    return side_table().layout(key)


def _local_size(size: int, key: str, length: int, inner: int) -> int:
    return size // (length * inner) * _shards(key).local_len * inner


def _global_size(size: int, key: str, length: int, inner: int) -> int:
    return size // (_shards(key).local_len * inner) * length * inner


@custom_op("ultraattn::sp_dispatch", mutates_args=())
def sp_dispatch(x: Tensor, key: str, dim: int, length: int, inner: int, check: str) -> Tensor:
    """This rank's tokens of the global ``x`` (its ``dim`` carries ``length`` positions).

    ``check`` (the ``debug`` option): the input's name; every rank must hold the same ``x``."""
    if check:
        _shards(key).check_same(x, check)
    return _shards(key).shard(x, dim, length, inner).contiguous()


@sp_dispatch.register_fake
def _(x, key, dim, length, inner, check):
    shape = list(x.shape)
    shape[dim] = _local_size(shape[dim], key, length, inner)
    return x.new_empty(shape)


@custom_op("ultraattn::sp_dispatch_grad", mutates_args=())
def sp_dispatch_grad(g: Tensor, key: str, dim: int, length: int, inner: int) -> Tensor:
    """``sp_gather``'s backward: this rank's part of the global gradient ``g``, zeros at the padding (a position
    past ``length`` is no output: its gradient is 0, not a copy of the last position's as ``sp_dispatch`` pads
    values)."""
    return _shards(key).shard(g, dim, length, inner, zero_pad=True).contiguous()


@sp_dispatch_grad.register_fake
def _(g, key, dim, length, inner):
    shape = list(g.shape)
    shape[dim] = _local_size(shape[dim], key, length, inner)
    return g.new_empty(shape)


@custom_op("ultraattn::sp_gather", mutates_args=())
def sp_gather(x: Tensor, key: str, dim: int, length: int, inner: int, after: Tensor | None = None) -> Tensor:
    """The global tensor from every rank's local ``x`` (an all-gather), positions past ``length`` dropped.

    ``after`` (unused data): orders this collective after another (``explicit/order.py``)."""
    return _shards(key).gather(x, dim, length, inner).contiguous()


@sp_gather.register_fake
def _(x, key, dim, length, inner, after=None):
    shape = list(x.shape)
    shape[dim] = _global_size(shape[dim], key, length, inner)
    return x.new_empty(shape)


# [Note] ``after`` is only ever set by ``explicit/order.py`` in the graphs AOT autograd has already made,
# never in a differentiated call, and the autograd wrapper expects gradient slots for the arguments a call
# passed: so the backward formulas have none for it.
def _dispatch_bwd(ctx, g):
    return torch.ops.ultraattn.sp_gather(g, ctx.key, ctx.dim, ctx.length, ctx.inner), None, None, None, None, None


def _gather_bwd(ctx, g):
    return torch.ops.ultraattn.sp_dispatch_grad(g, ctx.key, ctx.dim, ctx.length, ctx.inner), None, None, None, None


def _keep_args(ctx, inputs, output):
    _x, ctx.key, ctx.dim, ctx.length, ctx.inner = inputs[:5]


sp_dispatch.register_autograd(_dispatch_bwd, setup_context=_keep_args)
sp_gather.register_autograd(_gather_bwd, setup_context=_keep_args)
sp_dispatch_grad.register_autograd(_dispatch_bwd, setup_context=_keep_args)


@custom_op("ultraattn::sp_all_reduce", mutates_args=())
def sp_all_reduce(x: Tensor, key: str, after: Tensor | None = None) -> Tensor:
    """Sum of ``x`` over the layout's ranks (partial sums of a reduction over the sequence)."""
    return _shards(key).all_reduce(x)


@sp_all_reduce.register_fake
def _(x, key, after=None):
    return torch.empty_like(x)


def _all_reduce_bwd(ctx, g):
    return g, None


sp_all_reduce.register_autograd(_all_reduce_bwd, setup_context=lambda ctx, inputs, output: None)


@custom_op("ultraattn::sp_weight_grad", mutates_args=())
def sp_weight_grad(g: Tensor, key: str, after: Tensor | None = None) -> Tensor:
    """A replicated weight's gradient: the sum of every rank's part (``sp_enter``'s backward)."""
    return _shards(key).all_reduce(g)


@sp_weight_grad.register_fake
def _(g, key, after=None):
    return torch.empty_like(g)


class _Enter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, key: str) -> Tensor:
        ctx.key = key
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: Tensor):
        return torch.ops.ultraattn.sp_weight_grad(g.contiguous(), ctx.key), None


def sp_enter(x: Tensor, key: str) -> Tensor:
    """A replicated tensor (a weight) used by sharded ops: identity forward, summed gradient backward."""
    return _Enter.apply(x, key)


@custom_op("ultraattn::sp_valid", mutates_args=())
def sp_valid(key: str, length: int, device: torch.device) -> Tensor:
    """bool [local_len]: which of this rank's tokens are real positions of a ``length``-token coordinate."""
    return _shards(key).valid(length, device)


@sp_valid.register_fake
def _(key, length, device):
    return torch.empty(_shards(key).local_len, dtype=torch.bool, device=device)
