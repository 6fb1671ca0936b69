"""Terminal renderings of a context-parallel plan: pure functions from plain data to ``rich``.

Every function here takes PLAIN Python data (ints, floats, dicts, nested lists; a torch
tensor is accepted wherever a list is, via ``.tolist()``) and returns a ``rich``
renderable. Nothing here imports the planner, so the report can be fed from a saved
JSON plan, a test, or the live planner alike; the CLI does the wiring.

Renderings:

* ``mask_heatmap``: block-kind grid (EMPTY / PARTIAL / FULL) with density stats.
* ``assignment_heatmap``: which rank computes each tile, coloured by node, with the
  chunk owners along the top and left edges.
* ``rank_table``: per-rank compute share and NVLink / inter-node traffic.
* ``gantt``: per-(rank, stream) timeline of a simulated schedule.
* ``comparison_table``: our plan against the baselines, with speedups.
* ``solver_panel``: ILP solve statistics per hierarchy level.

Conventions: times in task dicts are SECONDS, times in table dicts are MILLISECONDS
(``*_ms`` keys); bytes are plain ints. Cells are glyph-coded as well as coloured so the
output still reads when piped to a file without colour.

Caution: grids larger than ``max_cells`` are downsampled for the terminal; the stats in
the legends are always computed on the full-resolution grid.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.measure import Measurement
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

__all__ = [
    "EMPTY",
    "PARTIAL",
    "FULL",
    "assignment_heatmap",
    "comparison_table",
    "format_bytes",
    "format_ms",
    "gantt",
    "mask_heatmap",
    "rank_table",
    "solver_panel",
]

# Block kinds, matching the mask pattern's encoding.
EMPTY, PARTIAL, FULL = 0, 1, 2

_KIND_GLYPH = {FULL: "██", PARTIAL: "▒▒", EMPTY: "  "}
_KIND_STYLE = {FULL: "bright_cyan", PARTIAL: "cyan dim", EMPTY: ""}
_KIND_NAME = {FULL: "FULL", PARTIAL: "PARTIAL", EMPTY: "EMPTY"}

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

_DEVICE_CHARS = "0123456789abcdefghijklmnopqrstuvwxyz"

# Gantt task kinds: (glyph, style). Distinct glyphs so the chart reads without colour.
TASK_KINDS: dict[str, tuple[str, str]] = {
    "attn": ("█", "bright_green"),
    "q": ("q", "bold black on bright_blue"),
    "kv": ("k", "bold black on bright_magenta"),
    "o": ("o", "bold black on bright_yellow"),
    "merge": ("m", "bold black on bright_cyan"),
    "dq": ("Q", "bold white on blue"),
    "dkv": ("K", "bold white on magenta"),
}
_EXTRA_GLYPHS = "#%@&+=*~$"
_EXTRA_STYLES = ("bold black on white", "bold white on red", "bold black on green", "bold white on dark_orange3")
_STREAM_ORDER = ("compute", "send_intra", "recv_intra", "send_inter", "recv_inter")

_BYTE_UNITS = ("KiB", "MiB", "GiB", "TiB", "PiB")


# ---------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------


def format_bytes(n: int | float | None) -> str:
    """Human-readable binary size: ``512 -> "512 B"``, ``1536 -> "1.5 KiB"``.

    Args:
        n: byte count (``None`` renders as an em dash).

    Returns:
        The size with one decimal in the largest unit that keeps the value >= 1.

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
    for unit in _BYTE_UNITS:
        value /= 1024.0
        # Round first so 1023.96 KiB becomes "1.0 MiB", not "1024.0 KiB".
        if round(value, 1) < 1024 or unit == _BYTE_UNITS[-1]:
            return f"{value:.1f} {unit}"
    raise AssertionError("unreachable")


def format_ms(x: float | None) -> str:
    """Milliseconds with precision that scales with magnitude: ``0.123 ms``, ``12.35 ms``, ``1234.6 ms``.

    ``None`` renders as an em dash.
    """
    if x is None:
        return "—"
    x = float(x)
    if abs(x) < 1:
        return f"{x:.3f} ms"
    if abs(x) < 100:
        return f"{x:.2f} ms"
    return f"{x:.1f} ms"


