"""Sequence sharding: every activation of a compiled graph lives on this rank's tokens.

Rewrites the Dynamo graph the backend receives (after ``rewrite.py`` turned each attention
site into ``ultraattn::site_attention``) so that the ops that carry the sequence run on this
rank's tokens only, in the token layout of the graph's attention plans (DESIGN.md, "the
global view"):

    before (every rank, full sequence)           after (rank r, its tokens)
    x   = embedding(tokens, W)                   x   = embedding(sp_dispatch(tokens), sp_enter(W))
    cos = outer(arange(S), f).cos()              cos = outer(sp_dispatch(arange(S)), f).cos()
    q   = linear(rms_norm(x), Wq).view(B,S,H,D)  q   = linear(rms_norm(x), sp_enter(Wq)).view(B,L,H,D)
    o   = site_attention(q, k, v)                o   = site_attention_local(q, k, v)
    ...                                          ...
    loss = cross_entropy(logits, labels)         loss = sp_all_reduce([ce_sum, count]) -> sum / count
    return loss, logits                          return loss, sp_gather(logits)   (or the shard)

Three steps, analysis before mutation (STYLE.md):

1. **Alignment** (``align``): which dimension of each tensor is the sequence. Seeded at every
   site's q, k, v (dim 2) and propagated forwards and backwards through per-op *links* (this
   input's dim d is the output's dim e): views and reshapes that keep the sequence whole (a
   flattened ``[batch * seq]`` dimension is tracked with the elements per position), permutes,
   broadcasting pointwise ops, linear/matmul rows, embedding, norms, indexing, cat/split along
   other dims, losses. A tensor aligned twice over (an S x S mask) is never sharded.
2. **Region** (``choose_region``): the ops that run on local tokens. Each op has a *mode*: "shard"
   (token-wise along the sequence: its output's positions come from sharded inputs), "reduce"
   (sum, mean or a loss over the sequence: a local reduction of the real tokens plus an
   all-reduce) or none (it runs on replicated data). The region grows forwards from the sites
   and backwards towards the inputs, where an op joins when every consumer of its output takes
   it sharded; so token ids, position ids and labels are sliced where they enter, and a tensor
   also needed replicated (a mask built from positions) stays replicated instead of being
   gathered.
3. **Lowering** (``lower``): a new graph. Replicated tensors that line up with the sequence are
   sliced (``sp_dispatch``) where they meet the region; replicated weights entering it pass
   ``sp_enter`` (their gradient is summed over ranks); a sharded tensor that an op outside the
   region needs is all-gathered (``sp_gather``): always correct, recorded as a fallback with its
   bytes; shapes in view/reshape/expand arguments become local; graph outputs are gathered
   (``outputs="global"``) or returned as the shard (``outputs="sharded"``).

Padding: local tensors hold ``local_len`` tokens; positions at or past a tensor's sequence
length (the layout's tail, or tokens a prefix slice like ``logits[:, :-1]`` dropped) are
padding, excluded from every reduction over the sequence and dropped by gathers.

Caution: dropout runs on local tokens with this rank's random stream (a different mask than
one process would draw; the same distribution). In-place ops are sharded only together with
the tensor they modify. Activation-checkpoint regions are inlined first, tagged so that AOT autograd
still recomputes them (``inline_checkpoints``); other higher-order ops (selective checkpointing,
custom autograd functions) run on replicated data: correct, and listed as fallbacks.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.fx as fx

# ----------------------------------------------------------------------------- specs


@dataclass(frozen=True, slots=True)
class Seq:
    """A dimension that carries the sequence: size ``outer * length * inner`` (global)."""

    dim: int
    length: int
    """Positions of the global sequence coordinate this tensor holds (0 .. length-1)."""
    inner: int = 1
    """Elements per position inside the dimension (a flattened ``[seq * hidden]``)."""

    def at(self, dim: int) -> Seq:
        return Seq(dim, self.length, self.inner)


class _Top:
    def __repr__(self) -> str:
        return "TOP"


TOP = _Top()
"""A tensor aligned with the sequence in two ways (S x S): never sharded."""


def _val(n):
    if isinstance(n, fx.Node):
        return n.meta.get("example_value", n.meta.get("val"))
    return None


def _is_tensor_node(n) -> bool:
    return isinstance(n, fx.Node) and isinstance(_val(n), torch.Tensor)


def _shape(n) -> tuple[int, ...]:
    return tuple(_val(n).shape)


def _ndim(n) -> int:
    return _val(n).dim()


def _norm_dim(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


# ----------------------------------------------------------------------------- op names
_OPERATORS = {
    operator.add: "add", operator.sub: "sub", operator.mul: "mul", operator.truediv: "div",
    operator.floordiv: "floor_divide", operator.mod: "remainder", operator.pow: "pow", operator.neg: "neg",
    operator.pos: "positive", operator.abs: "abs", operator.invert: "bitwise_not", operator.and_: "bitwise_and",
    operator.or_: "bitwise_or", operator.xor: "bitwise_xor", operator.eq: "eq", operator.ne: "ne",
    operator.lt: "lt", operator.le: "le", operator.gt: "gt", operator.ge: "ge", operator.getitem: "getitem",
    operator.matmul: "matmul", operator.iadd: "add_", operator.isub: "sub_", operator.imul: "mul_",
    operator.itruediv: "div_",
}


def opname(n: fx.Node) -> str | None:
    """The op's name (``torch.add``, ``x.add`` and ``operator.add`` are all "add"); None: not a torch op."""
    if n.op == "call_method":
        return n.target
    if n.op != "call_function":
        return None
    t = n.target
    if t in _OPERATORS:
        return _OPERATORS[t]
    if t is torch.ops.ultraattn.site_attention.default:
        return "ultraattn_site"
    mod = getattr(t, "__module__", None)
    name = getattr(t, "__name__", None)
    if name is None:
        return None
    if mod is None or mod.startswith("torch"):
        return name
    owner = getattr(t, "__objclass__", None)  # torch.Tensor.add and friends
    if owner is not None and issubclass(owner, torch._C.TensorBase):
        return name
    return None


def _arg(n: fx.Node, i: int, name: str, default=None):
    """Argument ``name`` at position ``i`` (self is position 0 for methods and functions alike)."""
    if len(n.args) > i:
        return n.args[i]
    return n.kwargs.get(name, default)


def _dims_arg(n: fx.Node, i: int, name: str, ndim: int) -> list[int] | None:
    """A dim / dims argument normalised to a sorted list (None: all dims)."""
    d = _arg(n, i, name)
    if d is None:
        return None
    if isinstance(d, int):
        return [_norm_dim(d, ndim)]
    return sorted(_norm_dim(x, ndim) for x in d)


# ----------------------------------------------------------------------------- links
@dataclass
class Link:
    """``inp``'s dim and the node's output dim hold the same positions (``fwd``: input spec -> output spec)."""

    inp: fx.Node
    fwd: Callable[[Seq], Seq | None]
    bwd: Callable[[Seq], Seq | None]
    out_index: int | None = None
    """Element of a tuple-valued output (None: the output is one tensor)."""
    in_index: int | None = None
    """Element of a tuple-valued input (getitem on a tuple)."""


def dim_link(inp: fx.Node, mapping: dict[int, int], out_index=None, in_index=None) -> Link:
    inv = {v: k for k, v in mapping.items()}
    return Link(inp, lambda s: s.at(mapping[s.dim]) if s.dim in mapping else None,
                lambda s: s.at(inv[s.dim]) if s.dim in inv else None, out_index, in_index)


