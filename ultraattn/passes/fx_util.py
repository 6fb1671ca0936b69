"""FX helpers every pass shares: a node's fake value, fake values for inserted nodes, splicing a graph in.

Invariant the passes keep: every node they insert carries a correct ``meta["val"]``
(and ``meta["example_value"]`` in Dynamo's graphs, which is what Dynamo's nodes carry), so any
later pass, ours or Inductor's, can read shapes and dtypes without re-tracing.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Sequence

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.passes.fake_tensor_prop import FakeTensorProp


def meta_value(n):
    """The value recorded on node ``n`` (Dynamo's ``example_value`` or AOT's ``val``), or None."""
    if isinstance(n, fx.Node):
        return n.meta.get("example_value", n.meta.get("val"))
    return None


def tensor_value(n) -> torch.Tensor | None:
    """``meta_value`` when it is a tensor."""
    v = meta_value(n)
    return v if isinstance(v, torch.Tensor) else None


def is_tensor_node(n) -> bool:
    return tensor_value(n) is not None


def set_value(n: fx.Node, value) -> None:
    """Record ``value`` (a fake tensor, or a tuple of them) as node ``n``'s ``val`` and ``example_value``."""
    n.meta["val"] = value
    n.meta["example_value"] = value


def fake_call(target: Callable, args: tuple, kwargs: dict | None = None):
    """``target`` applied to the fake values of ``args``'s nodes (in their fake mode): the value a new node
    computing ``target(*args)`` will have."""
    vals = fx.node.map_aggregate(args, lambda a: meta_value(a) if isinstance(a, fx.Node) else a)
    kw = fx.node.map_aggregate(kwargs or {}, lambda a: meta_value(a) if isinstance(a, fx.Node) else a)
    flat = [v for v in _flatten(vals) if isinstance(v, torch.Tensor)]
    mode = value_fake_mode(flat)
    if mode is None:
        raise RuntimeError(f"ultraattn: no fake values on the inputs of {getattr(target, '__name__', target)}")
    with mode:
        return target(*vals, **kw)


def value_fake_mode(values):
    """The fake mode of the fake tensors among ``values``: their own, not the tracing context's (in torch 2.13
    Dynamo's tracing context may hold another mode than the one its example values were made in)."""
    return next((v.fake_mode for v in values if isinstance(v, FakeTensor)), None) or \
        detect_fake_mode([v for v in values if isinstance(v, torch.Tensor)])


def _flatten(x):
    if isinstance(x, list | tuple):
        for y in x:
            yield from _flatten(y)
    else:
        yield x


def insert_call(graph: fx.Graph, target: Callable, args: tuple, kwargs: dict | None = None) -> fx.Node:
    """A ``call_function`` node at the graph's insertion point, with its fake value."""
    node = graph.call_function(target, args, kwargs)
    set_value(node, fake_call(target, args, kwargs))
    return node


def splice(gm: fx.GraphModule, before: fx.Node, sub: fx.GraphModule, args: Sequence, *,
           meta: Callable[[fx.Node, fx.Node], dict] | None = None, attr_name: Callable[[], str] | None = None):
    """Copy ``sub``'s nodes into ``gm`` before ``before``, its placeholders bound to ``args``; returns what its
    output returns (nodes, in the same structure).

    ``meta(old, new)``: the meta the copied node gets (default: the copy's own). ``attr_name()``: a fresh
    attribute name for each of ``sub``'s ``get_attr`` constants (default: constants are refused).
    """
    graph = gm.graph
    env: dict[fx.Node, object] = dict(zip([n for n in sub.graph.nodes if n.op == "placeholder"], args))
    outs = None
    with graph.inserting_before(before):
        for n in sub.graph.nodes:
            if n.op == "placeholder":
                continue
            if n.op == "output":
                outs = fx.map_arg(n.args[0], lambda a: env[a])
                continue
            if n.op == "get_attr":
                if attr_name is None:
                    raise RuntimeError(f"ultraattn: cannot splice constant {n.target} of a subgraph")
                name = attr_name()
                setattr(gm, name, getattr(sub, n.target))
                new = graph.get_attr(name)
                new.meta = dict(n.meta)
            else:
                new = graph.node_copy(n, lambda a: env[a])
                if meta is not None:
                    new.meta = meta(n, new)
            env[n] = new
    return outs


def set_input(n: fx.Node, where: int | str, value: fx.Node) -> None:
    """Set argument ``where`` (position or keyword) of ``n``, and the fake input Inductor keeps for it
    (``eager_input_vals``: it lays a custom op's inputs out by those fakes' strides)."""
    if isinstance(where, int):
        n.update_arg(where, value)
    else:
        n.update_kwarg(where, value)
    vals = n.meta.get("eager_input_vals")
    if vals is not None:
        args, kwargs = list(vals[0]), dict(vals[1])
        if isinstance(where, int):
            args[where] = value.meta.get("val")
        else:
            kwargs[where] = value.meta.get("val")
        n.meta["eager_input_vals"] = (tuple(args), kwargs)


