"""Rich reports of what the backend did to a graph: sites, reasons, the rewritten graph, plans made so far."""

from __future__ import annotations

from rich.console import Console, Group
from rich.panel import Panel
from rich.syntax import Syntax
from rich.table import Table
from rich.text import Text


def sites_table(rec) -> Table:
    t = Table(title=f"graph {rec.index}: attention sites (world size {rec.world_size})", title_justify="left")
    for col in ("site", "op", "q shape", "k/v shape", "dtype", "mask", "density", "rewritten", "why"):
        t.add_column(col)
    for s in rec.sites:
        t.add_row(s.name, s.op, str(s.q_shape), str(s.kv_shape), str(s.dtype).replace("torch.", ""), s.mask,
                  "?" if s.density is None else f"{s.density:.3f}",
                  Text("yes", style="bold green") if s.rewritable else Text("no", style="bold red"), s.reason)
    return t


def plans_table(specs) -> Table:
    t = Table(title="plans made at run time (cached on the mask's content)", title_justify="left")
    for col in ("site", "calls", "plans", "cache hits", "planning s"):
        t.add_column(col, justify="right")
    for sp in specs:
        st = sp.stats
        t.add_row(sp.name, str(st["calls"]), str(st["plans"]), str(st["cache_hits"]), f"{st['planning_seconds']:.2f}")
    return t


def graph_code(rec) -> Syntax:
    code = rec.code_after.strip()
    lines = [i + 1 for i, ln in enumerate(code.splitlines()) if "ultraattn" in ln]
    return Syntax(code, "python", line_numbers=True, highlight_lines=set(lines), word_wrap=True)


def render_graph_report(rec, *, full: bool = False):
    parts = [sites_table(rec)]
    if any(sp.stats["calls"] for sp in rec.specs):  # at compile time nothing has run yet
        parts.append(plans_table(rec.specs))
    if full:
        parts.append(Panel(graph_code(rec), title="rewritten graph (ultraattn nodes highlighted)"))
    return Group(*parts)


def report_console() -> Console:
    """A console for reports: the terminal's width, or 120 columns when output is a file or pipe."""
    c = Console()
    return c if c.is_terminal else Console(width=120)


def print_graph_report(rec, *, full: bool = False, console: Console | None = None) -> None:
    (console or report_console()).print(render_graph_report(rec, full=full))
