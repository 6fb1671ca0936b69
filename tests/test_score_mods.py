"""FlexAttention score_mods across ranks: attn-gym's score_mods trained through the backend (default Inductor) at 2
and 4 ranks against PyTorch's own eager flex_attention in one process; the tiles' score_mod path against a dense
reference (its gradient, buffers included); what stays kept. Models: ``score_cases.py``."""

from __future__ import annotations

import math

import pytest
import torch
from numerics import check_step, fresh_dynamo  # noqa: F401 - fresh_dynamo: an autouse fixture
from score_cases import CASES, reference, worker

from ultraattn.kernels import config
from ultraattn.masks.pattern import FULL
from ultraattn.runtime.tiles import ScoreMod, TileGeometry, _kernels_on, row_backward, row_forward
from ultraattn.testing import check_2x, dense_attention, run_ranks

FAST = {"ilp_time_limit": 1.0, "time_budget": 2.0, "timeout": 300.0}


def _runs(world: int) -> list[tuple[str, str, int]]:
    """Every case at each world size, S = 500 (a tail) and 512 (whole blocks) alternating between the cases and
    swapped between the world sizes: each case meets both lengths and both world sizes."""
    return [(c, m, (500, 512)[(n + (world == 4)) % 2]) for n, (c, m) in enumerate(CASES)]


@pytest.mark.parametrize("world", [2, 4])
def test_attn_gym_score_mods_train_exactly(world):
    """attn-gym's alibi (causal BlockMask, and none), softcap, sandwich, activation, graphormer (a learned table:
    its gradient is summed over the ranks) and mla_rope (documents), and GPT-OSS-style attention sinks through the
    LSE; batch 2, GQA: loss and every gradient by the numerics policy, each site rewritten as an explicit program
    with its score_mod."""
    runs = _runs(world)
    res = run_ranks(worker, world, args=(runs, FAST), timeout=1800)
    bad = []
    for i, (case, mask, S) in enumerate(runs):
        ref64, ref32 = reference(case, mask, S)
        for rank, r in enumerate(res):
            if check_step(r[i], ref64, ref32):
                bad.append(f"{case}/{mask} S={S} rank {rank}: {check_step(r[i], ref64, ref32)}")
        (site,) = res[0][i]["sites"]
        if not (site["rewritten"] and "score_mod" in site["why"] and site["form"] == "explicit"):
            bad.append(f"{case}/{mask} S={S}: {site}")
        want = "full" if mask == "none" else "block_mask"
        if site["mask"] != want:
            bad.append(f"{case}/{mask}: reported mask {site['mask']}, not {want}")
    assert not bad, "\n".join(bad)
    by_case = {c: r for (c, _m, _s), r in zip(runs, res[0], strict=True)}
    assert by_case["graphormer"]["grads"]["spatial"].abs().sum() > 0   # a learned table read by the score_mod
    assert by_case["sinks"]["grads"]["sinks"].abs().sum() > 0          # sinks: through the site's log-sum-exp


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
    kernel adds atomically), trained exactly at 2 ranks. MLA's RoPE term gathers vectors, which the generator does
    not translate: its tiles take the plain-torch path, and that is said (a warning) and exact too."""
    if not (torch.cuda.is_available() or config.interpret()):
        pytest.skip("no GPU and TRITON_INTERPRET is not set (tests/conftest.py sets it)")
    runs = [("softcap", "document", 500), ("alibi", "none", 512), ("graphormer", "causal", 512),
            ("mla_rope", "document", 500)]
    res = run_ranks(worker, 2, args=(runs, FAST), timeout=1800,
                    env={"ULTRAATTN_KERNELS": "triton", "TRITON_INTERPRET": "1"})
    for i, (case, mask, S) in enumerate(runs):
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
                        mask_mod=None, score_mod=score)


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