def band(src: tuple[int, ...], dst: tuple[int, ...], s: Seq) -> Seq | None:
    """The spec in ``dst`` of a reshape of ``src`` (sequence spec ``s``), or None where the reshape splits it.

    In the flat (row-major) index the positions have stride ``inner * prod(src[dim+1:])`` and
    ``length`` steps; the destination dim containing that band whole carries the sequence."""
    if s.dim >= len(src) or src[s.dim] % (s.length * s.inner):
        return None
    st = s.inner * math.prod(src[s.dim + 1:])
    ext = st * s.length
    for e in range(len(dst)):
        se = math.prod(dst[e + 1:])
        span = se * dst[e]
        if st >= se and st % se == 0 and ext <= span and span % ext == 0:
            return Seq(e, s.length, st // se)
    return None


def view_link(inp: fx.Node, out_shape: tuple[int, ...], out_index=None) -> Link:
    src = _shape(inp)
    return Link(inp, lambda s: band(src, out_shape, s), lambda s: band(out_shape, src, s), out_index)


def broadcast_links(n: fx.Node, inputs: list[fx.Node], out_shape: tuple[int, ...]) -> list[Link]:
    links = []
    for m in inputs:
        shp = _shape(m)
        off = len(out_shape) - len(shp)
        mapping = {d: d + off for d in range(len(shp)) if off >= 0 and shp[d] == out_shape[d + off] and shp[d] > 1}
        links.append(dim_link(m, mapping))
    return links


def _tensor_inputs(n: fx.Node) -> list[fx.Node]:
    seen: list[fx.Node] = []
    for m in n.all_input_nodes:
        if _is_tensor_node(m) and m not in seen:
            seen.append(m)
    return seen


# ----------------------------------------------------------------------------- rules
class Rule:
    """How one op relates its inputs' and output's sequence dims, whether it can run sharded, how it lowers.

    ``links``: the alignment relations. ``rep_args``: argument nodes that are replicated by design
    (weights, a type_as reference, a site's mask). ``mode``: "shard", "reduce" or None (the
    default: "shard" when the output is aligned, every aligned input maps onto it and at least one
    input carries it). ``lower``: the local op (default: the same op, arguments mapped).
    """

    def links(self, n: fx.Node) -> list[Link]:
        return []

    def rep_args(self, n: fx.Node) -> set[fx.Node]:
        return set()

    def tokenwise(self, n: fx.Node, sp: Specs) -> bool:
        """Op-specific condition beyond the generic one (e.g. softmax not over the sequence)."""
        return True

    def mode(self, n: fx.Node, sp: Specs) -> str | None:
        return "shard" if generic_shardable(self, n, sp) and self.tokenwise(n, sp) else None

    def lower(self, cx: Lowering, n: fx.Node) -> fx.Node:
        return cx.copy_sharded(n)


class Specs:
    """Sequence specs of every value (a tensor: Seq / None / TOP; a tuple: a list of those)."""

    def __init__(self, max_len: int | None = None):
        self.v: dict[fx.Node, object] = {}
        self.changed = False
        self.max_len = max_len
        """Longest coordinate that is the sequence (the attention's length): a longer one (a RoPE cache of
        max_position positions) is a table indexed by position, not a tensor of this sequence."""

    def get(self, n: fx.Node, index: int | None = None):
        s = self.v.get(n)
        if index is None:
            return s if not isinstance(s, list) else None
        return s[index] if isinstance(s, list) and index < len(s) else None

    def set(self, n: fx.Node, s, index: int | None = None) -> None:
        if s is None or (isinstance(s, Seq) and self.max_len is not None and s.length > self.max_len):
            return
        if index is None:
            cur = self.v.get(n)
            if isinstance(cur, list):
                return
            new = s if cur is None or cur == s else TOP
            if new is not cur and new != cur:
                self.v[n] = new
                self.changed = True
            return
        val = _val(n)
        size = len(val) if isinstance(val, tuple | list) else index + 1
        cur = self.v.get(n)
        if not isinstance(cur, list):
            cur = [None] * size
            self.v[n] = cur
        cur.extend([None] * (index + 1 - len(cur)))
        old = cur[index]
        new = s if old is None or old == s else TOP
        if new != old:
            cur[index] = new
            self.changed = True

    def seq(self, n: fx.Node, index: int | None = None) -> Seq | None:
        s = self.get(n, index)
        return s if isinstance(s, Seq) else None


def _out_specs(sp: Specs, n: fx.Node) -> list[tuple[int | None, object]]:
    s = sp.v.get(n)
    if isinstance(s, list):
        return list(enumerate(s))
    return [(None, s)]


def generic_shardable(rule: Rule, n: fx.Node, sp: Specs) -> bool:
    outs = _out_specs(sp, n)
    if any(s is TOP for _, s in outs) or not any(isinstance(s, Seq) for _, s in outs):
        return False
    links = rule.links(n)
    reps = rule.rep_args(n)
    carried = False
    for m in _tensor_inputs(n) + _tuple_inputs(n):
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
        return broadcast_links(n, _tensor_inputs(n), _shape(n))


class Identity(Rule):
    """Ops that keep their first argument's shape: casts, copies, dropout, ``*_like``."""

    def links(self, n):
        x = n.args[0] if n.args else None
        return [dim_link(x, {d: d for d in range(_ndim(x))})] if _is_tensor_node(x) else []

    def rep_args(self, n):
        return {m for m in _tensor_inputs(n) if m is not n.args[0]}


class Reshape(Rule):
    """view / reshape / flatten / unflatten / squeeze / unsqueeze / view_as / reshape_as."""

    def links(self, n):
        if any(isinstance(a, torch.dtype) for a in n.args[1:]):
            return []  # x.view(dtype) reinterprets bytes
        return [view_link(n.args[0], _shape(n))]

    def rep_args(self, n):
        return {m for m in _tensor_inputs(n) if m is not n.args[0]}

    def lower(self, cx, n):
        x = cx.shard_of(n.args[0], cx.want(n, n.args[0]))
        shape = cx.local_shape(n)
        name = opname(n)
        method = "view" if name in ("view", "view_as", "squeeze", "unsqueeze") else "reshape"
        return cx.g.call_method(method, (x, shape))


class Expand(Rule):
    """expand / broadcast_to / expand_as: new leading dims and size-1 dims grow; the rest keep."""

    def links(self, n):
        return broadcast_links(n, [n.args[0]], _shape(n))

    def rep_args(self, n):
        return {m for m in _tensor_inputs(n) if m is not n.args[0]}

    def lower(self, cx, n):
        x = cx.shard_of(n.args[0], cx.want(n, n.args[0]))
        return cx.g.call_method("expand", (x, cx.local_shape(n)))


class Permute(Rule):
    def perm(self, n) -> list[int]:
        nd = _ndim(n.args[0])
        name = opname(n)
        if name in ("transpose", "swapaxes", "swapdims"):
            a, b = (_norm_dim(d, nd) for d in (_arg(n, 1, "dim0"), _arg(n, 2, "dim1")))
            p = list(range(nd))
            p[a], p[b] = p[b], p[a]
            return p
        if name == "t":
            return list(range(nd))[::-1]
        if name == "permute":
            dims = n.args[1:] if len(n.args) > 2 or isinstance(_arg(n, 1, "dims"), int) else _arg(n, 1, "dims")
            return [_norm_dim(d, nd) for d in dims]
        if name == "movedim":
            src, dst = _arg(n, 1, "source"), _arg(n, 2, "destination")
            src = [src] if isinstance(src, int) else list(src)
            dst = [dst] if isinstance(dst, int) else list(dst)
            src = [_norm_dim(d, nd) for d in src]
            dst = [_norm_dim(d, nd) for d in dst]
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
        nd = _ndim(n.args[0])
        d = _arg(n, self.dim_pos, self.dim_name, self.default)
        if d is None:
            return None if self.default is None else [_norm_dim(self.default, nd)]
        return [_norm_dim(x, nd) for x in ([d] if isinstance(d, int) else d)]

    def links(self, n):
        x = n.args[0]
        nd = _ndim(x)
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
        nd = _ndim(n.args[0])
        return [nd - 2, nd - 1]


class FirstInput(Rule):
    """The output's leading dims are the first input's (same positions); the other inputs (weights) are
    replicated."""

    def links(self, n):
        x = n.args[0]
        return [dim_link(x, {d: d for d in range(_ndim(x))})]

    def rep_args(self, n):
        return {m for m in _tensor_inputs(n) if m is not n.args[0]}


class Norm(FirstInput):
    """layer_norm / rms_norm over the trailing ``normalized_shape`` dims."""

    def tokenwise(self, n, sp):
        shape = _arg(n, 1, "normalized_shape")
        k = 1 if isinstance(shape, int) else len(shape)
        s = sp.seq(n.args[0])
        return s is not None and s.dim < _ndim(n.args[0]) - k


class Linear(Rule):
    def links(self, n):
        x = n.args[0]
        nd = _ndim(x)
        return [dim_link(x, {d: d for d in range(nd - 1)})]

    def rep_args(self, n):
        return {m for m in _tensor_inputs(n) if m is not n.args[0]}


class Matmul(Rule):
    """matmul / mm / bmm / @: rows of the first operand, columns of the second, broadcast batch dims."""

    def links(self, n):
        a, b = n.args[0], n.args[1]
        if not (_is_tensor_node(a) and _is_tensor_node(b)):
            return []
        na, nb, no = _ndim(a), _ndim(b), _ndim(n)
        links = []
        if na >= 2:
            ma = {na - 2: no - 2} if nb >= 2 else {na - 2: no - 1}
            for d in range(na - 2):
                if _shape(a)[d] == _shape(n)[d + no - na] and _shape(a)[d] > 1:
                    ma[d] = d + no - na
            links.append(dim_link(a, ma))
        if nb >= 2:
            mb = {nb - 1: no - 1}
            for d in range(nb - 2):
                if _shape(b)[d] == _shape(n)[d + no - nb] and _shape(b)[d] > 1:
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
                for t, op in zip(terms, ops) if _is_tensor_node(op)]


