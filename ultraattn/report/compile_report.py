"""Reports of what the compile backend did: sites, sequence sharding, schedules, plans made at run time.

Renders the records of ``ultraattn.passes.records`` and nothing else, for the live report (printed
as graphs compile and sites are planned) and for saved reports (``options={"report_file": ...}``,
rendered by ``ultraattn report FILE``), which hold the same records as JSON.
"""

from __future__ import annotations

import json
import os

from rich.console import Console, Group, RenderableType
from rich.panel import Panel
from rich.syntax import Syntax
from rich.table import Table
from rich.text import Text

from ultraattn.passes.opinfo import TILE_OPS
from ultraattn.passes.records import AotGraphRecord, CompileReport, GraphRecord, PlanEvent, SiteStats
from ultraattn.report.plan_report import print_plan_result
from ultraattn.report.style import print_line, report_console, report_table
from ultraattn.report.tables import comparison_table, not_applicable_lines


def _short(name: str) -> str:
    for pre in ("l_self_modules_", "l_", "L_"):
        name = name.removeprefix(pre)
    return name.rstrip("_")


# ----------------------------------------------------------------------------- one graph
def _shape(shape) -> str:
    return "×".join(str(d) for d in shape)


def sites_table(rec: GraphRecord) -> Table:
    """One row per attention site: its call (shapes B×H×S×D, q over k/v where they differ), mask, what it runs as
    (``form``: green when ultraattn runs it, red when it runs as the model wrote it) and why."""
    t = report_table(title=f"graph {rec.index}: attention sites (world size {rec.world_size})", title_justify="left")
    for col in ("site", "op", "shape", "dtype", "mask", "density", "runs as", "why"):
        t.add_column(col, overflow="fold", no_wrap=col in ("site", "op", "shape", "dtype", "mask", "density"))
    for s in rec.sites:
        shape = _shape(s.q_shape) if tuple(s.q_shape) == tuple(s.kv_shape) else \
            f"{_shape(s.q_shape)}\nk/v {_shape(s.kv_shape)}"
        t.add_row(s.name, s.op, shape, s.dtype, s.mask, "?" if s.density is None else f"{s.density:.3f}",
                  Text(s.form or ("rewritten" if s.rewritten else "as written"),
                       style="green" if s.rewritten else "bold red"), s.why)
    return t


def shard_summary(rec: GraphRecord) -> Text | None:
    """One paragraph: what the sequence-sharding pass did to the graph (None: it did not run)."""
    sh = rec.shard
    if sh is None:
        return None
    n_fb = len(sh.fallbacks)
    t = Text()
    t.append(f"graph {rec.index}: sequence sharding", style="bold")
    t.append(f" · layout {sh.layout} · {sh.seq_len} tokens, {sh.local_len} per rank\n")
    t.append(f"  ops on local tokens {sh.sharded_ops} · replicated ops {sh.replicated_ops} · reductions over the "
             f"sequence {sh.reductions}\n")
    names = sorted({_short(n) for n in sh.dispatched})
    t.append(f"  inputs sliced {len(sh.dispatched)}"
             + (f" ({', '.join(names[:4])}{', ...' if len(names) > 4 else ''})" if names else "")
             + f" · weights entering {sh.entered} (their gradients all-reduced)\n")
    if sh.carried:
        t.append(f"  inputs arriving as shards (no communication) {len(sh.carried)} "
                 f"({', '.join(sorted({_short(n) for n in sh.carried}))})\n")
    returned = sum(o is not None for o in sh.outputs)
    if returned:
        t.append(f"  outputs returned as shards {returned}\n")
    t.append("  ")
    t.append(f"gathered fallbacks {n_fb}", style="bold red" if n_fb else "bold green")
    if sh.inlined_checkpoints:
        t.append(f"\n  {sh.inlined_checkpoints} activation-checkpoint regions inlined (still recomputed in the "
                 "backward)")
    for site, why in sh.skipped_sites:
        t.append(f"\n  {site} stays a global-view op: {why}", style="yellow")
    return t