def is_impure(n: fx.Node) -> bool:
    """Whether dead-code elimination must keep ``n``: FX's own rule, plus the vmap nesting calls of a region Dynamo
    inlined (``torch._functorch.predispatch``: they return nothing anyone reads, yet without them the region's
    batched values have no level)."""
    return n.is_impure() or (n.op == "call_function" and
                             getattr(n.target, "__module__", "") == "torch._functorch.predispatch")


class _FakeProp(FakeTensorProp):
    """FakeTensorProp that steps over ``vmap`` regions Dynamo inlined (a BlockMask built inside the compiled code:
    ``create_block_mask``, or flex_attention's default mask): their values are functorch batched tensors, which
    have no fake snapshot ("your tensor may have escaped from inside a function being vmapped"). Such nodes keep
    the example values Dynamo gave them."""

    _ENTER = ("_vmap_increment_nesting",)
    _EXIT = ("_vmap_decrement_nesting",)

    def __init__(self, gm, mode):
        super().__init__(gm, mode)
        self._vmap_depth = 0

    def run_node(self, n):
        name = getattr(n.target, "__name__", "") if n.op == "call_function" else ""
        self._vmap_depth += (name in self._ENTER) - (name in self._EXIT)
        if self._vmap_depth > 0 or name in self._EXIT:
            return fx.Interpreter.run_node(self, n)
        return super().run_node(n)


def refresh_fake_values(gm: fx.GraphModule, old_placeholders: list[fx.Node], example_inputs) -> None:
    """Fake values for every node of a rewritten graph, propagated from the original inputs' fakes
    (``old_placeholders``: the placeholders before the rewrite, which hold them)."""
    fakes = [n.meta.get("example_value") for n in old_placeholders]
    mode = value_fake_mode(fakes)
    if mode is None:
        return
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for n, f in zip(phs, fakes):
        n.meta["example_value"] = f
    _FakeProp(gm, mode).propagate_dont_convert_inputs(*fakes)
    for n in gm.graph.nodes:
        if "val" in n.meta and n.op != "placeholder":
            n.meta["example_value"] = n.meta["val"]


