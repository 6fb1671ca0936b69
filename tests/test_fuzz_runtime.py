"""Property-based fuzzing of the runtime's public API (plan_attention / dispatch / dist_attention / undispatch).

Hypothesis draws cases (``fuzz_case``): masks (random block patterns with element noise, documents of random
lengths including length-1 documents, windows, prefixes, dilations, rows that attend nowhere), odd lengths 64-700
(never a multiple of the block), heads 1-8 with every GQA ratio that divides them, head dims 16-80, batch 1-2,
blocks 64 and 128, every method and planner, the mask as a BlockMask or a mask_mod, on worlds 1-4 (gloo, ranks
spawned once per world size, ``fuzz_driver``). Each case must hold:

* out, LSE, dq, dk, dv against the fp64 dense reference by the 2x rule (docs/numerics.md, ``fuzz_case.check_2x``);
* every rank moved exactly the messages of the plan's transfers touching it (``runtime_cases.check_bytes``);
* a combination the runtime does not support (Ulysses where the world size does not divide the heads) is refused
  by every rank with one clear error (argument, value, fix) before any rank communicated.

A failure prints, after hypothesis shrank it, a self-contained Python program reproducing it (``fuzz_case.repro``).

Budget: CI runs a fixed, derandomized number of examples per world size (``CI_EXAMPLES``, about a minute).
``ULTRAATTN_FUZZ_EXAMPLES=500`` runs that many per world size with fresh random draws (and hypothesis' example
database replaying earlier failures); ``ULTRAATTN_FUZZ_FP32=1`` also draws fp32 (CI draws bf16 and fp16).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fuzz_case import dense_mask, reference, repro
from fuzz_driver import RankPool, run_one
from hypothesis import HealthCheck, event, example, given, seed, settings
from hypothesis import strategies as st
from runtime_cases import check_bytes

from ultraattn.runtime import METHODS
from ultraattn.testing import check_2x

CI_EXAMPLES = {1: 40, 2: 40, 3: 25, 4: 25}
LONG = int(os.environ.get("ULTRAATTN_FUZZ_EXAMPLES", "0") or 0)
DTYPES = ("bf16", "fp16", "fp32") if os.environ.get("ULTRAATTN_FUZZ_FP32") else ("bf16", "fp16")
_TORCH = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


# ----------------------------------------------------------------------------- strategies
def empty_rows(seqlen: int):
    """A few query ranges that attend nowhere (often none)."""
    rng = st.tuples(st.integers(0, seqlen - 1), st.integers(1, max(1, seqlen // 4)))
    return st.one_of(st.just([]), st.just([]), st.lists(rng, min_size=1, max_size=3)).map(
        lambda rs: [list(r) for r in rs])


@st.composite
def documents(draw, seqlen: int, batch: int):
    """Per batch entry, document lengths (length-1 documents likely); they may stop short of the sequence."""
    per = []
    for _ in range(draw(st.sampled_from([1, batch]))):
        lengths, left = [], seqlen - draw(st.sampled_from([0, 0, 0, 1, 17, seqlen // 3]))
        while left > 0 and len(lengths) < 40:  # (then the rest attends nowhere)
            n = min(left, draw(st.one_of(st.just(1), st.integers(1, 8), st.integers(1, seqlen))))
            lengths.append(n)
            left -= n
        per.append(lengths)
    return per


@st.composite
def masks(draw, seqlen: int, batch: int, block: int) -> dict:
    kind = draw(st.sampled_from(["blocks", "documents", "window", "prefix", "dilated"]))
    if kind == "blocks":
        p_empty = draw(st.sampled_from([0.0, 0.3, 0.6, 1.0]))
        spec = {"kind": kind, "seed": draw(st.integers(0, 2**16)), "block": draw(st.sampled_from([32, block])),
                "p_empty": p_empty, "p_full": draw(st.sampled_from([0.0, 0.5])) * (1 - p_empty),
                "density": draw(st.sampled_from([0.05, 0.5, 0.95])), "noise": draw(st.sampled_from([0.0, 0.0, 0.01]))}
    elif kind == "documents":
        spec = {"kind": kind, "lengths": draw(documents(seqlen, batch)), "causal": draw(st.booleans())}
    elif kind == "window":
        spec = {"kind": kind, "window": draw(st.one_of(st.integers(1, 4), st.integers(1, seqlen))),
                "causal": draw(st.booleans())}
    elif kind == "prefix":
        spec = {"kind": kind, "prefix": draw(st.integers(0, seqlen))}
    else:
        spec = {"kind": kind, "dilation": draw(st.integers(1, 9)), "span": draw(st.integers(1, 40))}
    spec["empty_rows"] = draw(empty_rows(seqlen))
    return spec


@st.composite
def score_mods(draw) -> dict | None:
    """None four times in seven; else a score_mod family with random parameters (``fuzz_case.score_mod_of``)."""
    kind = draw(st.sampled_from([None, None, None, None, "softcap", "alibi", "relbias"]))
    if kind == "softcap":
        return {"kind": kind, "cap": draw(st.floats(0.5, 30.0))}
    if kind == "alibi":
        return {"kind": kind, "strength": draw(st.floats(0.001, 2.0))}
    if kind == "relbias":
        return {"kind": kind, "seed": draw(st.integers(0, 2**16)), "std": draw(st.floats(0.1, 3.0))}
    return None


@st.composite
def cases(draw, world: int) -> dict:
    block = draw(st.sampled_from([64, 128]))
    seqlen = draw(st.integers(64, 700).map(lambda s: s + 1 if s % block == 0 else s))  # never a block multiple
    heads = draw(st.integers(1, 8))
    kv_heads = draw(st.sampled_from([d for d in range(1, heads + 1) if heads % d == 0]))
    batch = draw(st.integers(1, 2))
    method = draw(st.sampled_from(("ultraattn",) * (len(METHODS) - 1) + METHODS[1:]))  # ours half the time
    return {
        "world": world, "seqlen": seqlen, "heads": heads, "kv_heads": kv_heads,
        "head_dim": draw(st.integers(16, 80)), "batch": batch, "dtype": draw(st.sampled_from(DTYPES)),
        "block": block, "method": method,
        "planner": draw(st.sampled_from(["auto", "fast", "ilp"])) if method == "ultraattn" else "auto",
        "mask_arg": draw(st.sampled_from(["block_mask", "mask_mod"])),
        "mask": draw(masks(seqlen, batch, block)), "score": draw(score_mods()), "seed": draw(st.integers(0, 2**16)),
    }


# ----------------------------------------------------------------------------- the property
def refused(case: dict) -> bool:
    """Combinations the runtime must refuse: Ulysses where the world size does not divide the head counts."""
    w = case["world"]
    return case["method"] == "ulysses" and bool(case["heads"] % w or case["kv_heads"] % w)


def violations(case: dict, results: list[dict]) -> list[str]:
    """Everything wrong with the ranks' ``results`` for ``case`` (empty: the case holds)."""
    errors = [r.get("error") for r in results]
    if refused(case):
        bad = []
        for rank, r in enumerate(results):
            e = r.get("error") or "no error"
            # names the argument and its value, says which counts the world size must divide, and the fix
            if not (e.startswith("ValueError: method='ulysses'") and f"world size {case['world']}" in e
                    and (f"num_heads={case['heads']}" in e or f"num_kv_heads={case['kv_heads']}" in e)
                    and "method='usp'" in e):
                bad.append(f"rank {rank}: expected the Ulysses refusal, got: {e}")
            elif r["comm_calls"]:
                bad.append(f"rank {rank}: refused only after communicating: {r['comm_calls']}")
        if len(set(errors)) != 1:
            bad.append(f"ranks refused differently: {errors}")
        return bad
    if any(errors):
        return [f"rank {rank}: {e}" for rank, e in enumerate(errors) if e]
    ref64 = reference(case, torch.float64)
    ref = reference(case, _TORCH[case["dtype"]])
    bad = check_2x(results[0], ref64, ref, case["dtype"])
    if bad and case["dtype"] == "fp32" and not check_2x(*_without_few_key_rows(case, results[0], ref64, ref), "fp32"):
        event(f"fp32: off only where a row attends <= {FEW_KEYS} keys (known: test_fp32_rows_with_few_keys)")
        bad = []
    return bad + check_bytes(results)


