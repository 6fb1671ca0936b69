"""Plan reports: terminal renderings (``render``) and the optional PNG picture (``png``)."""

from .png import draw_plan_png
from .render import (
    assignment_heatmap,
    comparison_table,
    format_bytes,
    format_ms,
    gantt,
    mask_heatmap,
    rank_table,
    solver_panel,
)

__all__ = [
    "assignment_heatmap",
    "comparison_table",
    "draw_plan_png",
    "format_bytes",
    "format_ms",
    "gantt",
    "mask_heatmap",
    "rank_table",
    "solver_panel",
]
