"""``SeqShard``: how this rank's tokens travel between compiled regions, and into eager code.

A sequence-sharded graph computes each activation on this rank's tokens only. What it returns for an output that
carries the sequence (``options["outputs"] = "sharded"``, the default) is a ``SeqShard``: a tensor with the
**global** shape whose data is this rank's shard (``local``), in a token layout named by a key of the side
table's layouts. Three things meet one:

* **another ultraattn graph** (the next block of a model compiled block by block): Dynamo traces the block's code
  with the global shape (a RoPE table sized for the whole sequence still lines up), and the backend sees the
  input arrive already sharded in that layout (``passes/backend.py``): the graph takes the local tensor as it
  is, so consecutive regions hand shards to each other with no communication;
* **eager code** (torchtitan's final norm, output projection and loss after the last block): any op on a
  ``SeqShard`` runs on the exact global value, all-gathered once on first use and kept; the op's result is an
  ordinary tensor. Autograd works at the ``SeqShard`` level, so the global gradient such an op produces reaches
  the graph that returned the shard as this rank's slice of it (``from_local``'s backward);
* **anything else that traces** (another backend, AOT autograd): the gather is the traceable op
  ``ultraattn::sp_gather``, so a trace records it and computes the global value at run time.

Ops that are exact on the shard itself stay local and return a ``SeqShard``: pointwise ops over two or more shards
of the same layout and shape and nothing else but numbers (gradient accumulation of two shards), ``detach`` and
aliases. A pointwise op over one shard (``x.pow(2)``) runs on the global value: the shard it would return would
need a gather of its own the moment a non-pointwise op (``mean``) meets it, where the global value of ``x`` is
gathered once for all of them. A pointwise in-place op on such shards updates the local tensor; any other
in-place op on a shard is an error naming the fix (running it on a gathered copy would lose the write).

Why a tensor subclass of our own, not DTensor. The token layouts ultraattn plans are a permutation of the
sequence (head-tail chunks, stripes, a plan's own owners) plus padding at the tail. A DTensor ``Shard(seq_dim)``
of the permuted, padded sequence would be understood by eager ops as the permuted, padded sequence: a ``cumsum``,
a ``logits[:, :-1]`` or a loss over it would compute silently wrong values, and DTensor's redistribute to
``Replicate`` would return the permuted order. A ``SeqShard`` knows its permutation and length, so every op that
needs the global view gets it exactly, and Dynamo, which traces traceable wrapper subclasses
(``__tensor_flatten__`` / ``__tensor_unflatten__``), guards on the layout key like it guards on a DTensor's spec.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._pytree import tree_flatten, tree_map

from ultraattn.passes.state import side_table


@dataclass(frozen=True)
class Carried:
    """Where a ``SeqShard``'s tokens live: the layout (a side-table key) and the dim that carries the sequence
    (``runtime/sequence.py``: ``outer * length * inner`` elements globally)."""

    key: str
    dim: int
    length: int
    inner: int = 1

    def global_shape(self, local_shape) -> tuple[int, ...]:
        shape = list(local_shape)
        local_len = side_table().layout(self.key).local_len
        shape[self.dim] = shape[self.dim] // (local_len * self.inner) * self.length * self.inner
        return tuple(shape)


def _real(t: Tensor) -> bool:
    return type(t) is torch.Tensor and not isinstance(t, FakeTensor)


_ALIASES = {torch.ops.aten.detach.default, torch.ops.aten.alias.default}


class SeqShard(torch.Tensor):
    """This rank's tokens of a global tensor (module docstring). Build one with ``SeqShard.from_local``."""

    _local: Tensor
    _carried: Carried
    _ultraattn_carrier = True  # (what ``ultraattn.undispatch`` looks for: the runtime layer cannot import this)

    @staticmethod
    def __new__(cls, local: Tensor, carried: Carried, shape=None, cache=None):
        shape = carried.global_shape(local.shape) if shape is None else shape
        r = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=local.dtype, device=local.device)
        r._local = local
        r._carried = carried
        r._cache = [None] if cache is None else cache
        """The gathered global value, shared by this shard's aliases (``detach``, autograd's saved copies)."""
        return r

    __torch_function__ = torch._C._disabled_torch_function_impl

    # ------------------------------------------------------------------ Dynamo: a traceable wrapper subclass
    def __tensor_flatten__(self):
        return ["_local"], self._carried

    @staticmethod
    def __tensor_unflatten__(inner, carried, outer_size, outer_stride):
        return SeqShard(inner["_local"], carried, tuple(outer_size))

    # ------------------------------------------------------------------ the three views
    @staticmethod
    def from_local(local: Tensor, carried: Carried) -> SeqShard:
        """A shard from this rank's tokens (differentiable: the gradient comes back as this rank's part)."""
        return _FromLocal.apply(local, carried)

    def to_local(self) -> Tensor:
        """This rank's tokens (differentiable: their gradient is this shard's)."""
        return _ToLocal.apply(self)

    def full_tensor(self) -> Tensor:
        """The global value, an ordinary tensor (differentiable: the backward takes this rank's slice)."""
        return _Full.apply(self)

    def _gathered(self) -> Tensor:
        """The global value (no autograd); gathered once and kept when it holds data, traced otherwise."""
        if self._cache[0] is not None:
            return self._cache[0]
        c = self._carried
        g = torch.ops.ultraattn.sp_gather(self._local, c.key, c.dim, c.length, c.inner)
        if _real(self._local):
            self._cache[0] = g
        return g

    # ------------------------------------------------------------------ eager ops
    @classmethod
    @torch._disable_dynamo  # (as DTensor's: Dynamo records the op on the shard, it does not trace this)
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat, _ = tree_flatten((args, kwargs))
        shards = [a for a in flat if isinstance(a, SeqShard)]
        first = shards[0]
        if func in _ALIASES:
            return SeqShard(func(first._local), first._carried, tuple(first.shape), cache=first._cache)
        local_ok = all(s._carried == first._carried and s.shape == first.shape and _real(s._local) for s in shards) \
            and not any(isinstance(a, Tensor) and not isinstance(a, SeqShard) and a.dim() > 0 for a in flat)
        pointwise = torch.Tag.pointwise in func.tags
        if func._schema.is_mutable:
            if pointwise and local_ok and isinstance(args[0], SeqShard):
                func(*tree_map(_local_of, args), **tree_map(_local_of, kwargs))
                args[0]._cache[0] = None
                return args[0]
            raise RuntimeError(
                f"ultraattn: the in-place op {func} received a tensor an ultraattn graph returned sharded (a SeqShard "
                f"holding this rank's tokens of a {tuple(first.shape)} tensor); an in-place write to its gathered "
                f"copy would be lost. Write it out of place (x = x + y instead of x += y), or gather it first: "
                f"x = ultraattn.undispatch(x)")
        if pointwise and local_ok and len({id(s._local) for s in shards}) > 1:  # (same shapes: no broadcast)
            out = func(*tree_map(_local_of, args), **tree_map(_local_of, kwargs))
            return SeqShard(out, first._carried, tuple(first.shape))
        return func(*tree_map(_global_of, args), **tree_map(_global_of, kwargs))

    # ------------------------------------------------------------------ what does not dispatch
    def tolist(self):
        return self._gathered().tolist()

    def numpy(self, *args, **kwargs):
        return self._gathered().numpy(*args, **kwargs)

    def __reduce_ex__(self, protocol):  # torch.save / pickle: the global value
        return self._gathered().detach().__reduce_ex__(protocol)

    def __deepcopy__(self, memo):
        return self._gathered().detach().clone()

    def __repr__(self, *, tensor_contents=None) -> str:
        c = self._carried
        return (f"SeqShard(global shape {tuple(self.shape)}, this rank's {tuple(self._local.shape)}, sequence dim "
                f"{c.dim}, layout {c.key!r})")


