"""Real clients: attn-gym's masks, transformers' Llama, and the sites the backend keeps, against one process.

Every case is checked by the numerics policy (tests/numerics.py: loss and every parameter gradient against the
fp64 eager single process, within 2x the fp32 eager run's error) on every rank. Cases share spawned ranks: one
``run_ranks`` per group runs them all, one after another in the same processes, each from a fresh Dynamo but with
whatever ultraattn's process state the cases before it left (tests/client_cases.py), as a sweep or a notebook
would: every case must be exact whatever was compiled before it.

The attn-gym matrix runs under ``aot_eager``: the same sharded graphs and explicit per-rank programs as
Inductor (which test_backend and the kept/transformers cases here compile) at a fraction of the compile time.
It runs at 2 and 4 ranks (``ULTRAATTN_CLIENT_WORLDS`` picks others).
"""

from __future__ import annotations

import os

import attn_gym.masks as M
import pytest
import torch
from client_cases import (
    ARGS,
    CROSS,
    KEPT_CASES,
    KEPT_S,
    dense_of,
    gemma_reference,
    gemma_worker,
    gym_case,
    gym_masks,
    gym_reference,
    gym_worker,
    hf_reference,
    hf_worker,
    kept_reference,
    kept_worker,
)
from numerics import check_step, fresh_dynamo  # noqa: F401 - fresh_dynamo: an autouse fixture
from torch.nn.attention.flex_attention import create_block_mask, create_mask

from ultraattn.testing import run_ranks

FAST = {"ilp_time_limit": 1.0, "time_budget": 2.0, "timeout": 120.0}
WORLDS = [int(w) for w in os.environ.get("ULTRAATTN_CLIENT_WORLDS", "2,4").split(",")]
KEPT_WHY = ("cross-attention", "block size")
"""Why an attn-gym site may stay the original op: q and k/v lengths differ, or its BlockMask's blocks are not
power-of-two tiles (VSA's 50-token tiles at S=500)."""


def test_every_attn_gym_mask_is_found():
    """The matrix iterates over what the package exports: it must see the masks it ships (a broken discovery
    would make the matrix pass empty)."""
    names = dict(gym_masks())
    assert len(names) >= 20, names
    assert names["causal_mask"] == "mask_mod" and names["generate_doc_mask_mod"] == "generator"
    assert names["create_vsa_block_mask"] == "block_mask"
    assert "compute_vsa_topk_indices" not in names and "build_tree_ancestor_matrix" not in names  # helpers


@pytest.mark.parametrize("world", WORLDS)
def test_every_attn_gym_mask_matches_one_process(world):
    names = [n for n, _ in gym_masks()]
    res = run_ranks(gym_worker, world, args=(names, [500, 512], dict(FAST, compiler="aot_eager")), timeout=1800)
    bad = []
    for i, case in enumerate(res[0]):
        label = f"{case['name']} S={case['S']}"
        errors = {r[i].get("error") for r in res}
        if errors != {None}:
            bad.append(f"{label}: {errors} {res[0][i].get('trace', '')}")
            continue
        ref64, ref32 = gym_reference(gym_case(case["name"], case["S"]))
        for rank, r in enumerate(res):
            if check_step(r[i], ref64, ref32):
                bad.append(f"{label} rank {rank}: {check_step(r[i], ref64, ref32)}")
        (site,) = case["sites"]
        _, mask, rewritten, why, form = site
        if not rewritten and not any(w in why for w in KEPT_WHY):
            bad.append(f"{label}: kept ({why})")
        if rewritten and not form.startswith("program"):
            bad.append(f"{label}: {form}")
        if not rewritten and "eager flex_attention" not in form:
            bad.append(f"{label}: kept as {form!r}")
        if case["fallbacks"]:
            bad.append(f"{label}: ops on gathered data {case['fallbacks']}")
    assert not bad, "\n".join(bad)
    rewritten = sum(c["sites"][0][2] for c in res[0])
    assert rewritten >= len(res[0]) - 6, rewritten  # (kept: jetspec's 2 cross-attention masks x 2 lengths, VSA at 500)