def placeholders(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def ultraattn_op(n: fx.Node) -> str | None:
    """The op name of an ``ultraattn::`` call node (``cp_start``, ``site_attention``, ...), else None."""
    if n.op == "call_function" and getattr(n.target, "namespace", None) == "ultraattn":
        return n.target._opname
    return None


def module_digest(gm: fx.GraphModule | None) -> str:
    """A digest of what ``gm`` computes: its code (object addresses blanked), the value of every attribute its
    graph reads (a tensor by shape, dtype and bytes, anything else by its repr) and its submodules, recursively.
    Dynamo writes a score_mod's or mask_mod's numbers into its code (``tanh(score / 20)``) and its captured
    tensors either as inputs (the site's buffers: their values arrive at run time) or as attributes (read here),
    so two graphs with one digest compute the same function of their inputs."""
    h = hashlib.sha1()
    _digest_into(h, gm, set())
    return h.hexdigest()[:16]


def _digest_into(h, gm, seen: set[int]) -> None:
    if gm is None:
        h.update(b"none")
        return
    if id(gm) in seen:
        return
    seen.add(id(gm))
    h.update(re.sub(r"0x[0-9a-fA-F]+", "0x", gm.code).encode())
    for n in gm.graph.nodes:
        if n.op not in ("get_attr", "call_module"):
            continue
        value = gm
        for atom in str(n.target).split("."):
            value = getattr(value, atom)
        h.update(f"|{n.op}:{n.target}=".encode())
        if isinstance(value, fx.GraphModule):
            _digest_into(h, value, seen)
        elif isinstance(value, torch.Tensor):
            t = value.detach()
            h.update(repr((tuple(t.shape), str(t.dtype), str(t.device.type))).encode())
            if t.numel():
                h.update(t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        else:
            h.update(re.sub(r"0x[0-9a-fA-F]+", "0x", repr(value)).encode())


def specialize_sizes(gm: fx.GraphModule, example_inputs) -> list:
    """Make every symbolic size of ``gm`` the number it has now, with a guard; returns the example inputs to
    compile with.

    Dynamo makes a dimension symbolic when a frame recompiles with another size (automatic dynamic shapes: a
    second model of the same class at another sequence length, an eval pass on longer sequences). A plan is made
    for one sequence length, so the backend compiles each length on its own, as ``torch.compile(dynamic=False)``
    would: every size symbol is fixed to its current value through the shape environment (``guard_int``, the
    guard Dynamo then checks before running the graph, so another length recompiles), a ``SymInt`` input of such a
    size takes the number, and every node's fake value is propagated again from static inputs. A symbolic number
    that sizes no tensor (a window a mask_mod closes over, new every batch) stays symbolic: it reaches the site op
    as a 0-d tensor (``rewrite.py``), so a new value does not recompile. A graph with no symbolic size is returned
    as it is."""
    phs = placeholders(gm)
    metas = [ph.meta.get("example_value") for ph in phs]

    def symbolic(v) -> bool:
        return isinstance(v, torch.Tensor) and any(isinstance(d, torch.SymInt)
                                                   for d in (*v.shape, *v.stride(), v.storage_offset()))

    # sizes anywhere in the graph: Dynamo may fix a size while it traces (a guard), leaving earlier nodes' values
    # symbolic with a constant expression, and the placeholders static
    dims = [d for gm_ in gm.modules() if isinstance(gm_, fx.GraphModule) for n in gm_.graph.nodes
            for v in _flat_values(meta_value(n)) if symbolic(v)
            for d in (*v.shape, *v.stride(), v.storage_offset()) if isinstance(d, torch.SymInt)]
    if not dims:   # (a symbolic number that is no size, a window a mask_mod reads, stays an input: rewrite.py)
        return list(example_inputs)
    sizes = {sym for d in dims for sym in d.node.expr.free_symbols}
    from torch._guards import TracingContext
    from torch.fx.experimental.symbolic_shapes import guard_float, guard_int

    # (the tracing context's mode: flex_attention's fake implementation makes its score_mod's inputs there)
    context = TracingContext.try_get()
    for d in dims:
        guard_int(d)
    mode = context.fake_mode if context is not None and context.fake_mode is not None else \
        value_fake_mode([v for v in metas if isinstance(v, torch.Tensor)])
    values = list(example_inputs)
    for i, (ph, v) in enumerate(zip(phs, metas)):
        if isinstance(v, torch.SymInt | torch.SymFloat) and v.node.expr.free_symbols & sizes:
            number = guard_int(v) if isinstance(v, torch.SymInt) else guard_float(v)
            for user in list(ph.users):
                user.args = fx.map_arg(user.args, lambda a, ph=ph, number=number: number if a is ph else a)
                user.kwargs = fx.map_arg(user.kwargs, lambda a, ph=ph, number=number: number if a is ph else a)
            ph.meta["example_value"] = ph.meta["val"] = number
            values[i] = number
        elif symbolic(v) or (isinstance(v, FakeTensor) and v.fake_mode is not mode):
            static = _static_fake(v, mode)
            ph.meta["example_value"] = ph.meta["val"] = static
            if isinstance(values[i], torch.Tensor) and symbolic(values[i]):
                values[i] = static
    gm.recompile()
    refresh_fake_values(gm, phs, [ph.meta["example_value"] for ph in phs])
    return values


def _static_fake(v: torch.Tensor, mode) -> torch.Tensor:
    """A fake tensor like ``v`` with every size, stride and offset its current value (guarded)."""
    from torch.fx.experimental.symbolic_shapes import guard_int

    size = tuple(guard_int(d) for d in v.shape)
    stride = tuple(guard_int(d) for d in v.stride())
    with mode:
        t = torch.empty_strided(size, stride, dtype=v.dtype, device=v.device)
        if v.storage_offset():
            t = t.as_strided(size, stride, guard_int(v.storage_offset()))
    t.requires_grad_(v.requires_grad)
    return torch.nn.Parameter(t, requires_grad=v.requires_grad) if isinstance(v, torch.nn.Parameter) else t


#: largest constant the backend computes at compile time (elements): an S x S mask at S = 16K
MAX_CONSTANT_ELEMENTS = 1 << 28


def constant_value(node: fx.Node) -> torch.Tensor | None:
    """The value of ``node`` when the graph computes it from no input at all (a mask built from ``torch.arange``
    alone, as transformers builds its causal mask inside a compiled model), computed now, eagerly, on the device the
    graph names; None when it reads an input, calls a module, is random or impure, or would exceed
    ``MAX_CONSTANT_ELEMENTS``."""
    seen: set[fx.Node] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        if n.op not in ("call_function", "call_method", "get_attr") or is_impure(n) or \
                "rand" in str(getattr(n.target, "__name__", n.target)):
            return None
        v = meta_value(n)
        if isinstance(v, torch.Tensor) and v.numel() > MAX_CONSTANT_ELEMENTS:
            return None
        seen.add(n)
        stack.extend(n.all_input_nodes)
    owner = node.graph.owning_module
    env: dict[fx.Node, object] = {}
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    try:
        with unset_fake_temporarily(), torch.no_grad():
            for n in node.graph.nodes:
                if n not in seen:
                    continue
                args = fx.map_arg(n.args, env.__getitem__)
                kwargs = fx.map_arg(n.kwargs, env.__getitem__)
                if n.op == "get_attr":
                    value = owner
                    for atom in str(n.target).split("."):
                        value = getattr(value, atom)
                    env[n] = value
                elif n.op == "call_method":
                    env[n] = getattr(args[0], n.target)(*args[1:], **kwargs)
                else:
                    env[n] = n.target(*args, **kwargs)
    except Exception:  # noqa: BLE001 - what cannot be computed eagerly is not a constant here
        return None
    value = env[node]
    return value if isinstance(value, torch.Tensor) and not isinstance(value, FakeTensor) else None


def _flat_values(v) -> list:
    """The tensors in a node's value (one, or a tuple or list of them)."""
    if isinstance(v, torch.Tensor):
        return [v]
    if isinstance(v, list | tuple):
        return [x for y in v for x in _flat_values(y)]
    return []
