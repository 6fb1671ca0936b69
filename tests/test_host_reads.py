"""What a step reads onto the host (issue 51): on a GPU every ``.cpu()``, ``.item()`` or ``bool()`` of a device
tensor is a transfer and a wait, and a site that copied the S x S mask every step made transformers' Llama 23x
slower than plain ``torch.compile`` on an H100. On the CPU those reads cost nothing, so they are counted
(``ultraattn.testing.HostReads``: the reads made by ultraattn's own code) on transformers' Llama, SDPA (a boolean
mask) and flex_attention (a BlockMask), packed (the mask built at run time from ``position_ids``) and plain, at
world size 1 and at 2 ranks. After the first step a step plans nothing again and reads no mask data but the
mask's int8 block table, reduced where the mask lives, once for every site (``_check_reads``). An SDPA mask the
graph builds from no input is folded at compile time and never read again.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from client_cases import hf_data, hf_model, hf_step
from numerics import check_step, fresh_dynamo  # noqa: F401 - fresh_dynamo: an autouse fixture

import ultraattn
from ultraattn.passes import side_table
from ultraattn.passes.capture import Site
from ultraattn.passes.forms import form_for
from ultraattn.passes.options import parse_options
from ultraattn.passes.records import SiteForm
from ultraattn.testing import HostReads, run_ranks

S = 1024
OPTIONS = {"compiler": "aot_eager", "ilp_time_limit": 1.0, "time_budget": 2.0, "timeout": 120.0}


N = S // 128
"""Blocks per side: a mask's block table is N x N int8."""
TILE_LISTS = os.path.join("runtime", "tiles.py")
"""Where the CPU tiles read their own block-id lists (host tensors the plan made, at most N ids each): cache keys,
not mask data."""


def reads_worker(rank: int, world: int, impl: str, positions: bool) -> dict:
    """Three steps of transformers' Llama under the backend: the host reads of steps 2 and 3 (bytes, where) and the
    plan counts."""
    torch._dynamo.reset()
    ultraattn.reset()
    ids, pos = hf_data(S, True)
    cm = torch.compile(hf_model(impl), backend="ultraattn", options=dict(OPTIONS))

    def run():
        return hf_step(cm, ids, pos if positions else None, False)

    run()
    plans = sum(s.plans.plans for s in side_table().sites.values())
    out = {"reads": []}
    for _ in range(2):
        with HostReads() as r:
            run()
        out["reads"].append(list(zip(r.nbytes, r.calls, r.where, strict=True)))
    out["plans"] = (plans, sum(s.plans.plans for s in side_table().sites.values()))
    out["sites"] = [(s.name, s.mask, s.rewritten) for g in side_table().graphs for s in g.sites]
    return out


SCALARS = ("item", "__int__", "__bool__", "__float__")


def _mask_data(step: list) -> int:
    """Bytes of a step's reads that are not host ids (scalars) or the CPU tiles' own block-id lists."""
    return sum(n for n, how, where in step if how not in SCALARS and not where.startswith(TILE_LISTS))


def _check_reads(got: dict, label) -> None:
    """Issue 51's bound, after the first step: at most 4 N^2 bytes of mask data per step for the one mask both
    sites read (its int8 block table: moved to the host once, digested there), so never the S x S elements, a
    BlockMask's int32 lists or its per-token buffers (8 S bytes each). Besides that only the host ids of plans and
    stashes (scalars) and the tiles' block-id lists (at most N int64 ids each) are read. Nothing planned again."""
    for step in got["reads"]:
        lists = [n for n, how, where in step if where.startswith(TILE_LISTS) and how != "cpu"]
        mask_data = _mask_data(step)
        assert mask_data <= 4 * N * N, (label, mask_data, step)
        assert all(n <= 8 * N for n in lists), (label, step)
        assert all(n == 8 for n, how, _ in step if how in SCALARS and how != "__bool__"), (label, step)
    assert got["plans"][0] == got["plans"][1] >= 1, (label, got["plans"])


CASES = [(impl, positions) for impl in ("sdpa", "flex_attention") for positions in (True, False)]
"""transformers' Llama with SDPA and with flex_attention, each packed (documents from ``position_ids``: a mask
built at run time) and plain (no ``position_ids``: SDPA's causal mask, built in the graph from ``arange``, folds to
``is_causal`` at compile time; flex gets its BlockMask as a graph input, a run-time mask as far as the graph can
tell)."""


def test_a_step_reads_block_tables_not_masks_at_world_size_1():
    for impl, positions in CASES:
        got = reads_worker(0, 1, impl, positions)
        assert len(got["sites"]) == 2 and all(s[2] for s in got["sites"]), got["sites"]
        _check_reads(got, (impl, positions))
        if impl == "sdpa" and not positions:  # folded at compile time: never read again
            assert [s[1] for s in got["sites"]] == ["causal"] * 2 and not any(got["reads"][-1]), got
        if impl == "flex_attention":
            assert [s[1] for s in got["sites"]] == ["block_mask"] * 2