def _plain(x: Any) -> Any:
    """Tensors and numpy arrays to nested lists; anything else unchanged."""
    tolist = getattr(x, "tolist", None)
    return tolist() if callable(tolist) else x


def _as_grid(grid: Any, name: str) -> list[list[int]]:
    """Validate a non-empty rectangular 2-D grid of ints."""
    grid = _plain(grid)
    if not isinstance(grid, Sequence) or isinstance(grid, (str, bytes)) or len(grid) == 0:
        raise ValueError(f"`{name}` must be a non-empty 2-D list of ints, got {type(grid).__name__}")
    rows = [_plain(r) for r in grid]
    if not all(isinstance(r, Sequence) and not isinstance(r, (str, bytes)) for r in rows):
        raise ValueError(f"`{name}` must be a 2-D list of ints (rows must be lists), got {grid!r:.80}")
    width = len(rows[0])
    if width == 0 or any(len(r) != width for r in rows):
        raise ValueError(
            f"`{name}` must be rectangular and non-empty, got row lengths {sorted({len(r) for r in rows})}"
        )
    return [[int(v) for v in r] for r in rows]


def _check_max_cells(max_cells: int) -> None:
    if not isinstance(max_cells, int) or max_cells < 1:
        raise ValueError(f"`max_cells` must be a positive int, got {max_cells!r}")


def _bins(n: int, factor: int) -> list[range]:
    """Consecutive index ranges of ``factor`` (the last may be shorter) covering ``range(n)``."""
    return [range(i, min(i + factor, n)) for i in range(0, n, factor)]


def _rank_char(rank: int, devices: int) -> str:
    return _DEVICE_CHARS[rank % devices]


def _node_color(node: int) -> str:
    return NODE_COLORS[node % len(NODE_COLORS)]


def _task_kind_styles(kinds: Sequence[str]) -> dict[str, tuple[str, str]]:
    """Glyph and style for each kind: the fixed table first, then unused fallbacks."""
    out: dict[str, tuple[str, str]] = {}
    extra = 0
    for kind in kinds:
        if kind in out:
            continue
        if kind in TASK_KINDS:
            out[kind] = TASK_KINDS[kind]
        else:
            out[kind] = (
                _EXTRA_GLYPHS[extra % len(_EXTRA_GLYPHS)],
                _EXTRA_STYLES[extra % len(_EXTRA_STYLES)],
            )
            extra += 1
    return out


def _stream_key(stream: str) -> tuple[int, str]:
    if stream in _STREAM_ORDER:
        return (_STREAM_ORDER.index(stream), stream)
    return (len(_STREAM_ORDER), stream)


def _pct(part: int, total: int) -> str:
    return f"{100.0 * part / total:.1f}%" if total else "—"


# ---------------------------------------------------------------------------------------
# 1. Mask heatmap
# ---------------------------------------------------------------------------------------


def _downsample_kinds(grid: list[list[int]], factor: int) -> list[list[int]]:
    """FULL if every block in the bin is FULL, EMPTY if every block is EMPTY, else PARTIAL."""
    out = []
    for rb in _bins(len(grid), factor):
        row = []
        for cb in _bins(len(grid[0]), factor):
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
    grid = _as_grid(kind_grid, "kind_grid")
    _check_max_cells(max_cells)
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
            line.append(_KIND_GLYPH[v], style=_KIND_STYLE[v])
        lines.append(line)

    total = n_rows * n_cols
    legend = Text(no_wrap=False)
    for kind in (FULL, PARTIAL, EMPTY):
        glyph = _KIND_GLYPH[kind] if kind != EMPTY else "··"
        legend.append(glyph, style=_KIND_STYLE[kind] or "dim")
        legend.append(f" {_KIND_NAME[kind]} {_pct(counts[kind], total)}  ")
    legend.append(f"density {_pct(counts[FULL] + counts[PARTIAL], total)}", style="bold")
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


