"""Which sharding rule serves which op (by ``links.opname``); ops tagged pointwise in aten are token-wise."""

from __future__ import annotations

import functools
import operator

import torch
import torch.fx as fx

from ultraattn.passes.fx_util import is_tensor_node
from ultraattn.passes.shard.links import opname
from ultraattn.passes.shard.reductions import Loss, Metadata, Reduction, Site
from ultraattn.passes.shard.rules import (
    AlongDim,
    Cat,
    ComplexView,
    Einsum,
    Embedding,
    Expand,
    GetItem,
    Identity,
    LikeOther,
    Linear,
    Matmul,
    Norm,
    Outer,
    Permute,
    Pointwise,
    Reshape,
    Rule,
    Split,
    Triangle,
)

POINTWISE_EXTRA = {
    "where", "masked_fill", "clamp", "clip", "lerp", "addcmul", "addcdiv", "dropout", "float_power",
    "logical_and", "logical_or", "logical_not", "logical_xor", "bitwise_and", "bitwise_or", "bitwise_xor",
    "bitwise_not", "floor_divide", "remainder", "positive", "maximum", "minimum", "fmax", "fmin", "nan_to_num",
}
IDENTITY = {
    "float", "double", "half", "bfloat16", "int", "long", "bool", "type", "contiguous", "clone", "detach",
    "requires_grad_", "cpu", "cuda", "dropout", "dropout1d", "alpha_dropout", "feature_alpha_dropout", "zeros_like",
    "ones_like", "empty_like", "full_like", "rand_like", "randn_like", "detach_",
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
    "view_as_complex": ComplexView(), "view_as_real": ComplexView(), "type_as": LikeOther(), "to": LikeOther(),
    "ultraattn_site": Site(), "size": Metadata(), "dim": Metadata(), "numel": Metadata(),
})
for _n in ("sum", "mean", "nansum", "nanmean", "amax", "amin", "max", "min", "prod", "std", "var", "norm",
           "logsumexp", "all", "any", "argmax", "argmin", "count_nonzero"):
    RULES[_n] = Reduction()
for _n in (*Loss.CLASS, *Loss.ELEMENTWISE):
    RULES[_n] = Loss()
RULES["dropout"] = Identity()
POINTWISE = Pointwise()


def rule_for(n: fx.Node) -> Rule | None:
    name = opname(n)
    if name is None:
        return None
    r = RULES.get(name)
    if r is not None:
        if isinstance(r, Reduction) and name in ("max", "min") and len(n.args) > 1 and is_tensor_node(n.args[1]):
            return POINTWISE  # torch.max(a, b): elementwise
        return r
    if name in POINTWISE_EXTRA or aten_pointwise(name):
        return POINTWISE
    return None


@functools.cache
def aten_pointwise(name: str) -> bool:
    """Whether aten's op of this name (or its in-place form's) is tagged pointwise (a pure function of the
    name, memoised)."""
    base = name[:-1] if name.endswith("_") and not name.endswith("__") else name
    packet = getattr(torch.ops.aten, base, None)
    if packet is None:
        return False
    try:
        return any(torch.Tag.pointwise in getattr(packet, ov).tags for ov in packet.overloads())
    except Exception:  # noqa: BLE001 - not an op packet
        return False


def is_inplace(n: fx.Node) -> bool:
    name = opname(n) or ""
    return (name.endswith("_") and not name.endswith("__")) or n.target in (operator.iadd, operator.isub,
                                                                            operator.imul, operator.itruediv)


