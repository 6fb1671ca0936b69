"""PNG picture of a plan: tile assignment next to one node's schedule (``ultraattn plan --png``).

Same plain-data inputs as the terminal renderings (lists/dicts or tensors), drawn with matplotlib.
matplotlib is an optional extra (``pip install 'ultraattn[plot]'``), imported lazily so
the core install and the terminal report work without it.

[Note] We draw on a bare ``matplotlib.figure.Figure`` with the Agg canvas instead of
``pyplot``: no global backend switch (``matplotlib.use``) and no figure registry to
leak, so calling this from a notebook or a test leaves the caller's state alone.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

from ultraattn.report.gantt import stream_key
from ultraattn.report.heatmaps import check_assignment, check_mesh
from ultraattn.report.style import as_grid, plain

__all__ = ["draw_plan_png"]

# Kind colours, close to the terminal Gantt's palette.
KIND_COLORS = {
    "attn": "#2ca02c",
    "q": "#1f77b4",
    "kv": "#c837ab",
    "o": "#e6b800",
    "merge": "#17becf",
    "dq": "#0b3c8c",
    "dkv": "#6a1b9a",
}
_EXTRA_KIND_COLORS = ("#7f7f7f", "#d62728", "#ff7f0e", "#8c564b", "#bcbd22", "#e377c2")

_MISSING = "--png needs matplotlib: pip install 'ultraattn[plot]'"


def _rank_colors(world: int) -> list:
    """One qualitative colour per rank: tab20, tab20b, tab20c (60 colours), then cycled."""
    from matplotlib import colormaps

    pool = [c for name in ("tab20", "tab20b", "tab20c") for c in colormaps[name].colors]
    if world <= 10:
        pool = list(colormaps["tab10"].colors)
    return [pool[r % len(pool)] for r in range(world)]


def draw_plan_png(
    path: str | os.PathLike,
    *,
    assign_grid: Any,
    owner: Any,
    nodes: int,
    devices: int,
    tasks: Sequence[Mapping[str, Any]],
    title: str,
    node_to_draw: int = 0,
) -> str | os.PathLike:
    """Save a two-panel PNG: the P x P tile assignment and one node's Gantt chart.

    Left: cell (i, j) (query chunk i, KV chunk j) coloured by the rank computing it
    (qualitative colormap, white = empty), the owner of each chunk as a strip along the
    top and left edges, and black lines where the owning node changes. Right: the
    tasks of ranks ``node_to_draw * devices ... + devices - 1``, one row per
    (rank, stream), bars coloured by kind, time in ms.

    Args:
        path: output file (``.png``).
        assign_grid: P x P ranks, -1 = empty (as in ``heatmaps.assignment_heatmap``).
        owner: length-P chunk owners.
        nodes, devices: mesh shape; ``rank = node * devices + device``.
        tasks: dicts ``{rank, stream, start, end, kind}`` with times in seconds
            (as in ``gantt.gantt``); tasks of other nodes are ignored.
        title: figure title.
        node_to_draw: which node's ranks the Gantt panel shows.

    Returns:
        ``path``, unchanged.

    Raises:
        RuntimeError: if matplotlib is not installed.
        ValueError: on inconsistent inputs or ``node_to_draw`` outside ``[0, nodes)``.
    """
    try:
        import matplotlib  # noqa: F401  (import the parent first so a missing install fails here)
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise RuntimeError(_MISSING) from e

    check_mesh(nodes, devices)
    if not isinstance(node_to_draw, int) or not 0 <= node_to_draw < nodes:
        raise ValueError(f"`node_to_draw` must be a node index in [0, {nodes}), got {node_to_draw!r}")
    grid = as_grid(assign_grid, "assign_grid")
    owner = [int(v) for v in plain(owner)]
    check_assignment(grid, owner, nodes * devices)

    fig = Figure(figsize=(16, 7), layout="constrained")
    FigureCanvasAgg(fig)
    fig.suptitle(title)
    ax_grid, ax_gantt = fig.subplots(1, 2, width_ratios=[1, 1.5])
    _draw_assignment(fig, ax_grid, grid, owner, devices, nodes * devices)
    _draw_gantt(ax_gantt, tasks, node_to_draw, devices)
    fig.savefig(path, dpi=120)
    return path


def _draw_assignment(fig, ax, grid: list[list[int]], owner: list[int], devices: int, world: int) -> None:
    """The tile assignment panel: cells by computing rank, owner strips, node boundaries."""
    import numpy as np  # a matplotlib dependency, so present whenever matplotlib is
    from matplotlib.colors import ListedColormap

    p = len(grid)
    cmap = ListedColormap(_rank_colors(world)).with_extremes(bad="white")
    cells = np.ma.masked_less(np.asarray(grid, dtype=float), 0)
    style = dict(cmap=cmap, vmin=-0.5, vmax=world - 0.5, interpolation="nearest", aspect="equal")
    image = ax.imshow(cells, extent=(0, p, p, 0), **style)
    strip, gap = max(0.04 * p, 0.6), max(0.01 * p, 0.15)
    ax.imshow([owner], extent=(0, p, -gap, -gap - strip), **style)
    ax.imshow([[o] for o in owner], extent=(-gap - strip, -gap, p, 0), **style)
    for i in range(1, p):
        if owner[i] // devices != owner[i - 1] // devices:
            ax.axhline(i, color="black", lw=0.8)
            ax.axvline(i, color="black", lw=0.8)
    ax.set_xlim(-gap - strip, p)
    ax.set_ylim(p, -gap - strip)
    ax.set_xlabel("KV chunk (top strip: owner)")
    ax.set_ylabel("Q chunk (left strip: owner)")
    n_tiles = sum(v >= 0 for row in grid for v in row)
    ax.set_title(f"tile assignment ({p}×{p} chunks, {n_tiles} tiles)")
    bar = fig.colorbar(image, ax=ax, shrink=0.8, label="computing rank")
    if world <= 32:
        bar.set_ticks(range(world))


def _draw_gantt(ax, tasks: Sequence[Mapping[str, Any]], node: int, devices: int) -> None:
    """One node's schedule: a row per (rank, stream), bars coloured by kind, time in ms."""
    from matplotlib.patches import Patch

    ranks = range(node * devices, (node + 1) * devices)
    mine = [t for t in tasks if int(t["rank"]) in ranks]
    rows = sorted({(int(t["rank"]), str(t["stream"])) for t in mine}, key=lambda k: (k[0], stream_key(k[1])))
    y_of = {k: y for y, k in enumerate(rows)}
    kind_colors: dict[str, str] = {}
    bars: dict[tuple[int, str], list[tuple[float, float]]] = defaultdict(list)
    for t in mine:
        kind = str(t["kind"])
        if kind not in kind_colors:
            extra = sum(k not in KIND_COLORS for k in kind_colors)
            kind_colors[kind] = KIND_COLORS.get(kind, _EXTRA_KIND_COLORS[extra % len(_EXTRA_KIND_COLORS)])
        start, end = float(t["start"]) * 1e3, float(t["end"]) * 1e3
        if end < start:
            raise ValueError(f"tasks must end at or after their start, got start={t['start']} end={t['end']}")
        bars[(y_of[(int(t["rank"]), str(t["stream"]))], kind)].append((start, end - start))
    # One broken_barh per (row, kind): thousands of tasks stay one artist each.
    for (y, kind), spans in bars.items():
        ax.broken_barh(spans, (y - 0.4, 0.8), facecolors=kind_colors[kind], edgecolor="none")
    for y in range(1, len(rows)):
        if rows[y][0] != rows[y - 1][0]:
            ax.axhline(y - 0.5, color="grey", lw=0.5)
    ax.set_yticks(range(len(rows)), [f"r{r} {s}" for r, s in rows])
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlabel("time (ms)")
    ax.set_title(f"schedule of node {node} (ranks {ranks.start}–{ranks.stop - 1})")
    ax.grid(axis="x", alpha=0.3)
    if not mine:
        ax.text(0.5, 0.5, f"no tasks on node {node}", ha="center", va="center", transform=ax.transAxes)
        return
    ax.set_xlim(left=min(0.0, min(float(t["start"]) for t in mine) * 1e3))
    ax.legend(handles=[Patch(color=c, label=k) for k, c in kind_colors.items()], loc="upper center",
              bbox_to_anchor=(0.5, -0.08), fontsize="small", ncols=min(len(kind_colors), 8), frameon=False)
