"""The full report of one planning result (used by ``ultraattn plan``, the backend and ``ultraattn.explain``)."""

from __future__ import annotations

from rich.rule import Rule
from rich.table import Table  # noqa: TC002 - the return annotation

from ultraattn.planner.api import method_summaries
from ultraattn.report.gantt import gantt
from ultraattn.report.heatmaps import assignment_heatmap, mask_heatmap
from ultraattn.report.style import compare_words, format_ms, print_line, report_table
from ultraattn.report.tables import comparison_table, not_applicable_lines, rank_table, solver_panel


def print_plan_result(console, res, mesh, *, backward: bool = True, title: str | None = None) -> None:
    """Mask heat map, tile assignment, per-rank table, node 0's schedule, solver panel and the planner's notes (one
    line each), baselines."""
    ours = res.ours
    plan = res.plan
    pat = res.pattern
    title = title or f"ultraattn plan · {pat.name} · S={pat.q_len} · CP {mesh}"
    if len(title) + 6 <= console.width:
        console.print(Rule(title))
    else:  # a rule would cut it
        console.print(Rule())
        print_line(console, title)
    console.print(mask_heatmap(pat.kind_BGQK[0, 0].tolist(), title=f"mask {pat.name}"))
    real = min(plan.num_chunks, -(-pat.q_len // plan.chunk_size))  # chunks past these hold only padding
    grid = [row[:real] for row in plan.assign_GPP[0].tolist()[:real]]
    console.print(assignment_heatmap(grid, list(plan.owner)[:real], nodes=mesh.nodes, devices=mesh.devices,
                                     title="tile assignment (head group 0)"))
    if real < plan.num_chunks:
        print_line(console, f"(chunks {real}-{plan.num_chunks - 1} of the {plan.num_chunks} hold only padding: "
                            f"{pat.q_len} tokens fill {real} chunks of {plan.chunk_size}; not shown)")
    rows = ours.rank_rows
    if len(rows) > 16:
        keep = {r["rank"] for r in rows if r["node"] == 0}
        keep.add(max(rows, key=lambda r: r["inter_in_bytes"] + r["inter_out_bytes"])["rank"])
        rows = [r for r in rows if r["rank"] in keep]
    console.print(rank_table(rows, title=f"per rank ({'fwd+bwd' if backward else 'fwd'} bytes)"))
    node0 = set(range(mesh.devices))
    console.print(gantt(ours.fwd.gantt_tasks(node0), title="forward schedule, node 0"))
    info = dict(res.solver)
    info["levels"] = [{**lv, "level": lv["name"], "fallback": lv["note"] if not lv["used"] else None}
                      for lv in info["levels"]]
    info["schedule"] = {**info["schedule"], "level": "schedule"}
    notes = list(res.notes) + [f"plan structure: {plan.meta.get('structure')}",
                               f"plan hash: {plan.content_hash()[:16]}"]
    if res.compute_bound_ms:
        t = ours.total_ms() if backward else ours.fwd_ms
        notes.append(bound_note(t, res.compute_bound_ms))
    console.print(solver_panel(info))
    for n in notes:
        print_line(console, f"• {n}")
    methods = method_summaries(res)
    console.print(comparison_table(methods, title="modeled time against the baselines"))
    for line in not_applicable_lines(methods):
        print_line(console, line)


FIXED_COSTS_DOMINATE = 4.0
"""A plan modelled at more than this multiple of its compute bound spends most of its time on fixed costs."""


def bound_note(ms: float, bound_ms: float) -> str:
    """The plan's modeled time against its compute bound, in words that say what a large ratio means."""
    text = (f"compute bound {format_ms(bound_ms)} (the whole attention spread evenly over the ranks, nothing moved): "
            f"the plan models {ms / bound_ms:.2f}x it")
    if ms / bound_ms > FIXED_COSTS_DOMINATE:
        text += ("; at this size the time is mostly fixed costs (kernel launches, message latency) that the bound "
                 "leaves out, so the ratio says little about the plan")
    return text


def plan_row(res, mask: str, seq: int) -> dict:
    """One planning result as a row of ``plans_table`` (plain data): a ``PlanResult`` (world > 1) or a single rank's
    kernel block lists (anything else: shown by its ``repr``)."""
    row = {"mask": mask, "seq": seq}
    if not hasattr(res, "evaluations"):
        return {**row, "plan": f"block-sparse kernels, {res!r}"}
    best = res.best_baseline()
    return {**row, "plan": str(res.plan.meta.get("structure") or "tiled"), "ms": res.ours.total_ms(),
            "best": None if best is None else best[0], "best_ms": None if best is None else best[1].total_ms(),
            "bound_ms": res.compute_bound_ms}


def plans_table(rows: list[dict], *, title: str) -> Table:
    """One line per distinct plan: the sites that share it, the mask, the plan's modeled forward+backward time, the
    best baseline's, how the two compare (``compare_words``) and the plan against its compute bound. ``rows``:
    ``plan_row`` dicts with ``sites``."""
    fixed = False
    t = report_table(title=title, title_justify="left")
    for col in ("sites", "mask", "S", "plan", "fwd+bwd", "best baseline", "ultraattn", "x bound"):
        t.add_column(col, justify="right" if col in ("S", "fwd+bwd", "x bound") else "left", overflow="fold")
    for r in rows:
        ms, best_ms, bound = r.get("ms"), r.get("best_ms"), r.get("bound_ms")
        words = compare_words(ms, best_ms).removesuffix(" than").removesuffix(" as") \
            if ms is not None and best_ms is not None else "—"
        ratio = "—"
        if ms is not None and bound:
            ratio = f"{ms / bound:.2f}x" + ("*" if ms / bound > FIXED_COSTS_DOMINATE else "")
            fixed = fixed or ms / bound > FIXED_COSTS_DOMINATE
        t.add_row("\n".join(r["sites"]), r["mask"], str(r["seq"]), r["plan"], "—" if ms is None else format_ms(ms),
                  "—" if best_ms is None else f"{r['best']} {format_ms(best_ms)}", words, ratio)
    t.caption = "ultraattn: against the best baseline; x bound: over the compute bound" + (
        "\n*: mostly fixed costs at this size (launches, latency)" if fixed else "")
    t.caption_justify = "left"
    return t
