"""ultraattn: context-parallel block-sparse attention planned by hierarchical context tiling.

The package is laid out along the data flow (DESIGN.md):
masks -> planner -> kernels/runtime -> passes -> report.
"""

__version__ = "0.1.0"

from ultraattn.runtime import AttentionPlan, dispatch, dist_attention, plan_attention, undispatch

__all__ = ["AttentionPlan", "dispatch", "dist_attention", "plan_attention", "undispatch", "__version__"]
