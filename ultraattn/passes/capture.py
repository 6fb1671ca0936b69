"""Find the attention sites of a Dynamo graph and decide, per site, whether it can be rewritten exactly.

Two kinds of site, as Dynamo hands them to a backend:

* ``torch._C._nn.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0,
  is_causal=False, scale=None, enable_gqa=False)``: rewritten when there is no dropout, the
  mask is absent or boolean, and the shapes are 4-D self-attention (or cross-attention at
  world size 1). An additive float mask keeps the original op.
* ``torch.ops.higher_order.flex_attention(q, k, v, score_mod, block_mask_tuple, scale,
  kernel_options, score_mod_buffers, mask_mod_buffers)``: rewritten when the auxiliary "max"
  output is not used. A score_mod other than the identity goes with the site (its graph, and its
  buffers as run-time inputs after the mask's): every tile applies it with global indices
  (``runtime.tiles.ScoreMod``). At world size 1 such a site keeps flex_attention. The block-mask
  tuple is parsed by position from both ends, because its middle grew fields across torch versions.

Every site gets a reason string, shown in reports; a site that is not rewritten runs as the
user wrote it, so the answer is never wrong.

Find, then rewrite: ``find_sites`` only reads the graph and returns ``Site`` match
objects; each carries what its replacement needs (``mask_inputs``, ``flex_info``) and how to put
it in place (``replace_with``), which ``rewrite.py`` calls.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from ultraattn.passes.fx_util import constant_value, insert_call, meta_value, tensor_value
from ultraattn.passes.records import SiteForm, SiteRecord
from ultraattn.passes.site import FlexMaskInfo

_INV_LN2 = 1.0 / math.log(2.0)
_NO_MASK_BLOCK = 1 << 30
"""The block size of the BlockMask flex_attention makes when it is given none (``_LARGE_SPARSE_BLOCK_SIZE``)."""
_SDPA_TARGETS = {torch._C._nn.scaled_dot_product_attention, torch.nn.functional.scaled_dot_product_attention}


def _is_flex(node: fx.Node) -> bool:
    return node.op == "call_function" and getattr(node.target, "__name__", "") == "flex_attention" and \
        type(node.target).__name__ == "FlexAttentionHOP"


@dataclass
class Site:
    """One attention call in the graph."""

    index: int
    node: fx.Node
    op: str
    """'sdpa' or 'flex'."""
    q: fx.Node
    k: fx.Node
    v: fx.Node
    q_shape: tuple[int, ...] = ()
    kv_shape: tuple[int, ...] = ()
    dtype: torch.dtype | None = None
    device: torch.device | None = None
    """q's device (None when q's value is unknown)."""
    scale: float | None = None
    is_causal: bool = False
    mask: str = "full"
    """full | causal | bool_mask | block_mask."""
    mask_node: fx.Node | None = None
    """SDPA's boolean attn_mask."""
    block_mask: dict = field(default_factory=dict)
    """flex: q_len, kv_len, q_block, kv_block, tensors (kv_num_blocks, kv_indices, full_kv_num_blocks,
    full_kv_indices as nodes or None), mask_mod (GraphModule), buffers (nodes)."""
    rewritable: bool = True
    reason: str = ""
    density: float | None = None
    """Fraction of (q, kv) pairs that attend (SDPA) or of non-empty blocks (BlockMask), when known."""
    score_mod: fx.GraphModule | None = None
    """flex: the score_mod's graph, None for the identity."""
    score_buffers: tuple = ()
    """flex: the score_mod's captured tensors (nodes, or numbers ``rewrite`` makes 0-d tensors)."""
    score_grads: tuple[bool, ...] = ()
    """Per score buffer: a floating-point tensor that requires grad (a learned bias)."""
    folded: bool = False
    """SDPA: the boolean attn_mask is a graph constant equal to ``mask`` (causal or full), read at compile time."""
    form: SiteForm | None = None
    """What the site runs as (``forms.form_for``, when the graph is rewritten), and why."""
    form_why: str = ""

    @property
    def name(self) -> str:
        return f"{self.op}#{self.index}"

    def skip(self, reason: str) -> None:
        self.rewritable = False
        self.reason = reason

    def keep_folded(self) -> None:
        """A kept SDPA site whose attn_mask is a graph constant equal to causal or full: call SDPA without the mask
        (``is_causal`` for causal), the same attention on its faster kernels (flash, not a dense-mask kernel)."""
        if self.op != "sdpa" or not self.folded or self.rewritable:
            return
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
        args = dict(zip(names, self.node.args))
        args.update(self.node.kwargs)
        q, k, v = args.pop("query"), args.pop("key"), args.pop("value")
        self.node.args = (q, k, v)
        self.node.kwargs = {**args, "attn_mask": None, "is_causal": self.mask == "causal"}

    def mask_inputs(self) -> list[fx.Node]:
        """The graph values the site's op takes besides q, k, v: the mask's content (the bool mask, or the
        BlockMask's tensors and mask_mod buffers: kv_num_blocks, kv_indices[, full_kv_num_blocks,
        full_kv_indices], buffers...), then the score_mod's buffers."""
        if self.mask == "bool_mask":
            return [self.mask_node]
        if self.mask == "block_mask":
            kvn, kvi, fkn, fki = self.block_mask["tensors"]
            full = [fkn, fki] if self.has_full_blocks else []
            return [kvn, kvi, *full, *self.block_mask["buffers"], *self.score_buffers]
        return list(self.score_buffers)

    @property
    def has_full_blocks(self) -> bool:
        _, _, fkn, fki = self.block_mask["tensors"]
        return isinstance(fkn, fx.Node) and isinstance(fki, fx.Node)

    def flex_info(self) -> FlexMaskInfo | None:
        if self.mask != "block_mask":
            return None
        bm = self.block_mask
        return FlexMaskInfo(q_len=bm["q_len"], kv_len=bm["kv_len"], q_block=bm["q_block"], kv_block=bm["kv_block"],
                            has_full=self.has_full_blocks, mask_mod=bm["mask_mod"])

    def replace_with(self, res: fx.Node) -> None:
        """Route the site's outputs to ``res`` (a node returning (out, lse in natural log, ...)) and erase the
        site. SDPA's one output is ``res[0]``; flex_attention's (out, lse, max) tuple is read through getitem
        nodes: ``[0]`` becomes ``res[0]``, ``[1]`` becomes ``res[1] / ln 2`` (the HOP's lse is in log2 units),
        unused ones (checkpoint bodies unpack all three) are dropped."""
        graph = self.node.graph
        with graph.inserting_before(self.node):
            out = insert_call(graph, operator.getitem, (res, 0))
        if self.op == "sdpa":
            self.node.replace_all_uses_with(out)
        else:
            lse = None
            for user in list(self.node.users):
                idx = user.args[1]
                if user.users and idx == 0:
                    user.replace_all_uses_with(out)
                elif user.users:  # idx == 1 (capture refused a used max)
                    if lse is None:
                        with graph.inserting_before(user):
                            nat = insert_call(graph, operator.getitem, (res, 1))
                            lse = insert_call(graph, operator.mul, (nat, _INV_LN2))
                    user.replace_all_uses_with(lse)
                graph.erase_node(user)
        graph.erase_node(self.node)

    def record(self, form: str = "") -> SiteRecord:
        """The report's row; ``form``: its form column (``backend.site_forms``)."""
        return SiteRecord(name=self.name, op=self.op, q_shape=tuple(self.q_shape), kv_shape=tuple(self.kv_shape),
                          dtype=str(self.dtype).replace("torch.", "") if self.dtype is not None else "",
                          mask=self.mask, density=self.density, rewritten=self.rewritable, why=self.reason, form=form)


