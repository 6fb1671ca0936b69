"""attn-gym's score_mods in one attention layer, for tests/test_score_mods.py (spawned ranks import this module).

Every case is a score_mod from ``attn_gym.mods`` with the mask it is used with: ALiBi (causal BlockMask, and
no block_mask at all), tanh soft-capping (documents), Sandwich (causal), an activation in place of the softmax
(documents), Graphormer's spatial bias (a learned table indexed by per-batch distances; causal) and MLA's
decoupled RoPE term (query/key rope vectors as fixed buffers: PyTorch's own flex_attention cannot differentiate a
score_mod that gathers vectors from a tensor requiring grad, "idx shape must match value shape", so there is no
reference to check such a gradient against; documents). And attention sinks as GPT-OSS has them (transformers'
flex path): a learned per-head logit joins every row's softmax, applied after flex_attention through its
log-sum-exp, which the rewritten site returns exact across ranks (soft-capped scores, causal). Batch 2 and GQA
(4 query heads, 2 kv heads), so the score_mods see every index they can read.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

HEADS, KV_HEADS, DIM, BATCH, ROPE = 4, 2, 32, 2, 8
BUCKETS = 6
CASES = (("alibi", "causal"), ("alibi", "none"), ("softcap", "document"), ("sandwich", "causal"),
         ("activation", "document"), ("graphormer", "causal"), ("mla_rope", "document"), ("sinks", "causal"))


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def _block_mask(kind: str, S: int):
    from attn_gym.masks import generate_doc_mask_mod, generate_sliding_window

    kind, _, arg = kind.partition(":")
    if kind == "none":
        return None
    if kind == "causal":
        return create_block_mask(_causal, None, None, S, S, device="cpu")
    if kind == "window":   # attn-gym's sliding window: the width is a constant of the mask_mod's code
        return create_block_mask(generate_sliding_window(int(arg)), None, None, S, S, device="cpu")
    cuts = torch.tensor(sorted({0, 37, 38, S // 3, S // 2 + 5, S - 29, S}))   # uneven documents, none on a block edge
    return create_block_mask(generate_doc_mask_mod(_causal, cuts), None, None, S, S, device="cpu")


class ScoreModel(nn.Module):
    """q/k/v projections, one flex_attention with the case's score_mod and mask, an output projection."""

    def __init__(self, case: str, mask: str, S: int):
        super().__init__()
        d = DIM // HEADS
        self.case, self.S = case, S
        self.q = nn.Linear(DIM, HEADS * d, bias=False)
        self.kv = nn.Linear(DIM, 2 * KV_HEADS * d, bias=False)
        self.o = nn.Linear(HEADS * d, DIM, bias=False)
        self.block_mask = _block_mask(mask, S)   # built outside the compiled code: the mask is run-time data
        if case.startswith("graphormer"):
            self.spatial = nn.Parameter(0.5 * torch.randn(HEADS, BUCKETS))
            g = torch.Generator().manual_seed(3)
            self.register_buffer("distances", torch.randint(0, BUCKETS, (BATCH, S, S), generator=g, dtype=torch.int32))
        if case.startswith("sinks"):
            self.sinks = nn.Parameter(torch.randn(HEADS))
        if case.startswith("mla_rope"):
            g = torch.Generator().manual_seed(5)
            self.register_buffer("q_rope", torch.randn(BATCH, HEADS, S, ROPE, generator=g))
            self.register_buffer("k_rope", torch.randn(BATCH, 1, S, ROPE, generator=g))

    def score_mod(self, x):
        from attn_gym.mods import (
            generate_activation_score_mod,
            generate_alibi_bias,
            generate_graphormer_spatial_bias,
            generate_mla_rope_score_mod,
            generate_sandwich_bias,
            generate_tanh_softcap,
        )

        B, S, _ = x.shape
        c, _, arg = self.case.partition(":")
        if c == "alibi":
            return generate_alibi_bias(HEADS)
        if c in ("softcap", "sinks"):   # "softcap:20": another cap, the same family and graph code but a constant
            return generate_tanh_softcap(float(arg) if arg else 2)
        if c == "sandwich":
            return generate_sandwich_bias(HEADS, S, d_bar=16)
        if c == "activation":
            return generate_activation_score_mod(F.gelu, offset=1.0)
        if c == "graphormer":
            return generate_graphormer_spatial_bias(self.spatial, self.distances)
        if c == "mla_rope":
            return generate_mla_rope_score_mod(self.q_rope, self.k_rope, HEADS, scale=0.5)
        raise ValueError(c)

    def forward(self, x):
        B, S, _ = x.shape
        d = DIM // HEADS
        q = self.q(x).view(B, S, HEADS, d).transpose(1, 2)
        k, v = self.kv(x).view(B, S, 2, KV_HEADS, d).permute(2, 0, 3, 1, 4)
        if self.case.startswith("sinks"):   # transformers' flex_attention_forward with s_aux, as GPT-OSS calls it
            a, aux = flex_attention(q, k, v, score_mod=self.score_mod(x), block_mask=self.block_mask, enable_gqa=True,
                                    return_aux=AuxRequest(lse=True))
            lse = aux.lse.unsqueeze(-1)
            both = torch.logsumexp(torch.cat([lse, self.sinks.view(1, -1, 1, 1).expand_as(lse)], dim=-1), -1, True)
            a = a * torch.exp(lse - both)
        else:
            a = flex_attention(q, k, v, score_mod=self.score_mod(x), block_mask=self.block_mask, enable_gqa=True)
        y = self.o(a.transpose(1, 2).reshape(B, S, -1))
        return (y.float() ** 2).mean()


