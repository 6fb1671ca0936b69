"""Test-session setup: without a GPU, Triton kernels run in Triton's interpreter.

Triton reads TRITON_INTERPRET when a kernel is decorated (ultraattn.kernels imports its Triton
module at the first launch), so it is set here, before any test runs. Nothing else in the
suite uses Triton on CPU (Inductor's CPU backend generates C++).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
