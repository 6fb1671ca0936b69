"""Move tokens by a plan and run attention on them: ``dispatch`` (global -> this rank's tokens), ``undispatch`` /
``gather_tokens`` (every rank's tokens -> global), ``dist_attention`` (this rank's share of the attention).

    q_local = ultraattn.dispatch(q, plan)                 # global -> this rank's tokens
    out_local, lse_local = ultraattn.dist_attention(q_local, k_local, v_local, plan)
    out = ultraattn.undispatch(out_local, plan)           # this rank's tokens -> global

``plan`` is an ``AttentionPlan`` from ``runtime.api.plan_attention``. Layout is (batch, heads, seq, dim) like SDPA
and flex_attention; ``seq_dim`` says where the sequence sits for other tensors (2 for q/k/v/out, 2 for lse
[B, H, S]).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor

from .api import AttentionPlan, check_consistent
from .executor import run


def _check_plan(plan) -> AttentionPlan:
    if not isinstance(plan, AttentionPlan):
        raise TypeError(f"`plan` must be an AttentionPlan from ultraattn.plan_attention, got {type(plan).__name__}")
    if plan.world > 1:
        if not dist.is_initialized():
            raise RuntimeError(f"the plan is for {plan.world} ranks but torch.distributed is not initialised")
        if dist.get_rank() != plan.global_ranks[plan.rank]:
            raise ValueError(f"the plan was made on global rank {plan.global_ranks[plan.rank]} but this process is "
                             f"rank {dist.get_rank()}")
        if plan.group is not dist.group.WORLD and dist.get_world_size(plan.group) != plan.world:
            raise ValueError(f"the plan is for {plan.world} ranks but its group now has "
                             f"{dist.get_world_size(plan.group)}")
    elif dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 and plan.group is None:
        # a 1-rank plan inside a multi-rank job is legal only when made for a 1-rank group
        pass
    return plan


def _seq_dim(x: Tensor, seq_dim: int, name: str) -> int:
    if not -x.dim() <= seq_dim < x.dim():
        raise ValueError(f"`seq_dim`={seq_dim} is out of range for `{name}` with {x.dim()} dims")
    return seq_dim % x.dim()


def dispatch(x: Tensor, plan: AttentionPlan, seq_dim: int = 2) -> Tensor:
    """This rank's tokens of the global tensor ``x`` (sequence on ``seq_dim``), the tail padded (``SequenceShards``).

    Differentiable; the gradient flows to this rank's tokens of ``x`` only.
    """
    plan = _check_plan(plan)
    d = _seq_dim(x, seq_dim, "x")
    if x.shape[d] != plan.seq_len:
        raise ValueError(f"`x` has {x.shape[d]} tokens on seq_dim={seq_dim} but the plan is for seqlen={plan.seq_len}")
    return plan.seq.shard(x, d, plan.seq_len)


class _Undispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, plan: AttentionPlan, d: int):
        ctx.plan, ctx.d = plan, d
        return gather_tokens(x, plan, d)

    @staticmethod
    def backward(ctx, g):
        # every rank holds the same global gradient (the global view): the local part is a slice
        return dispatch(g, ctx.plan, ctx.d), None, None


def gather_tokens(x: Tensor, plan: AttentionPlan, seq_dim: int = 2) -> Tensor:
    """The global tensor from every rank's tokens of ``x`` (an all-gather; not differentiable: see ``undispatch``)."""
    return plan.seq.gather(x, seq_dim, plan.seq_len)


def undispatch(x_local: Tensor, plan: AttentionPlan | None = None, seq_dim: int = 2) -> Tensor:
    """The global tensor from every rank's tokens (an all-gather), without the tail padding.

    ``plan`` None: ``x_local`` is a shard a compiled graph returned (a ``SeqShard``, ``options={"outputs":
    "sharded"}``, the default), which carries its layout and sequence dim; the result is its global value as a
    plain tensor. Differentiable: the backward takes this rank's slice of the (replicated) global gradient.
    """
    if plan is None:
        if not getattr(x_local, "_ultraattn_carrier", False):  # (passes/carrier.py, a layer above this one)
            raise TypeError("ultraattn.undispatch: `x_local` is not a shard an ultraattn graph returned (a SeqShard, "
                            f"got {type(x_local).__name__}); pass the AttentionPlan it was dispatched with as `plan`")
        return x_local.full_tensor()
    plan = _check_plan(plan)
    d = _seq_dim(x_local, seq_dim, "x_local")
    if x_local.shape[d] != plan.local_len:
        raise ValueError(f"`x_local` has {x_local.shape[d]} tokens on seq_dim={seq_dim} but this rank holds "
                         f"{plan.local_len} (did you pass a global tensor?)")
    return _Undispatch.apply(x_local, plan, d)


def dist_attention(q_local: Tensor, k_local: Tensor, v_local: Tensor, plan: AttentionPlan, *,
                   scale: float | None = None, return_lse: bool = True):
    """Attention of this rank's query tokens over the whole sequence, by the plan.

    Args:
        q_local: [B, H, L, D] from ``dispatch(q, plan)``; k_local, v_local: [B, Hk, L, D].
        scale: softmax scale (default 1/sqrt(D)).
        return_lse: also return the log-sum-exp (fp32 [B, H, L], natural log), differentiable.

    Returns:
        ``(out_local, lse_local)`` or ``out_local`` (q's dtype).
    """
    plan = _check_plan(plan)
    s = plan.shape
    want = {"q_local": (s.batch, s.num_heads, plan.local_len, s.head_dim),
            "k_local": (s.batch, s.kv_heads, plan.local_len, s.head_dim),
            "v_local": (s.batch, s.kv_heads, plan.local_len, s.head_dim)}
    for nm, t in (("q_local", q_local), ("k_local", k_local), ("v_local", v_local)):
        if not isinstance(t, Tensor):
            raise TypeError(f"`{nm}` must be a tensor, got {type(t).__name__}")
        if tuple(t.shape) != want[nm]:
            raise ValueError(f"`{nm}` has shape {tuple(t.shape)} but the plan expects {want[nm]} "
                             f"(batch, heads, local tokens, head_dim); dispatch the global tensor first")
        if t.dtype != plan.dtype:
            raise ValueError(f"`{nm}` has dtype {t.dtype} but the plan was made for {plan.dtype}; plan with "
                             f"dtype={t.dtype} or cast")
    if not (q_local.device == k_local.device == v_local.device):
        raise ValueError(f"q_local, k_local, v_local must be on one device, got {q_local.device}, "
                         f"{k_local.device}, {v_local.device}")
    check_consistent(plan)
    sc = 1.0 / math.sqrt(s.head_dim) if scale is None else float(scale)
    out, lse = run(plan.executor, q_local, k_local, v_local, sc)
    return (out, lse) if return_lse else out
