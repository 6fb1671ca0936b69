"""A shard that a graph returned (``options["outputs"] = "sharded"``) meets code that expects the global sequence.

A shard holds this rank's tokens only. Passed to another compiled function, two things can happen:

* Dynamo traces the function and hands the graph to the backend: ``check_no_shards`` refuses it (any graph, with
  attention or without: a loss over a shard would be this rank's loss, silently).
* Dynamo fails while tracing, inside the user's code, before any backend sees a graph: a model with positions
  (torchtitan's RoPE tables, sized for the whole sequence) meets the shorter shard in a ``view`` and Dynamo
  raises its own error (``TorchRuntimeError ... view(FakeTensor(512, 8), ...)``), which never mentions
  ultraattn. ``install_shard_error_hint`` wraps Dynamo's handler of such failures
  (``torch._dynamo.convert_frame.exception_handler``, which receives the frame being traced) so that, when one
  of that frame's arguments is such a shard, the error says so and names the fix. Nothing else changes: the
  wrapper only adds text to an error that is raised anyway, and when the handler is absent (another torch
  version) it installs nothing.
"""

from __future__ import annotations

import torch

_SHARD_ATTR = "_ultraattn_shard"


def is_shard(x) -> bool:
    """Whether ``x`` is a tensor an ultraattn graph returned as this rank's shard."""
    return isinstance(x, torch.Tensor) and getattr(x, _SHARD_ATTR, None) is not None


def shard_message(where: str) -> str:
    return (f"ultraattn: {where} received a tensor that an ultraattn graph returned sharded (options['outputs']="
            f"'sharded'): it holds only this rank's tokens, so code that expects the whole sequence fails or "
            f"computes this rank's part alone. Gather it first with ultraattn.undispatch(x), or keep "
            f"options['outputs']='global' (the default) between separately compiled regions and graph breaks")


def check_no_shards(example_inputs) -> None:
    """A graph compiled for more than one rank must see the global view: a shard among its inputs is an error."""
    if any(is_shard(v) for v in example_inputs):
        raise ValueError(shard_message("a compiled graph"))


def _shards_in(values) -> bool:
    for v in values:
        if is_shard(v):
            return True
        if isinstance(v, tuple | list) and any(is_shard(x) for x in v):
            return True
        if isinstance(v, dict) and any(is_shard(x) for x in v.values()):
            return True
    return False


def install_shard_error_hint() -> bool:
    """Wrap Dynamo's frame-failure handler once (module docstring); True if this call installed it."""
    import torch._dynamo.convert_frame as cf

    orig = getattr(cf, "exception_handler", None)
    if orig is None or getattr(orig, "_ultraattn_hint", False):
        return False

    def exception_handler(e, code, frame=None, *args, **kwargs):
        try:
            hit = frame is not None and _shards_in(frame.f_locals.values())
        except Exception:  # noqa: BLE001 - a frame we cannot read: leave the error as it is
            hit = False
        if hit and e.args and isinstance(e.args[0], str) and "returned sharded" not in e.args[0]:
            e.args = (shard_message(f"{code.co_name}() (being traced by torch.compile)") + "\n\n" + e.args[0],
                      *e.args[1:])
        return orig(e, code, frame, *args, **kwargs)

    exception_handler._ultraattn_hint = True
    exception_handler.__wrapped__ = orig
    cf.exception_handler = exception_handler
    return True
