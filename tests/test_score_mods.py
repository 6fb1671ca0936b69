"""FlexAttention score_mods across ranks: attn-gym's score_mods trained through the backend (default Inductor) at 2
and 4 ranks against PyTorch's own eager flex_attention in one process; the tiles' score_mod path against a dense
reference (its gradient, buffers included); what stays kept. Models: ``score_cases.py``."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from numerics import check_step, fresh_dynamo  # noqa: F401 - fresh_dynamo: an autouse fixture
from score_cases import CASES, ScoreModel, alive_worker, inputs, reference, worker

from ultraattn.kernels import config
from ultraattn.masks.pattern import FULL
from ultraattn.runtime.tile_kernels import _kernels_on
from ultraattn.runtime.tiles import ScoreMod, TileGeometry, row_backward, row_forward
from ultraattn.testing import check_2x, dense_attention, run_ranks

FAST = {"ilp_time_limit": 1.0, "time_budget": 2.0, "timeout": 300.0}


ROW1 = (("alibi", "causal"), ("softcap", "document"), ("activation", "document"))
"""One model after another in the same ranks, ``torch._dynamo.reset()`` between them: the second and third ran
the first one's score_mod (their sites shared a run-time plan that carried it), silently wrong."""
ROW2 = (("softcap:20", "document"), ("softcap:5", "document"), ("alibi", "causal"))
"""One family, another constant, and no reset at all: graph code that differs only in a number."""
WINDOWS = (("softcap:30", "window:64"), ("softcap:30", "window:128"))
"""A mask_mod family with two constants (the window's width), no reset."""


def _runs(world: int) -> list[tuple]:
    """The in-process sequences every world size runs in the same ranks, nothing of ultraattn reset between them:
    ``ROW1``, ``ROW2``, ``WINDOWS`` at S = 500, then all eight cases in attn-gym's order (``CASES``), S = 500 (a
    tail) and 512 (whole blocks) alternating between the cases and swapped between the world sizes, Dynamo reset
    before every other one (Dynamo recompiles a fresh model of the same class up to its recompile limit); at 4 ranks
    that reset is ``ultraattn.reset()``, so those cases run as in a process of their own."""
    runs = [(c, m, 500, "dynamo") for c, m in ROW1] + [(c, m, 500, "none") for c, m in ROW2 + WINDOWS]
    first = "dynamo" if world == 2 else "ultraattn"   # at 4 ranks every other case runs as if alone (issue 50's row 4)
    runs += [(c, m, (500, 512)[(n + (world == 4)) % 2], (first, "none")[n % 2]) for n, (c, m) in enumerate(CASES)]
    return runs


@pytest.mark.parametrize("world", [2, 4])
def test_attn_gym_score_mods_train_exactly(world):
    """attn-gym's alibi (causal BlockMask, and none), softcap, sandwich, activation, graphormer (a learned table:
    its gradient is summed over the ranks) and mla_rope (documents), and GPT-OSS-style attention sinks through the
    LSE; batch 2, GQA: loss and every gradient by the numerics policy, each site rewritten as an explicit program
    with its score_mod. All of them one model after another in the same ranks (``_runs``), with soft-capping at
    three constants and a sliding window at two: no site may run another's score_mod, mask_mod or plan."""
    runs = _runs(world)
    res = run_ranks(worker, world, args=(runs, FAST), timeout=1800)
    bad = []
    refs = {}
    for i, (case, mask, S, reset) in enumerate(runs):
        if (case, mask, S) not in refs:
            refs[case, mask, S] = reference(case, mask, S)
        ref64, ref32 = refs[case, mask, S]
        for rank, r in enumerate(res):
            if check_step(r[i], ref64, ref32):
                bad.append(f"#{i} {case}/{mask} S={S} (after reset={reset}) rank {rank}: "
                           f"{check_step(r[i], ref64, ref32)}")
        sites = res[0][i]["sites"]
        if len(sites) != 1 or not (sites[0]["rewritten"] and "score_mod" in sites[0]["why"]
                                   and sites[0]["form"].startswith("program")):
            bad.append(f"#{i} {case}/{mask} S={S}: {sites}")
            continue
        want = "full" if mask == "none" else "block_mask"
        if sites[0]["mask"] != want:
            bad.append(f"#{i} {case}/{mask}: reported mask {sites[0]['mask']}, not {want}")
    assert not bad, "\n".join(bad)
    by_case = {c: r for (c, _m, _s, _r), r in zip(runs, res[0], strict=True)}
    assert by_case["graphormer"]["grads"]["spatial"].abs().sum() > 0   # a learned table read by the score_mod
    assert by_case["sinks"]["grads"]["sinks"].abs().sum() > 0          # sinks: through the site's log-sum-exp
    # the constants matter: each softcap's reference differs from the others' by more than the policy allows
    caps = [refs[f"softcap:{c}", "document", 500][0]["loss"] for c in (20, 5)] + \
        [refs["softcap", "document", 500][0]["loss"]]
    assert min(abs(a - b) for a, b in itertools.combinations(caps, 2)) > 1e-6, caps