class Embedding(FirstInput):
    """A row of the (replicated) table per id: the ids' dims lead the output's."""

    def tokenwise(self, n, sp):
        return _arg(n, 3, "max_norm") is None  # max_norm renormalises the rows each rank looks up, in place


class Cat(Rule):
    """cat / concat / stack along a dim that is not the sequence."""

    def parts(self, n):
        xs = _arg(n, 0, "tensors")
        return [x for x in xs if _is_tensor_node(x)] if isinstance(xs, list | tuple) else []

    def cat_dim(self, n) -> int:
        return _norm_dim(_arg(n, 1, "dim", 0), _ndim(n))

    def links(self, n):
        d = self.cat_dim(n)
        stack = opname(n) == "stack"
        links = []
        for x in self.parts(n):
            nd = _ndim(x)
            if stack:
                mapping = {i: (i if i < d else i + 1) for i in range(nd)}
            else:
                mapping = {i: i for i in range(nd) if i != d}
            links.append(dim_link(x, mapping))
        return links

    def tokenwise(self, n, sp):
        s = sp.seq(n)
        return s is not None and s.dim != self.cat_dim(n) and all(sp.seq(x) is not None for x in self.parts(n))


class Split(Rule):
    """chunk / split / tensor_split / unbind along a dim that is not the sequence (tuple outputs)."""

    def split_dim(self, n) -> int:
        nd = _ndim(n.args[0])
        if opname(n) == "unbind":
            return _norm_dim(_arg(n, 1, "dim", 0), nd)
        return _norm_dim(_arg(n, 2, "dim", 0), nd)

    def links(self, n):
        x = n.args[0]
        nd = _ndim(x)
        d = self.split_dim(n)
        k = len(_val(n))
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
        return isinstance(_val(n.args[0]), tuple | list)

    def parse(self, n):
        """(per output dim: ('x', input dim, slice) or ('idx', index-tensor dim) or ('new',)), tensor index."""
        x, idx = n.args[0], n.args[1]
        idx = idx if isinstance(idx, tuple) else (idx,)
        nd = _ndim(x)
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
                if not _is_tensor_node(i) or _val(i).dtype == torch.bool:
                    return None
                if not placed:
                    out.extend(("idx", j) for j in range(_ndim(i)))
                    placed = True
                d += 1
            else:
                return None
        out.extend(("x", j, slice(None)) for j in range(d, nd))
        return out, (tensors[0] if tensors else None)

    def links(self, n):
        if self.tuple_input(n):
            i = n.args[1]
            return [dim_link(n.args[0], {d: d for d in range(_ndim(n))}, in_index=i)] \
                if isinstance(i, int) and _is_tensor_node(n) else []
        p = self.parse(n)
        if p is None:
            return []
        out, t = p
        x = n.args[0]
        xs = _shape(x)
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
            idx = _replace_slice(idx, _ndim(x), want.dim)
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