def _check_mesh(nodes: int, devices: int) -> None:
    if not isinstance(nodes, int) or nodes < 1:
        raise ValueError(f"`nodes` must be a positive int, got {nodes!r}")
    if not isinstance(devices, int) or not 1 <= devices <= len(_DEVICE_CHARS):
        raise ValueError(f"`devices` must be an int in [1, {len(_DEVICE_CHARS)}] (one char per device), got {devices!r}")


def _check_assignment(grid: list[list[int]], owner: list[int], world: int) -> None:
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
    _check_mesh(nodes, devices)
    _check_max_cells(max_cells)
    grid = _as_grid(assign_grid, "assign_grid")
    owner = [int(v) for v in _plain(owner)]
    world = nodes * devices
    _check_assignment(grid, owner, world)
    p = len(grid)

    factor = math.ceil(p / max_cells)
    bins = _bins(p, factor)
    cells = [[_majority([grid[i][j] for i in rb for j in cb]) for cb in bins] for rb in bins]
    owners = [_majority([owner[i] for i in b]) for b in bins]

    def cell(rank: int) -> Text:
        if rank < 0:
            return Text("  ")
        return Text(_rank_char(rank, devices) + " ", style=f"bold white on {_node_color(rank // devices)}")

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
        legend.append(f" node {n} ", style=f"bold white on {_node_color(n)}")
        legend.append(f" r{n * devices}-{(n + 1) * devices - 1}  ")
    legend.append("\nchar = device index, blank = empty; top/left strip = chunk owner")
    legend.append(
        f"\n{len(tiles)} tiles: {_pct(on_rank, len(tiles))} on the query owner's rank, "
        f"{_pct(on_node, len(tiles))} on its node"
    )
    if factor > 1:
        legend.append(f"\nshown {len(bins)}×{len(bins)} (1 cell = {factor}×{factor} tiles, majority rank)", style="dim")
    return Panel(Group(*lines, Text(""), legend), title=title, expand=False)


# ---------------------------------------------------------------------------------------
# 3. Rank table
# ---------------------------------------------------------------------------------------

_RANK_KEYS = (
    "rank",
    "node",
    "compute_share",
    "compute_ms",
    "intra_in_bytes",
    "intra_out_bytes",
    "inter_in_bytes",
    "inter_out_bytes",
    "kernels",
)
_BYTES_COLS = (
    ("intra_in_bytes", "intra in"),
    ("intra_out_bytes", "intra out"),
    ("inter_in_bytes", "inter in"),
    ("inter_out_bytes", "inter out"),
)
HIGHLIGHT = "bold red"


