"""Lowering of the sequence-sharding pass: the graph rewritten to run the region on this rank's tokens.

Builds a new graph from the analysis (see the package docstring): replicated tensors that line up
with the sequence are sliced (``sp_dispatch``) where they meet the region; replicated weights
entering it pass ``sp_enter``; a sharded tensor an op outside the region needs is all-gathered
(``sp_gather``, a reported fallback); shapes in view/reshape/expand arguments become local;
graph outputs are gathered or returned as the shard.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from ultraattn.passes.fx_util import is_impure, is_tensor_node, meta_value
from ultraattn.passes.ops.seq import sp_enter
from ultraattn.passes.records import Fallback, ShardSummary
from ultraattn.passes.shard.analysis import Analysis, why_gathered
from ultraattn.passes.shard.links import TARGET, Seq, opname, shape_of
from ultraattn.passes.shard.reductions import acc_dtype
from ultraattn.passes.shard.table import rule_for


@dataclass
class _Tally:
    """What ``lower`` did so far (frozen into a ``ShardSummary`` at the end)."""

    sharded_ops: int = 0
    reductions: int = 0
    dispatched: list[str] = field(default_factory=list)
    carried: list[str] = field(default_factory=list)
    entered: int = 0
    fallbacks: list[Fallback] = field(default_factory=list)
    replicated_ops: int = 0
    outputs: list = field(default_factory=list)


class Lowering:
    """Builds the rewritten graph (``lower``); the helpers turn values into the form a new op takes."""

    def __init__(self, gm: fx.GraphModule, an: Analysis, key: str, local_len: int, debug: bool = False):
        self.gm, self.an, self.key, self.local_len, self.debug = gm, an, key, local_len, debug
        self.rec = _Tally()
        self.g = fx.Graph(owning_module=gm)
        self.mode = an.mode
        self.rep: dict[fx.Node, fx.Node] = {}
        self.local: dict[fx.Node, fx.Node] = {}
        self.cache: dict[tuple, fx.Node] = {}
        self.grads: dict[fx.Node, bool] = {}
        """``carries_grad``'s answers."""
        self.current: fx.Node | None = None

    # ------------------------------------------------------------------ specs
    def seq_of(self, n: fx.Node) -> Seq | None:
        """The sequence spec of ``n``: a carried input's own, else the analysis's."""
        return self.an.carried.get(n) or self.an.specs.seq(n)

    def spec(self, n: fx.Node) -> Seq:
        s = self.seq_of(n)
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
        if isinstance(meta_value(m), tuple | list):  # a sharded tuple (chunk, split): each element gathered
            parts = []
            for i, s_i in enumerate(self.an.specs.v.get(m) or []):
                part = self.g.call_function(operator.getitem, (self.local[m], i))
                if isinstance(s_i, Seq):
                    part = self.g.call_function(torch.ops.ultraattn.sp_gather.default,
                                                (part, self.key, s_i.dim, s_i.length, s_i.inner))
                parts.append(part)
            self.rep[m] = self.g.call_function(_pack, tuple(parts))
            return self.rep[m]
        s = self.seq_of(m)
        if s is None:
            raise NotImplementedError(f"ultraattn: {m.name} is sharded without a single sequence dim")
        user = self.current
        nbytes = meta_value(m).numel() * meta_value(m).element_size() if is_tensor_node(m) else 0
        self.rec.fallbacks.append(Fallback(node=m.name, op=(opname(user) or user.op) if user is not None else "output",
                                           why=why_gathered(user) if user is not None else "graph output",
                                           bytes=int(nbytes)))
        g = self.g.call_function(torch.ops.ultraattn.sp_gather.default, (self.local[m], self.key, s.dim, s.length,
                                                                         s.inner))
        self.rep[m] = g
        return g

    def shard_of(self, m: fx.Node, want: Seq) -> fx.Node:
        """``m`` on this rank's tokens in spec ``want`` (slices of the global value if it is replicated)."""
        if m in self.local and self.spec(m) == want:
            return self.local[m]
        key = ("dispatch", m, want)
        if key not in self.cache:
            src = self.rep_of(m)
            check = _input_name(m) if self.debug and m.op == "placeholder" else ""
            self.cache[key] = self.g.call_function(torch.ops.ultraattn.sp_dispatch.default,
                                                   (src, self.key, want.dim, want.length, want.inner, check))
            self.rec.dispatched.append(m.name)
        return self.cache[key]

    def carries_grad(self, m: fx.Node) -> bool:
        """Whether a gradient can reach ``m``: its recorded value requires grad, or a floating-point value it is
        computed from does. (Dynamo's recorded value alone is not enough: ``1.0 + w.float()``, Gemma's RMSNorm
        scale, is recorded without requires_grad; a weight reaching the region through it must still have its
        gradient summed over the ranks.)"""
        todo = [m]
        while todo:   # (iterative: a model's graph is deeper than Python's recursion limit)
            n = todo[-1]
            if n in self.grads:
                todo.pop()
                continue
            val = meta_value(n)
            if not isinstance(val, torch.Tensor) or not (val.is_floating_point() or val.is_complex()):
                self.grads[n] = False
            elif val.requires_grad:
                self.grads[n] = True
            else:
                pending = [a for a in n.all_input_nodes if a not in self.grads]
                if pending:
                    todo.extend(pending)
                    continue
                self.grads[n] = any(self.grads[a] for a in n.all_input_nodes)
            todo.pop()
        return self.grads[m]

    def rep_for_sharded(self, m):
        """A replicated value used by an op in the region: its gradient is summed over the ranks."""
        if not isinstance(m, fx.Node):
            return m
        v = self.rep_of(m)
        if not self.carries_grad(m):
            return v
        key = ("enter", m)
        if key not in self.cache:
            self.cache[key] = self.g.call_function(sp_enter, (v, self.key))
            self.rec.entered += 1
        return self.cache[key]

    def arg_for(self, user: fx.Node, m):
        if not isinstance(m, fx.Node):
            return m
        if isinstance(meta_value(m), tuple | list) and m in self.local:
            return self.local[m]
        want = self.want(user, m)
        return self.shard_of(m, want) if want is not None else self.rep_for_sharded(m)

    def copy_sharded(self, n: fx.Node) -> fx.Node:
        return self.g.node_copy(n, lambda m: self.arg_for(n, m))

    def local_shape(self, n: fx.Node) -> list[int]:
        shape = list(shape_of(n))
        s = self.spec(n)
        outer = shape[s.dim] // (s.length * s.inner)
        shape[s.dim] = outer * self.local_len * s.inner
        return shape

    # ------------------------------------------------------------------ reductions
    def valid(self, s: Seq, shape: tuple[int, ...]) -> fx.Node:
        """bool, broadcastable to the local form of a tensor of global ``shape`` and spec ``s``: which
        elements are real positions (not padding)."""
        key = ("valid", s, tuple(shape))
        if key not in self.cache:
            g = self.g
            L = self.local_len
            outer = shape[s.dim] // (s.length * s.inner)
            dev = meta_value(self.an.sites[0].args[0] if self.an.sites else next(iter(self.an.carried))).device
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
        """The sum over ranks of a partial reduction (accumulated in ``acc_dtype``), cast to ``dtype``."""
        g = self.g
        acc = acc_dtype(dtype)
        total = g.call_function(torch.ops.ultraattn.sp_all_reduce.default, (g.call_method("to", (part, acc)),
                                                                            self.key))
        self.rec.reductions += 1
        return g.call_method("to", (total, dtype))