class Reduction(Rule):
    """sum / mean / amax / var / ... over dims; over the sequence: "reduce" for sum and mean, else none."""

    SEQ_REDUCIBLE = ("sum", "mean", "nansum")
    POSITIONS = {"norm": (2, 3), "std": (1, 3), "var": (1, 3), "count_nonzero": (1, None)}
    """name -> positions of (dim, keepdim) when not (1, 2)."""

    def dims(self, n):
        return _dims_arg(n, self.POSITIONS.get(opname(n), (1, 2))[0], "dim", _ndim(n.args[0]))

    def keepdim(self, n) -> bool:
        pos = self.POSITIONS.get(opname(n), (1, 2))[1]
        return bool(n.kwargs.get("keepdim", False) if pos is None else _arg(n, pos, "keepdim", False))

    def links(self, n):
        x = n.args[0]
        nd = _ndim(x)
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
        if isinstance(_val(n), tuple | list):  # max/min with a dim: (values, indices)
            return [dim_link(x, mapping, out_index=i) for i in range(len(_val(n)))]
        return [dim_link(x, mapping)]

    def mode(self, n, sp):
        s = sp.seq(n.args[0])
        if s is None:
            return None
        dims = self.dims(n)
        if dims is not None and s.dim not in dims:
            return super().mode(n, sp)
        if opname(n) in self.SEQ_REDUCIBLE and not isinstance(_val(n), tuple | list) and n.kwargs.get("out") is None:
            return "reduce"
        return None

    def lower(self, cx, n):
        if cx.mode[n] == "shard":
            return cx.copy_sharded(n)
        x = n.args[0]
        s = cx.spec(x)
        xl = cx.masked(cx.shard_of(x, s), s, _shape(x))
        dims = self.dims(n)
        keep = self.keepdim(n)
        dtype = _arg(n, 3, "dtype")
        kw = {"dtype": dtype} if dtype is not None else {}
        g = cx.g
        if dims is None:
            part = g.call_function(torch.sum, (xl,), kw)
        else:
            part = g.call_function(torch.sum, (xl, dims, keep), kw)
        if opname(n) == "mean":
            count = math.prod(_shape(x)) if dims is None else math.prod(_shape(x)[d] for d in dims)
            part = g.call_function(operator.truediv, (part, count))
        return cx.all_reduce(part, _val(n).dtype)


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
        if _arg(n, 3 if name in self.CLASS else 2, "size_average") is not None or \
                _arg(n, 5 if name in self.CLASS else 3, "reduce") is not None:
            return "legacy"
        return _arg(n, pos, "reduction", "mean")

    def links(self, n):
        x, t = n.args[0], _arg(n, 1, "target")
        if not (_is_tensor_node(x) and _is_tensor_node(t)):
            return []
        red = self.reduction(n)
        if opname(n) in self.CLASS:
            nx = _ndim(x)
            if nx < 2:
                return []
            tx = {0: 0, **{d: d - 1 for d in range(2, nx)}}  # input dim -> target dim
            links = [dim_link(x, tx, out_index=TARGET)]
            if red == "none":
                links += [dim_link(t, {d: d for d in range(_ndim(t))}), dim_link(x, tx)]
            return links
        links = [dim_link(x, {d: d for d in range(_ndim(x))}, out_index=TARGET)]
        if red == "none":
            links += broadcast_links(n, [x, t], _shape(n))
        return links

    def rep_args(self, n):
        return {m for m in _tensor_inputs(n) if m is not n.args[0] and m is not _arg(n, 1, "target")}

    def mode(self, n, sp):
        x, t = n.args[0], _arg(n, 1, "target")
        sx, st = sp.seq(x), sp.seq(t)
        if sx is None or st is None:
            return None
        red = self.reduction(n)
        if red == "none":
            return "shard" if sp.seq(n) is not None else None
        if red not in ("mean", "sum"):
            return None
        if opname(n) in self.CLASS:
            if _val(t).dtype.is_floating_point:
                return None  # class probabilities: not handled
            if opname(n) == "cross_entropy" and _arg(n, 2, "weight") is not None and \
                    float(_arg(n, 7, "label_smoothing", 0.0) or 0.0) and red == "mean":
                return None
        return "reduce"

    def lower(self, cx, n):
        if cx.mode[n] == "shard":
            return cx.copy_sharded(n)
        g = cx.g
        name = opname(n)
        x, t = n.args[0], _arg(n, 1, "target")
        red = self.reduction(n)
        sx, st = cx.spec(x), cx.spec(t)
        xl, tl = cx.shard_of(x, sx), cx.shard_of(t, st)
        acc = _acc_dtype(_val(n).dtype)
        if name in self.CLASS:
            ii = _arg(n, 4, "ignore_index", -100)
            weight = _arg(n, 2, "weight")
            wl = cx.rep_for_sharded(weight) if isinstance(weight, fx.Node) else None
            valid = cx.valid(st, _shape(t))
            tm = g.call_function(torch.where, (valid, tl, ii))
            kw = {"weight": wl, "ignore_index": ii, "reduction": "sum"}
            if name == "cross_entropy":
                kw["label_smoothing"] = _arg(n, 7, "label_smoothing", 0.0)
            fn = torch.nn.functional.cross_entropy if name == "cross_entropy" else torch.nn.functional.nll_loss
            total = g.call_function(fn, (xl, tm), kw)
            if red == "sum":
                return cx.all_reduce(total, _val(n).dtype)
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
            return g.call_method("to", (out, _val(n).dtype))
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
        per = cx.masked(per, sx, _shape(x))
        total = g.call_method("sum", (per,))
        if red == "mean":
            total = g.call_function(operator.truediv, (total, math.prod(_shape(x))))
        return cx.all_reduce(total, _val(n).dtype)