#: rows attending at most this many keys: where fp32 dq/dk may miss the 2x rule (test_fp32_rows_with_few_keys)
FEW_KEYS = 4


def _without_few_key_rows(case: dict, got: dict, ref64: dict, ref: dict) -> tuple[dict, dict, dict]:
    """The tensors with dq's rows that attend 1 to ``FEW_KEYS`` keys, and dk's columns such rows attend, set to the
    oracle (the known fp32 deviation of ``test_fp32_rows_with_few_keys``; everything else is compared unchanged)."""
    m = dense_mask(case)  # [B, S, S]
    n = m.sum(-1)
    one = (n >= 1) & (n <= FEW_KEYS)  # [B, S] rows with few keys
    cols = (m & one[:, :, None]).any(1)  # [B, S] keys such a row attends
    got, ref = dict(got), dict(ref)
    for name, sel in (("dq", one), ("dk", cols)):
        s = sel[:, None, :, None]
        got[name] = torch.where(s, ref64[name], got[name].double())
        ref[name] = torch.where(s, ref64[name], ref[name].double())
    return got, ref64, ref


def explain(case: dict, problems: list[str]) -> str:
    return ("\n".join(problems) + "\n\nA self-contained reproduction (save as repro.py, run `python repro.py`):\n\n"
            + repro(case))