def rank_table(rows: Sequence[Mapping[str, Any]], *, title: str) -> Table:
    """Per-rank load table: compute share, compute time, traffic by link class, kernel launches.

    Args:
        rows: one dict per rank with keys ``rank, node, compute_share`` (fraction of the
            total, 0..1), ``compute_ms, intra_in_bytes, intra_out_bytes, inter_in_bytes,
            inter_out_bytes, kernels``. Sorted by rank for display.
        title: table title.

    Returns:
        A ``rich.table.Table``. In each bytes column the maximum is styled ``bold red``
        (only when the column is not uniform, so a balanced plan shows no alarm); the
        footer row gives max / mean per column and the caption the compute imbalance.

    Raises:
        ValueError: if ``rows`` is empty or a row lacks a key.
    """
    rows = list(rows)
    if not rows:
        raise ValueError("`rows` must hold at least one rank, got []")
    for i, r in enumerate(rows):
        missing = [k for k in _RANK_KEYS if k not in r]
        if missing:
            raise ValueError(f"`rows[{i}]` must have keys {list(_RANK_KEYS)}, got it missing {missing}")
    rows = sorted(rows, key=lambda r: r["rank"])
    n = len(rows)

    def col(key: str) -> list[float]:
        return [float(_plain(r[key])) for r in rows]

    def max_mean(values: list[float], fmt) -> str:
        return f"{fmt(max(values))}\n{fmt(sum(values) / n)}"

    share, ms, kernels = col("compute_share"), col("compute_ms"), col("kernels")
    mean_share = sum(share) / n
    imbalance = max(share) / mean_share if mean_share > 0 else float("nan")

    table = Table(
        title=title,
        show_footer=True,
        caption=f"compute imbalance (max / mean share) {imbalance:.3f}×; intra = NVLink, "
        f"inter = inter-node; {HIGHLIGHT.split()[-1]} = busiest rank per column",
        caption_justify="left",
    )
    table.add_column("rank", justify="right", footer="max\nmean")
    table.add_column("node", justify="right")
    table.add_column("compute", justify="right", footer=max_mean(share, lambda v: f"{100 * v:.1f}%"))
    table.add_column("compute ms", justify="right", footer=max_mean(ms, format_ms))
    byte_values = {key: col(key) for key, _ in _BYTES_COLS}
    for key, label in _BYTES_COLS:
        table.add_column(label, justify="right", footer=max_mean(byte_values[key], format_bytes))
    table.add_column("kernels", justify="right", footer=max_mean(kernels, lambda v: f"{v:.1f}".removesuffix(".0")))

    hot = {
        key: max(v) if max(v) > 0 and max(v) > min(v) else None for key, v in byte_values.items()
    }
    for i, r in enumerate(rows):
        cells: list[Text | str] = [
            str(int(r["rank"])),
            str(int(r["node"])),
            f"{100 * share[i]:.1f}%",
            format_ms(ms[i]),
        ]
        for key, _ in _BYTES_COLS:
            v = byte_values[key][i]
            cells.append(Text(format_bytes(v), style=HIGHLIGHT if v == hot[key] else ""))
        cells.append(str(int(kernels[i])))
        table.add_row(*cells)
    return table


# ---------------------------------------------------------------------------------------
# 4. Gantt chart
# ---------------------------------------------------------------------------------------

_TASK_KEYS = ("rank", "stream", "start", "end", "kind")


def _nice_step(span_ms: float, n_ticks: int) -> float:
    """Smallest of 1, 2, 2.5, 5 x 10^k that gives at most ``n_ticks`` intervals."""
    raw = span_ms / n_ticks
    mag = 10.0 ** math.floor(math.log10(raw))
    for m in (1.0, 2.0, 2.5, 5.0, 10.0):
        if m * mag >= raw:
            return m * mag
    raise AssertionError("unreachable")


