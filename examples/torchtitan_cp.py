"""Context-parallel training of torchtitan's Llama 3, compiled block by block with ultraattn.

torchtitan compiles a model one TransformerBlock at a time (``apply_compile``): smaller graphs, one compile
shared by identical blocks. ``ultraattn.compile_blocks(model.layers)`` does the same with the ultraattn backend
(torchtitan's own ``apply_compile`` refuses backends other than ``inductor`` and ``aot_eager``). The first block
meets the global sequence and slices it; every block returns this rank's tokens (a ``SeqShard``) and the next
block takes them as they are, so the norms, projections, RoPE, attention and MLP of every block run on this rank's
tokens with no all-gather between blocks. The final norm and the output projection are compiled as regions too,
and the loss as torchtitan compiles it (its ``loss`` compile component), so the logits and the loss are computed
on local tokens as well (the loss summed over the ranks). torchtitan's own forward runs unchanged, eagerly, around
the regions: its embedding before the first block meets the global tokens; with ``--eager-head`` its final norm
and output projection run on the exact global values (one all-gather of the last block's output).

The model is torchtitan 0.3.0's Llama 3 debug model, smaller (2 layers, dim 128, 8 heads / 4 KV heads, vocab 2048,
its ComplexRoPE and fused QKV). ``--attn flex`` (the default) uses torchtitan's FlexAttention with the block-causal
document mask its own ``get_attention_masks`` builds from per-document positions (new documents every step: a new
mask every batch, planned without recompiling); ``--attn sdpa`` its causal ``scaled_dot_product_attention``. The
script trains ``--steps`` AdamW steps on ``--nproc`` gloo ranks and checks every step's loss against the same
training in one eager process (fp32, tolerance 1e-4).

    pip install --no-deps torchtitan==0.3.0 && pip install spmd_types==0.2.3 tyro einops   # torchtitan's model
    python examples/torchtitan_cp.py                      # 4 gloo ranks on this CPU, flex document masks
    python examples/torchtitan_cp.py --attn sdpa --nproc 2
    torchrun --nproc-per-node 4 examples/torchtitan_cp.py # launched by torchrun instead
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F

import ultraattn
from ultraattn.testing import RankFailure, run_ranks

TOLERANCE = 1e-4


def need_torchtitan() -> None:
    try:
        import torchtitan  # noqa: F401
    except ImportError:
        sys.exit("this example needs torchtitan's model code: pip install --no-deps torchtitan==0.3.0 && "
                 "pip install spmd_types==0.2.3 tyro einops")


# ----------------------------------------------------------------------------- torchtitan's model and data
def add_model_args(p: argparse.ArgumentParser) -> None:
    """The model's sizes and the data's seed (``build``, ``make_batch``; ``benchmarks/clients.py`` shares them)."""
    p.add_argument("--seqlen", type=int, default=512)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)


def build(args, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """torchtitan's Llama 3 debug model with the sizes of ``args``; seeded, so every process holds the same
    weights."""
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm, compute_ffn_hidden_dim
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import _EMBEDDING_INIT, _NORM_INIT, Llama3Model, _build_llama3_layers
    from torchtitan.models.llama3 import _output_linear_init as _lm_head_init

    d, v = args.dim, args.vocab
    cfg = Llama3Model.Config(  # as torchtitan's llama3 ``_debugmodel``, with the sizes of the command line
        dim=d, vocab_size=v,
        tok_embeddings=Embedding.Config(num_embeddings=v, embedding_dim=d, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=d, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=d, out_features=v, param_init=_lm_head_init(d)),
        layers=_build_llama3_layers(
            fuse_qkv=True, n_layers=args.layers, dim=d, n_heads=args.heads, n_kv_heads=args.kv_heads,
            hidden_dim=compute_ffn_hidden_dim(d, multiple_of=256), attn_backend="flex",
            rope=ComplexRoPE.Config(dim=d // args.heads, max_seq_len=args.seqlen, theta=500000, scaling="llama")))
    if args.attn == "sdpa":  # 0.3.0 refuses "sdpa" by name for language models; its ScaledDotProductAttention is causal
        for layer in cfg.layers:
            layer.attention.inner_attention = ScaledDotProductAttention.Config()
    torch.manual_seed(args.seed)
    model = cfg.build()
    model.init_states()
    # Module.to(float64) would cast the complex RoPE table to a real one: cast real and complex tensors apart
    wide = dtype == torch.float64
    return model._apply(lambda t: t.to(torch.complex128 if wide else torch.complex64) if t.is_complex()
                        else t.to(dtype) if t.is_floating_point() else t)


def make_batch(args, model, step: int = 0) -> tuple:
    """Seeded tokens, labels and the model's extra inputs: none (sdpa), or positions that restart at every document
    and the BlockMask torchtitan builds from them (flex); new documents every step."""
    g = torch.Generator().manual_seed(args.seed + 1 + step)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seqlen + 1), generator=g)
    rows = []
    for _ in range(args.batch):
        cuts = (torch.randperm(args.seqlen - 1, generator=g)[: max(args.seqlen // 128, 1) - 1] + 1).sort().values
        bounds = [0, *cuts.tolist(), args.seqlen]
        rows.append(torch.cat([torch.arange(b - a) for a, b in zip(bounds, bounds[1:])]))
    positions = torch.stack(rows)
    extra = () if args.attn == "sdpa" else (positions, model.get_attention_masks(positions))
    return tokens[:, :-1], tokens[:, 1:], extra


def cross_entropy(pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """torchtitan's loss (``components/loss.py``): mean next-token cross-entropy."""
    return F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten())