def test_a_step_reads_block_tables_not_masks_at_two_ranks():
    """The same at 2 ranks (each rank plans the mask it reads for itself, from its block table)."""
    for impl, positions in CASES:
        for rank, got in enumerate(run_ranks(reads_worker, 2, args=(impl, positions), timeout=900)):
            _check_reads(got, (impl, positions, rank))
            if positions:
                assert [s[1] for s in got["sites"]] == (["bool_mask"] * 2 if impl == "sdpa" else ["block_mask"] * 2)
            elif impl == "sdpa":  # folded at compile time: no mask data read at run time
                assert [s[1] for s in got["sites"]] == ["causal"] * 2
                assert all(_mask_data(step) == 0 for step in got["reads"]), got["reads"]


# ----------------------------------------------------------------------------- masks the graph builds from nothing
class PositionsMask(torch.nn.Module):
    """SDPA with the causal mask built inside the compiled code from ``torch.arange`` alone, as transformers 5.17
    does under ``torch.compile``: a dense S x S boolean mask that depends on no input."""

    def __init__(self, window: int | None = None):
        super().__init__()
        self.qkv = torch.nn.Linear(32, 96, bias=False)
        self.window = window

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, 4, 8).permute(2, 0, 3, 1, 4)
        i = torch.arange(T, device=x.device)
        mask = (i[None, None, :, None] >= i[None, None, None, :]).expand(B, 1, T, T)
        if self.window is not None:
            mask = mask & (i[:, None] - i[None, :] < self.window)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).square().mean()


def _fold_case(window, dtype=torch.float32):
    torch.manual_seed(0)
    model = PositionsMask(window).to(dtype)
    return model, torch.randn(2, 300, 32, generator=torch.Generator().manual_seed(1)).to(dtype)


def _fold_step(model, fn, x) -> dict:
    loss = fn(x)
    loss.backward()
    return {"loss": loss.detach().double(), "grads": {n: p.grad.double() for n, p in model.named_parameters()}}


def fold_worker(rank: int, world: int, window, world1: str) -> dict:
    torch._dynamo.reset()
    ultraattn.reset()
    model, x = _fold_case(window)
    got = _fold_step(model, torch.compile(model, backend="ultraattn", options=dict(OPTIONS, world1=world1)), x)
    rec = side_table().graphs[-1]
    got["site"] = [(s.mask, s.rewritten, s.why) for s in rec.sites]
    got["code"] = rec.code_after
    return got


def _fold_reference(window) -> tuple[dict, dict]:
    out = []
    for dt in (torch.float64, torch.float32):
        model, x = _fold_case(window, dt)
        out.append(_fold_step(model, model, x))
    return out[0], out[1]


def test_a_mask_built_from_positions_alone_is_causal_at_compile_time():
    """World size 1 and 2: the site is planned as causal (the mask is read at compile time, never passed to the site
    op) and exact; with ``world1="original"`` the kept SDPA call loses the dense mask for ``is_causal=True``. A
    windowed mask built the same way is not causal: it stays a run-time boolean mask, exact too."""
    ref = _fold_reference(None)
    got1 = fold_worker(0, 1, None, "auto")
    res2 = run_ranks(fold_worker, 2, args=(None, "auto"), timeout=600)
    for got in (got1, *res2):
        assert not check_step(got, *ref), check_step(got, *ref)
        ((mask, rewritten, why),) = got["site"]
        assert (mask, rewritten) == ("causal", True) and "positions alone" in why, got["site"]
    kept = fold_worker(0, 1, None, "original")
    assert not check_step(kept, *ref)
    assert kept["site"][0][:2] == ("causal", False)
    call = next(line for line in kept["code"].splitlines() if "scaled_dot_product_attention" in line)
    assert "attn_mask = None" in call and "is_causal = True" in call, call
    windowed = fold_worker(0, 1, 64, "auto")
    assert not check_step(windowed, *_fold_reference(64))
    assert windowed["site"][0][:2] == ("bool_mask", True)


def test_world_size_1_keeps_the_faster_op_on_a_gpu():
    """The world-1 choice (``forms.form_for``): on a GPU, flex_attention and SDPA without a boolean mask keep
    the original op; an SDPA boolean mask runs on the tiles; the CPU runs the tiles; ``world1`` overrides."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")

    def site(op, mask, device, choice="auto", world=1):
        s = Site(index=0, node=None, op=op, q=None, k=None, v=None, mask=mask, reason="rewritten", device=device,
                 q_shape=(1, 2, 64, 16), kv_shape=(1, 2, 64, 16))
        form, why = form_for(s, parse_options({"world_size": world, "world1": choice}, require_group=False))
        return form is not SiteForm.AS_WRITTEN, why if form is SiteForm.AS_WRITTEN else s.reason

    assert site("flex", "block_mask", cuda) == (False, "kept (world size 1 on cuda: flex_attention is faster there "
                                                       "than the tiles (docs/gpu.md))")
    assert not site("sdpa", "causal", cuda)[0] and not site("sdpa", "full", cuda)[0]
    assert site("sdpa", "bool_mask", cuda)[0]
    assert site("flex", "block_mask", cpu)[0] and site("sdpa", "causal", cpu)[0]
    assert site("flex", "block_mask", cuda, "tiles")[0]
    assert site("sdpa", "bool_mask", cuda, "original") == (False, "kept (the world1 option)")
    assert site("flex", "block_mask", cuda, world=2)[0]
