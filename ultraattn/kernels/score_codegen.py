"""A FlexAttention score_mod as Triton code, for the block-sparse kernels (``triton_kernels``).

The score_mod is traced twice on 0-d inputs (score fp32; batch, head, query and key indices int32, as
FlexAttention passes them; its buffers as they are), with FlexAttention's own rule that ``buf[i]`` on
0-d indices is a gather (``TransformGetItemToIndex``):

* forward: ``score -> score'``;
* joint: ``(score, dscore') -> (dscore, dbuf...)`` by autograd, for the buffers that want a gradient.

Each aten graph is then written out as one ``@triton.jit`` function, node by node. A 0-d graph is
elementwise, so the same code runs on a kernel's [BLOCK_M, BLOCK_N] score tile with the indices as
broadcast row and column vectors. A gather ``buf[i, j]`` becomes a load at ``i * stride0 + j`` (negative
indices wrap, as in torch); a buffer's gradient (``flex_lib.zeros_and_scatter`` in the joint graph)
becomes an atomic add into a zeroed fp32 tensor, masked to the scores the tile really attends; where the
address does not vary along a tile axis (a per-head slope) the tile is summed first. ``GRADS`` is for the dQ
kernel only, whose tiles are [queries, keys] (dK/dV calls ``bwd`` on transposed tiles, with ``GRADS`` off).

    fwd(s, b, h, q_idx, kv_idx, P0, P1, P2, P3) -> s'
    bwd(ds, s, b, h, q_idx, kv_idx, keep, P0..P3, D0..D3, GRADS: tl.constexpr) -> d s

``P*`` are the buffers (made contiguous; then tensor constants the graph holds), ``D*`` their gradients
(one per buffer), unused slots any tensor. The source is written to a file named by its hash (Triton
reads a jit function's source from its file) and imported once per process.

What is not translated raises :class:`Unsupported` with the reason, and the tiles then take the plain-torch
path: a gather of a vector (MLA's RoPE term indexes ``q_rope[b, h, q_idx]``, a row of numbers), reductions,
more than ``MAX_BUFFERS`` tensors, dtypes the kernels do not load. tanh has no core Triton function that the
interpreter also runs (libdevice is GPU-only), so it is written out (``_tanh``: Cephes' single-precision
rational form below 0.625, ``1 - 2 / (exp(2x) + 1)`` above: within 1.3 ulp of the exact value in fp32 over
±20, torch's own within 0.5).
"""

from __future__ import annotations

import hashlib
import importlib.util
import math
import os
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

MAX_BUFFERS = 4
"""Pointer slots for buffers and tensor constants the kernels pass (``P0..P3``) and gradients (``D0..D3``)."""

_TL = {torch.float32: "tl.float32", torch.float64: "tl.float64", torch.float16: "tl.float16",
       torch.bfloat16: "tl.bfloat16", torch.int32: "tl.int32", torch.int64: "tl.int64", torch.int16: "tl.int16",
       torch.int8: "tl.int8", torch.uint8: "tl.uint8", torch.bool: "tl.int1"}


class Unsupported(Exception):
    """The score_mod has something this generator does not translate (the message says what)."""


@dataclass(frozen=True)
class ScoreKernels:
    """The generated functions and what the kernels must pass with them."""

    fwd: object
    """``@triton.jit`` fwd(s, b, h, q_idx, kv_idx, P0..P3)."""
    bwd: object
    """``@triton.jit`` bwd(ds, s, b, h, q_idx, kv_idx, keep, P0..P3, D0..D3, GRADS)."""
    constants: tuple[Tensor, ...]
    """Tensor constants of the graphs, passed after the buffers."""
    source: str
    path: str