def test_two_models_alive_at_once_and_an_eval_model():
    """Two models of one class that differ only in the soft-cap constant, alive together and stepped in turn, then
    an eval model of the class at another length and mask (Dynamo makes the length symbolic on that recompile; the
    backend compiles it for its one length): every step exact against its own model's single process."""
    res = run_ranks(alive_worker, 2, args=(FAST,), timeout=1800)
    refs = {cap: reference(f"softcap:{cap}", "document", 500) for cap in (20, 5)}
    ev64, ev32 = (_eval_loss(dt) for dt in (torch.float64, torch.float32))
    for rank, r in enumerate(res):
        for i, cap in enumerate((20, 5, 20, 5)):
            assert not check_step(r[i], *refs[cap]), (rank, i, cap, check_step(r[i], *refs[cap]))
        assert not check_step(r[4], ev64, ev32), (rank, "eval", check_step(r[4], ev64, ev32))
        assert r[0]["grads"]["q.weight"].ne(r[1]["grads"]["q.weight"]).any()   # the two models differ


def _eval_loss(dtype) -> dict:
    import torch.nn.attention.flex_attention as fa

    orig, fa._validate_device = fa._validate_device, lambda *args: None
    try:
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = ScoreModel("softcap:20", "window:128", 512).to(dtype).eval()
        with torch.no_grad():
            return {"loss": model(inputs(512, dtype)).double(), "grads": {}}
    finally:
        fa._validate_device = orig


def test_a_restart_with_warm_caches_and_one_constant_changed(tmp_path):
    """Across processes, with Inductor's on-disk caches warm: soft-capping at 20, then at 5 in new processes (the
    same graph code but a constant), then at 20 again. The second must not be served the first one's graphs (its
    site key differs) and is exact; the third hits the cache the first filled (the key is deterministic)."""
    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    runs = [run_ranks(worker, 2, args=([(f"softcap:{cap}", "document", 500)], FAST), timeout=900, env=env)
            for cap in (20, 5, 20)]
    for cap, res in zip((20, 5, 20), runs, strict=True):
        ref = reference(f"softcap:{cap}", "document", 500)
        for rank, (r,) in enumerate(res):
            assert not check_step(r, *ref), (cap, rank, check_step(r, *ref))
    keys = [res[0][0]["keys"] for res in runs]
    assert keys[0] == keys[2] and keys[0] != keys[1], keys
    assert runs[2][0][0]["fx_cache_hits"] > 0 and runs[1][0][0]["fx_cache_hits"] == 0, \
        [res[0][0]["fx_cache_hits"] for res in runs]


def test_score_mods_in_one_op_sites():
    """``explicit=False``: each site one op running the runtime's executor (its backward op returns the learned
    table's gradient, summed over the ranks by the transport): exact too, with a run-time mask and with none."""
    runs = [("graphormer", "causal", 500), ("alibi", "none", 512)]
    res = run_ranks(worker, 2, args=(runs, dict(FAST, explicit=False)), timeout=1800)
    for i, (case, mask, S) in enumerate(runs):
        ref64, ref32 = reference(case, mask, S)
        for rank, r in enumerate(res):
            assert not check_step(r[i], ref64, ref32), (case, rank, check_step(r[i], ref64, ref32))
            (site,) = r[i]["sites"]
            assert site["rewritten"] and site["form"].startswith("one op"), site
    assert res[0][0]["grads"]["spatial"].abs().sum() > 0


