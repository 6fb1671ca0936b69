"""ultraattn: context-parallel block-sparse attention planned by hierarchical context tiling.

The package is laid out along the data flow (DESIGN.md):
masks -> planner -> kernels/runtime -> passes -> report.

``torch.compile(model, backend="ultraattn")`` finds the backend through its entry point;
``ultraattn.backend`` is the same callable (imported on first access, so ``import ultraattn``
stays light and does not touch torch.compile machinery).
"""

__version__ = "0.1.0"

from ultraattn.runtime import AttentionPlan, dispatch, dist_attention, plan_attention, undispatch

__all__ = ["AttentionPlan", "backend", "dispatch", "explain", "dist_attention", "plan_attention", "undispatch", "__version__"]


def __getattr__(name: str):
    if name == "backend":
        from ultraattn.passes.backend import ultraattn_backend

        return ultraattn_backend
    if name == "explain":
        from ultraattn.passes.explain import explain

        return explain
    raise AttributeError(f"module 'ultraattn' has no attribute {name!r}")
