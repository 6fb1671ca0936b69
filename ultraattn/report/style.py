"""What every report rendering shares: block-kind glyphs, node colours, number formats, grid checks.

Conventions of the report package: renderings take PLAIN Python data (ints, floats, dicts, nested
lists; a torch tensor is accepted wherever a list is, via ``.tolist()``) and return ``rich``
renderables; times in task dicts are SECONDS, times in table dicts are MILLISECONDS (``*_ms``
keys); bytes are plain ints. Cells are glyph-coded as well as coloured so the output still reads
when piped to a file without colour.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

# Block kinds, matching the mask pattern's encoding.
EMPTY, PARTIAL, FULL = 0, 1, 2

KIND_GLYPH = {FULL: "██", PARTIAL: "▒▒", EMPTY: "  "}
KIND_STYLE = {FULL: "bright_cyan", PARTIAL: "cyan dim", EMPTY: ""}
KIND_NAME = {FULL: "FULL", PARTIAL: "PARTIAL", EMPTY: "EMPTY"}

# Distinct background colours for nodes (cycled when there are more nodes).
NODE_COLORS = (
    "blue",
    "green4",
    "magenta",
    "dark_orange3",
    "cyan4",
    "red3",
    "purple4",
    "yellow4",
    "deep_sky_blue4",
    "orchid",
    "spring_green4",
    "indian_red",
)

DEVICE_CHARS = "0123456789abcdefghijklmnopqrstuvwxyz"

BYTE_UNITS = ("KiB", "MiB", "GiB", "TiB", "PiB")


PIPED_WIDTH = 120
"""Columns of a report written to a file or a pipe (unless ``COLUMNS`` says otherwise): wide enough for every table
of a report without cutting a header. Sentences are never broken there (``print_line``)."""


def report_console() -> Console:
    """The console every report prints on: the terminal's width, or ``COLUMNS``, or ``PIPED_WIDTH`` columns when output
    is a file or pipe (rich's own default there is 80)."""
    c = Console()
    return c if c.is_terminal or os.environ.get("COLUMNS") else Console(width=PIPED_WIDTH)


def report_table(**kwargs) -> Table:
    """A report's table: a rule under the header and no vertical borders, one column of space between columns, so
    that every table of a report fits 80 columns without cutting a header (a long word in a cell folds)."""
    return Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, collapse_padding=True, padding=(0, 1), **kwargs)


def print_line(console: Console, text: str) -> None:
    """A sentence of a report, on one line whatever the width: the terminal wraps it, a pipe keeps it whole."""
    console.print(text, soft_wrap=True)


def format_bytes(n: int | float | None) -> str:
    """Human-readable binary size: ``512 -> "512 B"``, ``1536 -> "1.5 KiB"``.

    Args:
        n: byte count (``None`` renders as an em dash).

    Returns:
        The size in the largest unit that keeps the value >= 1, with one decimal below 100 (at most 8 characters).

    Raises:
        ValueError: if ``n`` is negative.
    """
    if n is None:
        return "—"
    if n < 0:
        raise ValueError(f"`n` must be a non-negative byte count, got {n}")
    if n < 1024:
        return f"{int(n)} B"
    value = float(n)
    for unit in BYTE_UNITS:
        value /= 1024.0
        # Round first so 1023.96 KiB becomes "1.0 MiB", not "1024.0 KiB".
        if round(value, 1) < 1024 or unit == BYTE_UNITS[-1]:
            return f"{value:.1f} {unit}" if round(value, 1) < 100 else f"{value:.0f} {unit}"
    raise AssertionError("unreachable")


def format_ms(x: float | None) -> str:
    """Milliseconds with precision that scales with magnitude: ``4.20 us``, ``0.123 ms``, ``12.35 ms``, ``1234.6 ms``.

    ``None`` renders as an em dash.
    """
    if x is None:
        return "—"
    x = float(x)
    if 0 < abs(x) < 0.01:
        return f"{x * 1e3:.2f} us"
    if abs(x) < 1:
        return f"{x:.3f} ms"
    if abs(x) < 100:
        return f"{x:.2f} ms"
    return f"{x:.1f} ms"


def plain(x: Any) -> Any:
    """Tensors and numpy arrays to nested lists; anything else unchanged."""
    tolist = getattr(x, "tolist", None)
    return tolist() if callable(tolist) else x


def as_grid(grid: Any, name: str) -> list[list[int]]:
    """Validate a non-empty rectangular 2-D grid of ints."""
    grid = plain(grid)
    if not isinstance(grid, Sequence) or isinstance(grid, (str, bytes)) or len(grid) == 0:
        raise ValueError(f"`{name}` must be a non-empty 2-D list of ints, got {type(grid).__name__}")
    rows = [plain(r) for r in grid]
    if not all(isinstance(r, Sequence) and not isinstance(r, (str, bytes)) for r in rows):
        raise ValueError(f"`{name}` must be a 2-D list of ints (rows must be lists), got {grid!r:.80}")
    width = len(rows[0])
    if width == 0 or any(len(r) != width for r in rows):
        raise ValueError(
            f"`{name}` must be rectangular and non-empty, got row lengths {sorted({len(r) for r in rows})}"
        )
    return [[int(v) for v in r] for r in rows]


def check_max_cells(max_cells: int) -> None:
    if not isinstance(max_cells, int) or max_cells < 1:
        raise ValueError(f"`max_cells` must be a positive int, got {max_cells!r}")


def bin_ranges(n: int, factor: int) -> list[range]:
    """Consecutive index ranges of ``factor`` (the last may be shorter) covering ``range(n)``."""
    return [range(i, min(i + factor, n)) for i in range(0, n, factor)]


def rank_char(rank: int, devices: int) -> str:
    return DEVICE_CHARS[rank % devices]


def node_color(node: int) -> str:
    return NODE_COLORS[node % len(NODE_COLORS)]


def pct(part: int, total: int) -> str:
    return f"{100.0 * part / total:.1f}%" if total else "—"


# ---------------------------------------------------------------------------------------
# 1. Mask heatmap
# ---------------------------------------------------------------------------------------


def fmt_num(x: Any, spec: str) -> str:
    return "—" if x is None else format(float(x), spec)


def compare_words(ours: float, other: float, *, tie: float = 0.005) -> str:
    """How ``ours`` (a time) compares with ``other``, in words whose sense follows the sign: "1.13x faster than",
    "1.37x slower than", or "as fast as" within ``tie`` (relative). Every comparison line of the reports and the
    CLI is worded by this one helper, so a slower plan is never called faster."""
    if ours <= 0 or other <= 0:
        return "as fast as" if ours == other else ("faster than" if ours < other else "slower than")
    ratio = other / ours
    if abs(ratio - 1.0) <= tie:
        return "as fast as"
    return f"{ratio:.2f}x faster than" if ratio > 1 else f"{1 / ratio:.2f}x slower than"
