"""Reports: pure renderings from plain data and records to ``rich`` (and an optional PNG).

Plans: ``heatmaps`` (mask block kinds, tile assignment), ``gantt`` (schedules), ``tables`` (per-rank
traffic, baselines, solver), ``plan_report`` (all of them for one planning result), ``png``.
Compiles: ``compile_report`` renders the records of ``ultraattn.passes.records``, live and saved.
``style`` holds what they share. Nothing here plans or compiles; callers pass what to show.
"""

from ultraattn.report.gantt import gantt
from ultraattn.report.heatmaps import assignment_heatmap, mask_heatmap
from ultraattn.report.png import draw_plan_png
from ultraattn.report.style import format_bytes, format_ms
from ultraattn.report.tables import comparison_table, not_applicable_lines, rank_table, solver_panel

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
    "not_applicable_lines",
]