def inputs(S: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(11)
    return torch.randn(BATCH, S, DIM, generator=g).to(dtype)


def step(model, x) -> dict:
    model.zero_grad(set_to_none=True)
    loss = model(x)
    loss.backward()
    return {"loss": loss.detach().double(),
            "grads": {n.removeprefix("_orig_mod."): p.grad.detach().double().clone()
                      for n, p in model.named_parameters()}}


def reference(case: str, mask: str, S: int) -> tuple[dict, dict]:
    """fp64 and fp32 eager single-process steps on PyTorch's own flex_attention (its CPU backward refusal lifted
    for the call: its math path differentiates any score_mod)."""
    import torch.nn.attention.flex_attention as fa

    out = []
    orig = fa._validate_device
    fa._validate_device = lambda *args: None
    try:
        for dt in (torch.float64, torch.float32):
            torch._dynamo.reset()   # (eager flex_attention traces its score_mod with Dynamo: no stale graphs)
            torch.manual_seed(0)
            out.append(step(ScoreModel(case, mask, S).to(dt), inputs(S, dt)))
    finally:
        fa._validate_device = orig
    return out[0], out[1]


RESETS = ("none", "dynamo", "ultraattn")
"""What a worker clears before a case: nothing (a second model compiled in the same process, as a sweep or a
train-then-eval script does), Dynamo's graphs (``torch._dynamo.reset()``), or all of ultraattn's state too."""


def worker(rank: int, world: int, cases: list[tuple], options: dict) -> list[dict]:
    """Every ``(score_mod, mask, S[, reset])`` compiled with the backend (default Inductor) on this rank, one after
    another in this process, each a fresh model: the step, the site records of the graphs compiled for it, and
    whether each score_mod it compiled was generated into the kernels. ``reset`` (``RESETS``; default "ultraattn")
    is what is cleared before the case."""
    from torch._dynamo.utils import counters

    import ultraattn
    import ultraattn.passes
    from ultraattn.runtime import tile_kernels as tiles

    results = []
    for case, mask, S, *how in cases:
        reset = how[0] if how else "ultraattn"
        assert reset in RESETS, reset
        if reset == "ultraattn":
            ultraattn.reset()
        elif reset == "dynamo":
            torch._dynamo.reset()
        graphs, kernels = len(ultraattn.passes.side_table().graphs), set(tiles._SCORE_KERNELS)
        torch.manual_seed(0)
        cm = torch.compile(ScoreModel(case, mask, S), backend="ultraattn", options=dict(options))
        res = step(cm, inputs(S))
        res["generated"] = [v is not None for k, v in tiles._SCORE_KERNELS.items() if k not in kernels]
        recs = ultraattn.passes.side_table().graphs[graphs:]
        res["sites"] = [s.to_json() for g in recs for s in g.sites]
        res["keys"] = [k for g in recs for k in g.site_keys]
        res["fx_cache_hits"] = counters["inductor"]["fxgraph_cache_hit"]
        results.append(res)
    return results


def alive_worker(rank: int, world: int, options: dict) -> list[dict]:
    """Two models of one class alive at once, soft-capping at 20 and at 5 over the same documents, stepped in turn
    (A, B, A, B); then an eval model of the class (a sliding window, another length) run under ``no_grad``: each
    step's loss and gradients, the eval's loss alone."""
    models = {}
    for cap in (20, 5):
        torch.manual_seed(0)   # (as ``reference`` builds each)
        models[cap] = torch.compile(ScoreModel(f"softcap:{cap}", "document", 500), backend="ultraattn",
                                    options=dict(options))
    out = [step(models[cap], inputs(500)) for cap in (20, 5, 20, 5)]
    torch.manual_seed(0)
    model = ScoreModel("softcap:20", "window:128", 512).eval()
    ev = torch.compile(model, backend="ultraattn", options=dict(options))
    with torch.no_grad():
        out.append({"loss": ev(inputs(512)).double(), "grads": {}})
    return out


_SINCE_DYNAMO_RESET = [0]


def serve_site(rank: int, world: int, case: dict) -> dict:
    """One fuzzed site in a long-lived rank (``fuzz_driver.RankPool``): ``ScoreModel(case["score"], case["mask"],
    case["S"])`` compiled (``aot_eager``) and stepped after everything the rank compiled before, nothing of ultraattn
    reset; Dynamo is reset every few models only, below its recompile limit for one class."""
    import ultraattn.passes

    if _SINCE_DYNAMO_RESET[0] >= 6:
        torch._dynamo.reset()
        _SINCE_DYNAMO_RESET[0] = 0
    _SINCE_DYNAMO_RESET[0] += 1
    table = ultraattn.passes.side_table()
    graphs = len(table.graphs)
    torch.manual_seed(0)
    cm = torch.compile(ScoreModel(case["score"], case["mask"], case["S"]), backend="ultraattn",
                       options={"compiler": "aot_eager", "ilp_time_limit": 1.0, "time_budget": 2.0, "timeout": 120.0})
    res = step(cm, inputs(case["S"]))
    res["sites"] = [s.to_json() for g in table.graphs[graphs:] for s in g.sites]
    return res