TARGET = "target"
"""``Link.out_index`` of a loss's input <-> target relation (they hold the same positions)."""


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Partial sums cross ranks in fp32 (fp64 for fp64 and integer sums: counts stay exact)."""
    return torch.float32 if dtype in (torch.float32, torch.float16, torch.bfloat16) else torch.float64


class Site(Rule):
    """A rewritten attention site: q, k, v and (out, lse) on dim 2; the mask tensors stay replicated."""

    def links(self, n):
        q, k, v = n.args[:3]
        return [dim_link(m, {2: 2}, out_index=o) for m in (q, k, v) for o in (0, 1)]

    def rep_args(self, n):
        return set(n.args[3])

    def mode(self, n, sp):
        S = _shape(n.args[0])[2]
        want = Seq(2, S, 1)
        if all(sp.get(m) == want for m in n.args[:3]) and sp.get(n, 0) == want and sp.get(n, 1) == want:
            return "shard"
        return None

    def lower(self, cx, n):
        q, k, v, masks, key = n.args
        S = _shape(q)[2]
        loc = [cx.shard_of(m, Seq(2, S, 1)) for m in (q, k, v)]
        return cx.g.call_function(torch.ops.ultraattn.site_attention_local.default,
                                  (*loc, [cx.rep_of(m) for m in masks], key))


class Metadata(Rule):
    """size / dim / numel of a tensor: the global values, constants (no data needed)."""

    def mode(self, n, sp):
        return None


POINTWISE_EXTRA = {
    "where", "masked_fill", "clamp", "clip", "lerp", "addcmul", "addcdiv", "type_as", "dropout", "float_power",
    "logical_and", "logical_or", "logical_not", "logical_xor", "bitwise_and", "bitwise_or", "bitwise_xor",
    "bitwise_not", "floor_divide", "remainder", "positive", "maximum", "minimum", "fmax", "fmin", "nan_to_num",
}
IDENTITY = {
    "float", "double", "half", "bfloat16", "int", "long", "bool", "to", "type", "contiguous", "clone", "detach",
    "requires_grad_", "cpu", "cuda", "dropout", "dropout1d", "alpha_dropout", "feature_alpha_dropout", "zeros_like",
    "ones_like", "empty_like", "full_like", "rand_like", "randn_like", "type_as", "detach_",
}

RULES: dict[str, Rule] = {}
for _n in ("view", "reshape", "flatten", "unflatten", "squeeze", "unsqueeze", "view_as", "reshape_as"):
    RULES[_n] = Reshape()
for _n in ("expand", "expand_as", "broadcast_to"):
    RULES[_n] = Expand()
for _n in ("transpose", "swapaxes", "swapdims", "t", "permute", "movedim"):
    RULES[_n] = Permute()
for _n in IDENTITY:
    RULES[_n] = Identity()
RULES.update({
    "softmax": AlongDim(1), "log_softmax": AlongDim(1), "cumsum": AlongDim(1), "cumprod": AlongDim(1),
    "logcumsumexp": AlongDim(1), "normalize": AlongDim(2, default=1), "glu": AlongDim(1, default=-1,
                                                                                     keeps_positions=False),
    "flip": AlongDim(1, "dims", keeps_positions=False), "roll": AlongDim(2, "dims", keeps_positions=False),
    "tril": Triangle(), "triu": Triangle(),
    "layer_norm": Norm(), "rms_norm": Norm(), "linear": Linear(), "matmul": Matmul(), "mm": Matmul(),
    "bmm": Matmul(), "outer": Outer(), "ger": Outer(), "einsum": Einsum(), "embedding": Embedding(),
    "cat": Cat(), "concat": Cat(), "concatenate": Cat(), "stack": Cat(), "chunk": Split(), "split": Split(),
    "tensor_split": Split(), "unbind": Split(), "split_with_sizes": Split(), "getitem": GetItem(),
    "ultraattn_site": Site(), "size": Metadata(), "dim": Metadata(), "numel": Metadata(),
})
for _n in ("sum", "mean", "nansum", "nanmean", "amax", "amin", "max", "min", "prod", "std", "var", "norm",
           "logsumexp", "all", "any", "argmax", "argmin", "count_nonzero"):
    RULES[_n] = Reduction()
for _n in (*Loss.CLASS, *Loss.ELEMENTWISE):
    RULES[_n] = Loss()
RULES["dropout"] = Identity()
_POINTWISE = Pointwise()


def rule_for(n: fx.Node) -> Rule | None:
    name = opname(n)
    if name is None:
        return None
    r = RULES.get(name)
    if r is not None:
        if isinstance(r, Reduction) and name in ("max", "min") and len(n.args) > 1 and _is_tensor_node(n.args[1]):
            return _POINTWISE  # torch.max(a, b): elementwise
        return r
    if name in POINTWISE_EXTRA or _aten_pointwise(name):
        return _POINTWISE
    return None


_POINTWISE_CACHE: dict[str, bool] = {}


def _aten_pointwise(name: str) -> bool:
    """Whether aten's op of this name (or its in-place form's) is tagged pointwise."""
    if name in _POINTWISE_CACHE:
        return _POINTWISE_CACHE[name]
    base = name[:-1] if name.endswith("_") and not name.endswith("__") else name
    ok = False
    packet = getattr(torch.ops.aten, base, None)
    if packet is not None:
        try:
            for ov in packet.overloads():
                if torch.Tag.pointwise in getattr(packet, ov).tags:
                    ok = True
                    break
        except Exception:  # noqa: BLE001 - not an op packet
            ok = False
    _POINTWISE_CACHE[name] = ok
    return ok


def _inplace(n: fx.Node) -> bool:
    name = opname(n) or ""
    return (name.endswith("_") and not name.endswith("__")) or n.target in (operator.iadd, operator.isub,
                                                                            operator.imul, operator.itruediv)


# ----------------------------------------------------------------------------- analysis
@dataclass
class Analysis:
    """What the pass decided for one graph (plain data for reports and tests)."""

    specs: Specs
    mode: dict[fx.Node, str]
    """Nodes in the region -> 'shard' | 'reduce'."""
    seq_len: int
    sites: list[fx.Node]
    skipped_sites: dict[str, str] = field(default_factory=dict)
    """site node name -> why it stays a global-view op."""


def site_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    op = torch.ops.ultraattn.site_attention.default
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is op]


def align(gm: fx.GraphModule, seeds: dict[fx.Node, Seq]) -> tuple[Specs, dict[fx.Node, list[Link]]]:
    """Sequence specs of every value, from the seeds, by the rules' links (fixpoint, both directions)."""
    sp = Specs(max(s.length for s in seeds.values()) if seeds else None)
    for n, s in seeds.items():
        sp.set(n, s)
    links: dict[fx.Node, list[Link]] = {}
    for n in gm.graph.nodes:
        r = rule_for(n) if n.op in ("call_function", "call_method") else None
        if r is None:
            continue
        try:
            links[n] = r.links(n)
        except Exception:  # noqa: BLE001 - an op whose arguments the rule does not understand: no links
            links[n] = []
    for _ in range(100):
        sp.changed = False
        for n, lks in links.items():
            for lk in lks:
                if lk.out_index == TARGET:  # (a loss) input <-> target: the target node carries it
                    t = _arg(n, 1, "target")
                    a, b = sp.seq(lk.inp), sp.seq(t)
                    if a is not None:
                        sp.set(t, lk.fwd(a))
                    if b is not None:
                        sp.set(lk.inp, lk.bwd(b))
                    continue
                a = sp.seq(lk.inp, lk.in_index)
                b = sp.seq(n, lk.out_index)
                if a is not None:
                    sp.set(n, lk.fwd(a), lk.out_index)
                if b is not None:
                    sp.set(lk.inp, lk.bwd(b), lk.in_index)
        if not sp.changed:
            break
    return sp, links


def choose_region(gm: fx.GraphModule, sp: Specs, sites: list[fx.Node]) -> dict[fx.Node, str]:
    """The nodes that run on local tokens (see the module docstring), each with its mode."""
    modes: dict[fx.Node, str | None] = {}
    rules: dict[fx.Node, Rule] = {}
    for n in gm.graph.nodes:
        r = rule_for(n) if n.op in ("call_function", "call_method") else None
        if r is None:
            continue
        rules[n] = r
        try:
            modes[n] = r.mode(n, sp)
        except Exception:  # noqa: BLE001 - arguments the rule does not understand: replicated
            modes[n] = None
    region: dict[fx.Node, str] = {n: "shard" for n in sites if modes.get(n) == "shard"}
    nodes = list(gm.graph.nodes)
    pinned: set[fx.Node] = set()
    for n in nodes:  # an in-place op that cannot run sharded keeps the tensor it modifies replicated
        if n in rules and _inplace(n) and modes.get(n) is None and n.args and isinstance(n.args[0], fx.Node):
            pinned.add(n.args[0])

    def takes_sharded(user: fx.Node, m: fx.Node) -> bool:
        if user.op == "output":
            return True
        if user not in region:
            return False
        r = rules[user]
        if m in r.rep_args(user):
            return False
        if region[user] == "reduce":
            return True
        return any(lk.inp is m for lk in r.links(user))

    def is_tuple(n: fx.Node) -> bool:
        return isinstance(_val(n), tuple | list)

    def element_ok(gi: fx.Node) -> bool:
        """A getitem of a tuple can join with its producer: it runs sharded and its consumers take it so."""
        return modes.get(gi) == "shard" and all(takes_sharded(u, gi) or u in region for u in gi.users)

    changed = True
    while changed:
        changed = False
        for n in nodes:  # forwards: consumers of the region
            mode = modes.get(n)
            if n in region or mode is None or n in pinned:
                continue
            r = rules[n]
            if any(m in region and m not in r.rep_args(n) for m in _tensor_inputs(n) + _tuple_inputs(n)):
                if _inplace(n) and n.args[0] not in region:
                    continue
                if opname(n) == "getitem" and is_tuple(n.args[0]) and n.args[0] not in region:
                    continue
                region[n] = mode
                changed = True
        for n in reversed(nodes):  # backwards: producers whose every consumer takes them sharded
            if n in region or modes.get(n) != "shard" or n in pinned:
                continue
            if opname(n) == "getitem" and is_tuple(n.args[0]):
                continue  # joins with its tuple's producer
            users = list(n.users)
            if is_tuple(n):
                if users and all(opname(u) == "getitem" and element_ok(u) for u in users) and \
                        any(any(v in region for v in u.users) for u in users):
                    region[n] = "shard"
                    for u in users:
                        region.setdefault(u, "shard")
                    changed = True
                continue
            if not users or not any(u in region for u in users):
                continue
            if all(takes_sharded(u, n) for u in users):
                region[n] = "shard"
                changed = True
    return region


