"""CPU FlexAttention training under the backend: a narrow shim of one front-end check.

PyTorch's flex_attention refuses ``requires_grad`` inputs on CPU in its Python front end
(``_validate_device``), which Dynamo executes while tracing, before any backend sees the graph.
``install_flex_cpu_shim`` wraps that check so that, on CPU and only while Dynamo is tracing,
the backward refusal is skipped (every other check still runs). Eager calls and non-CPU devices
behave exactly as before. A flex site that the backend rewrites then trains on CPU through
ultraattn's kernels; one it keeps runs PyTorch's own eager flex_attention through one op
(``kept.py``), since Inductor's CPU flex_attention is inference-only. Installed when the backend is
loaded (``ultraattn.compiler``).
"""

from __future__ import annotations

import torch
import torch.nn.attention.flex_attention as fa


def install_flex_cpu_shim() -> bool:
    """Wrap ``_validate_device`` once; True if this call installed the wrapper."""
    orig = getattr(fa, "_validate_device", None)
    if orig is None or getattr(orig, "_ultraattn_shim", False):
        return False

    def _validate_device(query, key, value):
        if query.device.type == "cpu" and torch.compiler.is_dynamo_compiling():
            return None  # tracing for a backend: the backward refusal is the backend's call to make
        return orig(query, key, value)

    _validate_device._ultraattn_shim = True
    _validate_device.__wrapped__ = orig
    fa._validate_device = _validate_device
    return True


def shim_installed() -> bool:
    return getattr(getattr(fa, "_validate_device", None), "_ultraattn_shim", False)