# ----------------------------------------------------------------------------- tracing
def _trace(fn: Callable, buffers: Sequence[Tensor], wanted: Sequence[int]):
    """(forward graph, joint graph) of the score_mod on 0-d inputs."""
    from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex
    from torch.fx.experimental.proxy_tensor import make_fx

    def forward(s, b, h, q, kv, *bufs):
        with TransformGetItemToIndex():
            return fn(s, b, h, q, kv, *bufs)

    def joint(s, b, h, q, kv, ds, *bufs):
        with torch.enable_grad():
            s = s.detach().requires_grad_()
            bs = [x.detach().requires_grad_(n in wanted) for n, x in enumerate(bufs)]
            with TransformGetItemToIndex():
                out = fn(s, b, h, q, kv, *bs)
            if not out.requires_grad:
                return (torch.zeros_like(s), *(torch.zeros_like(bs[n]) for n in wanted))
            got = torch.autograd.grad(out, [s, *(bs[n] for n in wanted)], ds, allow_unused=True)
            return tuple(torch.zeros_like(x) if g is None else g for g, x in zip(got, [s, *(bs[n] for n in wanted)]))

    def ins():   # distinct objects: make_fx maps a tensor to one placeholder
        return [torch.zeros((), dtype=torch.float32)] + [torch.zeros((), dtype=torch.int32) for _ in range(4)]

    bufs = [x.detach() for x in buffers]
    return make_fx(forward)(*ins(), *bufs), make_fx(joint)(*ins(), torch.zeros(()), *[x.clone() for x in bufs])


# ----------------------------------------------------------------------------- translation
_TANH = '''
@triton.jit
def _tanh(x):
    a = tl.abs(x)
    z = x * x
    small = ((((-5.70498872745e-3 * z + 2.06390887954e-2) * z - 5.37397155531e-2) * z + 1.33314422036e-1) * z
             - 3.33332819422e-1) * z * x + x
    big = 1.0 - 2.0 / (tl.exp(2.0 * a) + 1.0)
    return tl.where(a < 0.625, small, tl.where(x < 0, -big, big))
'''

_UNARY = {"neg": "-({0})", "abs": "tl.abs({0})", "exp": "tl.exp({0})", "exp2": "tl.exp2({0})",
          "log": "tl.log({0})", "log2": "tl.log2({0})", "sqrt": "tl.sqrt({0})", "rsqrt": "tl.rsqrt({0})",
          "sin": "tl.sin({0})", "cos": "tl.cos({0})", "sigmoid": "tl.sigmoid({0})", "erf": "tl.erf({0})",
          "floor": "tl.floor({0})", "ceil": "tl.ceil({0})", "tanh": "_tanh({0})", "reciprocal": "1.0 / ({0})",
          "relu": "tl.maximum({0}, 0.0)", "silu": "({0}) * tl.sigmoid({0})",
          "log1p": "tl.log(1.0 + ({0}))", "expm1": "(tl.exp({0}) - 1.0)"}