def fallbacks_table(rec: GraphRecord) -> Table | None:
    """Sharded tensors an op outside the region needed whole: each is an all-gather (its bytes, per rank)."""
    sh = rec.shard
    if sh is None or not sh.fallbacks:
        return None
    t = report_table(title=f"graph {rec.index}: ops run on gathered data", title_justify="left")
    for col in ("gathered", "for op", "why", "bytes"):
        t.add_column(col, justify="right" if col == "bytes" else "left")
    for f in sh.fallbacks:
        t.add_row(f.node, f.op, f.why, f"{f.bytes:,}")
    return t


def graph_code(code: str) -> Syntax:
    code = code.strip()
    lines = {i + 1 for i, ln in enumerate(code.splitlines()) if "ultraattn" in ln}
    return Syntax(code, "python", line_numbers=True, highlight_lines=lines, word_wrap=True)


def render_graph(rec: GraphRecord, *, full: bool = False, stats: tuple[SiteStats, ...] = ()) -> RenderableType:
    parts: list[RenderableType] = [sites_table(rec)]
    parts += [x for x in (shard_summary(rec), fallbacks_table(rec)) if x is not None]
    mine = [s for s in stats if s.graph == rec.index]
    if any(s.calls for s in mine):  # at compile time nothing has run yet
        parts.append(plans_table(mine))
    if full:
        parts.append(Panel(graph_code(rec.code_after), title="rewritten graph (ultraattn nodes highlighted)"))
    return Group(*parts)


def print_graph_report(rec: GraphRecord, *, full: bool = False, console: Console | None = None) -> None:
    (console or report_console()).print(render_graph(rec, full=full))


# ----------------------------------------------------------------------------- the graphs a compiler receives
def _counts(rec: AotGraphRecord) -> str:
    return f"{rec.stages} communication stages, {rec.tiles} tile nodes"


def schedule_table(rec: AotGraphRecord) -> Table:
    """The ultraattn nodes of one graph the compiler receives, in order; communication nodes highlighted."""
    t = report_table(title=f"graph {rec.graph} · {rec.kind} graph for Inductor: {_counts(rec)}", title_justify="left")
    for col in ("node", "site", "op", "what", "bytes sent"):
        t.add_column(col, justify="right" if col == "bytes sent" else "left")
    for r in rec.schedule:
        style = "bold magenta" if r.comm else ("cyan" if r.op in TILE_OPS else "")
        t.add_row(r.node, r.site, Text(r.op, style=style), r.what, str(r.bytes) if r.bytes else "")
    return t


def print_schedule(rec: AotGraphRecord, *, full: bool, console: Console | None = None) -> None:
    console = console or report_console()
    if full:
        console.print(schedule_table(rec))
    else:
        print_line(console, f"[bold]ultraattn[/bold] graph {rec.graph} {rec.kind}: sites {list(rec.expanded)} as "
                            f"explicit nodes ({_counts(rec)})")


# ----------------------------------------------------------------------------- plans made at run time
def plans_table(stats: list[SiteStats] | tuple[SiteStats, ...]) -> Table:
    t = report_table(title="plans made at run time (cached on the mask's content)", title_justify="left")
    for col in ("site", "calls", "plans", "cache hits", "planning s"):
        t.add_column(col, justify="right")
    for s in stats:
        t.add_row(s.site, str(s.calls), str(s.plans), str(s.cache_hits), f"{s.planning_seconds:.2f}")
    return t


def duration(seconds: float) -> str:
    """Milliseconds under a second (run-time plans), else seconds."""
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def _planner_words(ev: PlanEvent) -> str:
    if not ev.planner:
        return ""
    how = {"fast": "fast planner", "ilp": "ILP planner", "baseline": f"baseline {ev.method}",
           "kernels": "block lists"}.get(ev.planner, ev.planner)
    return f"{how}{', made ahead' if ev.ahead else ''}, "