def _identity_score_mod(gm) -> bool:
    """A score_mod graph whose output is its first input (the score) unchanged."""
    if not isinstance(gm, fx.GraphModule):
        return False
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    outs = [n for n in gm.graph.nodes if n.op == "output"]
    if not phs or len(outs) != 1:
        return False
    ret = outs[0].args[0]
    if isinstance(ret, tuple | list):
        if len(ret) != 1:
            return False
        ret = ret[0]
    return ret is phs[0]


def _sdpa_site(index: int, node: fx.Node, world: int) -> Site:
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    args = dict(zip(names, node.args))
    args.update(node.kwargs)
    s = Site(index=index, node=node, op="sdpa", q=args["query"], k=args["key"], v=args["value"])
    qv, kv, vv = tensor_value(s.q), tensor_value(s.k), tensor_value(s.v)
    if qv is None or kv is None or vv is None:
        s.skip("q/k/v shapes are unknown in the graph")
        return s
    s.q_shape, s.kv_shape, s.dtype, s.device = tuple(qv.shape), tuple(kv.shape), qv.dtype, qv.device
    s.scale = args.get("scale")
    s.is_causal = bool(args.get("is_causal", False))
    s.mask = "causal" if s.is_causal else "full"   # (before any refusal: a kept site is reported with its mask)
    mask = args.get("attn_mask")
    dropout = args.get("dropout_p", 0.0)
    if isinstance(dropout, fx.Node) or float(dropout or 0.0) != 0.0:
        s.skip(f"dropout_p={dropout}: attention dropout is not applied by the tile kernels")
        return s
    if len(s.q_shape) != 4 or len(s.kv_shape) != 4 or tuple(vv.shape) != s.kv_shape:
        s.skip(f"q {s.q_shape} / k {s.kv_shape} / v {tuple(vv.shape)}: the rewrite needs 4-D (batch, heads, seq, dim) "
               f"with k and v of one shape")
        return s
    if s.q_shape[3] != s.kv_shape[3]:
        s.skip(f"q head dim {s.q_shape[3]} != k head dim {s.kv_shape[3]}")
        return s
    if s.q_shape[1] != s.kv_shape[1]:
        if not args.get("enable_gqa", False):
            s.skip("q and k head counts differ without enable_gqa (SDPA itself would reject this)")
            return s
        if s.q_shape[1] % s.kv_shape[1]:
            s.skip(f"{s.q_shape[1]} query heads are not a multiple of {s.kv_shape[1]} kv heads")
            return s
    if qv.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        s.skip(f"dtype {qv.dtype} is not supported by the tile kernels (fp16, bf16, fp32)")
        return s
    if mask is not None:
        if s.is_causal:
            s.skip("attn_mask together with is_causal=True (SDPA rejects this)")
            return s
        mv = tensor_value(mask)
        if mv is None:
            s.skip("attn_mask is not a tensor in the graph")
            return s
        if mv.dtype != torch.bool:
            s.skip(f"attn_mask has dtype {mv.dtype}: an additive float mask is not a sparsity pattern; "
                   f"pass a boolean mask (True = attend) or a BlockMask to flex_attention")
            return s
        s.mask, s.mask_node = "bool_mask", mask
        folded = _folded_mask(mask, s)
        if folded is not None:
            s.mask, s.mask_node, s.is_causal, s.folded = folded, None, folded == "causal", True
    else:
        s.mask = "causal" if s.is_causal else "full"
    if s.q_shape[2] != s.kv_shape[2] and world > 1:
        s.skip(f"cross-attention (q len {s.q_shape[2]} != kv len {s.kv_shape[2]}) is not sharded; "
               f"it runs replicated")
        return s
    s.reason = f"rewritten ({s.mask}" + (", an attn_mask built in the graph from positions alone" if s.folded else "") \
        + ")"
    return s