class Pools:
    """One RankPool at a time: the tests of a world size share it; the next world size closes it."""

    def __init__(self) -> None:
        self.pool: RankPool | None = None

    def get(self, world: int) -> RankPool:
        if self.pool is not None and self.pool.world != world:
            self.close()
        if self.pool is None:
            self.pool = RankPool(world)
        return self.pool

    def close(self) -> None:
        p, self.pool = self.pool, None
        if p is not None:
            served = p.close()
            assert served == [p.count] * p.world, (served, p.count)  # every rank ran every case, then stopped


@pytest.fixture(scope="module")
def pools():
    ps = Pools()
    yield ps
    ps.close()


def _settings(world: int):
    if LONG:
        return settings(max_examples=LONG, deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow])
    # CI: the same cases every run (a fixed seed per world size, so the world sizes draw different cases)
    return settings(max_examples=CI_EXAMPLES[world], deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow])


def _case(world: int, **kw) -> dict:
    base = {"world": world, "seqlen": 200, "heads": 4, "kv_heads": 2, "head_dim": 16, "batch": 1, "dtype": "bf16",
            "block": 64, "method": "ultraattn", "planner": "fast", "mask_arg": "block_mask",
            "mask": {"kind": "window", "window": 1, "causal": True, "empty_rows": []}, "score": None, "seed": 0}
    return {**base, **kw}


#: cases every world size runs first (hypothesis' explicit examples): found by the fuzzer, or must stay covered
PINNED = [
    # no block at all (every row attends nowhere): the fast planner's price once failed on numpy's int64 bincount
    dict(mask={"kind": "blocks", "seed": 0, "block": 64, "p_empty": 1.0, "p_full": 0.0, "density": 0.5,
               "noise": 0.0, "empty_rows": []}),
    dict(mask={"kind": "window", "window": 3, "causal": False, "empty_rows": [[0, 200]]}, method="ring"),
    # length-1 documents everywhere, and a sequence the documents do not fill
    dict(mask={"kind": "documents", "lengths": [[1] * 67 + [60]], "causal": True, "empty_rows": []}, seqlen=131,
         batch=2, method="zigzag"),
    # Ulysses whose heads divide the world (runs) and do not (refused)
    dict(method="ulysses", heads=4, kv_heads=4), dict(method="ulysses", heads=6, kv_heads=3),
    dict(method="usp", heads=6, kv_heads=3, batch=2, mask={"kind": "prefix", "prefix": 70, "empty_rows": [[5, 9]]}),
    dict(planner="ilp", mask_arg="mask_mod", mask={"kind": "dilated", "dilation": 2, "span": 30, "empty_rows": []}),
    # a score_mod with a table indexed by relative position, a padded tail and rows that attend nowhere
    dict(method="zigzag", seqlen=150, mask={"kind": "window", "window": 40, "causal": True, "empty_rows": [[3, 5]]},
         score={"kind": "relbias", "seed": 1, "std": 2.0}),
]


