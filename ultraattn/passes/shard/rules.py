"""Sharding rules of the ops that keep or move the sequence: shapes, permutes, token-wise math, indexing.

A ``Rule`` says how one op relates its inputs' and output's sequence dims (``links``), which
arguments stay replicated by design (``rep_args``), whether the op can run on local tokens
(``mode``), and how it is rewritten there (``lower``, default: the same op on mapped arguments).
Reductions, losses and the attention site are in ``reductions.py``; the table of which rule
serves which op is ``table.py``.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ultraattn.passes.fx_util import is_tensor_node, meta_value
from ultraattn.passes.shard.links import (
    TOP,
    Link,
    Seq,
    Specs,
    arg,
    broadcast_links,
    dim_link,
    ndim_of,
    norm_dim,
    opname,
    shape_of,
    tensor_inputs,
    tuple_inputs,
    view_link,
)


class Rule:
    """How one op relates its inputs' and output's sequence dims, whether it can run sharded, how it lowers.

    ``links``: the alignment relations. ``rep_args``: argument nodes that are replicated by design
    (weights, a type_as reference, a site's mask). ``mode``: "shard", "reduce" or None (the
    default: "shard" when the output is aligned, every aligned input maps onto it and at least one
    input carries it). ``lower``: the local op (default: the same op, arguments mapped); ``cx`` is the
    ``lowering.Lowering`` building the new graph (not imported here: lowering looks rules up, so the rules
    stay below it).
    """

    def links(self, n: fx.Node) -> list[Link]:
        return []

    def rep_args(self, n: fx.Node) -> set[fx.Node]:
        return set()

    def meta_args(self, n: fx.Node) -> set[fx.Node]:
        """Arguments of which the op reads only dtype or device (``type_as``'s reference): any form will do, so
        they never need gathering; they are also in ``rep_args``, and ``lower`` does not read them."""
        return set()

    def tokenwise(self, n: fx.Node, sp: Specs) -> bool:
        """Op-specific condition beyond the generic one (e.g. softmax not over the sequence)."""
        return True

    def mode(self, n: fx.Node, sp: Specs) -> str | None:
        return "shard" if generic_shardable(self, n, sp) and self.tokenwise(n, sp) else None

    def lower(self, cx, n: fx.Node) -> fx.Node:
        return cx.copy_sharded(n)


def out_specs(sp: Specs, n: fx.Node) -> list[tuple[int | None, object]]:
    s = sp.v.get(n)
    if isinstance(s, list):
        return list(enumerate(s))
    return [(None, s)]


def generic_shardable(rule: Rule, n: fx.Node, sp: Specs) -> bool:
    outs = out_specs(sp, n)
    if any(s is TOP for _, s in outs) or not any(isinstance(s, Seq) for _, s in outs):
        return False
    links = rule.links(n)
    reps = rule.rep_args(n)
    carried = False
    for m in tensor_inputs(n) + tuple_inputs(n):
        if m in reps:
            continue
        ms = sp.get(m)
        if ms is TOP:
            return False
        mine = [lk for lk in links if lk.inp is m]
        if isinstance(ms, Seq):
            ok = False
            for lk in mine:
                src = sp.seq(m, lk.in_index) if lk.in_index is not None else ms
                if src is not None and lk.fwd(src) is not None and lk.fwd(src) == sp.get(n, lk.out_index):
                    ok = True
            if not ok:
                return False
            carried = True
        elif isinstance(sp.v.get(m), list):  # getitem on a sharded tuple
            for lk in mine:
                src = sp.seq(m, lk.in_index)
                if src is not None and lk.fwd(src) == sp.get(n, lk.out_index):
                    carried = True
    return carried


class Pointwise(Rule):
    def links(self, n):
        return broadcast_links(n, tensor_inputs(n), shape_of(n))


class Identity(Rule):
    """Ops that keep their first argument's shape: casts, copies, dropout, ``*_like``."""

    def links(self, n):
        x = n.args[0] if n.args else None
        return [dim_link(x, {d: d for d in range(ndim_of(x))})] if is_tensor_node(x) else []

    def rep_args(self, n):
        return {m for m in tensor_inputs(n) if m is not n.args[0]}


class LikeOther(Identity):
    """``x.type_as(y)`` / ``x.to(y)``: x cast to y's dtype (and device); y is read for that alone (torchtitan's RoPE
    ends with ``xq_out.type_as(xq)``), so a sharded y is never gathered for it."""

    def other(self, n):
        y = arg(n, 1, "other")
        return y if is_tensor_node(y) else None

    def meta_args(self, n):
        y = self.other(n)
        return {y} if y is not None else set()

    def lower(self, cx, n):
        y = self.other(n)
        if y is None:  # x.to(dtype), x.to(device): the op as it is
            return super().lower(cx, n)
        x = cx.shard_of(n.args[0], cx.want(n, n.args[0]))
        return cx.g.call_method("to", (x,), {"dtype": meta_value(y).dtype, "device": meta_value(y).device})


class ComplexView(Rule):
    """view_as_complex / view_as_real: a trailing pair of reals is one complex number, the other dims keep (RoPE as
    complex rotations, as torchtitan's Llama writes it)."""

    def links(self, n):
        x = n.args[0]
        return [dim_link(x, {d: d for d in range(min(ndim_of(x), ndim_of(n)))})]


class Reshape(Rule):
    """view / reshape / flatten / unflatten / squeeze / unsqueeze / view_as / reshape_as."""

    def links(self, n):
        if any(isinstance(a, torch.dtype) for a in n.args[1:]):
            return []  # x.view(dtype) reinterprets bytes
        return [view_link(n.args[0], shape_of(n))]

    def rep_args(self, n):
        return {m for m in tensor_inputs(n) if m is not n.args[0]}

    def lower(self, cx, n):
        x = cx.shard_of(n.args[0], cx.want(n, n.args[0]))
        shape = cx.local_shape(n)
        name = opname(n)
        method = "view" if name in ("view", "view_as", "squeeze", "unsqueeze") else "reshape"
        return cx.g.call_method(method, (x, shape))


class Expand(Rule):
    """expand / broadcast_to / expand_as: new leading dims and size-1 dims grow; the rest keep."""

    def links(self, n):
        return broadcast_links(n, [n.args[0]], shape_of(n))

    def rep_args(self, n):
        return {m for m in tensor_inputs(n) if m is not n.args[0]}

    def lower(self, cx, n):
        x = cx.shard_of(n.args[0], cx.want(n, n.args[0]))
        return cx.g.call_method("expand", (x, cx.local_shape(n)))


class Permute(Rule):
    def perm(self, n) -> list[int]:
        nd = ndim_of(n.args[0])
        name = opname(n)
        if name in ("transpose", "swapaxes", "swapdims"):
            a, b = (norm_dim(d, nd) for d in (arg(n, 1, "dim0"), arg(n, 2, "dim1")))
            p = list(range(nd))
            p[a], p[b] = p[b], p[a]
            return p
        if name == "t":
            return list(range(nd))[::-1]
        if name == "permute":
            dims = n.args[1:] if len(n.args) > 2 or isinstance(arg(n, 1, "dims"), int) else arg(n, 1, "dims")
            return [norm_dim(d, nd) for d in dims]
        if name == "movedim":
            src, dst = arg(n, 1, "source"), arg(n, 2, "destination")
            src = [src] if isinstance(src, int) else list(src)
            dst = [dst] if isinstance(dst, int) else list(dst)
            src = [norm_dim(d, nd) for d in src]
            dst = [norm_dim(d, nd) for d in dst]
            out = [-1] * nd
            for s_, d_ in zip(src, dst):
                out[d_] = s_
            rest = iter(d for d in range(nd) if d not in src)
            return [o if o >= 0 else next(rest) for o in out]
        raise AssertionError(name)

    def links(self, n):
        p = self.perm(n)  # output dim i is input dim p[i]
        return [dim_link(n.args[0], {src: i for i, src in enumerate(p)})]


class AlongDim(Rule):
    """Ops along one dim that keep positions (softmax, cumsum, normalize): token-wise unless along the sequence.

    ``keeps_positions=False`` (flip, roll, sort): the op moves positions along its dim, so that
    dim is not linked at all."""

    def __init__(self, dim_pos: int, dim_name: str = "dim", default=None, keeps_positions: bool = True,
                 out_tuple: int = 0):
        self.dim_pos, self.dim_name, self.default = dim_pos, dim_name, default
        self.keeps_positions, self.out_tuple = keeps_positions, out_tuple

    def dims(self, n) -> list[int] | None:
        nd = ndim_of(n.args[0])
        d = arg(n, self.dim_pos, self.dim_name, self.default)
        if d is None:
            return None if self.default is None else [norm_dim(self.default, nd)]
        return [norm_dim(x, nd) for x in ([d] if isinstance(d, int) else d)]

    def links(self, n):
        x = n.args[0]
        nd = ndim_of(x)
        dims = self.dims(n)
        if dims is None:
            return []
        mapping = {d: d for d in range(nd) if self.keeps_positions or d not in dims}
        if self.out_tuple:
            return [dim_link(x, mapping, out_index=i) for i in range(self.out_tuple)]
        return [dim_link(x, mapping)]

    def tokenwise(self, n, sp):
        s = sp.seq(n.args[0])
        dims = self.dims(n)
        return s is not None and dims is not None and s.dim not in dims


class Triangle(AlongDim):
    """tril / triu: over the last two dims."""

    def __init__(self):
        super().__init__(1, "diagonal")

    def dims(self, n):
        nd = ndim_of(n.args[0])
        return [nd - 2, nd - 1]


class FirstInput(Rule):
    """The output's leading dims are the first input's (same positions); the other inputs (weights) are
    replicated."""

    def links(self, n):
        x = n.args[0]
        return [dim_link(x, {d: d for d in range(ndim_of(x))})]

    def rep_args(self, n):
        return {m for m in tensor_inputs(n) if m is not n.args[0]}


class Norm(FirstInput):
    """layer_norm / rms_norm over the trailing ``normalized_shape`` dims."""

    def tokenwise(self, n, sp):
        shape = arg(n, 1, "normalized_shape")
        k = 1 if isinstance(shape, int) else len(shape)
        s = sp.seq(n.args[0])
        return s is not None and s.dim < ndim_of(n.args[0]) - k


class Linear(Rule):
    def links(self, n):
        x = n.args[0]
        nd = ndim_of(x)
        return [dim_link(x, {d: d for d in range(nd - 1)})]

    def rep_args(self, n):
        return {m for m in tensor_inputs(n) if m is not n.args[0]}


class Matmul(Rule):
    """matmul / mm / bmm / @: rows of the first operand, columns of the second, broadcast batch dims."""

    def links(self, n):
        a, b = n.args[0], n.args[1]
        if not (is_tensor_node(a) and is_tensor_node(b)):
            return []
        na, nb, no = ndim_of(a), ndim_of(b), ndim_of(n)
        links = []
        if na >= 2:
            ma = {na - 2: no - 2} if nb >= 2 else {na - 2: no - 1}
            for d in range(na - 2):
                if shape_of(a)[d] == shape_of(n)[d + no - na] and shape_of(a)[d] > 1:
                    ma[d] = d + no - na
            links.append(dim_link(a, ma))
        if nb >= 2:
            mb = {nb - 1: no - 1}
            for d in range(nb - 2):
                if shape_of(b)[d] == shape_of(n)[d + no - nb] and shape_of(b)[d] > 1:
                    mb[d] = d + no - nb
            links.append(dim_link(b, mb))
        return links


class Outer(Rule):
    def links(self, n):
        return [dim_link(n.args[0], {0: 0}), dim_link(n.args[1], {0: 1})]


class Einsum(Rule):
    """einsum: a letter kept in the output links the operands' dims with it."""

    def parse(self, n):
        eq = n.args[0]
        ops = n.args[1:] if len(n.args) > 2 or not isinstance(n.args[1], list | tuple) else n.args[1]
        if not isinstance(eq, str) or "..." in eq or "->" not in eq:
            return None
        lhs, out = eq.replace(" ", "").split("->")
        terms = lhs.split(",")
        if len(terms) != len(ops):
            return None
        return terms, out, list(ops)

    def links(self, n):
        p = self.parse(n)
        if p is None:
            return []
        terms, out, ops = p
        return [dim_link(op, {i: out.index(c) for i, c in enumerate(t) if c in out})
                for t, op in zip(terms, ops) if is_tensor_node(op)]


class Embedding(FirstInput):
    """A row of the (replicated) table per id: the ids' dims lead the output's."""

    def tokenwise(self, n, sp):
        return arg(n, 3, "max_norm") is None  # max_norm renormalises the rows each rank looks up, in place


class Cat(Rule):
    """cat / concat / stack along a dim that is not the sequence, or along any dim where every other part is empty.

    An empty 1-D part (``torch.tensor([])``, which cat skips whatever the other parts' shapes) contributes nothing:
    Hugging Face's ``DynamicCache`` (``use_cache=True``, the default even in training) appends each layer's keys and
    values to such an empty cache, ``cat([tensor([]), k], dim=-2)``, which is ``k`` itself."""

    def parts(self, n):
        xs = arg(n, 0, "tensors")
        return [x for x in xs if is_tensor_node(x) and not self.empty(n, x)] if isinstance(xs, list | tuple) else []

    def empty(self, n, x) -> bool:
        v = meta_value(x)
        return opname(n) != "stack" and v.dim() == 1 and v.numel() == 0

    def rep_args(self, n):
        xs = arg(n, 0, "tensors")
        return {x for x in xs if is_tensor_node(x) and self.empty(n, x)} if isinstance(xs, list | tuple) else set()

    def cat_dim(self, n) -> int:
        return norm_dim(arg(n, 1, "dim", 0), ndim_of(n))

    def links(self, n):
        d = self.cat_dim(n)
        stack = opname(n) == "stack"
        parts = self.parts(n)
        links = []
        for x in parts:
            nd = ndim_of(x)
            if stack:
                mapping = {i: (i if i < d else i + 1) for i in range(nd)}
            else:  # the cat dim is the same positions only where the part is all there is
                mapping = {i: i for i in range(nd) if i != d or len(parts) == 1}
            links.append(dim_link(x, mapping))
        return links

    def tokenwise(self, n, sp):
        s = sp.seq(n)
        parts = self.parts(n)
        along = s is not None and s.dim == self.cat_dim(n)
        return s is not None and (not along or len(parts) == 1 and opname(n) != "stack") and \
            all(sp.seq(x) is not None for x in parts)


class Split(Rule):
    """chunk / split / tensor_split / unbind along a dim that is not the sequence (tuple outputs)."""

    def split_dim(self, n) -> int:
        nd = ndim_of(n.args[0])
        if opname(n) == "unbind":
            return norm_dim(arg(n, 1, "dim", 0), nd)
        return norm_dim(arg(n, 2, "dim", 0), nd)

    def links(self, n):
        x = n.args[0]
        nd = ndim_of(x)
        d = self.split_dim(n)
        k = len(meta_value(n))
        if opname(n) == "unbind":
            mapping = {i: (i if i < d else i - 1) for i in range(nd) if i != d}
        else:
            mapping = {i: i for i in range(nd) if i != d}
        return [dim_link(x, mapping, out_index=j) for j in range(k)]

    def tokenwise(self, n, sp):
        s = sp.seq(n.args[0])
        return s is not None and s.dim != self.split_dim(n)


class GetItem(Rule):
    """``x[index]``: ints, slices, None, Ellipsis and one tensor index (a table looked up by positions).

    A slice of the sequence from its start (``logits[:, :-1]``) keeps the positions and shortens
    the length; any other slice or an int on the sequence moves positions (not linked)."""

    def tuple_input(self, n) -> bool:
        return isinstance(meta_value(n.args[0]), tuple | list)

    def parse(self, n):
        """(per output dim: ('x', input dim, slice) or ('idx', index-tensor dim) or ('new',)), tensor index."""
        x, idx = n.args[0], n.args[1]
        idx = idx if isinstance(idx, tuple) else (idx,)
        nd = ndim_of(x)
        n_used = sum(1 for i in idx if i is not None and i is not Ellipsis and not isinstance(i, bool))
        expanded = []
        for i in idx:
            if i is Ellipsis:
                expanded.extend([slice(None)] * (nd - n_used))
            else:
                expanded.append(i)
        tensors = [i for i in expanded if isinstance(i, fx.Node)]
        if len(tensors) > 1 or any(isinstance(i, bool | list) for i in expanded):
            return None
        out, d, placed = [], 0, False
        for i in expanded:
            if i is None:
                out.append(("new",))
            elif isinstance(i, int):
                d += 1
            elif isinstance(i, slice):
                out.append(("x", d, i))
                d += 1
            elif isinstance(i, fx.Node):
                if not is_tensor_node(i) or meta_value(i).dtype == torch.bool:
                    return None
                if not placed:
                    out.extend(("idx", j) for j in range(ndim_of(i)))
                    placed = True
                d += 1
            else:
                return None
        out.extend(("x", j, slice(None)) for j in range(d, nd))
        return out, (tensors[0] if tensors else None)

    def links(self, n):
        if self.tuple_input(n):
            i = n.args[1]
            return [dim_link(n.args[0], {d: d for d in range(ndim_of(n))}, in_index=i)] \
                if isinstance(i, int) and is_tensor_node(n) else []
        p = self.parse(n)
        if p is None:
            return []
        out, t = p
        x = n.args[0]
        xs = shape_of(x)
        keep: dict[int, tuple[int, slice]] = {}
        tmap: dict[int, int] = {}
        for e, o in enumerate(out):
            if o[0] == "x":
                keep[o[1]] = (e, o[2])
            elif o[0] == "idx":
                tmap[o[1]] = e

        def fwd(s: Seq) -> Seq | None:
            if s.dim not in keep:
                return None
            e, sl = keep[s.dim]
            if sl == slice(None):
                return s.at(e)
            if s.inner != 1 or xs[s.dim] != s.length or sl.step not in (None, 1) or sl.start not in (None, 0):
                return None
            stop = s.length if sl.stop is None else (sl.stop + s.length if sl.stop < 0 else min(sl.stop, s.length))
            return Seq(e, stop, 1) if stop >= 1 else None

        def bwd(s: Seq) -> Seq | None:
            for d, (e, sl) in keep.items():
                if e == s.dim:
                    if sl == slice(None):
                        return s.at(d)
                    if s.inner != 1 or sl.step not in (None, 1) or sl.start not in (None, 0):
                        return None
                    stop = xs[d] if sl.stop is None else (sl.stop + xs[d] if sl.stop < 0 else min(sl.stop, xs[d]))
                    return Seq(d, xs[d], 1) if stop == s.length else None
            return None

        links = [Link(x, fwd, bwd)]
        if t is not None:
            links.append(dim_link(t, tmap))
        return links

    def tokenwise(self, n, sp):
        if self.tuple_input(n):
            return True
        p = self.parse(n)
        if p is None:
            return False
        out, t = p
        s = sp.seq(n.args[0])
        if s is not None:
            if t is not None:
                return False  # a tensor index together with a sharded table: a gather across ranks
            # the sequence dim must survive (no int index on it)
            return any(o[0] == "x" and o[1] == s.dim for o in out)
        return True

    def lower(self, cx, n):
        if self.tuple_input(n):
            if n.args[0] not in cx.local:
                raise RuntimeError("the tuple it indexes runs replicated")
            return cx.copy_sharded(n)
        x = n.args[0]
        want = cx.want(n, x)
        idx = n.args[1]
        if want is not None:
            # the local tensor keeps every position: a prefix slice of the sequence becomes a full slice
            out, _ = self.parse(n)
            seq_out = cx.spec(n).dim
            e_of = {o[1]: e for e, o in enumerate(out) if o[0] == "x"}
            target = e_of.get(want.dim)
            assert target == seq_out, (n.format_node(), target, seq_out)
            idx = _replace_slice(idx, ndim_of(x), want.dim)
        mapped = fx.map_arg(idx, lambda a: cx.arg_for(n, a))
        base = cx.shard_of(x, want) if want is not None else cx.rep_for_sharded(x)
        return cx.g.call_function(operator.getitem, (base, mapped))


def _replace_slice(idx, nd: int, dim: int):
    """The index with the slice on input dim ``dim`` replaced by ``slice(None)``."""
    t = idx if isinstance(idx, tuple) else (idx,)
    n_used = sum(1 for i in t if i is not None and i is not Ellipsis)
    out, d = [], 0
    for i in t:
        if i is Ellipsis:
            out.append(i)
            d += nd - n_used
        elif i is None:
            out.append(i)
        else:
            out.append(slice(None) if d == dim else i)
            d += 1
    return tuple(out) if isinstance(idx, tuple) else out[0]