def loss_of(model, batch, loss_fn=cross_entropy) -> torch.Tensor:
    inputs, labels, extra = batch
    return loss_fn(model(inputs, *extra), labels)


def eager_reference_mode() -> None:
    """Let one eager process run torchtitan's flex attention on CPU (reference processes only).

    PyTorch refuses eager flex_attention backward on CPU in its front end (``_validate_device``), and torchtitan's
    torch.compile'd flex has no CPU backward in Inductor: the reference lifts that check and runs flex_attention
    eagerly (PyTorch's unfused math path). Its RoPE runs in fp64 for fp64 inputs (the original rounds q and k to
    fp32), so an fp64 reference is fp64 throughout."""
    import torch.nn.attention.flex_attention as fa
    from torchtitan.models.common import ComplexRoPE
    from torchtitan.models.common.attention import FlexAttention

    fa._validate_device = lambda query, key, value: None
    FlexAttention._compiled_flex_attn = fa.flex_attention
    orig = ComplexRoPE.apply_rotary_emb

    def rope(query, key, rope_cache):
        if query.dtype != torch.float64:
            return orig(query, key, rope_cache)
        q = torch.view_as_complex(query.reshape(*query.shape[:-1], -1, 2))
        k = torch.view_as_complex(key.reshape(*key.shape[:-1], -1, 2))
        cache = rope_cache.to(torch.complex128)
        return torch.view_as_real(q * cache).flatten(3), torch.view_as_real(k * cache).flatten(3)

    ComplexRoPE.apply_rotary_emb = staticmethod(rope)
    warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")


def compile_like_torchtitan(model, options: dict | None = None, head: bool = True):
    """torchtitan's ``apply_compile`` with the ultraattn backend: every TransformerBlock compiled on its own, with
    the Dynamo setting torchtitan uses; returns the loss function, compiled as torchtitan's ``loss`` compile
    component does.

    ``head``: the final norm and the output projection are regions of their own too, so the last block's shard
    flows through them into the loss and the logits never exist whole on any rank (without: they run eagerly on
    the global values, one all-gather of the last block's output, and the loss runs on every rank's full logits)."""
    torch._dynamo.config.capture_scalar_outputs = True
    opts = {"report": "off", **(options or {})}
    ultraattn.compile_blocks(model.layers, options=opts)
    if head:
        ultraattn.compile_blocks([model.norm, model.lm_head], options=opts)
    return torch.compile(cross_entropy, backend="ultraattn", options=opts)


# ----------------------------------------------------------------------------- training
def train(model, args, steps: int, loss_fn=cross_entropy) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(steps):
        loss = loss_of(model, make_batch(args, model, step), loss_fn)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def rank_main(rank: int, world: int, args) -> list[float]:
    torch.set_num_threads(1)
    model = build(args)
    loss_fn = compile_like_torchtitan(model, head=not args.eager_head)
    t0 = time.perf_counter()
    losses = train(model, args, args.steps, loss_fn)
    if rank == 0:
        print(f"{world} ranks: {args.steps} steps in {time.perf_counter() - t0:.1f} s (the first compiles)", flush=True)
    return losses


def reference_main(rank: int, world: int, args) -> list[float]:
    torch.set_num_threads(1)
    eager_reference_mode()
    return train(build(args), args, args.steps)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--attn", choices=("flex", "sdpa"), default="flex")
    p.add_argument("--steps", type=int, default=3)
    add_model_args(p)
    p.add_argument("--eager-head", action="store_true",
                   help="leave the final norm and output projection eager (on the gathered global values)")
    args = p.parse_args()
    need_torchtitan()
    if "RANK" in os.environ:  # launched by torchrun: this process is one rank
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
        losses = rank_main(dist.get_rank(), dist.get_world_size(), args)
        if dist.get_rank() == 0:
            print("losses:", " ".join(f"{x:.5f}" for x in losses))
        dist.destroy_process_group()
        return
    try:
        ranks = run_ranks(rank_main, args.nproc, args=(args,), timeout=1800)
        (ref,) = run_ranks(reference_main, 0, args=(args,), timeout=1800)
    except RankFailure as exc:
        sys.exit(f"failed:\n{exc}")
    worst = max(abs(a - b) for losses in ranks for a, b in zip(losses, ref))
    print(f"{'step':>4}  {'ultraattn, ' + str(args.nproc) + ' ranks':>20}  {'one process':>12}")
    for i, (a, b) in enumerate(zip(ranks[0], ref)):
        print(f"{i:>4}  {a:>20.6f}  {b:>12.6f}")
    print(f"largest loss difference over all ranks and steps: {worst:.2e} (tolerance {TOLERANCE:g})")
    if worst > TOLERANCE:
        sys.exit("the losses differ from one process")


if __name__ == "__main__":
    main()