def plan_line(ev: PlanEvent) -> str:
    regret = "" if ev.regret is None else f", worst-case regret {ev.regret:.2f}"
    return (f"[bold]ultraattn[/bold] {ev.site} (call {ev.call}): planned in {duration(ev.seconds)} "
            f"({_planner_words(ev)}{ev.structure}{regret}, plan {ev.hash}, {ev.world} ranks)")


def planning_table(history: tuple[PlanEvent, ...] | list[PlanEvent], *, last: int | None = None) -> Table:
    """One row per plan made at run time: the step (the site's call) that needed it, the planner, the time the
    step spent (a plan made ahead costs the step only the lookup) and the plan's hash."""
    rows = list(history)[-last:] if last else list(history)
    t = report_table(title="planning per step" + (f" (last {len(rows)})" if last and len(history) > last else ""),
                     title_justify="left")
    staged = any(ev.stages for ev in rows)
    robust = any(ev.regret is not None for ev in rows)
    cols = ("site", "call", "planner", "ahead", "on the step") + \
        (("fwd bytes / stage", "bwd bytes / stage", "imbalance") if staged else ()) + \
        (("regret",) if robust else ()) + ("structure", "plan")
    for col in cols:
        t.add_column(col, justify="left" if col in ("site", "planner", "ahead", "structure", "plan") else "right")
    for ev in rows:
        facts = ()
        if staged:
            st = ev.stages or {}
            facts = (" ".join(str(b) for b in st.get("fwd", ())), " ".join(str(b) for b in st.get("bwd", ())),
                     f"{st['imbalance']:.2f}" if "imbalance" in st else "")
        if robust:
            facts = (*facts, "" if ev.regret is None else f"{ev.regret:.2f}")
        t.add_row(ev.site, str(ev.call), ev.planner or "?", "yes" if ev.ahead else "", duration(ev.seconds), *facts,
                  ev.structure, ev.hash)
    return t


def print_plan_event(ev: PlanEvent, *, full: bool, console: Console | None = None) -> None:
    console = console or report_console()
    print_line(console, plan_line(ev))
    if full and ev.result is not None:
        print_plan_result(console, ev.result, ev.result.plan.mesh, title=f"{ev.site} · run-time plan")


# ----------------------------------------------------------------------------- saved reports
def save_report(path: str | os.PathLike, report: CompileReport) -> None:
    with open(path, "w") as fh:
        json.dump(report.to_json(), fh, indent=1, default=str)


def load_report(path: str | os.PathLike) -> CompileReport:
    """A report saved with ``options={"report_file": path}``; ``ValueError`` if the file is not one."""
    with open(path) as fh:
        try:
            data = json.load(fh)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} is not JSON ({exc})") from None
    try:
        return CompileReport.from_json(data)
    except (KeyError, TypeError) as exc:
        raise ValueError(f"{path} is not an ultraattn report ({type(exc).__name__}: {exc})") from None


def render_saved(path: str | os.PathLike, console: Console | None = None) -> None:
    """Print a report saved with ``options={"report_file": path}``."""
    report = load_report(path)
    console = console or report_console()
    for g in report.graphs:
        console.print(render_graph(g, stats=report.stats))
        console.print(graph_code(g.code_after))
        for aot in report.aot_graphs:
            if aot.graph == g.index and aot.expanded:
                console.print(schedule_table(aot))
    if report.history:
        console.print(planning_table(report.history))
    for p in report.plans:
        print_line(console, f"[bold]{p.site}[/bold] (latest plan, call {p.call}): planned in {duration(p.seconds)} "
                            f"({_planner_words(p)}plan {p.hash}, {p.world} ranks, structure {p.structure})")
        if p.comparison:
            console.print(comparison_table(p.comparison, title=f"{p.site}: modeled time against the baselines"))
            for line in not_applicable_lines(p.comparison):
                print_line(console, line)
