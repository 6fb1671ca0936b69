"""Context-parallel training of a small Llama-style model with ``torch.compile(backend="ultraattn")``.

Every rank runs the same single-device training script on the full sequence. The ``ultraattn``
backend shards the sequence through the whole compiled graph: each rank embeds, normalises,
projects and computes the MLP and the loss for its own tokens only, and each attention call runs
as context-parallel tiles planned across the ranks, so activation memory per rank falls with the
number of ranks (``benchmarks/memory_cpu.py``: 4-layer model, S = 16K, 4 ranks). The losses and
gradients (and therefore the AdamW updates) equal a single-process run. The script checks exactly
that: it also trains the model eagerly in one process and compares the per-step losses (fp32,
tolerance 1e-4). ``--attention-only`` keeps the rest of the model replicated (context parallelism
of the attention calls alone) for comparison.

    python examples/train_cp.py                                  # spawns 4 gloo ranks on this CPU
    python examples/train_cp.py --mask document --nproc 2        # packed documents, flex_attention
    python examples/train_cp.py --mask document --softcap 20     # and a score_mod (tanh soft-capping)
    torchrun --nproc-per-node 2 examples/train_cp.py --steps 2   # gloo ranks on CPU, launched by torchrun
    torchrun --nproc-per-node 8 examples/train_cp.py --seqlen 16384 --dim 1024 --layers 4   # NCCL, a GPU per rank

Attention is ``F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)``. With
``--mask document`` every step packs new random-length documents (seeded: the same on every rank)
into the sequence and calls ``flex_attention`` with a document-causal BlockMask; each new mask is
planned without recompiling, by every rank for itself (milliseconds; the "plan ms" column is rank
0's planning time inside the step): the explicit program's exchange plan, or with ``--opaque`` the
fast planner's. ``--plan-ahead`` hands the next step's mask to ``ultraattn.plan_ahead`` before
running the current step, as a data loader would, so the fast plan is made on a worker thread while
the step runs (opaque sites; explicit sites plan in the step). The single-process reference uses
SDPA with the equivalent dense boolean mask (eager flex_attention has no backward on CPU). On CPU
the ranks share the cores, so the step times show the overhead of the run, not a speed-up.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch._dynamo.utils import counters
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

import ultraattn
from ultraattn.runtime.online import ONLINE
from ultraattn.testing import RankFailure, run_ranks

VOCAB = 1024
BLOCK = 128
"""BlockMask block size (the backend's own block size for the masks it builds for SDPA sites)."""
TOLERANCE = 1e-4


# ----------------------------------------------------------------------------- the model
def rope_tables(seqlen: int, head_dim: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """cos and sin of the rotary angles, ``[seqlen, head_dim // 2]`` (base 10000)."""
    inv_freq = 10000.0 ** -(torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seqlen, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the two halves of each head of ``x`` ``[batch, heads, seq, head_dim]`` by its position's angles."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Attention(nn.Module):
    """Grouped-query attention with RoPE; ``mask``: None (causal SDPA), a BlockMask (flex) or a dense bool mask.
    ``softcap``: tanh soft-capping of the scores, as Gemma 2 does (a score_mod of flex_attention; the dense path
    writes it out)."""

    def __init__(self, dim: int, heads: int, kv_heads: int, softcap: float | None = None):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.softcap = heads, kv_heads, dim // heads, softcap
        self.wq = nn.Linear(dim, heads * self.head_dim, bias=False)
        self.wkv = nn.Linear(dim, 2 * kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(heads * self.head_dim, dim, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: BlockMask | Tensor | None) -> Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.wkv(x).view(b, s, 2, self.kv_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        cap = self.softcap
        if isinstance(mask, BlockMask):
            score_mod = None if cap is None else (lambda s, b, h, q_idx, kv_idx: cap * torch.tanh(s / cap))
            out = flex_attention(q, k, v, score_mod=score_mod, block_mask=mask, enable_gqa=True)
        elif cap is not None:  # the single-process reference of a soft-capped run: plain torch, dense mask
            rep = self.heads // self.kv_heads
            s_ = q @ k.repeat_interleave(rep, 1).transpose(-1, -2) / math.sqrt(self.head_dim)
            s_ = (cap * torch.tanh(s_ / cap)).masked_fill(~mask, float("-inf"))
            out = torch.softmax(s_, -1) @ v.repeat_interleave(rep, 1)
        elif mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Layer(nn.Module):
    """Pre-norm transformer layer: RMSNorm -> attention, RMSNorm -> SwiGLU, each with a residual."""

    def __init__(self, dim: int, heads: int, kv_heads: int, softcap: float | None = None):
        super().__init__()
        self.attn_norm, self.mlp_norm = nn.RMSNorm(dim, eps=1e-6), nn.RMSNorm(dim, eps=1e-6)
        self.attn = Attention(dim, heads, kv_heads, softcap)
        self.mlp = SwiGLU(dim, hidden=64 * math.ceil(8 * dim / 3 / 64))  # ~8/3 dim, a multiple of 64

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: BlockMask | Tensor | None) -> Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, mask)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    def __init__(self, dim: int, layers: int, heads: int, kv_heads: int, vocab: int = VOCAB,
                 softcap: float | None = None):
        super().__init__()
        self.head_dim = dim // heads
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Layer(dim, heads, kv_heads, softcap) for _ in range(layers))
        self.norm = nn.RMSNorm(dim, eps=1e-6)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: Tensor, mask: BlockMask | Tensor | None = None) -> Tensor:
        """Mean next-token cross-entropy over ``tokens`` ``[batch, seq]``."""
        x = self.embed(tokens)
        cos, sin = rope_tables(tokens.shape[1], self.head_dim, tokens.device)
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        return self.loss(x, tokens)

    def loss(self, x: Tensor, tokens: Tensor) -> Tensor:
        """The head: final norm, output projection and next-token cross-entropy (a region of its own when the model
        is compiled block by block: ``benchmarks/memory_cpu.py``)."""
        logits = self.lm_head(self.norm(x))
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())