def test_score_mods_on_the_triton_kernels():
    """``ULTRAATTN_KERNELS=triton`` under the interpreter: the tiles run the block-sparse kernels with each score_mod
    generated into them (soft-capping; ALiBi with no block_mask; Graphormer's learned table, whose gradient the dQ
    kernel adds atomically), trained exactly at 2 ranks, one model after another in the same processes. MLA's RoPE
    term gathers vectors, which the generator does not translate: its tiles take the plain-torch path, and that is
    said (a warning) and exact too."""
    if not (torch.cuda.is_available() or config.interpret()):
        pytest.skip("no GPU and TRITON_INTERPRET is not set (tests/conftest.py sets it)")
    runs = [("softcap", "document", 500, "dynamo"), ("alibi", "none", 512, "dynamo"),
            ("graphormer", "causal", 512, "dynamo"), ("mla_rope", "document", 500, "dynamo")]   # one process
    res = run_ranks(worker, 2, args=(runs, FAST), timeout=1800,
                    env={"ULTRAATTN_KERNELS": "triton", "TRITON_INTERPRET": "1"})
    for i, (case, mask, S, _reset) in enumerate(runs):
        ref64, ref32 = reference(case, mask, S)
        for rank, r in enumerate(res):
            assert not check_step(r[i], ref64, ref32), (case, rank, check_step(r[i], ref64, ref32))
            assert r[i]["generated"] == [case != "mla_rope"], (case, r[i]["generated"])
    assert res[0][2]["grads"]["spatial"].abs().sum() > 0


