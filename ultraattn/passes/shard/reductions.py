"""Sharding rules of reductions and losses over the sequence, and of the attention site itself.

Over the sequence, ``sum``/``mean`` and the common losses run as a local sum of this rank's real
tokens (padding masked out) plus an all-reduce, accumulated in fp32 (fp64 for integers), so the
result is the single-process one; other reductions along the sequence run replicated.
"""

from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx

from ultraattn.passes.fx_util import is_tensor_node, meta_value
from ultraattn.passes.shard.links import (
    TARGET,
    Seq,
    arg,
    broadcast_links,
    dim_link,
    dims_arg,
    ndim_of,
    opname,
    shape_of,
    tensor_inputs,
)
from ultraattn.passes.shard.rules import Rule


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Partial sums cross ranks in fp32 (fp64 for fp64 and integer sums: counts stay exact)."""
    return torch.float32 if dtype in (torch.float32, torch.float16, torch.bfloat16) else torch.float64


class Reduction(Rule):
    """sum / mean / amax / var / ... over dims; over the sequence: "reduce" for sum and mean, else none."""

    SEQ_REDUCIBLE = ("sum", "mean", "nansum")
    POSITIONS = {"norm": (2, 3), "std": (1, 3), "var": (1, 3), "count_nonzero": (1, None)}
    """name -> positions of (dim, keepdim) when not (1, 2)."""

    def dims(self, n):
        return dims_arg(n, self.POSITIONS.get(opname(n), (1, 2))[0], "dim", ndim_of(n.args[0]))

    def keepdim(self, n) -> bool:
        pos = self.POSITIONS.get(opname(n), (1, 2))[1]
        return bool(n.kwargs.get("keepdim", False) if pos is None else arg(n, pos, "keepdim", False))

    def links(self, n):
        x = n.args[0]
        nd = ndim_of(x)
        dims = self.dims(n)
        if dims is None:
            return []
        keep = self.keepdim(n)
        mapping, e = {}, 0
        for d in range(nd):
            if d in dims:
                if keep:
                    e += 1
                continue
            mapping[d] = e
            e += 1
        if isinstance(meta_value(n), tuple | list):  # max/min with a dim: (values, indices)
            return [dim_link(x, mapping, out_index=i) for i in range(len(meta_value(n)))]
        return [dim_link(x, mapping)]

    def mode(self, n, sp):
        s = sp.seq(n.args[0])
        if s is None:
            return None
        dims = self.dims(n)
        if dims is not None and s.dim not in dims:
            return super().mode(n, sp)
        tuple_out = isinstance(meta_value(n), tuple | list)
        if opname(n) in self.SEQ_REDUCIBLE and not tuple_out and n.kwargs.get("out") is None:
            return "reduce"
        return None

    def lower(self, cx, n):
        if cx.mode[n] == "shard":
            return cx.copy_sharded(n)
        x = n.args[0]
        s = cx.spec(x)
        xl = cx.masked(cx.shard_of(x, s), s, shape_of(x))
        dims = self.dims(n)
        keep = self.keepdim(n)
        dtype = arg(n, 3, "dtype")
        kw = {"dtype": dtype} if dtype is not None else {}
        g = cx.g
        if dims is None:
            part = g.call_function(torch.sum, (xl,), kw)
        else:
            part = g.call_function(torch.sum, (xl, dims, keep), kw)
        if opname(n) == "mean":
            count = math.prod(shape_of(x)) if dims is None else math.prod(shape_of(x)[d] for d in dims)
            part = g.call_function(operator.truediv, (part, count))
        return cx.all_reduce(part, meta_value(n).dtype)


class Loss(Rule):
    """cross_entropy / nll_loss (class targets) and the elementwise losses; "reduce" for mean and sum."""

    CLASS = ("cross_entropy", "nll_loss")
    ELEMENTWISE = {  # name -> position of `reduction`
        "mse_loss": 4, "l1_loss": 4, "smooth_l1_loss": 4, "huber_loss": 2, "binary_cross_entropy": 5,
        "binary_cross_entropy_with_logits": 5,
    }

    def reduction(self, n) -> str:
        name = opname(n)
        pos = 6 if name in self.CLASS else self.ELEMENTWISE[name]
        if arg(n, 3 if name in self.CLASS else 2, "size_average") is not None or \
                arg(n, 5 if name in self.CLASS else 3, "reduce") is not None:
            return "legacy"
        return arg(n, pos, "reduction", "mean")

    def links(self, n):
        x, t = n.args[0], arg(n, 1, "target")
        if not (is_tensor_node(x) and is_tensor_node(t)):
            return []
        red = self.reduction(n)
        if opname(n) in self.CLASS:
            nx = ndim_of(x)
            if nx < 2:
                return []
            tx = {0: 0, **{d: d - 1 for d in range(2, nx)}}  # input dim -> target dim
            links = [dim_link(x, tx, out_index=TARGET)]
            if red == "none":
                links += [dim_link(t, {d: d for d in range(ndim_of(t))}), dim_link(x, tx)]
            return links
        links = [dim_link(x, {d: d for d in range(ndim_of(x))}, out_index=TARGET)]
        if red == "none":
            links += broadcast_links(n, [x, t], shape_of(n))
        return links

    def rep_args(self, n):
        return {m for m in tensor_inputs(n) if m is not n.args[0] and m is not arg(n, 1, "target")}

    def mode(self, n, sp):
        x, t = n.args[0], arg(n, 1, "target")
        sx, st = sp.seq(x), sp.seq(t)
        if sx is None or st is None:
            return None
        red = self.reduction(n)
        if red == "none":
            return "shard" if sp.seq(n) is not None else None
        if red not in ("mean", "sum"):
            return None
        if opname(n) in self.CLASS:
            if meta_value(t).dtype.is_floating_point:
                return None  # class probabilities: not handled
            if opname(n) == "cross_entropy" and arg(n, 2, "weight") is not None and \
                    float(arg(n, 7, "label_smoothing", 0.0) or 0.0) and red == "mean":
                return None
        return "reduce"

    def lower(self, cx, n):
        if cx.mode[n] == "shard":
            return cx.copy_sharded(n)
        g = cx.g
        name = opname(n)
        x, t = n.args[0], arg(n, 1, "target")
        red = self.reduction(n)
        sx, st = cx.spec(x), cx.spec(t)
        xl, tl = cx.shard_of(x, sx), cx.shard_of(t, st)
        acc = acc_dtype(meta_value(n).dtype)
        if name in self.CLASS:
            ii = arg(n, 4, "ignore_index", -100)
            weight = arg(n, 2, "weight")
            wl = cx.rep_for_sharded(weight) if isinstance(weight, fx.Node) else None
            valid = cx.valid(st, shape_of(t))
            tm = g.call_function(torch.where, (valid, tl, ii))
            kw = {"weight": wl, "ignore_index": ii, "reduction": "sum"}
            if name == "cross_entropy":
                kw["label_smoothing"] = arg(n, 7, "label_smoothing", 0.0)
            fn = torch.nn.functional.cross_entropy if name == "cross_entropy" else torch.nn.functional.nll_loss
            total = g.call_function(fn, (xl, tm), kw)
            if red == "sum":
                return cx.all_reduce(total, meta_value(n).dtype)
            keep = g.call_function(operator.ne, (tm, ii))
            if wl is None:
                den = g.call_method("sum", (keep,))
            else:
                safe = g.call_function(torch.where, (keep, tm, 0))
                den = g.call_method("sum", (g.call_function(torch.where, (keep, g.call_function(
                    operator.getitem, (wl, safe)), 0.0)),))
            pair = g.call_function(torch.stack, ([g.call_method("to", (total, acc)), g.call_method("to", (den, acc))],))
            both = cx.all_reduce(pair, acc)
            out = g.call_function(operator.truediv, (g.call_function(operator.getitem, (both, 0)),
                                                     g.call_function(operator.getitem, (both, 1))))
            return g.call_method("to", (out, meta_value(n).dtype))
        # elementwise: the unreduced loss, its real tokens summed
        args = [cx.arg_for(n, a) if isinstance(a, fx.Node) else a for a in n.args]
        kwargs = {k: (cx.arg_for(n, v) if isinstance(v, fx.Node) else v) for k, v in n.kwargs.items()}
        pos = self.ELEMENTWISE[name]
        if len(args) > pos:
            args[pos] = "none"
        else:
            kwargs["reduction"] = "none"
        args[0], args[1] = xl, tl
        per = g.call_function(n.target, tuple(args), kwargs)
        per = cx.masked(per, sx, shape_of(x))
        total = g.call_method("sum", (per,))
        if red == "mean":
            total = g.call_function(operator.truediv, (total, math.prod(shape_of(x))))
        return cx.all_reduce(total, meta_value(n).dtype)


class Site(Rule):
    """A rewritten attention site: q, k, v and (out, lse) on dim 2; the mask tensors stay replicated."""

    def links(self, n):
        q, k, v = n.args[:3]
        return [dim_link(m, {2: 2}, out_index=o) for m in (q, k, v) for o in (0, 1)]

    def rep_args(self, n):
        return set(n.args[3])

    def mode(self, n, sp):
        S = shape_of(n.args[0])[2]
        want = Seq(2, S, 1)
        if all(sp.get(m) == want for m in n.args[:3]) and sp.get(n, 0) == want and sp.get(n, 1) == want:
            return "shard"
        return None

    def lower(self, cx, n):
        q, k, v, masks, key = n.args
        S = shape_of(q)[2]
        loc = [cx.shard_of(m, Seq(2, S, 1)) for m in (q, k, v)]
        return cx.g.call_function(torch.ops.ultraattn.site_attention_local.default,
                                  (*loc, [cx.rep_of(m) for m in masks], key))


class Metadata(Rule):
    """size / dim / numel of a tensor: the global values, constants (no data needed)."""

    def mode(self, n, sp):
        return None