def _local_of(x):
    return x._local if isinstance(x, SeqShard) else x


def _global_of(x):
    return x._gathered() if isinstance(x, SeqShard) else x


def local_grad(g: Tensor, carried: Carried) -> Tensor:
    """This rank's part of a gradient that arrives for a ``SeqShard``: a shard's own local tensor, or the slice of
    a global one (zeros at the padding)."""
    if isinstance(g, SeqShard) and g._carried == carried:
        return g._local
    if isinstance(g, SeqShard):
        g = g._gathered()
    c = carried
    return torch.ops.ultraattn.sp_dispatch_grad(g.contiguous(), c.key, c.dim, c.length, c.inner)


class _FromLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local: Tensor, carried: Carried):
        ctx.carried = carried
        return SeqShard(local, carried)

    @staticmethod
    def backward(ctx, g):
        return local_grad(g, ctx.carried), None


class _ToLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: SeqShard):
        ctx.carried, ctx.shape = x._carried, tuple(x.shape)
        return x._local.view_as(x._local)

    @staticmethod
    def backward(ctx, g):
        return SeqShard(g, ctx.carried, ctx.shape)


class _Full(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: SeqShard):
        g = x._gathered()
        return g.view_as(g)

    @staticmethod
    def backward(ctx, g):
        return g