def test_kept_and_new_flex_forms_run_exactly_under_inductor():
    """Sites the backend keeps compile with the default compiler (Inductor) on CPU and train exactly:
    cross-attention (flex with attn-gym's flamingo mask, SDPA), a kept site (soft-capped cross-attention) fed by a
    rewritten one in a checkpointed region (the graph stays sequence-sharded); and the flex forms it rewrites:
    score_mods (attn-gym's ALiBi with a causal BlockMask, soft-capping without one, a learned bias table whose
    gradient is checked), no block_mask (full attention) and a BlockMask built inside the compiled code. Sites are
    reported with their true mask and density."""
    res = run_ranks(kept_worker, 2, args=(list(KEPT_CASES), FAST), timeout=1800)
    bm = create_block_mask(lambda b, h, q, k: q >= k, None, None, KEPT_S, KEPT_S, device="cpu")
    causal_blocks = float(bm.kv_num_blocks.sum() + bm.full_kv_num_blocks.sum()) / bm.kv_indices[0, 0].numel()
    bad = []
    for i, case in enumerate(KEPT_CASES):
        ref64, ref32 = kept_reference(case)
        for rank, r in enumerate(res):
            if check_step(r[i], ref64, ref32):
                bad.append(f"{case} rank {rank}: {check_step(r[i], ref64, ref32)}")
        *first, site = res[0][i]["sites"]
        if case == "mixed_ckpt":  # the first site is rewritten and sharded; the kept one runs on gathered data
            if not (first[0]["rewritten"] and res[0][i]["sharded"] == [True] and
                    [op for op in res[0][i]["fallbacks"] if "kept_flex" not in op] == []):
                bad.append(f"{case}: {first} sharded {res[0][i]['sharded']} gathered {res[0][i]['fallbacks']}")
        kept = case in CROSS  # score_mods are rewritten (tests/test_score_mods.py); cross-attention is kept
        if site["rewritten"] == kept:
            bad.append(f"{case}: rewritten={site['rewritten']} ({site['why']})")
        want_mask = {"alibi_causal": "block_mask", "softcap": "full", "learned_bias": "full",
                     "flex_cross": "block_mask", "sdpa_cross": "full", "mixed_ckpt": "full", "flex_no_mask": "full",
                     "mask_in_graph": "block_mask"}[case]
        if site["mask"] != want_mask:
            bad.append(f"{case}: reported mask {site['mask']}, not {want_mask}")
        if case == "alibi_causal" and site["density"] != causal_blocks:  # the BlockMask's, not "full, 1.000"
            bad.append(f"{case}: density {site['density']} != {causal_blocks}")
        if kept and case != "sdpa_cross" and "kept_flex" not in res[0][i]["code"][0]:
            bad.append(f"{case}: no ultraattn::kept_flex in the graph")
        if case in ("alibi_causal", "softcap", "learned_bias") and not ("score_mod" in site["why"]
                                                                       and site["form"].startswith("program")):
            bad.append(f"{case}: {site['why']} ({site['form']}), not an explicit score_mod site")
    assert not bad, "\n".join(bad)
    assert res[0][KEPT_CASES.index("learned_bias")]["grads"]["rel"].abs().sum() > 0


HF_CASES = [  # (attn_implementation, S, packed, use_cache, compiler)
    ("flex_attention", 200, True, False, "inductor"), ("flex_attention", 200, True, None, "aot_eager"),
    ("flex_attention", 256, False, False, "aot_eager"), ("flex_attention", 256, False, None, "aot_eager"),
    ("sdpa", 200, True, False, "aot_eager"), ("sdpa", 200, True, None, "aot_eager"),
    ("sdpa", 256, False, False, "aot_eager"), ("sdpa", 256, False, None, "inductor"),
]


def test_transformers_llama_matches_one_process():
    """transformers' LlamaForCausalLM (tiny random config, no download), flex_attention and SDPA, packed
    documents (positions restarting) and plain, use_cache default (True, even in train()) and False: exact, every
    site rewritten, and no op on gathered data (the default cache appends keys to an empty tensor)."""
    res = run_ranks(hf_worker, 2, args=(HF_CASES, FAST), timeout=1800)
    bad = []
    for i, (impl, S, packed, use_cache, compiler) in enumerate(HF_CASES):
        label = f"{impl} S={S} packed={packed} use_cache={use_cache} {compiler}"
        ref64, ref32 = hf_reference(S, packed, use_cache)
        for rank, r in enumerate(res):
            if check_step(r[i], ref64, ref32):
                bad.append(f"{label} rank {rank}: {check_step(r[i], ref64, ref32)}")
        got = res[0][i]
        if len(got["sites"]) != 2 or not all(s[2] and s[3].startswith("program") for s in got["sites"]):
            bad.append(f"{label}: sites {got['sites']}")
        if got["fallbacks"] or not got["sharded"]:
            bad.append(f"{label}: gathered {got['fallbacks']}, sharded ops {got['sharded']}")
    assert not bad, "\n".join(bad)


def test_gym_reference_reads_the_blocks_of_a_block_built_mask():
    """The oracle of a BlockMask built from blocks (VSA) is its blocks, not its mask_mod (a padding predicate):
    what flex_attention computes on a GPU."""
    case = gym_case("create_vsa_block_mask", 512)
    want = create_mask(M.generate_vsa_mask_mod(ARGS["topk_indices"](512), 64), 1, 4, 512, 512, device="cpu")
    assert torch.equal(dense_of(case["block_mask"], 1, 4), want)
    assert not torch.equal(want, create_mask(case["block_mask"].mask_mod, 1, 4, 512, 512, device="cpu"))


def test_transformers_gemma2_trains_exactly():
    """transformers' Gemma 2 (tiny random config, flex_attention): tanh soft-capping of the attention logits is a
    score_mod, one layer slides a 96-token window over 200 tokens. Compiled whole and block by block
    (``compile_blocks`` on its decoder layers): every site rewritten with its score_mod, the graphs
    sequence-sharded with nothing gathered, loss and every gradient exact at 2 ranks under Inductor."""
    res = run_ranks(gemma_worker, 2, args=(200, FAST), timeout=1800)
    ref64, ref32 = gemma_reference(200)
    for rank, runs in enumerate(res):
        for how, r in zip(("whole", "blocks"), runs, strict=True):
            assert not check_step(r, ref64, ref32), (rank, how, check_step(r, ref64, ref32))
            assert len(r["sites"]) == 2 and all(s["rewritten"] and "score_mod" in s["why"] and
                                                s["form"].startswith("program") for s in r["sites"]), \
                (how, r["sites"])
            # (whole: the graph with the layers; blocks: each layer's graph)
            assert r["fallbacks"] == [] and max(r["sharded"]) > (100 if how == "whole" else 30), (how, r)
