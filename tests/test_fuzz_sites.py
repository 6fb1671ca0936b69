"""Property-based fuzzing of many attention sites compiled in one process (issue 50: a second model whose
attention differed only in its score_mod ran the first one's, silently wrong).

Hypothesis draws a site (a score_mod family and its constant, a mask family and its constant, a length); two gloo
ranks spawned once (``fuzz_driver.RankPool``, ``score_cases.serve_site``) compile each drawn site as a fresh model
after every site before it, nothing of ultraattn reset between them, and train one step. Every step must meet the
numerics policy against PyTorch's own flex_attention in one process, with the site rewritten. Families share graph
code and differ in constants (soft-caps, windows), so a cache keyed on less than a site's identity serves one
site's score_mod, mask_mod or plan to another; lengths change, so Dynamo's automatic dynamic shapes meet the
backend too.

CI runs ``CI_EXAMPLES`` derandomized examples (about a minute); ``ULTRAATTN_FUZZ_EXAMPLES=N`` runs N fresh ones.
"""

from __future__ import annotations

import os

import pytest
from fuzz_driver import RankPool
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from numerics import check_step
from score_cases import reference, serve_site

CI_EXAMPLES = 12
LONG = int(os.environ.get("ULTRAATTN_FUZZ_EXAMPLES", "0") or 0)


@st.composite
def sites(draw) -> dict:
    score = draw(st.sampled_from(["alibi", "softcap", "activation", "sandwich"]))
    if score == "softcap":
        score += f":{draw(st.sampled_from([2, 5, 20, 30]))}"
    mask = draw(st.sampled_from(["causal", "document", "window", "none"]))
    if mask == "window":
        mask += f":{draw(st.sampled_from([32, 64, 96, 200]))}"
    return {"world": 2, "score": score, "mask": mask, "S": draw(st.sampled_from([384, 500, 512]))}


@pytest.fixture(scope="module")
def pool():
    p = RankPool(2, serve=serve_site)
    yield p
    p.close()


@settings(max_examples=LONG or CI_EXAMPLES, derandomize=not LONG, deadline=None, database=None if not LONG else
          settings.default.database, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                             HealthCheck.too_slow])
@given(case=sites())
def test_sites_compiled_one_after_another_stay_exact(pool, case):
    results = pool.run(case, timeout=600)
    errors = [r.get("error") for r in results]
    assert not any(errors), errors
    ref64, ref32 = reference(case["score"], case["mask"], case["S"])
    for rank, r in enumerate(results):
        assert not check_step(r, ref64, ref32), (case, rank, check_step(r, ref64, ref32))
        (site,) = r["sites"]
        assert site["rewritten"] and "score_mod" in site["why"] and site["form"].startswith("program"), (case, site)
