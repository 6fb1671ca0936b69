"""Plain eager dispatch inside a custom op's kernel, for code that needs ``vmap`` or autograd there.

A compiled graph calls its custom ops below autograd, with functorch's and autograd's dispatch keys
excluded: ``torch.vmap`` then fails ("Cannot access storage of BatchedTensorImpl"; attn-gym's flamingo
mask, evaluated inside a run-time mask's planning op, failed this way), and so do
``torch.autograd.Function`` and ``torch.autograd.grad``. ``eager_dispatch()`` takes the functorch and
autograd keys out of the excluded set for a block of such code: it computes on concrete tensors and traces
nothing, so it then runs as it would in eager mode. Every other excluded key stays excluded: clearing them
all also let autocast in, and an fp32 flex_attention inside an Inductor graph on CPU then came out rounded
to bf16. Outside a custom op (nothing excluded) it does nothing. Outside the layers: any layer may use it,
it uses none.
"""

from __future__ import annotations

import contextlib

import torch

_K = torch._C.DispatchKey
_EAGER_KEYS = tuple(getattr(_K, name) for name in (
    "FuncTorchBatched", "FuncTorchVmapMode", "FuncTorchDynamicLayerFrontMode", "FuncTorchDynamicLayerBackMode",
    "FuncTorchGradWrapper", "Batched", "VmapMode", "BatchedNestedTensor", "ADInplaceOrView", "AutogradFunctionality",
    "AutogradOther", "AutogradNestedTensor") if hasattr(_K, name))
"""The keys a compiled graph's op call excludes that vmap and autograd need (others, such as autocast, stay
excluded)."""


def eager_dispatch() -> contextlib.AbstractContextManager:
    """A context in which ops dispatch as in eager mode (see the module docstring)."""
    excluded = [key for key in _EAGER_KEYS if torch._C._dispatch_tls_is_dispatch_key_excluded(key)]
    if not excluded:
        return contextlib.nullcontext()
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for key in excluded:
        exclude = exclude.remove(key)
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude)
