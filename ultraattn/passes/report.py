"""Rich reports of what the backend did to a graph: sites, reasons, the rewritten graph, plans made so far.

The live report (at compile time) and a saved one (``options={"report_file": ...}``, rendered by
``ultraattn report FILE``) draw the same tables from the same json-able record.
"""

from __future__ import annotations

import json

from rich.console import Console, Group
from rich.panel import Panel
from rich.syntax import Syntax
from rich.table import Table
from rich.text import Text


def record_json(rec) -> dict:
    """A GraphRecord as plain data (what the reports draw and report files hold)."""
    from ultraattn.passes.explicit import explicit_reason

    forms = {sp.name: explicit_reason(sp) for sp in rec.specs}
    return {
        "graph": rec.index, "world_size": rec.world_size,
        "sites": [{"site": s.name, "op": s.op, "q_shape": list(s.q_shape), "kv_shape": list(s.kv_shape),
                   "dtype": str(s.dtype).replace("torch.", ""), "mask": s.mask, "density": s.density,
                   "rewritten": s.rewritable, "why": s.reason,
                   "form": ("explicit" if forms[s.name] is None else f"one op: {forms[s.name]}")
                   if s.name in forms else ""} for s in rec.sites],
        "code": rec.code_after,
        "stats": {sp.name: dict(sp.stats) for sp in rec.specs},
        "aot_graphs": [{k: g[k] for k in ("kind", "expanded", "schedule")} for g in rec.extra.get("aot_graphs", [])
                       if g["expanded"]],
        "shard": rec.extra["shard"].to_dict() if "shard" in rec.extra else None,
    }


def shard_summary(graph: dict) -> Text | None:
    """One paragraph: what the sequence-sharding pass did to the graph (None: it did not run)."""
    sh = graph.get("shard")
    if sh is None:
        return None
    n_fb = len(sh["fallbacks"])
    t = Text()
    t.append(f"graph {graph['graph']}: sequence sharding", style="bold")
    t.append(f" · layout {sh['layout']} · {sh['seq_len']} tokens, {sh['local_len']} per rank\n")
    t.append(f"  ops on local tokens {sh['sharded_ops']} · inputs sliced {len(sh['dispatched'])}")
    names = sorted({_short(n) for n in sh["dispatched"]})
    if names:
        t.append(f" ({', '.join(names[:6])}{', ...' if len(names) > 6 else ''})")
    t.append(f" · weights entering (gradients all-reduced) {sh['entered']} · reductions over the sequence "
             f"{sh['reductions']} · replicated ops {sh['replicated_ops']} · ")
    t.append(f"gathered fallbacks {n_fb}", style="bold red" if n_fb else "bold green")
    if sh.get("inlined_checkpoints"):
        t.append(f"\n  {sh['inlined_checkpoints']} activation-checkpoint regions inlined (still recomputed in the "
                 "backward)")
    for site, why in sh.get("skipped_sites", {}).items():
        t.append(f"\n  {site} stays a global-view op: {why}", style="yellow")
    return t


def fallbacks_table(graph: dict) -> Table | None:
    """Sharded tensors an op outside the region needed whole: each is an all-gather (its bytes, per rank)."""
    sh = graph.get("shard")
    if not sh or not sh["fallbacks"]:
        return None
    t = Table(title=f"graph {graph['graph']}: ops run on gathered data", title_justify="left")
    for col in ("gathered", "for op", "why", "bytes"):
        t.add_column(col, justify="right" if col == "bytes" else "left")
    for f in sh["fallbacks"]:
        t.add_row(f["node"], f["op"], f["why"], f"{f['bytes']:,}")
    return t


def _short(name: str) -> str:
    for pre in ("l_self_modules_", "l_", "L_"):
        name = name.removeprefix(pre)
    return name.rstrip("_")


def sites_table(graph: dict) -> Table:
    t = Table(title=f"graph {graph['graph']}: attention sites (world size {graph['world_size']})",
              title_justify="left")
    for col in ("site", "op", "q shape", "k/v shape", "dtype", "mask", "density", "rewritten", "why", "form"):
        t.add_column(col)
    for s in graph["sites"]:
        d = s["density"]
        t.add_row(s["site"], s["op"], str(tuple(s["q_shape"])), str(tuple(s["kv_shape"])), s["dtype"], s["mask"],
                  "?" if d is None else f"{d:.3f}",
                  Text("yes", style="bold green") if s["rewritten"] else Text("no", style="bold red"), s["why"],
                  s.get("form", ""))
    return t


