"""ultraattn: context-parallel block-sparse attention planned by hierarchical context tiling.

The package is laid out along the data flow, imports going one way (docs/architecture.md):
masks -> planner -> kernels/runtime -> passes -> report -> compiler/cli.

``torch.compile(model, backend="ultraattn")`` finds the backend through its entry point;
``ultraattn.backend`` is the same callable and ``ultraattn.compile_blocks(model.layers)`` compiles a model block by
block with it (``ultraattn.compiler``, imported on first access, so
``import ultraattn`` stays light and does not touch torch.compile machinery).
"""

__version__ = "0.1.0"

from ultraattn.planner.profile import CostProfile
from ultraattn.runtime import AttentionPlan, dispatch, dist_attention, plan_ahead, plan_attention, undispatch
from ultraattn.runtime.calibrate import calibrate

__all__ = ["AttentionPlan", "BackendError", "CostProfile", "FallbackWarning", "SeqShard", "backend", "calibrate",
           "compile_blocks", "dispatch", "dist_attention", "explain", "plan_ahead", "plan_attention", "reset",
           "undispatch", "__version__"]


def __getattr__(name: str):
    if name in ("backend", "compile_blocks", "explain", "reset"):
        from ultraattn import compiler

        return getattr(compiler, name)
    if name in ("FallbackWarning", "BackendError"):  # what the backend warns with, and raises for the user's errors
        from ultraattn.passes import records

        return getattr(records, name)
    if name == "SeqShard":  # what a compiled region returns for a tensor that carries the sequence
        from ultraattn.passes.carrier import SeqShard

        return SeqShard
    raise AttributeError(f"module 'ultraattn' has no attribute {name!r}")