def _copy_placeholder(cx: Lowering, n: fx.Node) -> None:
    new = cx.g.node_copy(n)
    for attr, value in vars(n).items():  # Dynamo's own attributes (_dynamo_source: not in meta)
        if attr.startswith("_dynamo"):
            setattr(new, attr, value)
    if n in cx.an.carried:  # it arrives as this rank's tokens
        cx.local[n] = new
        cx.rec.carried.append(n.name)
    else:
        cx.rep[n] = new


def _output_value(cx: Lowering, m, outputs: str):
    """What the rewritten graph returns for output ``m``: the global value, or (``outputs="sharded"``) the
    local shard as is, recorded in ``cx.rec.outputs``."""
    if not isinstance(m, fx.Node):
        return m
    local_only = m in cx.local and m not in cx.rep
    s = cx.spec(m) if local_only else None
    if local_only and outputs == "sharded":
        cx.rec.outputs.append((s.dim, s.length, s.inner))
        return cx.local[m]
    cx.rec.outputs.append(None)
    if local_only:
        return cx.g.call_function(torch.ops.ultraattn.sp_gather.default, (cx.local[m], cx.key, s.dim, s.length,
                                                                           s.inner))
    return cx.rep[m] if m in cx.rep else cx.rep_of(m)


def _lower_replicated(cx: Lowering, n: fx.Node) -> None:
    """An op outside the region: it runs on global values (sizes of sharded tensors are the global constants)."""
    if opname(n) in ("size", "dim", "numel") and isinstance(n.args[0], fx.Node) and n.args[0] in cx.local \
            and n.args[0] not in cx.rep:
        const = meta_value(n)  # the global value, from the trace: users get the literal
        cx.rep[n] = tuple(const) if isinstance(const, torch.Size) else const
        return
    cx.rep[n] = cx.g.node_copy(n, lambda m: cx.rep_of(m))
    cx.rec.replicated_ops += 1


