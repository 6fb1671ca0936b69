"""Code nobody here wrote, run under the backend: attn-gym's masks and transformers' Llama (tests/test_clients.py).

attn-gym: every mask the package exports is found by what it is, not by name (``gym_masks``): a mask_mod
``(b, h, q_idx, kv_idx)``, a generator annotated to return one, or a function annotated to return a BlockMask.
Its arguments come from ``ARGS`` by parameter name (each recipe takes the target length S), then from the
parameter's default; a mask whose parameter has neither fails the test with that name, so a new mask in a
later release is covered as soon as its parameters are known ones. ``LENGTHS`` says how long q and k/v are
where that is not S (cross-attention, a sequence twice S, a geometry that fixes it).

Each case is a small attention layer (q, k, v projections, flex_attention with the case's BlockMask, an output
projection; GQA 4/2 heads) trained one step; its loss and gradients are checked against the fp64 and fp32
eager single process with the same mask, dense (rows that attend nowhere give 0, as in flex_attention).
"""

from __future__ import annotations

import inspect
import math
import traceback

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

from ultraattn.masks.convert import eval_mask, listed_blocks

HEADS, KV_HEADS, DIM = 4, 2, 32


# ----------------------------------------------------------------------------- attn-gym's masks
def _offsets(S: int) -> torch.Tensor:
    """Document offsets: uneven documents, one of length 1, none on a 128 boundary."""
    cuts = sorted({0, 37, 38, S // 3, S // 2 + 5, S - 29, S})
    return torch.tensor(cuts, dtype=torch.int32)


def _factor(S: int, k: int) -> tuple[int, ...]:
    """S as k factors, as near each other as the divisors allow (largest first)."""
    if k == 1:
        return (S,)
    f = max(d for d in range(1, int(round(S ** (1 / k))) + 2) if S % d == 0)
    return tuple(sorted((f, *_factor(S // f, k - 1)), reverse=True))


def _tile(dims: tuple[int, ...]) -> tuple[int, ...]:
    """Per dim, its smallest divisor >= 2 (a tile that divides the canvas)."""
    return tuple(min(d for d in range(2, n + 1) if n % d == 0) for n in dims)


def _topk(S: int) -> torch.Tensor:
    """VSA's selected KV tiles per query tile (B=1, the model's heads, tiles of ``_vsa_tile(S)``): seeded."""
    tile = _vsa_tile(S)
    n = S // tile
    g = torch.Generator().manual_seed(5)
    k = max(1, n // 2)
    return torch.stack([torch.stack([torch.randperm(n, generator=g)[:k].sort().values for _ in range(n)])
                        for _ in range(HEADS)])[None].to(torch.int32)


def _vsa_tile(S: int) -> int:
    """64 where it divides S, else the divisor of S nearest 64 (500: 100, a block the kernels refuse)."""
    return min((d for d in range(16, S + 1) if S % d == 0), key=lambda d: (abs(d - 64), d))


ARGS = {
    "mask_mod": lambda S: _causal,
    "offsets": _offsets,
    "prefix_document_id": lambda S: torch.tensor([0, 0, 2, 2, 4, 4], dtype=torch.int32)[:len(_offsets(S)) - 1],
    "window_size": lambda S: 45,
    "dilation": lambda S: 3,
    "is_global": lambda S: torch.arange(S) % 97 == 0,
    "prefix_length": lambda S: S // 5,
    "seq_len": lambda S: S // 2,
    "block_size": lambda S: 23,
    "batchify_size": lambda S: 150,
    "canvas_w": lambda S: _factor(S, 2)[0], "canvas_h": lambda S: _factor(S, 2)[1],
    "kernel_w": lambda S: 7, "kernel_h": lambda S: 5,
    "W": lambda S: _factor(S, 2)[0], "H": lambda S: _factor(S, 2)[1], "K_W": lambda S: 7, "K_H": lambda S: 5,
    "T_W": lambda S: _tile(_factor(S, 2))[0], "T_H": lambda S: _tile(_factor(S, 2))[1],
    "canvas_hw": lambda S: _factor(S, 2), "tile_hw": lambda S: _tile(_factor(S, 2)),
    "kernel_hw": lambda S: tuple(3 * t for t in _tile(_factor(S, 2))),
    "canvas_twh": lambda S: _factor(S, 3), "tile_twh": lambda S: _tile(_factor(S, 3)),
    "kernel_twh": lambda S: tuple(min(3 * t, c) for t, c in zip(_tile(_factor(S, 3)), _factor(S, 3))),
    "prompt_length": lambda S: S // 8, "num_frames": lambda S: 4, "token_per_frame": lambda S: S // 8,
    # (the first 5 text tokens see no image: rows that attend nowhere)
    "intervals": lambda S: torch.tensor([[5, S // 3], [S // 4, S // 2], [S // 2, S - 7], [S // 3, S]],
                                        dtype=torch.int32),
    "image_token_length": lambda S: S // 4,  # 4 images as long as the text (cross-attention: test_kept_sites)
    "ancestor_matrix": lambda S: _tree(S // 2),
    "topk_indices": _topk,
    "tile_numel": _vsa_tile,
    "num_kv_tiles": lambda S: S // _vsa_tile(S),
    "kv_block_size": lambda S: math.gcd(_vsa_tile(S), 32),
}
"""Per parameter name: its value for a target length S."""

LENGTHS = {
    "generate_jetspec_training_mask_mod": lambda S: (S, S // 5 + S),     # prefix, then the query blocks
    "generate_jetspec_tree_causal_mask_mod": lambda S: (S // 2, S // 5 + S // 2),
}
"""(q length, k/v length) of the masks where it is not (S, S)."""

PER_HEAD = {"generate_vsa_mask_mod", "create_vsa_block_mask", "create_vsa_flash_block_mask"}
"""Masks that differ per head (VSA's top-k tiles): their BlockMask is built per head."""


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def _tree(n: int) -> torch.Tensor:
    """A tree's ancestor matrix (each node its own ancestor), parents seeded."""
    from attn_gym.masks import build_tree_ancestor_matrix

    g = torch.Generator().manual_seed(3)
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]
    return build_tree_ancestor_matrix(parents, device="cpu")


def _kind(fn) -> str | None:
    """'mask_mod', 'generator', 'block_mask' or None (not a mask: a helper)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    if [p for p in sig.parameters] == ["b", "h", "q_idx", "kv_idx"]:
        return "mask_mod"
    ret = sig.return_annotation
    if ret is BlockMask or getattr(ret, "__name__", "") == "BlockMask" or "BlockMask" in str(ret):
        return "block_mask"
    text = str(ret)
    if "Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]" in text or \
            "_mask_mod_signature" in text:
        return "generator"
    return None


def gym_masks() -> list[tuple[str, str]]:
    """(name, kind) of every mask ``attn_gym.masks`` exports (module docstring)."""
    import attn_gym.masks as M

    found = []
    for name in sorted(dir(M)):
        fn = getattr(M, name)
        if name.startswith("_") or not callable(fn) or inspect.isclass(fn) or inspect.ismodule(fn):
            continue
        kind = _kind(fn)
        if kind is not None:
            found.append((name, kind))
    return found


def gym_case(name: str, S: int) -> dict:
    """The case of attn-gym mask ``name`` at target length S: its BlockMask, lengths, and how it was built."""
    import attn_gym.masks as M

    fn = getattr(M, name)
    kind = _kind(fn)
    q_len, kv_len = LENGTHS.get(name, lambda S: (S, S))(S)
    if kind == "mask_mod":
        mm, args = fn, {}
    else:
        args = {}
        for p in inspect.signature(fn).parameters.values():
            if p.name in ARGS:
                args[p.name] = ARGS[p.name](S)
            elif p.default is not inspect.Parameter.empty:
                continue
            else:
                raise LookupError(f"attn_gym.masks.{name}: no value for its parameter {p.name!r}; give it a recipe "
                                  f"in tests/client_cases.py ARGS")
        mm = fn(**args)
    per_head = name in PER_HEAD
    if kind == "block_mask":
        bm = mm
        q_len, kv_len = bm.seq_lengths
    else:
        bm = create_block_mask(mm, 1 if per_head else None, HEADS if per_head else None, q_len, kv_len, device="cpu")
    return {"name": name, "S": S, "block_mask": bm, "q_len": q_len, "kv_len": kv_len,
            "args": {k: v if not isinstance(v, torch.Tensor) else f"tensor{tuple(v.shape)}" for k, v in args.items()}}


def dense_of(bm: BlockMask, batch: int, heads: int) -> torch.Tensor:
    """The bool [B, H, Q, KV] mask a BlockMask means: its FULL blocks, and its partial blocks where the mask_mod
    holds (what flex_attention computes; eager flex_attention reads the mask_mod alone, which differs for a
    BlockMask built from blocks, such as VSA's)."""
    q_len, kv_len = bm.seq_lengths
    qb, kb = bm.BLOCK_SIZE

    def expand(b):  # [B', H', Qb, Kb] -> [B, H, Q, KV]
        b = b.repeat_interleave(qb, -2).repeat_interleave(kb, -1)[..., :q_len, :kv_len]
        return b.expand(batch, heads, q_len, kv_len)

    partial, full = (expand(t) for t in listed_blocks(bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks,
                                                        bm.full_kv_indices, -(-q_len // qb), -(-kv_len // kb)))
    qi, ki = torch.arange(q_len), torch.arange(kv_len)
    b = torch.arange(batch)[:, None, None, None]
    h = torch.arange(heads)[None, :, None, None]
    elem = eval_mask(bm.mask_mod, b, h, qi[:, None], ki[None, :])
    return full | (partial & elem.expand(batch, heads, q_len, kv_len))


# ----------------------------------------------------------------------------- the model
class Attention(nn.Module):
    """q from x, k and v from ``ctx`` (x itself for self-attention), flex_attention, an output projection."""

    def __init__(self):
        super().__init__()
        d = DIM // HEADS
        self.q = nn.Linear(DIM, HEADS * d, bias=False)
        self.kv = nn.Linear(DIM, 2 * KV_HEADS * d, bias=False)
        self.o = nn.Linear(HEADS * d, DIM, bias=False)

    def forward(self, x, ctx, block_mask=None, dense=None):
        from torch.nn.attention.flex_attention import flex_attention

        B, S, _ = x.shape
        d = DIM // HEADS
        q = self.q(x).view(B, S, HEADS, d).transpose(1, 2)
        k, v = self.kv(ctx).view(B, ctx.shape[1], 2, KV_HEADS, d).permute(2, 0, 3, 1, 4)
        if dense is None:
            a = flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)
        else:  # the reference: dense attention, rows that attend nowhere give 0 (as flex_attention)
            r = HEADS // KV_HEADS
            k, v = k.repeat_interleave(r, 1), v.repeat_interleave(r, 1)
            s = (q @ k.transpose(-1, -2)) / math.sqrt(d)
            a = torch.softmax(s.masked_fill(~dense, float("-inf")), -1).nan_to_num(0.0) @ v
        y = self.o(a.transpose(1, 2).reshape(B, S, -1))
        return (y.float() ** 2).mean()


def _inputs(q_len: int, kv_len: int, cross: bool):
    g = torch.Generator().manual_seed(11)
    x = torch.randn(1, q_len, DIM, generator=g)
    ctx = torch.randn(1, kv_len, DIM, generator=g) if cross else x
    return x, ctx


def gym_step(model: nn.Module, case: dict, x, ctx, dense=None) -> dict:
    model.zero_grad(set_to_none=True)
    loss = model(x, ctx, case["block_mask"], dense)
    loss.backward()
    return {"loss": loss.detach().double(),
            "grads": {n.removeprefix("_orig_mod."): p.grad.detach().double().clone()
                      for n, p in model.named_parameters()}}


def gym_reference(case: dict) -> tuple[dict, dict]:
    """fp64 and fp32 eager single-process results (dense, the mask from ``dense_of``)."""
    cross = case["q_len"] != case["kv_len"]
    dense = dense_of(case["block_mask"], 1, HEADS)
    out = []
    for dt in (torch.float64, torch.float32):
        torch.manual_seed(0)
        m = Attention().to(dt)
        x, ctx = (t.to(dt) for t in _inputs(case["q_len"], case["kv_len"], cross))
        out.append(gym_step(m, case, x, ctx if cross else x, dense))
    return out[0], out[1]


def gym_worker(rank: int, world: int, names: list[str], lengths: list[int], options: dict) -> list[dict]:
    """Every (mask, length) case on this rank, in one process: the result, or the error it raised."""
    from torch._dynamo.utils import counters

    import ultraattn
    import ultraattn.passes

    results = []
    table = ultraattn.passes.side_table()
    for name in names:
        for S in lengths:
            # one process for every case, nothing of ultraattn reset between them (a sweep does the same): each
            # case's sites must be its own, whatever the process compiled before
            torch._dynamo.reset()
            res = {"name": name, "S": S}
            graphs, rewritten = len(table.graphs), counters["ultraattn"]["rewritten"]
            try:
                case = gym_case(name, S)
                cross = case["q_len"] != case["kv_len"]
                torch.manual_seed(0)
                model = Attention()
                x, ctx = _inputs(case["q_len"], case["kv_len"], cross)
                cm = torch.compile(model, backend="ultraattn", options=dict(options))
                res.update(gym_step(cm, case, x, ctx if cross else x))
                recs = table.graphs[graphs:]
                res["sites"] = [(s.name, s.mask, s.rewritten, s.why, s.form) for g in recs for s in g.sites]
                res["fallbacks"] = [f.op for g in recs if g.shard for f in g.shard.fallbacks]
                res["rewritten"] = counters["ultraattn"]["rewritten"] - rewritten
            except Exception as exc:  # noqa: BLE001 - the test reads every case's outcome
                res["error"] = f"{type(exc).__name__}: {exc}"
                res["trace"] = traceback.format_exc()[-3000:]
            results.append(res)
    return results


# ----------------------------------------------------------------------------- transformers' Llama
def hf_model(impl: str, dtype=torch.float32):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      attn_implementation=impl)
    return LlamaForCausalLM(cfg).to(dtype).train()


def hf_data(S: int, packed: bool):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (1, S), generator=g)
    lens = [S // 3, S // 4, S - S // 3 - S // 4] if packed else [S]
    return ids, torch.cat([torch.arange(n) for n in lens])[None]


def hf_step(model, ids, pos, use_cache) -> dict:
    kw = {} if use_cache is None else {"use_cache": use_cache}
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, position_ids=pos, labels=ids, **kw)
    out.loss.backward()
    return {"loss": out.loss.detach().double(),
            "grads": {n.removeprefix("_orig_mod."): p.grad.detach().double().clone()
                      for n, p in model.named_parameters()}}


def hf_reference(S: int, packed: bool, use_cache) -> tuple[dict, dict]:
    """fp64 and fp32 eager single-process steps, with SDPA (the same attention as flex, for the same mask)."""
    ids, pos = hf_data(S, packed)
    return tuple(hf_step(hf_model("sdpa", dt), ids, pos, use_cache) for dt in (torch.float64, torch.float32))


def hf_worker(rank: int, world: int, cases: list[tuple], options: dict) -> list[dict]:
    """Every (impl, S, packed, use_cache, compiler) case on this rank: the step, the sites, the gathers."""
    import ultraattn
    import ultraattn.passes

    results = []
    table = ultraattn.passes.side_table()
    for impl, S, packed, use_cache, compiler in cases:
        torch._dynamo.reset()   # (ultraattn's state stays: the cases share one process as a sweep would)
        graphs = len(table.graphs)
        ids, pos = hf_data(S, packed)
        cm = torch.compile(hf_model(impl), backend="ultraattn", options=dict(options, compiler=compiler))
        res = hf_step(cm, ids, pos, use_cache)
        recs = table.graphs[graphs:]
        res["sites"] = [(s.name, s.mask, s.rewritten, s.form) for g in recs for s in g.sites]
        res["fallbacks"] = [(f.op, f.why) for g in recs if g.shard for f in g.shard.fallbacks]
        res["sharded"] = [g.shard.sharded_ops for g in recs if g.shard]
        results.append(res)
    return results


# ----------------------------------------------------------------------------- transformers' Gemma 2
def gemma_model(impl: str, dtype=torch.float32):
    """A tiny random Gemma 2: one sliding-window layer and one global layer, tanh soft-capping of the attention
    logits (a score_mod under flex_attention) and of the final logits, Gemma's (1 + w) RMSNorms."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    cfg = Gemma2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                       sliding_window=96, attn_implementation=impl)
    assert cfg.attn_logit_softcapping and set(cfg.layer_types) == {"sliding_attention", "full_attention"}
    return Gemma2ForCausalLM(cfg).to(dtype).train()


def gemma_reference(S: int) -> tuple[dict, dict]:
    """fp64 and fp32 eager single-process steps with transformers' eager attention (soft-capping and the sliding
    window written out in plain torch)."""
    ids, _ = hf_data(S, False)
    return tuple(hf_step(gemma_model("eager", dt), ids, None, False) for dt in (torch.float64, torch.float32))


def gemma_worker(rank: int, world: int, S: int, options: dict) -> list[dict]:
    """The whole model compiled, then its decoder layers compiled block by block (``ultraattn.compile_blocks``):
    each step with its site records."""
    import ultraattn
    import ultraattn.passes

    results = []
    table = ultraattn.passes.side_table()
    for blocks in (False, True):
        torch._dynamo.reset()   # (ultraattn's state stays: both runs in one process)
        graphs = len(table.graphs)
        ids, _ = hf_data(S, False)
        model = gemma_model("flex_attention")
        if blocks:
            ultraattn.compile_blocks(model.model.layers, options=dict(options))
        else:
            model = torch.compile(model, backend="ultraattn", options=dict(options))
        res = hf_step(model, ids, None, False)
        recs = table.graphs[graphs:]
        res["sites"] = [s.to_json() for g in recs for s in g.sites]
        res["fallbacks"] = [(f.op, f.why) for g in recs if g.shard for f in g.shard.fallbacks]
        res["sharded"] = [g.shard.sharded_ops if g.shard else 0 for g in recs]
        results.append(res)
    return results



# ----------------------------------------------------------------------------- sites the backend keeps
KEPT_S, KEPT_CTX = 200, 96


class KeptModel(nn.Module):
    """One attention layer whose call the case picks: score_mods (attn-gym's ALiBi and soft-capping, a learned
    relative-position bias), cross-attention (flex with attn-gym's flamingo mask, SDPA), a rewritten site feeding
    a kept one inside activation checkpointing, and two flex calls the backend rewrites (no block_mask; a
    BlockMask built inside the compiled code)."""

    def __init__(self, case: str):
        super().__init__()
        d = DIM // HEADS
        self.case = case
        self.checkpoint = True  # (the reference runs without: eager flex's CPU backward fails under its recompute)
        self.q = nn.Linear(DIM, HEADS * d, bias=False)
        self.kv = nn.Linear(DIM, 2 * KV_HEADS * d, bias=False)
        self.o = nn.Linear(HEADS * d, DIM, bias=False)
        if case == "learned_bias":
            self.rel = nn.Parameter(0.1 * torch.randn(HEADS, 2 * KEPT_S))
        if case in ("alibi_causal", "mixed_ckpt"):  # built outside the compiled code: graph inputs with data
            self.block_mask = create_block_mask(_causal, None, None, KEPT_S, KEPT_S, device="cpu")

    def forward(self, x, ctx):
        from attn_gym.masks import generate_vision_cross_attention_mask_mod
        from attn_gym.mods import generate_alibi_bias, generate_tanh_softcap
        from torch.nn.attention.flex_attention import flex_attention

        B, S, _ = x.shape
        d = DIM // HEADS
        q = self.q(x).view(B, S, HEADS, d).transpose(1, 2)
        k, v = self.kv(ctx).view(B, ctx.shape[1], 2, KV_HEADS, d).permute(2, 0, 3, 1, 4)
        c = self.case
        if c == "alibi_causal":
            a = flex_attention(q, k, v, score_mod=generate_alibi_bias(HEADS), block_mask=self.block_mask,
                               enable_gqa=True)
        elif c == "softcap":
            a = flex_attention(q, k, v, score_mod=generate_tanh_softcap(2), enable_gqa=True)
        elif c == "learned_bias":
            rel = self.rel

            def bias(score, b, h, q_idx, kv_idx):
                return score + rel[h, q_idx - kv_idx + S]

            a = flex_attention(q, k, v, score_mod=bias, enable_gqa=True)
        elif c == "flex_cross":
            mm = generate_vision_cross_attention_mask_mod(ARGS["intervals"](S), KEPT_CTX // 4)
            bm = create_block_mask(mm, None, None, S, ctx.shape[1], device="cpu")
            a = flex_attention(q, k, v, block_mask=bm, enable_gqa=True)
        elif c == "sdpa_cross":
            a = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        elif c == "flex_no_mask":
            a = flex_attention(q, k, v, enable_gqa=True)
        elif c == "mixed_ckpt":  # a rewritten site feeding a kept one, in an activation-checkpoint region
            kx, vx = self.kv(x).view(B, S, 2, KV_HEADS, d).permute(2, 0, 3, 1, 4)

            def layer(q, kx, vx, k, v):
                a = flex_attention(q, kx, vx, block_mask=self.block_mask, enable_gqa=True)
                return flex_attention(a, k, v, score_mod=generate_tanh_softcap(2), enable_gqa=True)

            a = torch.utils.checkpoint.checkpoint(layer, q, kx, vx, k, v, use_reentrant=False) if self.checkpoint \
                else layer(q, kx, vx, k, v)
        elif c == "mask_in_graph":
            bm = create_block_mask(_causal, None, None, S, S, device="cpu")
            a = flex_attention(q, k, v, block_mask=bm, enable_gqa=True)
        else:
            raise ValueError(c)
        y = self.o(a.transpose(1, 2).reshape(B, S, -1))
        return (y.float() ** 2).mean()


KEPT_CASES = ("alibi_causal", "softcap", "learned_bias", "flex_cross", "sdpa_cross", "mixed_ckpt", "flex_no_mask",
              "mask_in_graph")
CROSS = ("flex_cross", "sdpa_cross", "mixed_ckpt")


def kept_step(model, x, ctx) -> dict:
    model.zero_grad(set_to_none=True)
    loss = model(x, ctx)
    loss.backward()
    return {"loss": loss.detach().double(),
            "grads": {n.removeprefix("_orig_mod."): p.grad.detach().double().clone()
                      for n, p in model.named_parameters()}}


def kept_reference(case: str) -> tuple[dict, dict]:
    """fp64 and fp32 eager single-process steps: PyTorch's own flex_attention, its CPU backward refusal lifted
    for the call (with it, the model cannot train eagerly on CPU at all)."""
    import torch.nn.attention.flex_attention as fa

    out = []
    orig = fa._validate_device
    fa._validate_device = lambda *args: None
    try:
        for dt in (torch.float64, torch.float32):
            torch.manual_seed(0)
            m = KeptModel(case).to(dt)
            m.checkpoint = False  # the same values (see KeptModel)
            x, ctx = (t.to(dt) for t in _inputs(KEPT_S, KEPT_CTX, True))
            out.append(kept_step(m, x, ctx if case in CROSS else x))
    finally:
        fa._validate_device = orig
    return out[0], out[1]


def kept_worker(rank: int, world: int, cases: list[str], options: dict) -> list[dict]:
    """Every case compiled with the backend (default Inductor) on this rank: the step and the site records."""
    import ultraattn
    import ultraattn.passes

    results = []
    table = ultraattn.passes.side_table()
    for case in cases:
        torch._dynamo.reset()   # (ultraattn's state stays: the cases share one process as a sweep would)
        graphs = len(table.graphs)
        torch.manual_seed(0)
        model = KeptModel(case)
        x, ctx = _inputs(KEPT_S, KEPT_CTX, True)
        cm = torch.compile(model, backend="ultraattn", options=dict(options))
        res = kept_step(cm, x, ctx if case in CROSS else x)
        recs = table.graphs[graphs:]
        res["sites"] = [s.to_json() for g in recs for s in g.sites]
        res["code"] = [g.code_after for g in recs]
        res["fallbacks"] = [f.op for g in recs if g.shard for f in g.shard.fallbacks]
        res["sharded"] = [g.shard is not None for g in recs]
        results.append(res)
    return results
