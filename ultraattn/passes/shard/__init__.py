"""Sequence sharding: every activation of a compiled graph lives on this rank's tokens.

Rewrites the Dynamo graph the backend receives (after ``rewrite.py`` turned each attention
site into ``ultraattn::site_attention``) so that the ops that carry the sequence run on this
rank's tokens only, in the token layout of the graph's attention plans (docs/compile.md,
"Sequence sharding"):

    before (every rank, full sequence)           after (rank r, its tokens)
    x   = embedding(tokens, W)                   x   = embedding(sp_dispatch(tokens), sp_enter(W))
    cos = outer(arange(S), f).cos()              cos = outer(sp_dispatch(arange(S)), f).cos()
    q   = linear(rms_norm(x), Wq).view(B,S,H,D)  q   = linear(rms_norm(x), sp_enter(Wq)).view(B,L,H,D)
    o   = site_attention(q, k, v)                o   = site_attention_local(q, k, v)
    ...                                          ...
    loss = cross_entropy(logits, labels)         loss = sp_all_reduce([ce_sum, count]) -> sum / count
    return loss, logits                          return loss, sp_gather(logits)   (or the shard)

Three steps, analysis before mutation, one file each (``links.py`` and the rule files hold
the vocabulary: ``Seq``, ``Link``, and per-op ``Rule`` objects in ``rules.py``, ``reductions.py``,
looked up in ``table.py``):

1. **Alignment** (``analysis.align``): which dimension of each tensor is the sequence. Seeded at every
   site's q, k, v (dim 2) and propagated forwards and backwards through per-op *links* (this
   input's dim d is the output's dim e): views and reshapes that keep the sequence whole (a
   flattened ``[batch * seq]`` dimension is tracked with the elements per position), permutes,
   broadcasting pointwise ops, linear/matmul rows, embedding, norms, indexing, cat/split along
   other dims, losses. A tensor aligned twice over (an S x S mask) is never sharded.
2. **Region** (``analysis.choose_region``): the ops that run on local tokens. Each op has a *mode*: "shard"
   (token-wise along the sequence: its output's positions come from sharded inputs), "reduce"
   (sum, mean or a loss over the sequence: a local reduction of the real tokens plus an
   all-reduce) or none (it runs on replicated data). The region grows forwards from the sites
   and backwards towards the inputs, where an op joins when every consumer of its output takes
   it sharded; so token ids, position ids and labels are sliced where they enter, and a tensor
   also needed replicated (a mask built from positions) stays replicated instead of being
   gathered.
3. **Lowering** (``lowering.lower``): a new graph. Replicated tensors that line up with the sequence are
   sliced (``sp_dispatch``) where they meet the region; replicated weights entering it pass
   ``sp_enter`` (their gradient is summed over ranks); a sharded tensor that an op outside the
   region needs is all-gathered (``sp_gather``): always correct, recorded as a fallback with its
   bytes; shapes in view/reshape/expand arguments become local; graph outputs are gathered
   (``outputs="global"``) or returned as the shard (``outputs="sharded"``).

The token layout is not chosen here: the backend plans the graph's first attention (a collective)
and hands the layout to ``lower``, so the analysis stays pure.

Padding: local tensors hold ``local_len`` tokens; positions at or past a tensor's sequence
length (the layout's tail, or tokens a prefix slice like ``logits[:, :-1]`` dropped) are
padding, excluded from every reduction over the sequence and dropped by gathers.

Caution: dropout runs on local tokens with this rank's random stream (a different mask than
one process would draw; the same distribution). In-place ops are sharded only together with
the tensor they modify. Activation-checkpoint regions are inlined first, tagged so that AOT autograd
still recomputes them (``checkpoint.inline_checkpoints``); other higher-order ops (selective checkpointing,
custom autograd functions) run on replicated data: correct, and listed as fallbacks.
"""

from ultraattn.passes.shard.analysis import Analysis, align, analyse, choose_region, site_nodes, summarize
from ultraattn.passes.shard.checkpoint import inline_checkpoints
from ultraattn.passes.shard.links import TOP, Link, Seq, Specs, band, opname
from ultraattn.passes.shard.lowering import lower
from ultraattn.passes.shard.table import rule_for

__all__ = ["TOP", "Analysis", "Link", "Seq", "Specs", "align", "analyse", "band", "choose_region",
           "inline_checkpoints", "lower", "opname", "rule_for", "site_nodes", "summarize"]