def _fuzz_test(world: int):
    def test(pools, case):
        event(f"method {case['method']}" + ("" if case["method"] != "ultraattn" else f" planner {case['planner']}"))
        event(f"mask {case['mask']['kind']}" + (" with empty rows" if case["mask"]["empty_rows"] else ""))
        event("refused" if refused(case) else case["dtype"])
        event(f"score_mod {case['score']['kind'] if case['score'] else None}")
        problems = violations(case, pools.get(world).run(case))
        assert not problems, explain(case, problems)

    test.__name__ = test.__qualname__ = f"test_runtime_fuzz_world{world}"  # (hypothesis' database key)
    test.__doc__ = f"The property (module docstring) on {world} rank(s): the pinned cases, then hypothesis' cases."
    for kw in reversed(PINNED):
        test = example(case=_case(world, **kw))(test)
    test = _settings(world)(given(case=cases(world))(test))
    return test if LONG else seed(world)(test)


test_runtime_fuzz_world1 = _fuzz_test(1)
test_runtime_fuzz_world2 = _fuzz_test(2)
test_runtime_fuzz_world3 = _fuzz_test(3)
test_runtime_fuzz_world4 = _fuzz_test(4)


# ----------------------------------------------------------------------------- the reproduction
def test_repro_is_a_self_contained_program(tmp_path):
    """The program a failure prints runs on its own (spawning its ranks) and reports the case's numerics."""
    case = _case(2, seqlen=130, heads=2, kv_heads=1, mask={"kind": "dilated", "dilation": 3, "span": 5,
                                                              "empty_rows": [[7, 3]]})
    path = tmp_path / "repro.py"
    path.write_text(repro(case))
    root = str(Path(__file__).resolve().parents[1])  # this checkout's ultraattn, not another install
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, str(path)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "within the 2x rule: no problem" in proc.stdout, proc.stdout + proc.stderr[-3000:]


# ----------------------------------------------------------------------------- known fp32 deviation
@pytest.mark.xfail(strict=True, reason=(
    "fp32 only, rows that attend one or a few keys: the reference's softmax backward computes dS = P * (g - P.g) "
    "from ONE rounded g = dO.v, so where P is concentrated the matmul's rounding cancels (for one key exactly: its "
    "dq/dk are exact), while the runtime (like flash attention) computes dS = P * (dP - delta) with delta = "
    "rowsum(dO * O) from the output, rounded apart from dP: a few ulps of |dO||v| remain, up to ~2.5x the floor. "
    "bf16/fp16 and rows with more keys meet the 2x rule; matching it needs delta = sum_j P_ij dP_ij from the same "
    "dP, i.e. a second pass over every row's tiles and a cross-rank reduction"))
@pytest.mark.parametrize("kw", [
    dict(seqlen=65, heads=4, kv_heads=4, head_dim=34, mask={"kind": "window", "window": 1, "causal": True,
                                                            "empty_rows": []}),
    dict(seqlen=130, heads=2, kv_heads=1, head_dim=64, method="ring",
         mask={"kind": "documents", "lengths": [[1] * 100 + [30]], "causal": False, "empty_rows": []}),
], ids=["diagonal", "length1-documents"])
def test_fp32_rows_with_few_keys(kw):
    case = _case(1, dtype="fp32", **kw)
    got = run_one(0, 1, case)
    problems = check_2x(got, reference(case, torch.float64), reference(case, torch.float32), "fp32")
    assert not problems, explain(case, problems)


def test_fp32_three_key_rows_meet_the_rule():
    """Found at world 3 (ULTRAATTN_FUZZ_FP32=1): row 7 attends 3 keys, dq missed the 2x rule (2.41e-6 > 2.14e-6; the
    same at world 1) and was pinned above as a known deviation. Since the forward normalises each tile's output
    after its matmul (one rounding of the row sum instead of exp(s - lse) per element) it meets the rule
    (dq 1.34e-6); kept as a regression test."""
    case = _case(1, dtype="fp32", seqlen=65, heads=3, kv_heads=1, head_dim=27, batch=2, planner="auto", seed=2,
                 mask={"kind": "documents", "lengths": [[5, 3, 36]], "causal": False, "empty_rows": []})
    got = run_one(0, 1, case)
    problems = check_2x(got, reference(case, torch.float64), reference(case, torch.float32), "fp32")
    assert not problems, explain(case, problems)