def _lower_region(cx: Lowering, n: fx.Node, mode: str) -> None:
    """An op in the region, by its rule; if its sharded form fails, it runs on gathered data (never wrong)."""
    try:
        new = rule_for(n).lower(cx, n)
    except Exception as exc:  # noqa: BLE001 - never wrong: run it on gathered data and say why
        cx.mode.pop(n)
        cx.rec.fallbacks.append(Fallback(node=n.name, op=opname(n) or str(n.target),
                                         why=f"its sharded form failed ({type(exc).__name__}: {exc})", bytes=0))
        cx.rep[n] = cx.g.node_copy(n, lambda m: cx.rep_of(m))
        cx.rec.replicated_ops += 1
        return
    new.meta = {k: v for k, v in n.meta.items() if k not in ("example_value", "val", "tensor_meta")}
    if mode == "reduce":
        cx.rep[n] = new
    else:
        cx.local[n] = new
        cx.rec.sharded_ops += 1


def lower(gm: fx.GraphModule, an: Analysis, key: str, *, outputs: str, local_len: int, layout_text: str,
          debug: bool = False) -> ShardSummary:
    """Rewrite ``gm`` in place by the analysis (package docstring) for the layout ``key`` with ``local_len``
    tokens per rank; returns what was done. The new nodes get fake values from the caller
    (``fx_util.refresh_fake_values``)."""
    cx = Lowering(gm, an, key, local_len, debug)
    for n in gm.graph.nodes:
        cx.current = n
        if n.op == "placeholder":
            _copy_placeholder(cx, n)
        elif n.op == "output":
            cx.g.output(fx.map_arg(n.args[0], lambda m: _output_value(cx, m, outputs)))
        elif cx.mode.get(n) is None:
            _lower_replicated(cx, n)
        else:
            _lower_region(cx, n, cx.mode[n])
    gm.graph = cx.g
    gm.graph.eliminate_dead_code(is_impure_node=_impure)
    gm.graph.lint()
    gm.recompile()
    t = cx.rec
    return ShardSummary(layout=layout_text, seq_len=an.seq_len, local_len=local_len, sharded_ops=t.sharded_ops,
                        reductions=t.reductions, dispatched=tuple(t.dispatched), carried=tuple(t.carried),
                        entered=t.entered, replicated_ops=t.replicated_ops, fallbacks=tuple(t.fallbacks),
                        skipped_sites=tuple(an.skipped_sites.items()), outputs=tuple(t.outputs), key=key)


def _input_name(n: fx.Node) -> str:
    """A graph input's name as the user wrote it (Dynamo's ``L_tokens_`` -> ``tokens``)."""
    name = n.target if isinstance(n.target, str) else n.name
    for pre in ("L_", "l_", "G_", "g_"):
        name = name.removeprefix(pre)
    return name.rstrip("_") or n.name


def _pack(*xs):
    return xs


def _impure(n: fx.Node) -> bool:
    return is_impure(n) or (n.op == "call_function" and getattr(n.target, "namespace", None) == "ultraattn"
                             and "site_attention" in str(n.target))