# ----------------------------------------------------------------------------- data and training
def batches(args: argparse.Namespace) -> list[tuple[Tensor, list[int]]]:
    """Per step: random tokens ``[1, seqlen]`` and random document lengths; seeded, so the same on every rank."""
    g = torch.Generator().manual_seed(args.seed)
    out = []
    for _ in range(args.steps):
        tokens = torch.randint(0, VOCAB, (1, args.seqlen), generator=g)
        docs = int(torch.randint(2, 7, (), generator=g))
        cuts = torch.randperm(args.seqlen - 1, generator=g)[:docs - 1].add(1).sort().values.tolist()
        lengths = [b - a for a, b in zip([0, *cuts], [*cuts, args.seqlen], strict=True)]
        out.append((tokens, out[0][1] if args.same_mask and out else lengths))
    return out


def document_masks(lengths: list[int], device: torch.device) -> tuple[BlockMask, Tensor]:
    """The document-causal mask of packed documents: as a BlockMask (flex) and as a dense bool ``[S, S]`` (SDPA)."""
    ids = torch.repeat_interleave(torch.arange(len(lengths), device=device), torch.tensor(lengths, device=device))

    def document_causal(b: Tensor | None, h: Tensor | None, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (ids[q_idx] == ids[kv_idx]) & (q_idx >= kv_idx)

    s = len(ids)
    block_mask = create_block_mask(document_causal, None, None, s, s, device=device, BLOCK_SIZE=BLOCK)
    pos = torch.arange(s, device=device)
    return block_mask, document_causal(None, None, pos[:, None], pos[None, :])


def train(args: argparse.Namespace, device: torch.device, compiled: bool, rank: int = 0) -> dict:
    """Train ``args.steps`` AdamW steps; compiled: through the ultraattn backend (on every rank), else eagerly."""
    torch.manual_seed(args.seed)
    model = Llama(args.dim, args.layers, args.heads, args.kv_heads, softcap=args.softcap).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    options = {"report": "summary" if rank == 0 else "off", "ilp_time_limit": 1.0, "time_budget": 2.0,
               "explicit": not args.opaque, "shard": not args.attention_only}
    if args.cost != "default":
        options["cost"] = args.cost  # "auto": this machine's calibrated profile (measured on first use), or a path
    run = torch.compile(model, backend="ultraattn", options=options) if compiled else model
    losses, seconds, plan_ms = [], [], []
    data = batches(args)
    masks = [document_masks(lengths, device) if args.mask == "document" else (None, None) for _, lengths in data]
    for step, (tokens, _lengths) in enumerate(data):
        block_mask, dense = masks[step]
        mask = block_mask if compiled else dense
        if compiled and args.plan_ahead and step + 1 < len(data) and masks[step + 1][0] is not None:
            ultraattn.plan_ahead(masks[step + 1][0])  # the data loader's side: planned while this step runs
        # planning inside the step: the fast planner's (opaque sites) and the exchange plans (explicit sites)
        planned = ONLINE.stats.seconds_inline + counters["ultraattn"]["exchange_plan_us"] * 1e-6
        start = time.perf_counter()
        loss = run(tokens.to(device), mask)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())  # .item() waits for the device
        seconds.append(time.perf_counter() - start)
        plan_ms.append((ONLINE.stats.seconds_inline + counters["ultraattn"]["exchange_plan_us"] * 1e-6 - planned)
                       * 1e3)
    c = counters["ultraattn"]  # what the backend did, counted by torch._dynamo.utils.counters
    return {"losses": losses, "seconds": seconds, "plan_ms": plan_ms, "sites": c["sites"],
            "rewritten": c["rewritten"], "sharded_ops": c["sharded_ops"], "fallbacks": c["fallbacks"],
            "planned_ahead": ONLINE.stats.used_ahead, "fx_cache": (counters["inductor"]["fxgraph_cache_hit"],
                                                                   counters["inductor"]["fxgraph_cache_miss"])}