def _folded_mask(mask: fx.Node, s: Site) -> str | None:
    """"causal" or "full" when the graph computes SDPA's boolean ``attn_mask`` from no input and it is exactly that
    mask (transformers materialises its causal mask from ``torch.arange`` inside a compiled model), else None. Such a
    site is planned at compile time like ``is_causal=True`` and its mask tensor is never read at run time."""
    value = constant_value(mask)
    if value is None or value.dtype != torch.bool:
        return None
    B, H, Sq, D = s.q_shape
    Sk = s.kv_shape[2]
    try:
        value = value.expand(B, s.q_shape[1], Sq, Sk)
    except RuntimeError:
        return None
    if bool(value.all()):
        return "full"
    rows = torch.arange(Sq, device=value.device)[:, None]
    if bool((value == (rows >= torch.arange(Sk, device=value.device)[None, :])).all()):   # SDPA's is_causal
        return "causal"
    return None


def _flex_site(index: int, node: fx.Node, world: int) -> Site:
    q, k, v, score_mod, bm, scale, kernel_options, score_buffers, mask_buffers = node.args[:9]
    s = Site(index=index, node=node, op="flex", q=q, k=k, v=v, scale=float(scale) if scale is not None else None)
    qv, kv, vv = tensor_value(q), tensor_value(k), tensor_value(v)
    if qv is None or kv is None or vv is None:
        s.skip("q/k/v shapes are unknown in the graph")
        return s
    s.q_shape, s.kv_shape, s.dtype, s.device = tuple(qv.shape), tuple(kv.shape), qv.dtype, qv.device
    owner = node.graph.owning_module
    why_not = _flex_mask(s, bm, mask_buffers, owner)  # first: a site that is kept is reported with its true mask
    sm = getattr(owner, score_mod.target) if isinstance(score_mod, fx.Node) and score_mod.op == "get_attr" else None
    if score_buffers or not _identity_score_mod(sm):
        why = _score_mod(s, sm, score_buffers, world)
        if why:
            s.skip(why)
            return s
    for user in node.users:
        if user.target is operator.getitem and user.args[1] not in (0, 1) and user.users:
            s.skip("the auxiliary max output of flex_attention is used")
            return s
    if why_not:
        s.skip(why_not)
        return s
    if tuple(vv.shape) != s.kv_shape or s.q_shape[3] != s.kv_shape[3]:
        s.skip(f"q {s.q_shape} / k {s.kv_shape} / v {tuple(vv.shape)}: needs equal head dims and k, v of one shape")
        return s
    if qv.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        s.skip(f"dtype {qv.dtype} is not supported by the tile kernels (fp16, bf16, fp32)")
        return s
    if s.q_shape[2] != s.kv_shape[2] and world > 1:
        s.skip(f"cross-attention (q len {s.q_shape[2]} != kv len {s.kv_shape[2]}) is not sharded")
        return s
    if s.q_shape[1] % s.kv_shape[1]:
        s.skip(f"{s.q_shape[1]} query heads are not a multiple of {s.kv_shape[1]} kv heads")
        return s
    what = "BlockMask" if s.mask == "block_mask" else "no block_mask: full"
    if s.score_mod is not None:
        learned = sum(s.score_grads)
        what += ", score_mod" + (f" with {learned} learned buffer(s)" if learned else "")
    s.reason = f"rewritten ({what})"
    return s


