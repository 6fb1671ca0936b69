"""What the compile tests share: the numerics check of one training step, and a fresh Dynamo per test.

A compiled model's loss and every parameter gradient against the fp64 eager single-process model, by
the 2x rule (docs/numerics.md) with the fp32 eager model as the same-precision reference. The floor is 16 fp32
ulps of each tensor's scale: Inductor legitimately reorders the non-attention reductions (layer norm,
cross entropy), which moves fp32 results by a few ulps even without ultraattn.
"""

from __future__ import annotations

import pytest
import torch

EPS = torch.finfo(torch.float32).eps


def err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max())


def check_step(got: dict, ref64: dict, ref32: dict) -> list[str]:
    """``got``'s loss and gradients against the references (dicts with ``loss`` and ``grads``); the failures."""
    bad = []
    pairs = [("loss", got["loss"], ref64["loss"], ref32["loss"])]
    pairs += [(n, got["grads"][n], ref64["grads"][n], ref32["grads"][n]) for n in ref64["grads"]]
    for name, g, r64, r32 in pairs:
        tol = 2 * err(r32, r64) + 16 * EPS * (float(r64.abs().max()) or 1.0)
        e = err(g, r64)
        if not e <= tol:
            bad.append(f"{name}: err {e:.3g} > {tol:.3g}")
    return bad


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Every test compiles from scratch and starts with empty backend records."""
    import ultraattn

    ultraattn.reset()
    yield
    torch._dynamo.reset()