def spawned_rank(rank: int, world: int, args: argparse.Namespace) -> dict:
    """One rank started by ``ultraattn.testing.run_ranks`` (the gloo process group is already initialised)."""
    return train(args, torch.device("cpu"), compiled=True, rank=rank)


# ----------------------------------------------------------------------------- check and launch
def compare(args: argparse.Namespace, world: int, cp: list[dict], ref: dict) -> bool:
    """Print the per-step losses of the CP run (rank 0) and the single-process run; True if all ranks match."""
    print(f"\n{args.layers}-layer Llama (dim {args.dim}, {args.heads} query / {args.kv_heads} kv heads), "
          f"seqlen {args.seqlen}, {args.mask} mask, {world} ranks")
    docs = args.mask == "document"
    print(f"{'step':>4}  {'CP loss':>10}  {'1-proc loss':>11}  {'max |diff|':>10}  {'CP s/step':>9}  "
          f"{'1-proc s/step':>13}" + (f"  {'plan ms':>7}  document lengths" if docs else ""))
    worst = 0.0
    for i, (want, (_, lengths)) in enumerate(zip(ref["losses"], batches(args), strict=True)):
        diff = max(abs(r["losses"][i] - want) for r in cp)
        worst = max(worst, diff)
        print(f"{i + 1:>4}  {cp[0]['losses'][i]:>10.6f}  {want:>11.6f}  {diff:>10.2e}  {cp[0]['seconds'][i]:>9.2f}  "
              f"{ref['seconds'][i]:>13.3f}" + (f"  {cp[0]['plan_ms'][i]:>7.1f}  {lengths}" if docs else ""))
    print("(CP step 1 includes compiling; CP s/step and plan ms: rank 0; plan ms: planning inside the step, all "
          "attention sites)")
    if docs and args.plan_ahead:
        print(f"plans made ahead and used, per rank: {', '.join(str(r['planned_ahead']) for r in cp)}")
    hits, misses = cp[0]["fx_cache"]
    print(f"Inductor FX graph cache, rank 0: {hits} hits, {misses} misses (a second run of the same command hits: "
          f"the rewritten graphs are the same text in every run)")
    rewritten = all(r["sites"] > 0 and r["rewritten"] == r["sites"] for r in cp)
    counts = ", ".join(f"{r['rewritten']}/{r['sites']}" for r in cp)
    print(f"attention sites rewritten by ultraattn, per rank: {counts}")
    if not args.attention_only:
        sharded = ", ".join(f"{r['sharded_ops']} ({r['fallbacks']} gathered)" for r in cp)
        print(f"ops on local tokens (sequence sharding), per rank: {sharded}")
    ok = worst <= TOLERANCE and rewritten
    print(f"max |CP loss - single-process loss| over ranks and steps = {worst:.2e} (tolerance {TOLERANCE:g}): "
          f"{'OK' if ok else 'FAILED'}")
    return ok


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--nproc", type=int, default=None,
                   help="ranks to spawn when started with plain python (default 4); torchrun sets its own")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seqlen", type=int, default=512)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--mask", choices=("causal", "document"), default="causal")
    p.add_argument("--softcap", type=float, default=None,
                   help="with --mask document: tanh soft-capping of the attention scores at this value (Gemma 2's "
                        "score_mod), applied in every tile with global indices")
    p.add_argument("--same-mask", action="store_true",
                   help="with --mask document: the first step's documents every step (to compare with new ones)")
    p.add_argument("--plan-ahead", action="store_true",
                   help="hand each step's document mask to ultraattn.plan_ahead one step early (a data loader would)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cost", default="default",
                   help="the planner's cost model: default (H100 figures), auto (this machine, calibrated once and "
                        "cached: `ultraattn calibrate`) or a profile's path")
    p.add_argument("--opaque", action="store_true",
                   help="keep each attention one op (options explicit=False) instead of explicit per-rank nodes")
    p.add_argument("--attention-only", action="store_true",
                   help="context parallelism of the attention calls alone (options shard=False): the rest of the "
                        "model runs replicated on the full sequence")
    args = p.parse_args()
    torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if torchrun and args.nproc is not None and args.nproc != int(os.environ["WORLD_SIZE"]):
        p.error(f"--nproc {args.nproc} under torchrun, which started {os.environ['WORLD_SIZE']} ranks: "
                f"set the number of ranks with torchrun --nproc-per-node instead")
    args.nproc = 4 if args.nproc is None else args.nproc
    for name in ("nproc", "steps", "layers", "dim", "heads", "kv_heads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.dim % args.heads:
        p.error(f"--dim {args.dim} must be divisible by --heads {args.heads} (head dim = dim / heads)")
    if args.dim // args.heads % 2:
        p.error(f"--dim {args.dim} / --heads {args.heads} = {args.dim // args.heads}: the head dim must be even "
                f"(RoPE rotates pairs of channels)")
    if args.heads % args.kv_heads:
        p.error(f"--heads {args.heads} must be a multiple of --kv-heads {args.kv_heads} (grouped-query attention)")
    if args.softcap is not None and (args.mask != "document" or not args.softcap > 0):
        p.error(f"--softcap {args.softcap}: needs --mask document (a flex_attention score_mod) and a positive cap")
    if args.seqlen < 2:
        p.error(f"--seqlen must be at least 2 (next-token prediction), got {args.seqlen}")
    return args


def main() -> int:
    args = parse_args()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun: this process is one rank
        cuda = torch.cuda.is_available()
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=300))
        rank, world = dist.get_rank(), dist.get_world_size()
        mine = train(args, device, compiled=True, rank=rank)
        cp = [None] * world
        dist.all_gather_object(cp, mine)
        dist.destroy_process_group()
        if rank != 0:
            return 0
        ref = train(args, device, compiled=False)
    else:  # plain python: spawn the ranks here, then run the reference in this process
        world, device = args.nproc, torch.device("cpu")
        print(f"spawning {world} gloo ranks on CPU (127.0.0.1)")
        try:
            cp = run_ranks(spawned_rank, world, args=(args,), timeout=3600, pg_timeout=300)
        except RankFailure as e:
            print(e, file=sys.stderr)
            return 1
        torch.set_num_threads(1)  # like each spawned rank, so that the step times compare
        ref = train(args, device, compiled=False)
    return 0 if compare(args, world, cp, ref) else 1


if __name__ == "__main__":
    sys.exit(main())