def schedule_table(graph_index: int, entry: dict) -> Table:
    """The ultraattn nodes of one graph Inductor compiles, in order; communication nodes highlighted."""
    t = Table(title=f"graph {graph_index} · {entry['kind']} graph for Inductor: {_counts(entry)}",
              title_justify="left")
    for col in ("node", "site", "op", "what", "bytes sent"):
        t.add_column(col, justify="right" if col == "bytes sent" else "left")
    for r in entry["schedule"]:
        style = "bold magenta" if r["comm"] else ("cyan" if _is_tile(r["op"]) else "")
        t.add_row(r["node"], r["site"], Text(r["op"], style=style), r["what"], str(r["bytes"]) if r["bytes"] else "")
    return t


def print_schedule(graph_index: int, entry: dict, *, full: bool, console: Console | None = None) -> None:
    console = console or report_console()
    if full:
        console.print(schedule_table(graph_index, entry))
    else:
        console.print(f"[bold]ultraattn[/bold] graph {graph_index} {entry['kind']}: sites {entry['expanded']} as "
                      f"explicit nodes ({_counts(entry)})")


def _counts(entry: dict) -> str:
    sched = entry["schedule"]
    return (f"{sum(r['op'] == 'cp_start' for r in sched)} communication stages, "
            f"{sum(_is_tile(r['op']) for r in sched)} tile nodes")


def _is_tile(op: str) -> bool:
    return op in ("cp_tile_fwd", "cp_tile_bwd", "bsa_fwd", "bsa_bwd")


def plans_table(specs) -> Table:
    t = Table(title="plans made at run time (cached on the mask's content)", title_justify="left")
    for col in ("site", "calls", "plans", "cache hits", "planning s"):
        t.add_column(col, justify="right")
    for sp in specs:
        st = sp.stats
        t.add_row(sp.name, str(st["calls"]), str(st["plans"]), str(st["cache_hits"]), f"{st['planning_seconds']:.2f}")
    return t


def graph_code(code: str) -> Syntax:
    code = code.strip()
    lines = {i + 1 for i, ln in enumerate(code.splitlines()) if "ultraattn" in ln}
    return Syntax(code, "python", line_numbers=True, highlight_lines=lines, word_wrap=True)


def render_graph_report(rec, *, full: bool = False):
    data = record_json(rec)
    parts = [sites_table(data)]
    parts += [x for x in (shard_summary(data), fallbacks_table(data)) if x is not None]
    if any(sp.stats["calls"] for sp in rec.specs):  # at compile time nothing has run yet
        parts.append(plans_table(rec.specs))
    if full:
        parts.append(Panel(graph_code(rec.code_after), title="rewritten graph (ultraattn nodes highlighted)"))
    return Group(*parts)


def report_console() -> Console:
    """A console for reports: the terminal's width, or 120 columns when output is a file or pipe."""
    c = Console()
    return c if c.is_terminal else Console(width=120)


def print_graph_report(rec, *, full: bool = False, console: Console | None = None) -> None:
    (console or report_console()).print(render_graph_report(rec, full=full))


# ----------------------------------------------------------------------------- report files
def save_report(path: str) -> None:
    """Write every graph compiled with ``report_file=path`` and the plans made so far (rank 0 calls this)."""
    from ultraattn.passes.backend import RECORDS
    from ultraattn.passes.site_op import PLANS

    graphs = [record_json(r) for r in RECORDS if r.options.report_file == path]
    with open(path, "w") as fh:
        json.dump({"graphs": graphs, "plans": PLANS}, fh, indent=1, default=str)


def render_saved(path: str, console: Console | None = None) -> None:
    """Print a report saved with ``options={"report_file": path}``."""
    from ultraattn.report import render

    console = console or Console()
    with open(path) as fh:
        data = json.load(fh)
    for g in data["graphs"]:
        console.print(sites_table(g))
        for part in (shard_summary(g), fallbacks_table(g)):
            if part is not None:
                console.print(part)
        console.print(graph_code(g["code"]))
        for entry in g.get("aot_graphs", []):
            console.print(schedule_table(g["graph"], entry))
    for site, p in data.get("plans", {}).items():
        console.print(f"[bold]{site}[/bold]: planned in {p['seconds']:.2f} s, plan {p['hash']}, "
                      f"{p['world']} ranks, structure {p.get('structure')}")
        if p.get("comparison"):
            console.print(render.comparison_table(p["comparison"], title=f"{site}: modeled time against the baselines"))
