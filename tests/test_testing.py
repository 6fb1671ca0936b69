"""The numerics policy's step check (``ultraattn.testing.check_step``) on hand-made steps: what it accepts and what
it refuses, with and without the compiled same-precision reference (docs/numerics.md)."""

from __future__ import annotations

import torch

from ultraattn.testing import check_step


def _step(loss: float, w: list[float]) -> dict:
    return {"loss": torch.tensor(loss, dtype=torch.float64), "grads": {"w": torch.tensor(w, dtype=torch.float64)}}


REF64 = _step(1.0, [1.0, -2.0])
FLOOR = 16 * torch.finfo(torch.float32).eps * 2.0   # 16 fp32 ulps of max |w| = 2


def test_within_twice_the_eager_error_passes_and_beyond_it_fails():
    ref32 = _step(1.0, [1.0 + 1e-4, -2.0])
    assert check_step(_step(1.0, [1.0 + 2e-4, -2.0]), REF64, ref32) == []
    bad = check_step(_step(1.0, [1.0, -2.0 - 2e-4 - 2 * FLOOR]), REF64, ref32)
    assert len(bad) == 1 and bad[0].startswith("w: err")


def test_the_compiled_reference_widens_the_bound_only_where_it_is_further_from_fp64():
    ref32 = _step(1.0, [1.0 + 1e-6, -2.0])
    compiled = _step(1.0, [1.0 + 1e-3, -2.0])         # plain torch.compile: 1000x eager's error on w
    got = _step(1.0, [1.0 + 1.5e-3, -2.0])
    assert check_step(got, REF64, ref32) != []         # eager alone: far outside
    assert check_step(got, REF64, ref32, compiled=compiled) == []
    assert check_step(_step(1.0, [1.0 + 2.5e-3, -2.0]), REF64, ref32, compiled=compiled) != []
    # the loss: eager and compiled both exact, so the loss keeps the floor alone
    bad = check_step(_step(1.0 + 1e-3, [1.0, -2.0]), REF64, ref32, compiled=compiled)
    assert len(bad) == 1 and bad[0].startswith("loss: err")


def test_ranks_are_spawned_where_cuda_is_available(monkeypatch):
    # the fork server's imports initialise CUDA on a GPU machine, and a process forked after that cannot use it
    from ultraattn import testing

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert testing._context().get_start_method() == "spawn"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert testing._context().get_start_method() == "forkserver"