def _tuple_inputs(n: fx.Node) -> list[fx.Node]:
    return [m for m in n.all_input_nodes if isinstance(_val(m), tuple | list)]


def analyse(gm: fx.GraphModule) -> Analysis | None:
    """Alignment and region of ``gm`` (None: no site to shard around)."""
    sites = site_nodes(gm)
    if not sites:
        return None
    S = _shape(sites[0].args[0])[2]
    seeds = {}
    use = []
    skipped = {}
    for n in sites:
        q, k, v = n.args[:3]
        if not all(_is_tensor_node(m) and _ndim(m) == 4 for m in (q, k, v)) or \
                any(_shape(m)[2] != S for m in (q, k, v)):
            skipped[n.name] = f"sequence length differs from the graph's first attention ({S})"
            continue
        for m in (q, k, v):
            seeds[m] = Seq(2, S, 1)
        use.append(n)
    sp, _links = align(gm, seeds)
    for n in use:
        for o in (0, 1):
            sp.set(n, Seq(2, S, 1), o)
    region = choose_region(gm, sp, use)
    for n in use:
        if n not in region:
            skipped[n.name] = "its q, k or v is aligned with the sequence in two ways (a conflicting op)"
    return Analysis(specs=sp, mode=region, seq_len=S, sites=use, skipped_sites=skipped)


# ----------------------------------------------------------------------------- lowering
@dataclass
class Fallback:
    """A sharded tensor that an op outside the region needed whole (an all-gather)."""

    node: str
    op: str
    why: str
    bytes: int


@dataclass
class ShardRecord:
    """What ``lower`` did (reports, tests)."""

    layout: str
    seq_len: int
    local_len: int
    sharded_ops: int = 0
    reductions: int = 0
    dispatched: list[str] = field(default_factory=list)
    entered: int = 0
    fallbacks: list[Fallback] = field(default_factory=list)
    replicated_ops: int = 0
    outputs: list = field(default_factory=list)
    """Per graph output: None (replicated) or (dim, length, inner) of a returned shard."""
    skipped_sites: dict = field(default_factory=dict)
    key: str = ""
    """The layout's key in ``seq_ops.LAYOUTS``."""
    inlined_checkpoints: int = 0
    """Activation-checkpoint regions inlined (still recomputed in the backward: ``inline_checkpoints``)."""

    def to_dict(self) -> dict:
        return {"layout": self.layout, "seq_len": self.seq_len, "local_len": self.local_len,
                "sharded_ops": self.sharded_ops, "reductions": self.reductions, "dispatched": list(self.dispatched),
                "entered": self.entered, "replicated_ops": self.replicated_ops,
                "fallbacks": [f.__dict__ for f in self.fallbacks], "skipped_sites": dict(self.skipped_sites),
                "inlined_checkpoints": self.inlined_checkpoints}


class Lowering:
    """Builds the rewritten graph (``lower``); the helpers turn values into the form a new op takes."""

    def __init__(self, gm: fx.GraphModule, an: Analysis, key: str, record: ShardRecord, debug: bool = False):
        self.gm, self.an, self.key, self.rec, self.debug = gm, an, key, record, debug
        self.g = fx.Graph(owning_module=gm)
        self.mode = an.mode
        self.rep: dict[fx.Node, fx.Node] = {}
        self.local: dict[fx.Node, fx.Node] = {}
        self.cache: dict[tuple, fx.Node] = {}
        self.current: fx.Node | None = None

    # ------------------------------------------------------------------ specs
    def spec(self, n: fx.Node) -> Seq:
        s = self.an.specs.seq(n)
        assert s is not None, n.format_node()
        return s

    def want(self, user: fx.Node, m: fx.Node) -> Seq | None:
        """The spec ``user`` (in the region) takes ``m`` in, or None (replicated)."""
        r = rule_for(user)
        if m in r.rep_args(user):
            return None
        for lk in r.links(user):
            if lk.inp is m and lk.in_index is None and lk.out_index != TARGET:
                out = self.an.specs.seq(user, lk.out_index)
                if out is not None:
                    s = lk.bwd(out)
                    if s is not None:
                        return s
        return None

    # ------------------------------------------------------------------ forms
    def rep_of(self, m):
        """The global value of ``m`` (an all-gather if it only exists sharded: a fallback)."""
        if not isinstance(m, fx.Node):
            return m
        if m in self.rep:
            return self.rep[m]
        assert m in self.local, m.format_node()
        if isinstance(_val(m), tuple | list):  # a sharded tuple (chunk, split): each element gathered
            parts = []
            for i, s_i in enumerate(self.an.specs.v.get(m) or []):
                part = self.g.call_function(operator.getitem, (self.local[m], i))
                if isinstance(s_i, Seq):
                    part = self.g.call_function(torch.ops.ultraattn.sp_gather.default,
                                                (part, self.key, s_i.dim, s_i.length, s_i.inner))
                parts.append(part)
            self.rep[m] = self.g.call_function(_pack, tuple(parts))
            return self.rep[m]
        s = self.an.specs.seq(m)
        if s is None:
            raise NotImplementedError(f"ultraattn: {m.name} is sharded without a single sequence dim")
        user = self.current
        nbytes = _val(m).numel() * _val(m).element_size() if _is_tensor_node(m) else 0
        self.rec.fallbacks.append(Fallback(node=m.name, op=(opname(user) or user.op) if user is not None else "output",
                                           why=_why(user) if user is not None else "graph output",
                                           bytes=int(nbytes)))
        g = self.g.call_function(torch.ops.ultraattn.sp_gather.default, (self.local[m], self.key, s.dim, s.length,
                                                                         s.inner))
        self.rep[m] = g
        return g

    def shard_of(self, m: fx.Node, want: Seq) -> fx.Node:
        """``m`` on this rank's tokens in spec ``want`` (slices of the global value if it is replicated)."""
        if m in self.local and self.an.specs.seq(m) == want:
            return self.local[m]
        key = ("dispatch", m, want)
        if key not in self.cache:
            src = self.rep_of(m)
            check = _input_name(m) if self.debug and m.op == "placeholder" else ""
            self.cache[key] = self.g.call_function(torch.ops.ultraattn.sp_dispatch.default,
                                                   (src, self.key, want.dim, want.length, want.inner, check))
            self.rec.dispatched.append(m.name)
        return self.cache[key]

    def rep_for_sharded(self, m):
        """A replicated value used by an op in the region: its gradient is summed over the ranks."""
        if not isinstance(m, fx.Node):
            return m
        v = self.rep_of(m)
        val = _val(m)
        if not isinstance(val, torch.Tensor) or not val.requires_grad:
            return v
        key = ("enter", m)
        if key not in self.cache:
            from ultraattn.passes.seq_ops import sp_enter

            self.cache[key] = self.g.call_function(sp_enter, (v, self.key))
            self.rec.entered += 1
        return self.cache[key]

    def arg_for(self, user: fx.Node, m):
        if not isinstance(m, fx.Node):
            return m
        if isinstance(_val(m), tuple | list) and m in self.local:
            return self.local[m]
        want = self.want(user, m)
        return self.shard_of(m, want) if want is not None else self.rep_for_sharded(m)

    def copy_sharded(self, n: fx.Node) -> fx.Node:
        return self.g.node_copy(n, lambda m: self.arg_for(n, m))

    def local_shape(self, n: fx.Node) -> list[int]:
        shape = list(_shape(n))
        s = self.spec(n)
        outer = shape[s.dim] // (s.length * s.inner)
        shape[s.dim] = outer * LOCAL_LEN[self.key] * s.inner
        return shape

    # ------------------------------------------------------------------ reductions
    def valid(self, s: Seq, shape: tuple[int, ...]) -> fx.Node:
        """bool, broadcastable to the local form of a tensor of global ``shape`` and spec ``s``: which
        elements are real positions (not padding)."""
        key = ("valid", s, tuple(shape))
        if key not in self.cache:
            g = self.g
            L = LOCAL_LEN[self.key]
            outer = shape[s.dim] // (s.length * s.inner)
            dev = _val(self.an.sites[0].args[0]).device
            v = g.call_function(torch.ops.ultraattn.sp_valid.default, (self.key, s.length, dev))
            v = g.call_method("view", (v, [1, L, 1]))
            v = g.call_method("expand", (v, [outer, L, s.inner]))
            v = g.call_method("reshape", (v, [1] * s.dim + [outer * L * s.inner] + [1] * (len(shape) - s.dim - 1)))
            self.cache[key] = v
        return self.cache[key]

    def masked(self, x: fx.Node, s: Seq, shape: tuple[int, ...]) -> fx.Node:
        """``x`` (local, of a tensor of global ``shape``) with its padding positions zeroed."""
        return self.g.call_function(torch.where, (self.valid(s, shape), x, 0))

    def all_reduce(self, part: fx.Node, dtype: torch.dtype) -> fx.Node:
        """The sum over ranks of a partial reduction (accumulated in ``_acc_dtype``), cast to ``dtype``."""
        g = self.g
        acc = _acc_dtype(dtype)
        total = g.call_function(torch.ops.ultraattn.sp_all_reduce.default, (g.call_method("to", (part, acc)),
                                                                            self.key))
        self.rec.reductions += 1
        return g.call_method("to", (total, dtype))