def _score_mod(s: Site, sm, buffers, world: int) -> str:
    """Take a flex site's score_mod into ``s``; why it cannot go with the site ('' if it can)."""
    if not isinstance(sm, fx.GraphModule):
        return "the score_mod is not a graph submodule"
    if world == 1:
        return "a score_mod at world size 1: flex_attention itself runs the site (no context to split)"
    phs = [n for n in sm.graph.nodes if n.op == "placeholder"]
    if len(phs) != 5 + len(buffers):
        return f"the score_mod graph takes {len(phs)} inputs, not score, b, h, q_idx, kv_idx and {len(buffers)} buffers"
    grads = []
    for b in buffers:
        if isinstance(b, fx.Node) and tensor_value(b) is None and \
                not isinstance(meta_value(b), int | float | torch.SymInt | torch.SymFloat):
            return f"the score_mod's captured input {b.name} is neither a tensor nor a number"
        val = tensor_value(b) if isinstance(b, fx.Node) else None
        grads.append(bool(val is not None and val.is_floating_point() and val.requires_grad))
    s.score_mod, s.score_buffers, s.score_grads = sm, tuple(buffers), tuple(grads)
    return ""


def _flex_mask(s: Site, bm: tuple, mask_buffers, owner: fx.GraphModule) -> str:
    """Read a flex site's BlockMask into ``s.mask`` / ``s.block_mask``; why it cannot be rewritten ('' if it can).

    flex_attention without a block_mask passes PyTorch's default mask (one block of 2**30 tokens for lengths
    (1, 1)): every pair attends, the site's mask is "full"."""
    q_len, kv_len, q_block = bm[0], bm[1], bm[-3]
    if (q_len, kv_len) == (1, 1) and isinstance(q_block, int) and q_block >= _NO_MASK_BLOCK:
        s.mask = "full"
        return ""
    mm = bm[-1]
    mask_mod = getattr(owner, mm.target) if isinstance(mm, fx.Node) and mm.op == "get_attr" else None
    if mask_mod is None:
        return "the BlockMask's mask_mod is not a graph submodule"
    if not isinstance(q_len, int) or not isinstance(kv_len, int):
        return "the BlockMask's sequence lengths are dynamic"
    s.mask = "block_mask"
    s.block_mask = {
        "q_len": q_len, "kv_len": kv_len, "q_block": q_block, "kv_block": bm[-2],
        "tensors": tuple(bm[2:6]), "mask_mod": mask_mod, "buffers": tuple(mask_buffers),
    }
    if q_len != s.q_shape[2] or kv_len != s.kv_shape[2]:
        return f"BlockMask built for ({q_len}, {kv_len}) but q/k have lengths ({s.q_shape[2]}, {s.kv_shape[2]})"
    if any(not isinstance(b, fx.Node) for b in s.block_mask["tensors"][:2]):
        return "the BlockMask has no kv_num_blocks/kv_indices tensors"
    if any(not isinstance(b, int) or b < 16 or b & (b - 1) for b in (q_block, bm[-2])):
        return (f"the BlockMask's block size ({q_block}, {bm[-2]}) is not a power of two >= 16, which the "
                f"block-sparse tiles need; build it with BLOCK_SIZE=128 (FlexAttention's default) to shard this site")
    return ""