_BINARY = {"mul": "({0}) * ({1})", "maximum": "tl.maximum({0}, {1})", "minimum": "tl.minimum({0}, {1})"}
_COMPARE = {"eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">="}
_LOGIC = {"logical_and": "&", "logical_or": "|", "logical_xor": "^", "bitwise_and": "&", "bitwise_or": "|",
          "bitwise_xor": "^"}
_IDENTITY = {"detach", "alias", "clone", "lift_fresh_copy", "view", "_unsafe_view", "expand", "contiguous"}
_FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _op_name(target) -> tuple[str, bool]:
    """An aten op's name without overload and in-place suffix (``add_.Tensor`` -> ``add``), and whether it is
    in place."""
    name = getattr(target, "__name__", str(target)).split(".")[0]
    inplace = name.endswith("_") and not name.startswith("_")
    return (name[:-1] if inplace else name), inplace


def _lit(x) -> tuple:
    """A Python scalar as a literal value, with the dtype torch gives it."""
    return ("lit", x, torch.float32 if isinstance(x, float) else torch.bool if isinstance(x, bool) else torch.int64)


class _Writer:
    """Writes one graph as the body of a jit function (``lines``), one variable per node."""

    def __init__(self, n_buffers: int, constants: list[Tensor]):
        self.lines: list[str] = []
        self.env: dict[str, tuple] = {}
        self.n_buffers = n_buffers
        self.constants = constants
        self.axes: dict[str, frozenset] = {}
        """Per node: the tile axes its value varies along ("q", "kv"; the score varies along both)."""

    # A value: ("var", name, dtype) | ("lit", Python scalar, dtype) | ("buf", slot, shape, dtype) | ("const", tensor)
    # (folded, not yet placed) | ("scatter", [(shape, indices, value, axes)]) (a buffer gradient: a sum of scatters).
    def emit(self, expr: str, dtype: torch.dtype) -> tuple:
        name = f"t{len(self.lines)}"
        self.lines.append(f"{name} = {expr}")
        return ("var", name, dtype)

    def arg(self, v, dtype: torch.dtype | None = None) -> str:
        """The code of value ``v`` (or a Python scalar), cast to ``dtype`` when given."""
        if not isinstance(v, tuple):
            v = _lit(v)
        kind = v[0]
        if kind == "lit":
            x = v[1]
            if dtype is None:
                dtype = v[2]
            if dtype in _FLOATS:
                x = float(x)
                return repr(x) if math.isfinite(x) else f'float("{x}")'
            if dtype == torch.bool:
                return "True" if x else "False"
            return str(int(x))
        if kind == "var":
            if dtype is None or dtype == v[2]:
                return v[1]
            return f"{v[1]}.to({_TL[dtype]})"
        raise Unsupported(f"a {kind} value is used as a number")

    def value(self, a):
        """A node argument as a value."""
        if isinstance(a, torch.fx.Node):
            v = self.env[a.name]
            if v[0] == "const":   # a folded tensor, first used: inlined or given a pointer slot
                v = self.env[a.name] = self.slot(v[1])
            return v
        if isinstance(a, (int, float, bool)):
            return _lit(a)
        raise Unsupported(f"argument {a!r} of type {type(a).__name__}")

    def slot(self, t: Tensor) -> tuple:
        """A tensor constant: inlined when it has one element, else passed in a pointer slot."""
        if t.numel() == 1 and t.dim() == 0:
            return ("lit", t.item(), t.dtype)
        for n, c in enumerate(self.constants):   # (the forward's and the backward's graphs share them)
            if c.shape == t.shape and c.dtype == t.dtype and torch.equal(c, t.to(c.device)):
                return ("buf", self.n_buffers + n, tuple(t.shape), t.dtype)
        self.constants.append(t.detach().contiguous())
        return ("buf", self.n_buffers + len(self.constants) - 1, tuple(t.shape), t.dtype)

    def offset(self, shape: tuple, idx: list) -> str:
        """Element offset (int32, or int64 past 2**31 elements) of the indices ``idx`` into a contiguous tensor of
        ``shape``."""
        if len(idx) != len(shape) or any(i is None for i in idx):
            raise Unsupported(f"a gather from a {len(shape)}-d tensor with {len(idx)} indices (it reads a "
                              f"vector, not one number per score)")
        terms, stride = [], 1
        strides = []
        for n in reversed(shape):
            strides.append(stride)
            stride *= n
        # int32 offsets where they fit (half the registers of int64 over a whole score tile)
        it = torch.int32 if math.prod(shape) < 2 ** 31 else torch.int64
        for i, size, st in zip(idx, shape, reversed(strides)):
            v = self.value(i)
            if v[0] == "var" and v[2] in _FLOATS or v[0] not in ("var", "lit"):
                raise Unsupported("a gather with a non-integer index")
            code = self.arg(v, it) if v[0] == "var" else str(int(v[1]) % size)
            if v[0] == "var":
                code = self.emit(f"tl.where({code} < 0, {code} + {size}, {code})", it)[1]
            terms.append(code if st == 1 else f"{code} * {st}")
        return " + ".join(terms) if terms else "0"

    def node(self, n: torch.fx.Node) -> tuple:
        target = n.target
        name, _ = _op_name(target)   # an in-place op: its value (``run`` rebinds the input)
        packet = getattr(target, "_schema", None)
        overload = str(packet.name) if packet is not None else ""
        out = n.meta.get("val")
        dtype = out.dtype if isinstance(out, Tensor) else None
        args, kw = n.args, n.kwargs
        if overload == "flex_lib::zeros_and_scatter":
            shape, idx, val = args
            axes = frozenset().union(*(self.axes.get(x.name, frozenset()) for x in idx if isinstance(x, torch.fx.Node)))
            return ("scatter", [(tuple(shape), list(idx), self.value(val), axes)])
        if name in _IDENTITY:
            return self.value(args[0])
        if isinstance(out, Tensor) and out.dim() != 0:
            raise Unsupported(f"{overload or name} makes a {tuple(out.shape)} tensor per score (only elementwise "
                              f"score_mods and gathers of single numbers are generated)")
        if name == "index":
            src = self.value(args[0])
            if src[0] != "buf":
                raise Unsupported("a gather from something other than a buffer")
            return self.emit(f"tl.load(P{src[1]} + ({self.offset(src[2], list(args[1]))}))", src[3])
        if name in ("_to_copy", "to", "convert_element_type", "_conversion"):
            return self.emit(self.arg(self.value(args[0]), dtype), dtype)
        if name in ("scalar_tensor", "full"):
            v = args[0] if name == "scalar_tensor" else args[1]
            return ("lit", v, dtype)
        if name in ("zeros_like", "ones_like", "full_like", "zeros", "ones"):
            v = {"zeros_like": 0, "zeros": 0, "ones_like": 1, "ones": 1}.get(name, args[1] if len(args) > 1 else 0)
            return ("lit", v, dtype)
        a = [self.value(x) for x in args]
        if name in _UNARY:
            x = self.arg(a[0], dtype if dtype in _FLOATS else torch.float32)
            return self.emit(_UNARY[name].format(x), dtype)
        if name in ("add", "sub", "rsub"):
            alpha = kw.get("alpha", 1)
            x, y = self.arg(a[0], dtype), self.arg(a[1], dtype)
            if alpha != 1:
                y = f"({y}) * {self.arg(alpha, dtype)}"
            if name == "rsub":
                x, y = y, x
            return self.emit(f"({x}) {'+' if name == 'add' else '-'} ({y})", dtype)
        if name in ("mul", "maximum", "minimum"):
            return self.emit(_BINARY[name].format(self.arg(a[0], dtype), self.arg(a[1], dtype)), dtype)
        if name in ("div", "true_divide", "floor_divide", "remainder", "fmod"):
            mode = kw.get("rounding_mode", "floor" if name == "floor_divide" else None)
            if name in ("remainder", "fmod"):
                x, y = self.arg(a[0], dtype), self.arg(a[1], dtype)
                r = self.emit(f"({x}) % ({y})", dtype)[1]
                if name == "fmod":
                    return ("var", r, dtype)
                return self.emit(f"tl.where(({r} != 0) & (({r} < 0) != (({y}) < 0)), {r} + ({y}), {r})", dtype)
            if mode is None:
                return self.emit(f"({self.arg(a[0], dtype)}) / ({self.arg(a[1], dtype)})", dtype)
            if dtype in _FLOATS:
                q = self.emit(f"({self.arg(a[0], dtype)}) / ({self.arg(a[1], dtype)})", dtype)[1]
                return self.emit(f"tl.floor({q})" if mode == "floor" else
                                 f"tl.where({q} < 0, tl.ceil({q}), tl.floor({q}))", dtype)
            x, y = self.arg(a[0], dtype), self.arg(a[1], dtype)
            q = self.emit(f"({x}) // ({y})", dtype)[1]    # C division: truncates
            if mode == "trunc":
                return ("var", q, dtype)
            return self.emit(f"tl.where(({q} * ({y}) != ({x})) & ((({x}) < 0) != (({y}) < 0)), {q} - 1, {q})", dtype)
        if name in _COMPARE:
            common = torch.float32 if any(v[2] in _FLOATS for v in a if v[0] in ("var", "lit")) else torch.int64
            return self.emit(f"({self.arg(a[0], common)}) {_COMPARE[name]} ({self.arg(a[1], common)})", torch.bool)
        if name in _LOGIC:
            t = torch.bool if name.startswith("logical") else dtype
            return self.emit(f"({self.arg(a[0], t)}) {_LOGIC[name]} ({self.arg(a[1], t)})", dtype)
        if name in ("logical_not", "bitwise_not"):
            if dtype == torch.bool:
                return self.emit(f"({self.arg(a[0], torch.bool)}) == 0", dtype)
            return self.emit(f"~({self.arg(a[0], dtype)})", dtype)
        if name == "where":
            c, x, y = self.arg(a[0], torch.bool), self.arg(a[1], dtype), self.arg(a[2], dtype)
            return self.emit(f"tl.where({c}, {x}, {y})", dtype)
        if name in ("clamp", "clamp_min", "clamp_max"):
            bounds = {"clamp": (1, 2), "clamp_min": (1, None), "clamp_max": (None, 1)}[name]
            x = self.arg(a[0], dtype)
            for pos, key, fn in ((bounds[0], "min", "maximum"), (bounds[1], "max", "minimum")):
                b = args[pos] if pos is not None and pos < len(args) else kw.get(key)
                if b is not None:
                    x = self.emit(f"tl.{fn}({x}, {self.arg(self.value(b), dtype)})", dtype)[1]
            return ("var", x, dtype)
        if name == "pow" and a[1][0] == "lit":
            e = float(a[1][1])
            x = self.arg(a[0], dtype)
            if e == int(e) and 0 <= e <= 4:
                return self.emit(" * ".join([f"({x})"] * int(e)) if e else "1.0", dtype)
            if e == 0.5:
                return self.emit(f"tl.sqrt({x})", dtype)
            return self.emit(f"tl.exp2({e!r} * tl.log2({x}))", dtype)
        if name == "sign":
            x = self.arg(a[0], dtype)
            return self.emit(f"tl.where({x} > 0, 1, tl.where({x} < 0, -1, 0)).to({_TL[dtype]})", dtype)
        if name == "gelu":
            x = self.arg(a[0], dtype)
            if kw.get("approximate", "none") == "tanh":
                return self.emit(f"0.5 * {x} * (1.0 + _tanh(0.7978845608028654 * ({x} + 0.044715 * {x} * {x} * {x})))",
                                 dtype)
            return self.emit(f"0.5 * {x} * (1.0 + tl.erf({x} * 0.7071067811865476))", dtype)
        if name == "tanh_backward":
            g, y = self.arg(a[0], dtype), self.arg(a[1], dtype)
            return self.emit(f"{g} * (1.0 - {y} * {y})", dtype)
        if name == "sigmoid_backward":
            g, y = self.arg(a[0], dtype), self.arg(a[1], dtype)
            return self.emit(f"{g} * {y} * (1.0 - {y})", dtype)
        if name == "threshold_backward":
            g, x = self.arg(a[0], dtype), self.arg(a[1], dtype)
            return self.emit(f"tl.where({x} <= {self.arg(a[2], dtype)}, 0.0, {g})", dtype)
        if name == "gelu_backward":
            if kw.get("approximate", "none") != "none":
                raise Unsupported("gelu(approximate='tanh')'s backward")
            g, x = self.arg(a[0], dtype), self.arg(a[1], dtype)
            return self.emit(f"{g} * (0.5 * (1.0 + tl.erf({x} * 0.7071067811865476)) + {x} * "
                             f"0.3989422804014327 * tl.exp(-0.5 * {x} * {x}))", dtype)
        raise Unsupported(f"the op {overload or name} has no Triton translation here")

    def add_scatters(self, n: torch.fx.Node):
        a = [self.value(x) for x in n.args]
        if all(v[0] == "scatter" for v in a):
            return ("scatter", [p for v in a for p in v[1]])
        return None

    def run(self, gm: torch.fx.GraphModule, inputs: list[str], n_buffers: int) -> object:
        """Translate ``gm`` whose placeholders are ``inputs`` (names) then the buffers; the output node's args."""
        ph = [n for n in gm.graph.nodes if n.op == "placeholder"]
        along = {"s": {"q", "kv"}, "ds": {"q", "kv"}, "q_idx": {"q"}, "kv_idx": {"kv"}}
        for n, p in enumerate(ph):
            if n < len(inputs):
                val = p.meta["val"]
                self.env[p.name] = ("var", inputs[n], val.dtype)
                self.axes[p.name] = frozenset(along.get(inputs[n], ()))
            else:
                t = p.meta["val"]
                self.env[p.name] = ("buf", n - len(inputs), tuple(t.shape), t.dtype)
        known: dict[str, object] = {}   # nodes that depend on no input: their values (folded at generation)
        for n in gm.graph.nodes:
            if n.op == "get_attr":
                known[n.name] = getattr(gm, n.target)
                self.env[n.name] = ("const", known[n.name])
            elif n.op == "call_function" and all(x.name in known for x in n.all_input_nodes):
                val = n.target(*torch.fx.node.map_arg(n.args, lambda x: known[x.name]),
                               **torch.fx.node.map_arg(n.kwargs, lambda x: known[x.name]))
                if not isinstance(val, Tensor):
                    raise Unsupported(f"{n.target} makes a {type(val).__name__}")
                known[n.name] = val
                self.env[n.name] = ("const", val)
            elif n.op == "call_function":
                self.axes[n.name] = frozenset().union(*(self.axes.get(x.name, frozenset()) for x in n.all_input_nodes))
                got = self.add_scatters(n) if getattr(n.target, "__name__", "").startswith("add") else None
                self.env[n.name] = got if got is not None else self.node(n)
                if _op_name(n.target)[1] and isinstance(n.args[0], torch.fx.Node):
                    self.env[n.args[0].name] = self.env[n.name]   # later reads of the mutated input see its value
            elif n.op == "output":
                return n.args[0]
            elif n.op != "placeholder":
                raise Unsupported(f"a {n.op} node")
        raise Unsupported("no output")


def _source(fwd_gm, joint_gm, buffers: Sequence[Tensor], wanted: Sequence[int]) -> tuple[str, list[Tensor]]:
    for t in buffers:
        if t.dtype not in _TL or t.dtype == torch.bool:
            raise Unsupported(f"a {t.dtype} buffer")
    constants: list[Tensor] = []
    ptrs = ", ".join(f"P{n}" for n in range(MAX_BUFFERS))
    grads = ", ".join(f"D{n}" for n in range(MAX_BUFFERS))
    fw = _Writer(len(buffers), constants)
    out = fw.value(fw.run(fwd_gm, ["s", "b", "h", "q_idx", "kv_idx"], len(buffers)))
    res = fw.arg(out, torch.float32)
    lines = ["import triton", "import triton.language as tl", "", _TANH, "", "@triton.jit",
             f"def score_fwd(s, b, h, q_idx, kv_idx, {ptrs}):"]
    lines += [f"    {x}" for x in fw.lines] + [f"    return ({res}) + tl.zeros_like(s)", ""]
    bw = _Writer(len(buffers), constants)
    outs = bw.run(joint_gm, ["s", "b", "h", "q_idx", "kv_idx", "ds"], len(buffers))
    ds = bw.arg(bw.value(outs[0]), torch.float32)
    adds = []
    for slot, g in zip(wanted, outs[1:]):
        v = bw.value(g) if g is not None else ("scatter", [])
        if v[0] == "lit" and v[1] == 0:
            continue
        if v[0] != "scatter":
            raise Unsupported("a buffer gradient that is not a sum of gathers' scatters")
        for shape, idx, val, axes in v[1]:
            if tuple(shape) != tuple(buffers[slot].shape):
                raise Unsupported("a scatter into a tensor of another shape than its buffer")
            off = bw.offset(tuple(shape), idx)
            val = f"tl.where(keep, ({bw.arg(val, torch.float32)}) + zf, 0.0)"
            # [Note] reduce in the tile before the atomic add where the address does not vary along an axis (a
            # per-head slope: one add per tile, not one per score; the sum is a tree, not a chain of fp32 adds)
            ptr = f"D{slot} + ({off})"
            if not axes:
                add = f"{ptr}, tl.sum(tl.sum({val}, 1), 0)"
            elif axes == {"q"}:
                add = f"{ptr}, tl.sum({val}, 1, keep_dims=True)"
            elif axes == {"kv"}:
                add = f"{ptr}, tl.sum({val}, 0, keep_dims=True)"
            else:
                add = f"{ptr} + zi, {val}, mask=keep"
            adds.append(f"        tl.atomic_add({add}, sem='relaxed')")
    body = [f"    {x}" for x in bw.lines]   # (after the scatters: their offsets add lines)
    lines += ["@triton.jit", f"def score_bwd(ds, s, b, h, q_idx, kv_idx, keep, {ptrs}, {grads}, GRADS: tl.constexpr):"]
    lines += body
    if adds:
        lines += ["    if GRADS:", "        zf = tl.zeros_like(s)", "        zi = zf.to(tl.int32)"] + adds
    lines += [f"    return ({ds}) + tl.zeros_like(s)", ""]
    if len(buffers) + len(constants) > MAX_BUFFERS:
        raise Unsupported(f"{len(buffers)} buffers and {len(constants)} tensor constants (at most {MAX_BUFFERS})")
    return "\n".join(lines), constants


def _import(source: str) -> tuple[object, str]:
    """Write ``source`` to a file named by its hash (once) and import it (once per process)."""
    key = hashlib.sha256(source.encode()).hexdigest()[:24]
    name = f"ultraattn_score_{key}"
    if name in sys.modules:
        mod = sys.modules[name]
        return mod, mod.__file__
    folder = os.path.join(tempfile.gettempdir(), f"ultraattn-score-{os.getuid() if hasattr(os, 'getuid') else 0}")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, name + ".py")
    if not os.path.exists(path):
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            f.write(source)
        os.replace(tmp, path)   # atomic: ranks writing the same file at once read a whole one
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod, path


def generate(fn: Callable, buffers: Sequence[Tensor], grads: Sequence[bool] = ()) -> ScoreKernels:
    """The Triton functions of score_mod ``fn(score, b, h, q_idx, kv_idx, *buffers)``; ``grads[n]``: whether
    buffer ``n`` wants a gradient. Raises :class:`Unsupported` (with the reason) for what is not translated."""
    if len(buffers) > MAX_BUFFERS:
        raise Unsupported(f"{len(buffers)} buffers (at most {MAX_BUFFERS})")
    wanted = [n for n, w in enumerate(grads) if w]
    try:
        fwd_gm, joint_gm = _trace(fn, buffers, wanted)
    except Unsupported:
        raise
    except Exception as e:  # noqa: BLE001 - a score_mod make_fx cannot trace is one we do not generate
        first = str(e).splitlines()[0][:200] if str(e) else ""
        raise Unsupported(f"tracing it on 0-d inputs failed ({type(e).__name__}: {first})") from e
    source, constants = _source(fwd_gm, joint_gm, buffers, wanted)
    mod, path = _import(source)
    return ScoreKernels(fwd=mod.score_fwd, bwd=mod.score_bwd, constants=tuple(constants), source=source, path=path)