LOCAL_LEN: dict[str, int] = {}
"""layout key -> local tokens per rank (for shapes in rewritten arguments)."""


def _why(user: fx.Node) -> str:
    name = opname(user)
    if user.op == "output":
        return "graph output"
    if name is None:
        return f"{user.op} {getattr(user.target, '__name__', user.target)} is not a torch op the pass knows"
    if rule_for(user) is None:
        return f"no sharding rule for {name}"
    return f"{name} is not token-wise along the sequence here"


def lower(gm: fx.GraphModule, an: Analysis, key: str, *, outputs: str, local_len: int, layout_text: str,
          debug: bool = False) -> ShardRecord:
    """Rewrite ``gm`` in place by the analysis (module docstring); returns what was done."""
    rec = ShardRecord(layout=layout_text, seq_len=an.seq_len, local_len=local_len,
                      skipped_sites=dict(an.skipped_sites))
    LOCAL_LEN[key] = local_len
    cx = Lowering(gm, an, key, rec, debug)
    g = cx.g
    for n in gm.graph.nodes:
        cx.current = n
        if n.op == "placeholder":
            new = g.node_copy(n)
            for attr, value in vars(n).items():  # Dynamo's own attributes (_dynamo_source: not in meta)
                if attr.startswith("_dynamo"):
                    setattr(new, attr, value)
            cx.rep[n] = new
            continue
        if n.op == "output":
            outs = []

            def out_value(m):
                if not isinstance(m, fx.Node):
                    return m
                if m in cx.local and m not in cx.rep and outputs == "sharded":
                    s = an.specs.seq(m)
                    outs.append((s.dim, s.length, s.inner))
                    return cx.local[m]
                if m in cx.local and m not in cx.rep:
                    outs.append(None)
                    s = an.specs.seq(m)
                    return g.call_function(torch.ops.ultraattn.sp_gather.default,
                                           (cx.local[m], key, s.dim, s.length, s.inner))
                outs.append(None)
                return cx.rep[m] if m in cx.rep else cx.rep_of(m)

            g.output(fx.map_arg(n.args[0], out_value))
            rec.outputs = outs
            continue
        mode = cx.mode.get(n)
        if mode is None:
            name = opname(n)
            if name in ("size", "dim", "numel") and isinstance(n.args[0], fx.Node) and n.args[0] in cx.local \
                    and n.args[0] not in cx.rep:
                const = _val(n)  # the global value, from the trace: users get the literal
                cx.rep[n] = tuple(const) if isinstance(const, torch.Size) else const
                continue
            new = g.node_copy(n, lambda m: cx.rep_of(m))
            cx.rep[n] = new
            rec.replicated_ops += 1
            continue
        try:
            new = rule_for(n).lower(cx, n)
        except Exception as exc:  # noqa: BLE001 - never wrong: run it on gathered data and say why
            cx.mode.pop(n)
            rec.fallbacks.append(Fallback(node=n.name, op=opname(n) or str(n.target),
                                          why=f"its sharded form failed ({type(exc).__name__}: {exc})", bytes=0))
            cx.rep[n] = g.node_copy(n, lambda m: cx.rep_of(m))
            rec.replicated_ops += 1
            continue
        new.meta = {k: v for k, v in n.meta.items() if k not in ("example_value", "val", "tensor_meta")}
        if mode == "reduce":
            cx.rep[n] = new
        else:
            cx.local[n] = new
            rec.sharded_ops += 1
    gm.graph = g
    gm.graph.eliminate_dead_code(is_impure_node=_impure)
    gm.graph.lint()
    gm.recompile()
    return rec


def _input_name(n: fx.Node) -> str:
    """A graph input's name as the user wrote it (Dynamo's ``L_tokens_`` -> ``tokens``)."""
    name = n.target if isinstance(n.target, str) else n.name
    for pre in ("L_", "l_", "G_", "g_"):
        name = name.removeprefix(pre)
    return name.rstrip("_") or n.name


def _pack(*xs):
    return xs


def _impure(n: fx.Node) -> bool:
    return n.is_impure() or (n.op == "call_function" and getattr(n.target, "namespace", None) == "ultraattn"
                             and "site_attention" in str(n.target))



def summarize(gm: fx.GraphModule, an: Analysis) -> dict:
    """What lowering would do, from the analysis alone (``ultraattn.explain``: no process group needed)."""
    local = {n for n, m in an.mode.items() if m == "shard"}
    fallbacks = []
    for n in gm.graph.nodes:
        if n.op in ("call_function", "call_method") and n not in an.mode:
            for m in n.all_input_nodes:
                if m in local and not (opname(n) in ("size", "dim", "numel")):
                    fallbacks.append({"node": m.name, "op": opname(n) or str(n.target), "why": _why(n)})
    return {"sharded_ops": len(local), "reductions": sum(m == "reduce" for m in an.mode.values()),
            "fallbacks": fallbacks, "skipped_sites": dict(an.skipped_sites), "seq_len": an.seq_len}


