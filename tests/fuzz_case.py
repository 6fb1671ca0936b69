"""One runtime fuzz case as plain data, what a rank does with it, its fp64 reference, and its reproduction.

A case is a dict of literals (``world``, ``seqlen``, ``heads``, ``kv_heads``, ``head_dim``, ``batch``, ``dtype``,
``block``, ``method``, ``planner``, ``mask_arg``, ``mask``, ``score``, ``seed``), so it pickles to spawned ranks and
prints as Python. ``mask`` names a pattern and its parameters (``dense_mask``): random block patterns with element
noise, documents (length-1 documents included; tokens past the last document attend nowhere), windows, prefixes,
dilations, each with optional rows that attend nowhere. ``score`` names a FlexAttention score_mod family and its
parameters (``score_mod_of``: tanh soft-capping, ALiBi, a random relative-position bias table), or None.

The functions marked SELF-CONTAINED use only torch, math and ultraattn's public API (imports inside), because
``repro`` copies their source into the reproduction it prints: the snippet runs exactly the code the fuzzer ran.
"""

from __future__ import annotations

import inspect
import pprint
import textwrap


# ----------------------------------------------------------------------------- SELF-CONTAINED
def dense_mask(case: dict):
    """bool [batch, S, S]: which key each query attends to (the oracle's mask and the mask_mod's table)."""
    import torch

    s, b, spec = case["seqlen"], case["batch"], case["mask"]
    q = torch.arange(s).view(-1, 1)
    kv = torch.arange(s).view(1, -1)
    out = torch.zeros(b, s, s, dtype=torch.bool)
    for e in range(b):
        kind = spec["kind"]
        if kind == "blocks":  # each block EMPTY / FULL / PARTIAL (random elements), then element noise
            g = torch.Generator().manual_seed(spec["seed"] + 7919 * e)
            blk = spec["block"]
            nb = -(-s // blk)
            p_empty, p_full = spec["p_empty"], spec["p_full"]
            u = torch.rand(nb, nb, generator=g)
            kind_qk = torch.where(u < p_empty, 0, torch.where(u < p_empty + p_full, 1, 2))
            kind_el = kind_qk.repeat_interleave(blk, 0).repeat_interleave(blk, 1)[:s, :s]
            fine = torch.rand(s, s, generator=g) < spec["density"]
            m = (kind_el == 1) | ((kind_el == 2) & fine)
            m ^= torch.rand(s, s, generator=g) < spec["noise"]
        elif kind == "documents":  # block-diagonal (causal inside when asked); past the documents: nothing
            lengths = spec["lengths"][e % len(spec["lengths"])]
            doc = torch.full((s,), -1, dtype=torch.long)
            start = 0
            for n, length in enumerate(lengths):
                doc[start:min(start + length, s)] = n
                start += length
            m = (doc.view(-1, 1) == doc.view(1, -1)) & (doc.view(-1, 1) >= 0)
            if spec["causal"]:
                m &= q >= kv
        elif kind == "window":
            d = q - kv
            m = (d < spec["window"]) & (d >= 0) if spec["causal"] else d.abs() < spec["window"]
        elif kind == "prefix":  # prefix-LM: the prefix sees itself, later tokens see the prefix and the past
            m = (kv < spec["prefix"]) | (q >= kv)
        elif kind == "dilated":  # causal, every `dilation`-th key back, `span` of them
            d = q - kv
            m = (d >= 0) & (d % spec["dilation"] == 0) & (d < spec["dilation"] * spec["span"])
        else:
            raise ValueError(f"unknown mask kind {kind!r}")
        for start, length in spec.get("empty_rows", ()):  # rows that attend nowhere
            m[start:start + length] = False
        out[e] = m
    return out


def score_mod_of(case: dict):
    """The case's score_mod ``fn(score, b, h, q_idx, kv_idx)`` (plain torch on index tensors, so both the dense
    oracle's broadcasting and FlexAttention's vmap evaluate it), or None."""
    import torch

    spec = case.get("score")
    if spec is None:
        return None
    heads, s = case["heads"], case["seqlen"]
    if spec["kind"] == "softcap":
        cap = spec["cap"]
        return lambda score, b, h, q_idx, kv_idx: cap * torch.tanh(score / cap)
    if spec["kind"] == "alibi":
        strength = spec["strength"]
        return lambda score, b, h, q_idx, kv_idx: \
            score - strength * torch.exp2(-8.0 * (h + 1) / heads) * (q_idx - kv_idx).abs()
    if spec["kind"] == "relbias":
        g = torch.Generator().manual_seed(spec["seed"])
        table = torch.randn(heads, 2 * s - 1, generator=g) * spec["std"]
        return lambda score, b, h, q_idx, kv_idx: score + table[h, q_idx - kv_idx + s - 1]
    raise ValueError(f"unknown score_mod kind {spec['kind']!r}")


def make_inputs(case: dict):
    """q, k, v, the output's gradient and the LSE's gradient (global tensors, the case's dtype; dlse fp32)."""
    import torch

    dt = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[case["dtype"]]
    g = torch.Generator().manual_seed(case["seed"])
    b, s, d = case["batch"], case["seqlen"], case["head_dim"]
    q = torch.randn(b, case["heads"], s, d, generator=g).to(dt)
    k = torch.randn(b, case["kv_heads"], s, d, generator=g).to(dt)
    v = torch.randn(b, case["kv_heads"], s, d, generator=g).to(dt)
    do = torch.randn(b, case["heads"], s, d, generator=g).to(dt)
    dlse = torch.randn(b, case["heads"], s, generator=g)
    return q, k, v, do, dlse


def run_attention(rank: int, world: int, case: dict) -> dict:
    """The case through ultraattn's public runtime API on this rank: plan_attention, dispatch, dist_attention,
    undispatch, backward. Rank 0 returns the global out, lse, dq, dk, dv (gradients summed over the ranks, each
    of which holds its own tokens'); every rank returns the messages it moved."""
    import torch
    import torch.distributed as dist
    from torch.nn.attention.flex_attention import create_block_mask

    import ultraattn
    from ultraattn.planner.tiling import PlannerOptions

    dt = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[case["dtype"]]
    s, b = case["seqlen"], case["batch"]
    table = dense_mask(case)

    def mask_mod(bi, h, q_idx, kv_idx):
        return table[bi, q_idx, kv_idx]

    if case["mask_arg"] == "block_mask":
        mask = create_block_mask(mask_mod, b, None, s, s, device="cpu", BLOCK_SIZE=case["block"])
    else:
        mask = mask_mod
    # short ILP limits: the fuzzer wants many cases, not the best plan
    options = PlannerOptions(time_budget=1.0, ilp_time_limit=0.5, schedule_time_limit=0.3, heuristic_seconds=0.1)
    plan = ultraattn.plan_attention(mask, seqlen=s, num_heads=case["heads"], head_dim=case["head_dim"],
                                    num_kv_heads=case["kv_heads"], batch=b, dtype=dt, block_size=case["block"],
                                    method=case["method"], planner=case["planner"], options=options, timeout=60,
                                    score_mod=score_mod_of(case))
    q, k, v, do, dlse = make_inputs(case)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    ql, kl, vl = (ultraattn.dispatch(x, plan) for x in (q, k, v))
    o_local, lse_local = ultraattn.dist_attention(ql, kl, vl, plan)
    out, lse = ultraattn.undispatch(o_local, plan), ultraattn.undispatch(lse_local, plan)
    ((out.double() * do.double()).sum() + (lse.double() * dlse.double()).sum()).backward()
    grads = [x.grad.clone() for x in (q, k, v)]
    if world > 1:
        for g in grads:
            dist.all_reduce(g)
    res = {"records": [r[:8] for ph in ("fwd", "bwd") for r in plan.comm_log[ph].records],
           "planner": plan.planner}
    if rank == 0:
        tp = plan.tile_plan
        res.update(out=out.detach(), lse=lse.detach(), dq=grads[0], dk=grads[1], dv=grads[2],
                   transfers=[(t.phase, t.tensor, t.chunk, t.head_group, t.src, t.dst, t.nbytes) for t in tp.transfers])
    return res


def reference(case: dict, dtype):
    """Single-device dense attention in ``dtype`` (torch.float64: the oracle): out, lse, dq, dk, dv."""
    import torch

    from ultraattn.testing import dense_attention

    q, k, v, do, dlse = make_inputs(case)
    fn, bound = score_mod_of(case), None
    if fn is not None:
        b, h = torch.arange(case["batch"]).view(-1, 1, 1, 1), torch.arange(case["heads"]).view(1, -1, 1, 1)
        qi, ki = torch.arange(case["seqlen"]).view(1, 1, -1, 1), torch.arange(case["seqlen"]).view(1, 1, 1, -1)

        def bound(scores):
            return fn(scores, b, h, qi, ki)

    return dense_attention(q, k, v, dense_mask(case)[:, None], do, dlse, dtype, score_mod=bound)


def reproduce(case: dict) -> list[str]:
    """Run ``case`` on ``case['world']`` gloo ranks (spawned here) and check it; the violations."""
    import torch

    from ultraattn.testing import check_2x, run_ranks

    if case["world"] > 1:
        got = run_ranks(run_attention, case["world"], args=(case,), timeout=600)[0]
    else:
        got = run_attention(0, 1, case)
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[case["dtype"]]
    return check_2x(got, reference(case, torch.float64), reference(case, dt), case["dtype"])


# ----------------------------------------------------------------------------- the reproduction
_SNIPPET_FUNCTIONS = (dense_mask, score_mod_of, make_inputs, run_attention, reference, reproduce)


def repro(case: dict) -> str:
    """A self-contained Python program reproducing ``case`` (save it as a file and run it with python)."""
    body = "\n\n".join(textwrap.dedent(inspect.getsource(f)) for f in _SNIPPET_FUNCTIONS)
    return (
        "# ultraattn runtime fuzzer (tests/test_fuzz_runtime.py): a failing case. Save as repro.py and run\n"
        "# `python repro.py` (it spawns the ranks itself; needs torch and ultraattn).\n"
        f"CASE = {pprint.pformat(case, width=110, sort_dicts=False)}\n\n\n"
        f"{body}\n\n\n"
        'if __name__ == "__main__":\n'
        "    problems = reproduce(CASE)\n"
        '    print("\\n".join(problems) if problems else "within the 2x rule: no problem")\n'
    )