def estimate_density(site: Site, values: dict) -> float | None:
    """The site's mask density from the graph's example inputs (``values``: placeholder node -> tensor)."""
    if site.mask == "full":
        return 1.0
    if site.mask == "causal" and site.q_shape:
        sq, sk = site.q_shape[2], site.kv_shape[2]
        if not isinstance(sq, int) or not isinstance(sk, int):
            return None
        return sum(min(i + 1, sk) for i in range(sq)) / (sq * sk)
    if site.mask == "bool_mask":
        m = values.get(site.mask_node)
        return float(m.float().mean()) if isinstance(m, torch.Tensor) else None
    if site.mask == "block_mask":
        kvn, _, fkn, _ = site.block_mask["tensors"]
        parts = [values.get(n) for n in (kvn, fkn) if isinstance(n, fx.Node)]
        if not parts or any(p is None for p in parts):
            return None
        bm = site.block_mask
        nk = -(-bm["kv_len"] // bm["kv_block"])
        nonempty = sum(p.sum() for p in parts)
        return float(nonempty) / (parts[0].numel() * nk)
    return None


def find_sites(gm: fx.GraphModule, world: int = 1) -> list[Site]:
    """Every SDPA / flex_attention call in ``gm`` and its subgraphs, each marked rewritable or not (with why).

    Subgraphs are the bodies of higher-order ops (activation checkpointing, ``wrap``) that
    Dynamo stores as GraphModule attributes; sites inside them are rewritten in place.
    """
    sites = []
    for _, mod in gm.named_modules():
        if not isinstance(mod, fx.GraphModule):
            continue
        for node in mod.graph.nodes:
            if node.op == "call_function" and node.target in _SDPA_TARGETS:
                sites.append(_sdpa_site(len(sites), node, world))
            elif _is_flex(node):
                sites.append(_flex_site(len(sites), node, world))
    return sites