# ----------------------------------------------------------------------------- the backend's entry
def choose_layout(an: Analysis, specs_by_key: dict, values: dict, opts):
    """The graph's token layout: the first attention's own plan (planned now, without a given layout, where its
    mask is known at compile time: a static mask or mask tensors among the example inputs), else head-tail
    chunks (two per rank: balanced for causal-like masks). Every site of the graph is then planned in it.

    Returns (TokenLayout, how it was chosen)."""
    from ultraattn.planner.api import padded_chunk
    from ultraattn.planner.plan import TokenLayout

    world = opts.world_size
    first = an.sites[0]
    spec = specs_by_key[first.args[4]]
    masks = first.args[3]
    tensors = [values.get(m) for m in masks]
    if spec.mask in ("causal", "full") or (tensors and all(isinstance(t, torch.Tensor) and not
                                                            isinstance(t, torch._subclasses.FakeTensor)
                                                            for t in tensors)):
        from ultraattn.passes.site_op import seed_plan

        q = _val(first.args[0])
        plan = seed_plan(spec, q.dtype, q.device, tensors if spec.mask not in ("causal", "full") else [])
        return plan.layout, f"the plan of {spec.name}"
    block = spec.block_mask.get("q_block", opts.block_size) if spec.block_mask else opts.block_size
    chunk = padded_chunk(an.seq_len, 2 * world, block)
    half = list(range(world))
    return TokenLayout(chunk_size=chunk, owner=tuple(half + half[::-1])), "head-tail (the first mask is built " \
        "in the graph)"


def check_no_shards(example_inputs) -> None:
    """A graph with attention must see the global view: a shard an earlier graph returned is an error."""
    for v in example_inputs:
        if isinstance(v, torch.Tensor) and getattr(v, "_ultraattn_shard", None) is not None:
            raise ValueError(
                "a graph with attention received a tensor that an earlier ultraattn graph returned sharded "
                "(options['outputs']='sharded'): gather it first with ultraattn.undispatch(x), or keep "
                "options['outputs']='global' where the model has graph breaks between attention regions")


def _has_site(gm: fx.GraphModule) -> bool:
    op = torch.ops.ultraattn.site_attention.default
    return any(n.op == "call_function" and n.target is op for n in gm.graph.nodes) or \
        any(_has_site(m) for name, m in gm.named_children() if isinstance(m, fx.GraphModule))


def inline_checkpoints(gm: fx.GraphModule) -> int:
    """Inline the bodies of activation-checkpoint regions (``torch.utils.checkpoint`` under Dynamo: the
    ``tag_activation_checkpoint`` higher-order op) into ``gm``, so the analysis sees one flat graph.

    Checkpointing is kept: each inlined node carries the tags the higher-order op would have given it when
    AOT autograd traced it (``recompute = PREFER_RECOMPUTE`` and one ``ac_graph_id`` per region), which
    make_fx copies onto the aten nodes, so the partitioner recomputes the region in the backward exactly
    as before. Regions with a selective-checkpoint policy (``context_fn``) or nested higher-order ops stay
    as they are (run on gathered data, reported as fallbacks). Returns how many regions were inlined.
    """
    from torch.utils.checkpoint import CheckpointPolicy

    hop = getattr(torch.ops.higher_order, "tag_activation_checkpoint", None)
    g = gm.graph
    done = 0
    for n in list(g.nodes):
        if hop is None or n.op != "call_function" or n.target is not hop or n.args[0].op != "get_attr":
            continue
        body = getattr(gm, n.args[0].target)
        if "_checkpoint_context_fn" in getattr(body, "meta", {}) or set(n.kwargs) - {"use_reentrant"}:
            continue
        if any(b.op not in ("placeholder", "output", "call_function", "call_method") or
               isinstance(b.target, torch._ops.HigherOrderOperator) for b in body.graph.nodes):
            continue
        if any(u.op != "call_function" or u.target is not operator.getitem for u in n.users):
            continue
        _AC_IDS[0] += 1
        env: dict[fx.Node, object] = dict(zip([b for b in body.graph.nodes if b.op == "placeholder"], n.args[1:]))
        outs = None
        with g.inserting_before(n):
            for b in body.graph.nodes:
                if b.op == "output":
                    outs = fx.map_arg(b.args[0], lambda m: env[m])
                elif b.op != "placeholder":
                    new = g.node_copy(b, lambda m: env[m])
                    new.meta = dict(b.meta, recompute=CheckpointPolicy.PREFER_RECOMPUTE, ac_graph_id=_AC_IDS[0])
                    env[b] = new
        outs = outs if isinstance(outs, tuple | list) else (outs,)
        for u in list(n.users):
            u.replace_all_uses_with(outs[u.args[1]])
            g.erase_node(u)
        attr = n.args[0]
        g.erase_node(n)
        if not attr.users:
            g.erase_node(attr)
        done += 1
    if done:
        g.lint()
        gm.delete_all_unused_submodules()
        gm.recompile()
    return done


_AC_IDS = [1 << 20]
"""A counter for the inlined regions' ``ac_graph_id`` (apart from torch's own, which start at 1)."""


def shard_graph(gm: fx.GraphModule, specs: list, opts, example_inputs, graph_index: int) -> ShardRecord | None:
    """Sequence-shard ``gm`` in place for this rank (``opts.world_size`` > 1); None when it has no site to
    shard around. Every rank calls this with the same graph, in the same order (planning is collective)."""
    from ultraattn.passes.seq_ops import LAYOUTS
    from ultraattn.runtime.api import _resolve_group
    from ultraattn.runtime.sequence import SequenceShards

    if not _has_site(gm):
        return None
    inlined = inline_checkpoints(gm)
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    _refresh_meta(gm, phs, example_inputs)  # the rewritten sites' nodes have no fake values yet
    an = analyse(gm)
    if an is None or not an.sites:
        return None
    if any(not isinstance(d, int) for n in an.sites for d in _shape(n.args[0])):
        return None
    by_key = {sp.key: sp for sp in specs}
    values = dict(zip(phs, example_inputs))
    layout, how = choose_layout(an, by_key, values, opts)
    for n in an.sites:
        by_key[n.args[4]].layout = layout
    _mesh, ranks, group, me = _resolve_group(opts.mesh, None)
    key = f"g{graph_index}-{layout.to_string()}"
    LAYOUTS[key] = SequenceShards(layout, rank=me, global_ranks=ranks, group=group, timeout=opts.timeout)
    rec = lower(gm, an, key, outputs=opts.outputs, local_len=layout.local_len,
                layout_text=f"{layout.to_string()} ({how})", debug=opts.debug)
    rec.key = key
    rec.inlined_checkpoints = inlined
    _refresh_meta(gm, phs, example_inputs)
    return rec


def _refresh_meta(gm: fx.GraphModule, old_phs: list[fx.Node], example_inputs) -> None:
    """Fake values of the rewritten graph (Inductor's pre-grad passes read them), from the original inputs'."""
    from torch._guards import detect_fake_mode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    fakes = [n.meta.get("example_value") for n in old_phs]
    # the placeholders' own mode (torch 2.13's tracing context may hold another one)
    mode = next((f.fake_mode for f in fakes if isinstance(f, torch._subclasses.FakeTensor)), None) or \
        detect_fake_mode([f for f in fakes if isinstance(f, torch.Tensor)])
    if mode is None:
        return
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for n, f in zip(phs, fakes):
        n.meta["example_value"] = f
    FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*fakes)
    for n in gm.graph.nodes:
        if "val" in n.meta and n.op != "placeholder":
            n.meta["example_value"] = n.meta["val"]