# ----------------------------------------------------------------------------- the tiles' score_mod path
def _geometry(S: int, chunk: int, block: int, heads: int, kv_heads: int, batch: int, groups: int, score: ScoreMod
              ) -> TileGeometry:
    padded = -(-S // chunk) * chunk
    nb = padded // block
    kinds = torch.full((nb, nb), FULL, dtype=torch.int8)   # (the tiles mask the padded tail themselves)
    return TileGeometry(seq_len=S, chunk=chunk, q_block=block, kv_block=block, batch=batch, num_heads=heads,
                        num_kv_heads=kv_heads, head_groups=groups, head_dim=8, kind_gQK=[kinds] * groups,
                        element=None, score_mod=score)


def _tile_rows(geo: TileGeometry, q, k, v, do, dlse, scale, score) -> dict:
    """Every (q chunk, all kv chunks) row of each head group through ``row_forward`` (then the rows' global LSE
    into ``row_backward``): out, lse, dq, dk, dv on the unpadded sequence and each score buffer's gradient."""
    S, chunk, G = geo.seq_len, geo.chunk, geo.head_groups
    B, H, _, D = q.shape
    pad = -(-S // chunk) * chunk - S
    q, k, v, do = (torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (q, k, v, do))
    n = (S + pad) // chunk
    hq, hk = geo.hq, geo.hk
    out = torch.zeros(B, H, S + pad, D, dtype=q.dtype)
    lse = torch.zeros(B, H, S + pad, dtype=torch.float32)

    def row(g, i):
        hs, ks = slice(g * hq, (g + 1) * hq), slice(g * hk, (g + 1) * hk)
        rows = slice(i * chunk, (i + 1) * chunk)
        kvs = [(k[:, ks, j * chunk:(j + 1) * chunk], v[:, ks, j * chunk:(j + 1) * chunk]) for j in range(n)]
        return hs, ks, rows, kvs

    for g in range(G):
        for i in range(n):
            hs, _, rows, kvs = row(g, i)
            o, l_ = row_forward(geo, g, i, list(range(n)), q[:, hs, rows].contiguous(), kvs, scale, score)
            out[:, hs, rows], lse[:, hs, rows] = o.to(q.dtype), l_.float()
    delta = ((do * out).sum(-1) - torch.nn.functional.pad(dlse, (0, pad))).float()
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    dbufs = [torch.zeros(t.shape, dtype=torch.float64) for t in score]
    for g in range(G):
        for i in range(n):
            hs, ks, rows, kvs = row(g, i)
            dq_r, per_col, got = row_backward(geo, g, i, list(range(n)), q[:, hs, rows].contiguous(),
                                              do[:, hs, rows].contiguous(), lse[:, hs, rows].contiguous(),
                                              delta[:, hs, rows].contiguous(), kvs, scale, score)
            dq[:, hs, rows] += dq_r.to(q.dtype)
            for j, (dk_j, dv_j) in enumerate(per_col):
                dk[:, ks, j * chunk:(j + 1) * chunk] += dk_j.to(q.dtype)
                dv[:, ks, j * chunk:(j + 1) * chunk] += dv_j.to(q.dtype)
            for acc, gb in zip(dbufs, got, strict=True):
                acc += gb.double()
    return {"out": out[:, :, :S], "lse": lse[:, :, :S], "dq": dq[:, :, :S], "dk": dk[:, :, :S], "dv": dv[:, :, :S],
            "dbufs": dbufs}


@pytest.mark.parametrize("path", ["torch", "triton"])
def test_tiles_apply_a_score_mod_with_global_indices_and_differentiate_it(path, monkeypatch):
    """Every (q chunk, kv chunks) row of a padded sequence, two head groups, GQA, batch 2: the rows' (o, lse)
    merged, dq, dk, dv and the gradient of a learned (head, distance) table and of per-head slopes, against dense
    attention with the same score_mod (softcap of a biased score). ``torch``: the plain-torch tiles in fp64, to
    fp64 rounding. ``triton``: the Triton kernels with the score_mod generated into them (``kernels.score_codegen``),
    under the interpreter, fp32, by the numerics policy (2x the fp32 dense reference's error against fp64, the
    buffers' gradients included)."""
    torch.manual_seed(0)
    S, chunk, block, H, Hk, B, G = 90, 32, 16, 4, 2, 2, 2
    table = torch.randn(H, 2 * S - 1, dtype=torch.float64) * 0.3
    slopes = torch.rand(H, dtype=torch.float64)

    def fn(score, b, h, q_idx, kv_idx, tab, slope):
        return 3.0 * torch.tanh((score + tab[h, q_idx - kv_idx + S - 1] - slope[h] * (q_idx - kv_idx).abs()) / 3.0)

    geo = _geometry(S, chunk, block, H, Hk, B, G, ScoreMod(fn=fn, grads=(True, True)))
    q = torch.randn(B, H, S, 8, dtype=torch.float64)
    k, v = torch.randn(B, Hk, S, 8, dtype=torch.float64), torch.randn(B, Hk, S, 8, dtype=torch.float64)
    do, dlse = torch.randn(B, H, S, 8, dtype=torch.float64), torch.randn(B, H, S, dtype=torch.float64)
    scale = 1 / math.sqrt(8)

    def dense(dtype):
        tab, slope = table.to(dtype).detach().requires_grad_(), slopes.to(dtype).detach().requires_grad_()
        bi, hi = torch.arange(B).view(-1, 1, 1, 1), torch.arange(H).view(1, -1, 1, 1)
        qi, ki = torch.arange(S).view(1, 1, -1, 1), torch.arange(S).view(1, 1, 1, -1)
        got = dense_attention(q, k, v, torch.ones(S, S, dtype=torch.bool), do, dlse, dtype,
                              score_mod=lambda s: fn(s, bi, hi, qi, ki, tab, slope))
        return dict(got, dbufs=[tab.grad, slope.grad])

    want = dense(torch.float64)
    if path == "torch":
        got = _tile_rows(geo, q, k, v, do, dlse, scale, [table, slopes])
        for name in ("out", "lse", "dq", "dk", "dv"):
            tol = dict(rtol=1e-5, atol=1e-6) if name in ("out", "lse") else dict(rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(got[name].to(want[name].dtype), want[name], **tol, msg=name)
        for got_b, want_b in zip(got["dbufs"], want["dbufs"], strict=True):
            torch.testing.assert_close(got_b, want_b, rtol=1e-4, atol=1e-5)
        return
    monkeypatch.setenv("ULTRAATTN_KERNELS", "triton")
    if not (torch.cuda.is_available() or config.interpret()):
        pytest.skip("no GPU and TRITON_INTERPRET is not set (tests/conftest.py sets it)")
    f32 = [x.float() for x in (q, k, v, do, dlse)]
    buffers = [table.float(), slopes.float()]
    assert _kernels_on(geo, f32[0], buffers), "the score_mod was not generated into the kernels"
    got = _tile_rows(geo, *f32, scale, buffers)
    ref32 = dense(torch.float32)
    bad = check_2x(got, want, ref32, "fp32")
    for n, (g, w, r) in enumerate(zip(got["dbufs"], want["dbufs"], ref32["dbufs"], strict=True)):
        err, base = float((g - w).abs().max()), float((r.double() - w).abs().max())
        if not err <= 2 * base + 4 * torch.finfo(torch.float32).eps * float(w.abs().max()):
            bad.append(f"buffer {n} gradient: err {err:.3g} > 2 x {base:.3g}")
    assert not bad, bad