def _axis_ticks(t0: float, span: float, width: int, n_ticks: int = 5) -> tuple[str, str]:
    """Axis rule with ``┴`` at round millisecond values and their labels under them.

    Column c covers ``[t0 + c * span / width, t0 + (c + 1) * span / width)``, so a tick at
    time t sits on column ``floor((t - t0) / span * width)`` (the cell that starts there).
    """
    t0_ms, span_ms = t0 * 1e3, span * 1e3
    step = _nice_step(span_ms, n_ticks)
    rule = ["─"] * width
    labels = [" "] * (width + 8)
    last_end = -1
    k = math.ceil(t0_ms / step - 1e-9)
    while k * step <= t0_ms + span_ms * (1 + 1e-9):
        t = k * step
        col = min(width - 1, max(0, math.floor((t - t0_ms) / span_ms * width + 1e-9)))
        rule[col] = "┴"
        label = f"{round(t, 9):g}"
        start = max(0, col - len(label) // 2)
        if start > last_end and start + len(label) <= len(labels):
            labels[start : start + len(label)] = label
            last_end = start + len(label)
        k += 1
    return "".join(rule), "".join(labels).rstrip()


def gantt(
    tasks: Sequence[Mapping[str, Any]],
    *,
    title: str,
    width: int = 100,
    t_end: float | None = None,
) -> RenderableType:
    """Text timeline: one row per (rank, stream), tasks as glyphs coloured by kind.

    Args:
        tasks: dicts ``{rank, stream, start, end, kind}`` with times in SECONDS. Streams
            sort ``compute, send_intra, recv_intra, send_inter, recv_inter`` then others
            alphabetically. Overlapping tasks on one row are drawn in list order (later
            wins); every task gets at least one character.
        title: panel title.
        width: characters for the time axis.
        t_end: right end of the axis in seconds (default: the last task end); the axis
            starts at 0 (or the earliest start, if negative).

    Returns:
        A ``rich.panel.Panel``: rows labelled ``r<rank> <stream>`` with the busy share of
        each row on the right, an axis in ms, and a legend of the kinds present.

    Raises:
        ValueError: on a task missing a key or with ``end < start``, ``width < 10``,
            or ``t_end`` not after the axis start.
    """
    if not isinstance(width, int) or width < 10:
        raise ValueError(f"`width` must be an int >= 10, got {width!r}")
    tasks = list(tasks)
    for i, t in enumerate(tasks):
        missing = [k for k in _TASK_KEYS if k not in t]
        if missing:
            raise ValueError(f"`tasks[{i}]` must have keys {list(_TASK_KEYS)}, got it missing {missing}")
        if float(t["end"]) < float(t["start"]):
            raise ValueError(f"`tasks[{i}]` must end at or after its start, got start={t['start']} end={t['end']}")
    if not tasks:
        return Panel(Text("no tasks", style="dim"), title=title, expand=False)

    t0 = min(0.0, min(float(t["start"]) for t in tasks))
    t1 = float(t_end) if t_end is not None else max(float(t["end"]) for t in tasks)
    if t1 <= t0:
        if t_end is not None:
            raise ValueError(f"`t_end` must be after the axis start {t0}, got {t_end}")
        t1 = t0 + 1e-9  # every task has zero length: still draw one char each
    span = t1 - t0
    styles = _task_kind_styles([str(t["kind"]) for t in tasks])

    row_keys = sorted({(int(t["rank"]), str(t["stream"])) for t in tasks}, key=lambda k: (k[0], _stream_key(k[1])))
    spans: dict[tuple[int, str], list[tuple[float, float, str]]] = {k: [] for k in row_keys}
    for t in tasks:
        spans[(int(t["rank"]), str(t["stream"]))].append((float(t["start"]), float(t["end"]), str(t["kind"])))
    busy = []
    for key in row_keys:
        # Busy share = length of the union of the row's intervals inside the window.
        covered, reach = 0.0, t0
        for s, e, _ in sorted(spans[key]):
            s, e = max(s, reach), min(e, t1)
            if e > s:
                covered += e - s
                reach = e
        busy.append(covered / span)
    body = _GanttBody(
        rows=tuple((f"r{r} {st}", tuple(spans[(r, st)]), b) for (r, st), b in zip(row_keys, busy)),
        styles=styles,
        t0=t0,
        span=span,
        width=width,
    )
    legend = Text()
    for kind, (glyph, style) in styles.items():
        legend.append(glyph * 2, style=style)
        legend.append(f" {kind}   ")
    return Panel(Group(body, legend), title=title, expand=False)


_BUSY_W = len("│ 100.0%")


@dataclass(frozen=True, slots=True, kw_only=True)
class _GanttBody:
    """The chart rows and axis, laid out when rendered so the axis fits the console."""

    rows: tuple[tuple[str, tuple[tuple[float, float, str], ...], float], ...]
    """(label, (start s, end s, kind) in draw order, busy fraction) per row."""
    styles: dict[str, tuple[str, str]]
    """kind -> (glyph, rich style)."""
    t0: float
    """Axis start, seconds."""
    span: float
    """Axis length, seconds (> 0)."""
    width: int
    """Requested axis width in characters; shrunk to the console width if needed."""

    @property
    def _label_w(self) -> int:
        return max(len(label) for label, _, _ in self.rows)

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        chrome = self._label_w + 2 + _BUSY_W
        return Measurement(chrome + 10, chrome + self.width)

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        label_w = self._label_w
        width = max(10, min(self.width, options.max_width - label_w - 2 - _BUSY_W))
        t1 = self.t0 + self.span
        for label, spans, busy in self.rows:
            cells: list[str | None] = [None] * width
            for s, e, kind in spans:  # list order: later tasks overwrite earlier ones
                if s > t1 or (s == t1 and e > s):
                    continue  # starts after the visible window
                c0 = min(width - 1, max(0, math.floor((s - self.t0) / self.span * width)))
                c1 = min(width, max(c0 + 1, math.ceil((e - self.t0) / self.span * width)))
                cells[c0:c1] = [kind] * (c1 - c0)
            line = Text(no_wrap=True, overflow="crop")
            line.append(label.ljust(label_w) + " │")
            for kind in cells:
                if kind is None:
                    line.append(" ")
                else:
                    glyph, style = self.styles[kind]
                    line.append(glyph, style=style)
            line.append(f"│ {100 * busy:5.1f}%", style="dim")
            yield line
        rule, labels = _axis_ticks(self.t0, self.span, width)
        yield Text(" " * label_w + " └" + rule + "┘ busy", style="dim", no_wrap=True, overflow="crop")
        yield Text(" " * (label_w + 2) + labels + "  ms", style="dim", no_wrap=True, overflow="crop")


# ---------------------------------------------------------------------------------------
# 5. Comparison table
# ---------------------------------------------------------------------------------------


def _speedup_text(other: float | None, ours: float | None) -> Text:
    if other is None or ours is None or ours <= 0:
        return Text("—", style="dim")
    s = other / ours
    return Text(f"{s:.2f}x", style="green" if s > 1.0 else ("red" if s < 1.0 else ""))


def _total(m: Mapping[str, Any]) -> float | None:
    if m.get("fwd_ms") is None or m.get("bwd_ms") is None:
        return None
    return float(m["fwd_ms"]) + float(m["bwd_ms"])


def comparison_table(
    methods: Mapping[str, Mapping[str, Any]],
    *,
    best_of: str = "ultraattn",
    title: str,
) -> Table:
    """Our plan against the baselines: times, traffic, imbalance and speedups.

    Speedup of ``best_of`` over a method is ``method time / best_of time`` (> 1 means we
    are faster), for the forward and for forward + backward (``—`` where a backward time
    is missing). The best baseline (★) is the fastest other applicable method by
    forward + backward time when every applicable baseline has one, else by forward.

    Args:
        methods: name -> dict with keys ``fwd_ms, bwd_ms`` (may be None),
            ``max_rank_bytes, max_rank_inter_node_bytes, compute_imbalance`` and optionally
            ``note``. A method whose ``fwd_ms`` is None is not applicable: its numbers
            show as ``—`` and its note is shown.
        best_of: the method the speedups are relative to (must be in ``methods`` and
            have a forward time).
        title: table title.

    Returns:
        A ``rich.table.Table`` with ``best_of`` first, then the others in given order.

    Raises:
        ValueError: if ``best_of`` is not in ``methods`` or has no ``fwd_ms``.
    """
    if best_of not in methods:
        raise ValueError(f"`best_of` must name one of the methods {list(methods)}, got {best_of!r}")
    ours = methods[best_of]
    if ours.get("fwd_ms") is None:
        raise ValueError(f"`methods[{best_of!r}]['fwd_ms']` must be a time in ms, got None")
    ours_fwd, ours_total = float(ours["fwd_ms"]), _total(ours)

    applicable = [n for n, m in methods.items() if n != best_of and m.get("fwd_ms") is not None]
    best_baseline = None
    if applicable:
        by_total = all(_total(methods[n]) is not None for n in applicable)
        key = (lambda n: _total(methods[n])) if by_total else (lambda n: float(methods[n]["fwd_ms"]))
        best_baseline = min(applicable, key=key)

    has_notes = any(m.get("note") for m in methods.values())
    table = Table(title=title, caption=f"speedup = method time / {best_of} time; ★ = best baseline", caption_justify="left")
    table.add_column("method")
    table.add_column("fwd", justify="right")
    table.add_column("fwd+bwd", justify="right")
    table.add_column("max rank\nbytes", justify="right")
    table.add_column("max rank\ninter-node", justify="right")
    table.add_column("compute\nimbalance", justify="right")
    table.add_column("speedup\nfwd", justify="right")
    table.add_column("speedup\nfwd+bwd", justify="right")
    if has_notes:
        table.add_column("note", style="dim")

    order = [best_of] + [n for n in methods if n != best_of]
    for name in order:
        m = methods[name]
        note = str(m.get("note") or "")
        if name == best_of:
            label = Text(name, style="bold cyan")
            speed = [Text("(ref)", style="dim"), Text("(ref)", style="dim")]
        elif m.get("fwd_ms") is None:
            label = Text(name, style="dim")
            speed = [Text("—", style="dim"), Text("—", style="dim")]
            note = note or "not applicable"
        else:
            label = Text(name + (" ★" if name == best_baseline else ""), style="bold" if name == best_baseline else "")
            speed = [_speedup_text(float(m["fwd_ms"]), ours_fwd), _speedup_text(_total(m), ours_total)]
        imb = m.get("compute_imbalance")
        cells: list[Text | str] = [
            label,
            format_ms(m.get("fwd_ms")),
            format_ms(_total(m)),
            format_bytes(m.get("max_rank_bytes")),
            format_bytes(m.get("max_rank_inter_node_bytes")),
            "—" if imb is None else f"{float(imb):.2f}",
            *speed,
        ]
        if has_notes:
            cells.append(note)
        table.add_row(*cells, end_section=name == best_of)
    return table


# ---------------------------------------------------------------------------------------
# 6. Solver panel
# ---------------------------------------------------------------------------------------


def _fmt_num(x: Any, spec: str) -> str:
    return "—" if x is None else format(float(x), spec)


def solver_panel(info: Mapping[str, Any]) -> Panel:
    """ILP solve statistics: one row per hierarchy level plus the schedule solve.

    Args:
        info: ``{"seconds": total, "levels": [stage, ...], "schedule": stage or None,
            "notes": [str, ...]}`` where a stage is a dict with keys ``level, status,
            objective, gap`` (relative, shown in %), ``seconds, variables, constraints,
            fallback`` (None, or why a heuristic replaced the ILP). Missing keys show as ``—``.

    Returns:
        A ``rich.panel.Panel`` with the stage table and the notes as bullets.
    """
    stages = [dict(s) for s in info.get("levels") or []]
    if info.get("schedule"):
        stages.append({"level": "schedule", **info["schedule"]})
    table = Table(expand=False, box=None, padding=(0, 1))
    for name, justify in (
        ("stage", "left"),
        ("status", "left"),
        ("objective", "right"),
        ("gap", "right"),
        ("time", "right"),
        ("vars", "right"),
        ("cons", "right"),
        ("fallback", "left"),
    ):
        table.add_column(name, justify=justify, header_style="bold")
    for s in stages:
        status = str(s.get("status") or "—")
        fallback = s.get("fallback")
        table.add_row(
            str(s.get("level", "?")),
            Text(status, style="green" if status.lower() == "optimal" else "yellow"),
            _fmt_num(s.get("objective"), ".4g"),
            "—" if s.get("gap") is None else f"{100 * float(s['gap']):.2f}%",
            "—" if s.get("seconds") is None else f"{float(s['seconds']):.2f} s",
            "—" if s.get("variables") is None else str(int(s["variables"])),
            "—" if s.get("constraints") is None else str(int(s["constraints"])),
            Text("—", style="dim") if fallback is None else Text(str(fallback), style="red"),
        )
    parts: list[RenderableType] = [table]
    notes = [str(n) for n in info.get("notes") or []]
    if notes:
        parts.append(Text(""))
        parts.extend(Text(f"• {n}") for n in notes)
    total = info.get("seconds")
    title = "solver" + ("" if total is None else f" ({float(total):.2f} s)")
    return Panel(Group(*parts), title=title, expand=False)
