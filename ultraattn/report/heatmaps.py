"""Heat maps of a plan: the mask's block kinds, and which rank computes each tile.

* ``mask_heatmap``: block-kind grid (EMPTY / PARTIAL / FULL) with density stats.
* ``assignment_heatmap``: which rank computes each tile, coloured by node, with the chunk owners
  along the top and left edges.

Caution: grids larger than ``max_cells`` are downsampled for the terminal; the stats in the
legends are always computed on the full-resolution grid.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.text import Text

from ultraattn.report.style import (
    DEVICE_CHARS,
    EMPTY,
    FULL,
    KIND_GLYPH,
    KIND_NAME,
    KIND_STYLE,
    PARTIAL,
    as_grid,
    bin_ranges,
    check_max_cells,
    node_color,
    pct,
    plain,
    rank_char,
)


def _downsample_kinds(grid: list[list[int]], factor: int) -> list[list[int]]:
    """FULL if every block in the bin is FULL, EMPTY if every block is EMPTY, else PARTIAL."""
    out = []
    for rb in bin_ranges(len(grid), factor):
        row = []
        for cb in bin_ranges(len(grid[0]), factor):
            seen = {grid[i][j] for i in rb for j in cb}
            row.append(seen.pop() if len(seen) == 1 else PARTIAL)
        out.append(row)
    return out


def mask_heatmap(kind_grid: Any, *, title: str, max_cells: int = 48) -> RenderableType:
    """Block-sparsity picture of a mask: one two-character cell per (downsampled) block.

    Args:
        kind_grid: 2-D grid (rows = query blocks, columns = KV blocks) of block kinds:
            0 EMPTY, 1 PARTIAL, 2 FULL. A tensor is accepted.
        title: panel title.
        max_cells: at most this many cells per side. Larger grids are downsampled by one
            common factor (keeps the aspect ratio); a downsampled cell is FULL if all its
            blocks are FULL, EMPTY if all are EMPTY, else PARTIAL.

    Returns:
        A ``rich.panel.Panel``: the grid (FULL ``██``, PARTIAL ``▒▒``, EMPTY blank) and a
        legend with the share of FULL / PARTIAL / EMPTY blocks at full resolution.

    Raises:
        ValueError: on a ragged grid, a kind outside {0, 1, 2}, or ``max_cells < 1``.
    """
    grid = as_grid(kind_grid, "kind_grid")
    check_max_cells(max_cells)
    counts = Counter(v for row in grid for v in row)
    bad = sorted(set(counts) - {EMPTY, PARTIAL, FULL})
    if bad:
        raise ValueError(f"`kind_grid` must hold block kinds 0 (EMPTY), 1 (PARTIAL), 2 (FULL), got {bad}")
    n_rows, n_cols = len(grid), len(grid[0])
    factor = math.ceil(max(n_rows, n_cols) / max_cells)
    shown = _downsample_kinds(grid, factor) if factor > 1 else grid

    lines = []
    for row in shown:
        line = Text(no_wrap=True, overflow="crop")
        for v in row:
            line.append(KIND_GLYPH[v], style=KIND_STYLE[v])
        lines.append(line)

    total = n_rows * n_cols
    legend = Text(no_wrap=False)
    for kind in (FULL, PARTIAL, EMPTY):
        glyph = KIND_GLYPH[kind] if kind != EMPTY else "··"
        legend.append(glyph, style=KIND_STYLE[kind] or "dim")
        legend.append(f" {KIND_NAME[kind]} {pct(counts[kind], total)}  ")
    legend.append(f"density {pct(counts[FULL] + counts[PARTIAL], total)}", style="bold")
    scale = f"{n_rows}×{n_cols} blocks"
    if factor > 1:
        scale += f", shown {len(shown)}×{len(shown[0])} (1 cell = {factor}×{factor} blocks)"
    footer = Text(scale, style="dim")
    return Panel(Group(*lines, Text(""), legend, footer), title=title, expand=False)


# ---------------------------------------------------------------------------------------
# 2. Assignment heatmap
# ---------------------------------------------------------------------------------------


def _majority(values: Sequence[int]) -> int:
    """Most common non-negative value (ties -> smallest); -1 only if all are -1."""
    c = Counter(v for v in values if v >= 0)
    if not c:
        return -1
    best = max(c.values())
    return min(v for v, k in c.items() if k == best)


def check_mesh(nodes: int, devices: int) -> None:
    if not isinstance(nodes, int) or nodes < 1:
        raise ValueError(f"`nodes` must be a positive int, got {nodes!r}")
    if not isinstance(devices, int) or not 1 <= devices <= len(DEVICE_CHARS):
        raise ValueError(f"`devices` must be an int in [1, {len(DEVICE_CHARS)}] (one char per device), got {devices!r}")


def check_assignment(grid: list[list[int]], owner: list[int], world: int) -> None:
    p = len(grid)
    if len(grid[0]) != p:
        raise ValueError(f"`assign_grid` must be square (P x P), got {p}x{len(grid[0])}")
    if len(owner) != p:
        raise ValueError(f"`owner` must have one entry per chunk (P={p}), got length {len(owner)}")
    bad = sorted({v for row in grid for v in row if not -1 <= v < world})
    if bad:
        raise ValueError(f"`assign_grid` must hold ranks in [0, {world}) or -1 for empty, got {bad[:8]}")
    bad = sorted({v for v in owner if not 0 <= v < world})
    if bad:
        raise ValueError(f"`owner` must hold ranks in [0, {world}), got {bad[:8]}")


def assignment_heatmap(
    assign_grid: Any,
    owner: Any,
    *,
    nodes: int,
    devices: int,
    title: str,
    max_cells: int = 48,
) -> RenderableType:
    """Who computes each tile: cell colour = the computing rank's node, cell char = its device.

    Ranks are numbered node-major: ``rank = node * devices + device``.

    Args:
        assign_grid: P x P grid (rows = query chunks, columns = KV chunks) of the rank that
            computes each cell, -1 for an empty cell.
        owner: length-P list, ``owner[i]`` = rank owning chunk i. Drawn as a strip along
            the top (KV chunks) and the left (query chunks).
        nodes, devices: mesh shape; ``devices`` is at most 36 (chars ``0-9a-z``).
        title: panel title.
        max_cells: when P exceeds it, chunks are binned by a common factor and each cell
            shows the majority rank of its non-empty tiles (blank only if all are empty);
            the owner strip shows the majority owner.

    Returns:
        A ``rich.panel.Panel`` with the grid and a legend: node colours, and the share of
        tiles computed on the query chunk's owner rank / owner node.

    Raises:
        ValueError: on a non-square grid, a wrong-length ``owner``, or ranks outside the mesh.
    """
    check_mesh(nodes, devices)
    check_max_cells(max_cells)
    grid = as_grid(assign_grid, "assign_grid")
    owner = [int(v) for v in plain(owner)]
    world = nodes * devices
    check_assignment(grid, owner, world)
    p = len(grid)

    factor = math.ceil(p / max_cells)
    bins = bin_ranges(p, factor)
    cells = [[_majority([grid[i][j] for i in rb for j in cb]) for cb in bins] for rb in bins]
    owners = [_majority([owner[i] for i in b]) for b in bins]

    def cell(rank: int) -> Text:
        if rank < 0:
            return Text("  ")
        return Text(rank_char(rank, devices) + " ", style=f"bold white on {node_color(rank // devices)}")

    header = Text("   ", no_wrap=True, overflow="crop")
    for r in owners:
        header.append_text(cell(r))
    rule = Text("   " + "──" * len(owners), style="dim", no_wrap=True, overflow="crop")
    lines = [header, rule]
    for o, row in zip(owners, cells):
        line = Text(no_wrap=True, overflow="crop")
        line.append_text(cell(o))
        line.append("│", style="dim")
        for r in row:
            line.append_text(cell(r))
        lines.append(line)

    # Stats at full resolution: locality relative to the query chunk's owner.
    tiles = [(i, r) for i, row in enumerate(grid) for r in row if r >= 0]
    on_rank = sum(r == owner[i] for i, r in tiles)
    on_node = sum(r // devices == owner[i] // devices for i, r in tiles)
    legend = Text()
    for n in range(nodes):
        legend.append(f" node {n} ", style=f"bold white on {node_color(n)}")
        legend.append(f" r{n * devices}-{(n + 1) * devices - 1}  ")
    legend.append("\nchar = device index, blank = empty; top/left strip = chunk owner")
    legend.append(
        f"\n{len(tiles)} tiles: {pct(on_rank, len(tiles))} on the query owner's rank, "
        f"{pct(on_node, len(tiles))} on its node"
    )
    if factor > 1:
        legend.append(f"\nshown {len(bins)}×{len(bins)} (1 cell = {factor}×{factor} tiles, majority rank)", style="dim")
    return Panel(Group(*lines, Text(""), legend), title=title, expand=False)


# ---------------------------------------------------------------------------------------
# 3. Rank table
# ---------------------------------------------------------------------------------------

