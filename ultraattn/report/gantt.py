"""``gantt``: a per-(rank, stream) timeline of a simulated schedule, in the terminal."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.measure import Measurement
from rich.panel import Panel
from rich.text import Text

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


def stream_key(stream: str) -> tuple[int, str]:
    if stream in _STREAM_ORDER:
        return (_STREAM_ORDER.index(stream), stream)
    return (len(_STREAM_ORDER), stream)


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

    row_keys = sorted({(int(t["rank"]), str(t["stream"])) for t in tasks}, key=lambda k: (k[0], stream_key(k[1])))
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


