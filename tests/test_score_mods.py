"""FlexAttention score_mods across ranks: attn-gym's score_mods trained through the backend (default Inductor) at 2
and 4 ranks against PyTorch's own eager flex_attention in one process; the tiles' score_mod path against a dense
reference (its gradient, buffers included); what stays kept. Models: ``score_cases.py``."""

from __future__ import annotations

import math

import pytest
import torch
from numerics import check_step, fresh_dynamo  # noqa: F401 - fresh_dynamo: an autouse fixture
from score_cases import CASES, reference, worker

from ultraattn.masks.pattern import FULL
from ultraattn.runtime.tiles import ScoreMod, TileGeometry, row_backward, row_forward
from ultraattn.testing import dense_attention, run_ranks

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


# ----------------------------------------------------------------------------- the tiles' score_mod path
def _geometry(S: int, chunk: int, block: int, heads: int, kv_heads: int, batch: int, groups: int, score: ScoreMod
              ) -> TileGeometry:
    padded = -(-S // chunk) * chunk
    nb = padded // block
    kinds = torch.full((nb, nb), FULL, dtype=torch.int8)   # (the tiles mask the padded tail themselves)
    return TileGeometry(seq_len=S, chunk=chunk, q_block=block, kv_block=block, batch=batch, num_heads=heads,
                        num_kv_heads=kv_heads, head_groups=groups, head_dim=8, kind_gQK=[kinds] * groups,
                        mask_mod=None, score_mod=score)


def test_tiles_apply_a_score_mod_with_global_indices_and_differentiate_it():
    """Every (q chunk, kv chunks) row of a padded sequence, two head groups, GQA, batch 2: the rows' (o, lse)
    merged, dq, dk, dv and the gradient of a learned (head, distance) table and of per-head slopes, against dense
    fp64 attention with the same score_mod (softcap of a biased score)."""
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

    def dense(tab, slope):
        bi, hi = torch.arange(B).view(-1, 1, 1, 1), torch.arange(H).view(1, -1, 1, 1)
        qi, ki = torch.arange(S).view(1, 1, -1, 1), torch.arange(S).view(1, 1, 1, -1)
        return dense_attention(q, k, v, torch.ones(S, S, dtype=torch.bool), do, dlse, torch.float64,
                               score_mod=lambda s: fn(s, bi, hi, qi, ki, tab, slope))

    tab, slope = table.clone().requires_grad_(), slopes.clone().requires_grad_()
    want = dense(tab, slope)
    pad = -(-S // chunk) * chunk - S
    padded = [torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (q, k, v, do)]
    n = (S + pad) // chunk
    hq, hk = H // G, Hk // G
    out = torch.zeros(B, H, S + pad, 8, dtype=torch.float64)
    lse = torch.zeros(B, H, S + pad, dtype=torch.float64)
    for g in range(G):
        hs, ks_ = slice(g * hq, (g + 1) * hq), slice(g * hk, (g + 1) * hk)
        qg, kg, vg = padded[0][:, hs], padded[1][:, ks_], padded[2][:, ks_]
        for i in range(n):
            rows = slice(i * chunk, (i + 1) * chunk)
            kvs = [(kg[:, :, j * chunk:(j + 1) * chunk], vg[:, :, j * chunk:(j + 1) * chunk]) for j in range(n)]
            o, l_ = row_forward(geo, g, i, list(range(n)), qg[:, :, rows], kvs, scale, [table, slopes])
            out[:, g * hq:(g + 1) * hq, rows], lse[:, g * hq:(g + 1) * hq, rows] = o.double(), l_.double()
    torch.testing.assert_close(out[:, :, :S], want["out"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse[:, :, :S], want["lse"], rtol=1e-5, atol=1e-6)
    dlse_p = torch.nn.functional.pad(dlse, (0, pad))
    delta = (padded[3] * out).sum(-1) - dlse_p
    dq = torch.zeros_like(padded[0])
    dk, dv = torch.zeros_like(padded[1]), torch.zeros_like(padded[2])
    dtab, dslope = torch.zeros_like(table), torch.zeros_like(slopes)
    for g in range(G):
        hs, ks_ = slice(g * hq, (g + 1) * hq), slice(g * hk, (g + 1) * hk)
        for i in range(n):
            rows = slice(i * chunk, (i + 1) * chunk)
            kvs = [(padded[1][:, ks_, j * chunk:(j + 1) * chunk], padded[2][:, ks_, j * chunk:(j + 1) * chunk])
                   for j in range(n)]
            dq_r, per_col, dbufs = row_backward(geo, g, i, list(range(n)), padded[0][:, hs, rows],
                                                padded[3][:, hs, rows], lse[:, hs, rows].float(),
                                                delta[:, hs, rows].float(), kvs, scale, [table, slopes])
            dq[:, hs, rows] += dq_r.double()
            for j, (dk_j, dv_j) in enumerate(per_col):
                dk[:, ks_, j * chunk:(j + 1) * chunk] += dk_j.double()
                dv[:, ks_, j * chunk:(j + 1) * chunk] += dv_j.double()
            dtab += dbufs[0].double()
            dslope += dbufs[1].double()
    for name, got in (("dq", dq), ("dk", dk), ("dv", dv)):
        torch.testing.assert_close(got[:, :, :S], want[name], rtol=1e-4, atol=1e-5, msg=name)
    torch.testing.assert_close(dtab, tab.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(dslope, slope.grad, rtol=1e-4, atol=1e-5)
