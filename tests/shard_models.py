"""Transformer models written the way other codebases write them, for the sequence-sharding tests.

Each style uses its own op vocabulary on purpose (none of it is ultraattn's example model):

* ``llama``: HF-Llama-like. RMSNorm written out (pow, mean, rsqrt), RoPE from cached cos/sin
  buffers sliced to the length with ``rotate_half``, GQA by ``repeat_kv`` (expand + reshape)
  and SDPA ``is_causal``, SwiGLU, the loss inside forward with shifted labels and
  ``ignore_index``.
* ``gpt2``: nanoGPT-like. Learned positions (``wpe(arange)``), LayerNorm, tanh GELU, one fused
  QKV projection ``split`` three ways, SDPA ``is_causal``, the LM head tied to the token
  embedding, the loss inside forward.
* ``hf``: an HF-style attention module calling SDPA with a boolean ``attn_mask`` that the model
  builds from an ``attention_mask`` (padding) and ``position_ids`` inputs; returns logits, the loss
  is computed outside the compiled model.
* ``titan``: torchtitan-Llama-3-like. One fused ``wqkv`` projection split by sizes, RoPE as complex
  rotations (``view_as_complex`` of the pairs times a complex ``freqs_cis`` table sliced to the length,
  ``view_as_real``, ``flatten``, ``type_as`` the input), ``F.rms_norm``, SDPA ``is_causal`` with GQA, the loss
  inside forward.
* ``pool``: a bidirectional encoder (SDPA without a mask) with mean pooling over the tokens and a
  classifier: a reduction over the sequence inside the model, then a per-sequence loss.
* ``unknown``: a cumulative mean over the sequence between the layers (``cumsum`` along the
  sequence is not token-wise): the pass must run it on gathered data and report it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 64


# ----------------------------------------------------------------------------- llama style
class RMSNorm(nn.Module):
    """Llama's RMSNorm (``weight * x``), or Gemma's (``gemma``: ``x * (1 + weight.float())``, the weight reaching
    the sharded tokens through replicated ops, whose gradient must still be summed over the ranks)."""

    def __init__(self, dim: int, eps: float = 1e-6, gemma: bool = False):
        super().__init__()
        self.gemma = gemma
        self.weight = nn.Parameter(torch.zeros(dim) + 0.1 * torch.randn(dim) if gemma else
                                   torch.ones(dim) + 0.1 * torch.randn(dim))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.gemma:
            return (x * (1.0 + self.weight.float())).to(dtype)
        return self.weight * x.to(dtype)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def repeat_kv(x, n_rep: int):
    b, h, s, d = x.shape
    if n_rep == 1:
        return x
    return x[:, :, None, :, :].expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)


class LlamaAttention(nn.Module):
    def __init__(self, dim, heads, kv_heads, max_pos=512):
        super().__init__()
        self.h, self.hk, self.d = heads, kv_heads, dim // heads
        self.q_proj = nn.Linear(dim, heads * self.d, bias=False)
        self.k_proj = nn.Linear(dim, kv_heads * self.d, bias=False)
        self.v_proj = nn.Linear(dim, kv_heads * self.d, bias=False)
        self.o_proj = nn.Linear(heads * self.d, dim, bias=False)
        inv = 1.0 / (10000 ** (torch.arange(0, self.d, 2).float() / self.d))
        freqs = torch.outer(torch.arange(max_pos).float(), inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cached", emb.cos(), persistent=False)
        self.register_buffer("sin_cached", emb.sin(), persistent=False)

    def forward(self, x):
        bsz, q_len, _ = x.size()
        q = self.q_proj(x).view(bsz, q_len, self.h, self.d).transpose(1, 2)
        k = self.k_proj(x).view(bsz, q_len, self.hk, self.d).transpose(1, 2)
        v = self.v_proj(x).view(bsz, q_len, self.hk, self.d).transpose(1, 2)
        cos = self.cos_cached[:q_len].to(x.dtype)
        sin = self.sin_cached[:q_len].to(x.dtype)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        k, v = repeat_kv(k, self.h // self.hk), repeat_kv(v, self.h // self.hk)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(o.transpose(1, 2).contiguous().view(bsz, q_len, -1))


class LlamaMLP(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.gate_proj = nn.Linear(dim, 2 * dim, bias=False)
        self.up_proj = nn.Linear(dim, 2 * dim, bias=False)
        self.down_proj = nn.Linear(2 * dim, dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaLayer(nn.Module):
    def __init__(self, dim, heads, kv_heads):
        super().__init__()
        self.input_layernorm = RMSNorm(dim)
        self.self_attn = LlamaAttention(dim, heads, kv_heads)
        self.post_attention_layernorm = RMSNorm(dim)
        self.mlp = LlamaMLP(dim)

    def forward(self, x):
        residual = x
        x = residual + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaLM(nn.Module):
    def __init__(self, dim=32, heads=4, kv_heads=2, layers=2, unknown_op=False, checkpoint=False):
        super().__init__()
        self.checkpoint = checkpoint
        self.embed_tokens = nn.Embedding(VOCAB, dim)
        self.layers = nn.ModuleList(LlamaLayer(dim, heads, kv_heads) for _ in range(layers))
        self.norm = RMSNorm(dim, gemma=True)
        self.lm_head = nn.Linear(dim, VOCAB, bias=False)
        self.unknown_op = unknown_op

    def forward(self, input_ids, labels):
        h = self.embed_tokens(input_ids)
        for i, layer in enumerate(self.layers):
            # HF's gradient_checkpointing: each layer recomputed in the backward
            h = torch.utils.checkpoint.checkpoint(layer, h, use_reentrant=False) if self.checkpoint else layer(h)
            if self.unknown_op and i == 0:
                # a cumulative mean over the sequence: not token-wise, so it runs on gathered data
                steps = torch.arange(1, h.shape[1] + 1, device=h.device, dtype=h.dtype)[None, :, None]
                h = h + 0.5 * h.cumsum(dim=1) / steps
        logits = self.lm_head(self.norm(h)).float()
        shift_logits = logits[..., :-1, :].contiguous()
        shift_labels = labels[..., 1:].contiguous()
        return F.cross_entropy(shift_logits.view(-1, VOCAB), shift_labels.view(-1), ignore_index=-100)


# ----------------------------------------------------------------------------- gpt-2 style
class GPTBlock(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim)
        self.c_attn = nn.Linear(dim, 3 * dim)
        self.c_proj = nn.Linear(dim, dim)
        self.ln_2 = nn.LayerNorm(dim)
        self.c_fc = nn.Linear(dim, 4 * dim)
        self.mlp_proj = nn.Linear(4 * dim, dim)
        self.n_head = heads

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0,
                                           is_causal=getattr(self, "causal", True))
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        x = x + self.c_proj(y)
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT2(nn.Module):
    def __init__(self, dim=32, heads=4, layers=2, block_size=512):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, dim)
        self.wpe = nn.Embedding(block_size, dim)
        self.h = nn.ModuleList(GPTBlock(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying

    def forward(self, idx, targets):
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)


# ----------------------------------------------------------------------------- HF-style attention with a mask
class HFAttention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.num_heads, self.head_dim = heads, dim // heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=True)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, hidden_states, attention_mask, cos, sin):
        bsz, q_len, _ = hidden_states.shape
        qkv = self.qkv(hidden_states).view(bsz, q_len, 3, self.num_heads, self.head_dim)
        q, k, v = qkv.unbind(dim=2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask)
        return self.out_proj(out.transpose(1, 2).reshape(bsz, q_len, -1))


class HFLayer(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = HFAttention(dim, heads)
        self.ln2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.fc2 = nn.Linear(2 * dim, dim)

    def forward(self, x, mask, cos, sin):
        x = x + self.attn(self.ln1(x), mask, cos, sin)
        return x + self.fc2(F.relu(self.fc1(self.ln2(x))))


class HFModel(nn.Module):
    def __init__(self, dim=32, heads=4, layers=2, max_pos=512):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.layers = nn.ModuleList(HFLayer(dim, heads) for _ in range(layers))
        self.final = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB)
        d = dim // heads
        inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, input_ids, attention_mask, position_ids):
        bsz, seq = input_ids.shape
        # the 4-D boolean mask: causal and not a padding key (HF's sdpa mask), [bsz, 1, seq, seq]
        idx = torch.arange(seq, device=input_ids.device)
        causal = idx[None, :] <= idx[:, None]
        mask = causal[None, None, :, :] & attention_mask[:, None, None, :].bool()
        freqs = position_ids[:, :, None].float() * self.inv_freq[None, None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos()[:, None], emb.sin()[:, None]
        h = self.embed(input_ids)
        for layer in self.layers:
            h = layer(h, mask, cos, sin)
        return self.head(self.final(h))


# ----------------------------------------------------------------------------- torchtitan style
def precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0) -> torch.Tensor:
    """The rotations as (cos, sin) pairs, [end, dim // 2, 2] (real: Module.to(float64) would drop a complex
    table's imaginary part); forward views them as complex."""
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
    return torch.view_as_real(torch.polar(torch.ones(end, dim // 2), torch.outer(torch.arange(end).float(), freqs)))


def _wide(x):
    return x if x.dtype == torch.float64 else x.float()  # torchtitan's .float() (the fp64 oracle stays fp64)


def apply_rotary_emb(xq, xk, freqs_cis):
    xq_ = torch.view_as_complex(_wide(xq).reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(_wide(xk).reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = freqs_cis.view(1, xq_.shape[1], 1, xq_.shape[-1])
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


class TitanBlock(nn.Module):
    def __init__(self, dim, heads, kv_heads):
        super().__init__()
        self.h, self.hk, self.d = heads, kv_heads, dim // heads
        self.wqkv = nn.Linear(dim, (heads + 2 * kv_heads) * self.d, bias=False)
        self.wo = nn.Linear(heads * self.d, dim, bias=False)
        self.attention_norm = nn.Parameter(torch.ones(dim))
        self.ffn_norm = nn.Parameter(torch.ones(dim))
        self.w1 = nn.Linear(dim, 2 * dim, bias=False)
        self.w2 = nn.Linear(2 * dim, dim, bias=False)
        self.w3 = nn.Linear(dim, 2 * dim, bias=False)

    def forward(self, x, freqs_cis):
        bs, seqlen, _ = x.shape
        h = F.rms_norm(x, (x.shape[-1],), self.attention_norm, eps=1e-5)
        xq, xk, xv = self.wqkv(h).split([self.h * self.d, self.hk * self.d, self.hk * self.d], dim=-1)
        xq = xq.view(bs, seqlen, self.h, self.d)
        xk = xk.view(bs, seqlen, self.hk, self.d)
        xv = xv.view(bs, seqlen, self.hk, self.d)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis)
        o = F.scaled_dot_product_attention(xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2),
                                           is_causal=True, enable_gqa=True)
        x = x + self.wo(o.transpose(1, 2).reshape(bs, seqlen, -1))
        h = F.rms_norm(x, (x.shape[-1],), self.ffn_norm, eps=1e-5)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class TitanLM(nn.Module):
    def __init__(self, dim=32, heads=4, kv_heads=2, layers=2, max_seq_len=512):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, dim)
        self.layers = nn.ModuleList(TitanBlock(dim, heads, kv_heads) for _ in range(layers))
        self.norm = nn.Parameter(torch.ones(dim))
        self.output = nn.Linear(dim, VOCAB, bias=False)
        self.register_buffer("freqs_cis", precompute_freqs_cis(dim // heads, max_seq_len), persistent=False)

    def forward(self, tokens, labels):
        h = self.tok_embeddings(tokens)
        freqs_cis = torch.view_as_complex(self.freqs_cis[: tokens.shape[1]].contiguous())
        for layer in self.layers:
            h = layer(h, freqs_cis)
        logits = self.output(F.rms_norm(h, (h.shape[-1],), self.norm, eps=1e-5)).float()
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)


class PoolClassifier(nn.Module):
    """Encoder layers (GPT-2 blocks without the causal mask), mean pooling, a classifier."""

    def __init__(self, dim=32, heads=4, layers=2, classes=5):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.blocks = nn.ModuleList(GPTBlock(dim, heads) for _ in range(layers))
        for b in self.blocks:
            b.causal = False
        self.norm = nn.LayerNorm(dim)
        self.cls = nn.Linear(dim, classes)

    def forward(self, ids, target):
        h = self.embed(ids)
        for b in self.blocks:
            h = b(h)
        pooled = self.norm(h).mean(dim=1)
        return F.cross_entropy(self.cls(pooled), target)


def hf_loss(logits, labels):
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1), ignore_index=-100)


# ----------------------------------------------------------------------------- data and steps
def build(style: str, dtype=torch.float32, **kw) -> nn.Module:
    torch.manual_seed(0)
    if style in ("llama", "unknown", "llama_ckpt"):
        m = LlamaLM(unknown_op=style == "unknown", checkpoint=style == "llama_ckpt", **kw)
    elif style == "gpt2":
        m = GPT2(**kw)
    elif style == "hf":
        m = HFModel(**kw)
    elif style == "pool":
        m = PoolClassifier(**kw)
    elif style == "titan":
        m = TitanLM(**kw)
    else:
        raise ValueError(style)
    return m.to(dtype)


def batch(style: str, seqlen: int, bsz: int = 2) -> tuple:
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (bsz, seqlen), generator=g)
    if style == "pool":
        return ids, torch.randint(0, 5, (bsz,), generator=g)
    if style == "gpt2":
        targets = torch.roll(ids, -1, dims=1)
        targets[:, -1] = -1
        return ids, targets
    labels = ids.clone()
    if style == "hf":
        mask = torch.ones(bsz, seqlen, dtype=torch.long)
        mask[0, -5:] = 0  # right padding in the first row: padded keys are masked, their labels ignored
        labels[0, -5:] = -100
        pos = torch.arange(seqlen)[None].expand(bsz, -1).clone()
        return ids, mask, pos, labels
    labels[:, :3] = -100  # an ignored prefix
    return ids, labels


def forward(style: str, model, data):
    if style == "hf":
        ids, mask, pos, labels = data
        return hf_loss(model(ids, mask, pos), labels)
    return model(*data)


def step(style: str, model, data) -> dict:
    model.zero_grad(set_to_none=True)
    loss = forward(style, model, data)
    loss.backward()
    return {"loss": loss.detach().double(),
            "grads": {n.removeprefix("_orig_mod."): p.grad.detach().double().clone()
                      for n, p in model.named_parameters()}}


def oracle(style: str, seqlen: int) -> tuple[dict, dict]:
    """(fp64, fp32) eager single-process results."""
    data = batch(style, seqlen)
    return tuple(step(style, build(style, dt), data) for dt in (torch.float64, torch.float32))


def shard_worker(rank: int, world: int, style: str, seqlen: int, options: dict) -> dict:
    """One compiled step on this rank; the result and what the sharding pass did."""
    from ultraattn.passes import side_table

    model = build(style)
    cm = torch.compile(model, backend="ultraattn", options=dict(options))
    res = step(style, cm, batch(style, seqlen))
    table = side_table()
    res["records"] = [{"shard": r.shard.to_json() if r.shard is not None else None,
                       "code": r.code_after, "rewritten": r.rewritten,
                       "aot": {g.kind: g.code for g in table.aot_graphs_of(r.index)}} for r in table.graphs]
    return res
