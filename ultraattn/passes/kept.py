"""Kept flex_attention sites on CPU: PyTorch's own eager flex_attention, with the BlockMask's blocks, as one op.

A site the backend cannot rewrite (a score_mod, cross-attention across ranks, ...) keeps the user's
``flex_attention`` call: the answer must be exactly what the model computes without ultraattn. On a GPU
Inductor lowers that call as it always does. On CPU it cannot: Inductor's CPU flex_attention is
inference-only (no LSE, no backward: "torch.compile on CPU only supports inference") and its lowering
rejects queries that are views of a projection ("not enough values to unpack (expected 4, got 2)", also
without ultraattn). Plain ``torch.compile`` never gets that far on CPU in training, because flex_attention's
front end refuses CPU backward while Dynamo traces; the backend lifts that refusal for the sites it rewrites
(``flex_shim.py``), so it must make the sites it keeps run too.

So on CPU each kept flex site becomes ``ultraattn::kept_flex(q, k, v, tensors, key)`` (``ops/kept.py``): the
flex_attention higher-order op called eagerly, which is PyTorch's reference implementation, forward and
backward (its backward differentiates the score_mod, including captured tensors such as a learned bias
table). Inductor sees an opaque op and compiles the rest of the graph. One correction: PyTorch's eager path
reads the mask_mod alone and ignores which blocks the BlockMask lists, which is wrong for a BlockMask built
from blocks (attn-gym's VSA); ``KeptFlex.call`` applies the blocks as a GPU does. It does so under every
compiler (``aot_eager`` would run the eager path as is). ``KeptFlex`` holds what the call needs besides
tensors (the score_mod and mask_mod graphs, the BlockMask's static fields, scale, kernel options) in the side
table under ``key``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch import Tensor

from ultraattn.masks.convert import listed_blocks
from ultraattn.passes.capture import Site
from ultraattn.passes.fx_util import insert_call, module_digest, tensor_value
from ultraattn.passes.records import SiteForm


@dataclass(frozen=True)
class _Slot:
    """Position ``i`` of the op's tensor list."""

    i: int


@dataclass(frozen=True, kw_only=True)
class KeptFlex:
    """One kept flex site's call without its tensors (``call`` puts them back)."""

    score_mod: fx.GraphModule
    block_mask: tuple
    """The BlockMask tuple of the call, each tensor a ``_Slot`` and the mask_mod its graph module."""
    scale: float
    kernel_options: dict
    score_slots: tuple[int, ...]
    mask_slots: tuple[int, ...]
    grad_slots: tuple[int, ...]
    """Tensors that may get gradients: the score_mod's floating-point buffers (a learned bias)."""

    @property
    def identity(self) -> str:
        """A digest of what the call computes besides its tensors: the score_mod's and mask_mod's graphs with their
        constants (``fx_util.module_digest``) and every other field."""
        parts = [module_digest(x) if isinstance(x, fx.GraphModule) else repr(x) for x in
                 (self.score_mod, *self.block_mask, self.scale, sorted(self.kernel_options.items()),
                  self.score_slots, self.mask_slots, self.grad_slots)]
        return hashlib.sha1("|".join(parts).encode()).hexdigest()[:16]

    def call(self, q: Tensor, k: Tensor, v: Tensor, tensors) -> tuple[Tensor, Tensor, Tensor]:
        """flex_attention's higher-order op: (out, lse in log2 units, max), as in the graph, with the BlockMask's
        blocks applied (``_blocked``)."""
        bm = tuple(tensors[x.i] if isinstance(x, _Slot) else x for x in self.block_mask)
        bm = (*bm[:-1], _blocked(bm))
        return torch.ops.higher_order.flex_attention(q, k, v, self.score_mod, bm, self.scale, self.kernel_options,
                                                     tuple(tensors[i] for i in self.score_slots),
                                                     tuple(tensors[i] for i in self.mask_slots))


