"""Alignment vocabulary of the sequence-sharding pass: which dimension of a value carries the sequence.

``Seq`` describes one such dimension (its global size is ``outer * length * inner``); a ``Link``
relates an op's input dim to its output dim (the same positions); ``Specs`` holds the ``Seq``
(or ``TOP``: aligned two ways, never sharded) of every value while ``analysis.align`` propagates
them. ``opname`` gives every torch op one name (``torch.add``, ``x.add`` and ``operator.add``
are all "add"), which the rule table is keyed by.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.fx as fx

from ultraattn.passes.fx_util import is_tensor_node, meta_value


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


def shape_of(n) -> tuple[int, ...]:
    return tuple(meta_value(n).shape)


def ndim_of(n) -> int:
    return meta_value(n).dim()


def norm_dim(d: int, ndim: int) -> int:
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


def arg(n: fx.Node, i: int, name: str, default=None):
    """Argument ``name`` at position ``i`` (self is position 0 for methods and functions alike)."""
    if len(n.args) > i:
        return n.args[i]
    return n.kwargs.get(name, default)


def dims_arg(n: fx.Node, i: int, name: str, ndim: int) -> list[int] | None:
    """A dim / dims argument normalised to a sorted list (None: all dims)."""
    d = arg(n, i, name)
    if d is None:
        return None
    if isinstance(d, int):
        return [norm_dim(d, ndim)]
    return sorted(norm_dim(x, ndim) for x in d)


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
    src = shape_of(inp)
    return Link(inp, lambda s: band(src, out_shape, s), lambda s: band(out_shape, src, s), out_index)


def broadcast_links(n: fx.Node, inputs: list[fx.Node], out_shape: tuple[int, ...]) -> list[Link]:
    links = []
    for m in inputs:
        shp = shape_of(m)
        off = len(out_shape) - len(shp)
        mapping = {d: d + off for d in range(len(shp)) if off >= 0 and shp[d] == out_shape[d + off] and shp[d] > 1}
        links.append(dim_link(m, mapping))
    return links


def tuple_inputs(n: fx.Node) -> list[fx.Node]:
    """Inputs of ``n`` whose value is a tuple or list (a chunk/split result indexed by getitem)."""
    return [m for m in n.all_input_nodes if isinstance(meta_value(m), tuple | list)]


def tensor_inputs(n: fx.Node) -> list[fx.Node]:
    seen: list[fx.Node] = []
    for m in n.all_input_nodes:
        if is_tensor_node(m) and m not in seen:
            seen.append(m)
    return seen


TARGET = "target"
"""``Link.out_index`` of a loss's input <-> target relation (they hold the same positions)."""



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
        val = meta_value(n)
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


