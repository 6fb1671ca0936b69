"""What the compile tests share: the numerics check of one training step (``ultraattn.testing.check_step``: a
compiled model's loss and every parameter gradient against the fp64 eager single-process model, by the 2x rule of
docs/numerics.md), and a fresh Dynamo per test.
"""

from __future__ import annotations

import pytest
import torch

from ultraattn.testing import check_step  # noqa: F401 - the policy lives in the package (gpu_check applies it too)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Every test compiles from scratch and starts with empty backend records."""
    import ultraattn

    ultraattn.reset()
    yield
    torch._dynamo.reset()