def _blocked(bm: tuple):
    """The BlockMask's mask_mod restricted to its blocks: a pair attends where its block is FULL, or PARTIAL and the
    mask_mod holds. That is what flex_attention computes on a GPU; its eager CPU path reads the mask_mod alone,
    which differs for a BlockMask built from blocks (attn-gym's VSA: top-k tiles with a mask_mod that only
    masks padding)."""
    q_len, kv_len, kvn, kvi, fkn, fki = bm[:6]
    qb, kb, mask_mod = bm[-3], bm[-2], bm[-1]
    partial, full = listed_blocks(kvn, kvi, fkn, fki, -(-q_len // qb), -(-kv_len // kb))
    nb, nh = partial.shape[:2]

    def blocked_mask_mod(b, h, q_idx, kv_idx, *buffers):
        at = (b if nb > 1 else b * 0, h if nh > 1 else h * 0, q_idx // qb, kv_idx // kb)
        return full[at] | (partial[at] & mask_mod(b, h, q_idx, kv_idx, *buffers))

    return blocked_mask_mod


def _constant(owner: fx.GraphModule, x, tensors: list[fx.Node]):
    """``x`` of the call as it goes into ``KeptFlex``: a tensor node becomes a slot (appended to ``tensors``), a
    graph module attribute the module itself; raises ValueError for any other node (a symbolic number)."""
    if isinstance(x, fx.Node):
        if x.op == "get_attr":
            return getattr(owner, x.target)
        if tensor_value(x) is not None:
            tensors.append(x)
            return _Slot(len(tensors) - 1)
        raise ValueError(f"{x.name} is not a tensor")
    return x


def kept_flex_call(site: Site) -> tuple[KeptFlex, list[fx.Node]] | None:
    """The ``KeptFlex`` of a flex site and the tensor nodes its op takes, or None where a call argument is symbolic
    (the site then stays flex_attention, as Inductor lowers it)."""
    q, k, v, score_mod, bm, scale, kernel_options, score_buffers, mask_buffers = site.node.args[:9]
    owner = site.node.graph.owning_module
    tensors: list[fx.Node] = []
    try:
        sm = _constant(owner, score_mod, tensors)
        block_mask = tuple(_constant(owner, x, tensors) for x in bm)
        score = tuple(_constant(owner, x, tensors) for x in score_buffers)
        mask = tuple(_constant(owner, x, tensors) for x in mask_buffers)
    except ValueError:
        return None
    if not isinstance(sm, fx.GraphModule) or isinstance(scale, fx.Node) or \
            not all(isinstance(x, _Slot) for x in (*score, *mask)):
        return None
    grads = tuple(s.i for s in score if tensor_value(tensors[s.i]).dtype.is_floating_point)
    kept = KeptFlex(score_mod=sm, block_mask=block_mask, scale=scale, kernel_options=dict(kernel_options or {}),
                    score_slots=tuple(s.i for s in score), mask_slots=tuple(s.i for s in mask), grad_slots=grads)
    return kept, tensors


def keep_flex_eager(sites: list[Site], table, code: str) -> dict[str, str]:
    """Each kept flex site of ``sites`` as an ``ultraattn::kept_flex`` call (module docstring), in place; returns
    site name -> the key under which ``table`` (the side table) holds its ``KeptFlex``, derived from ``code`` (the
    graph's code as Dynamo gave it, which the rewritten sites' keys digest too: ``SideTable.site_key``)."""
    keys = {}
    touched = {}
    for s in sites:
        if s.form is not SiteForm.KEPT_FLEX:  # (``forms.form_for``)
            continue
        made = kept_flex_call(s)
        if made is None:
            raise RuntimeError(f"ultraattn: internal error: flex site {s.name} was decided kept, and its call has "
                               f"symbolic arguments")
        kept, tensors = made
        key = table.site_key(f"{s.name}-kept", code, s.q_shape, s.kv_shape, s.dtype, kept.identity)
        table.add_kept(key, kept)
        graph = s.node.graph
        q, k, v = s.node.args[:3]  # (not s.q: rewriting an earlier site may have replaced the node q was)
        with graph.inserting_before(s.node):
            res = insert_call(graph, torch.ops.ultraattn.kept_flex.default, (q, k, v, tensors, key))
        attrs = [a for a in s.node.all_input_nodes if a.op == "get_attr"]  # score_mod, mask_mod: KeptFlex holds them
        s.node.replace_all_uses_with(res)
        graph.erase_node(s.node)
        for a in attrs:  # (a graph without them stays inlinable: shard/checkpoint.py)
            if not a.users:
                graph.erase_node(a)
        touched[id(graph)] = graph.owning_module
        keys[s.name] = key
    for mod in touched.values():
        mod.graph.lint()
        mod.recompile()
    return keys
