"""Tables of a plan: per-rank compute and traffic, our plan against the baselines, the solver's statistics.

* ``rank_table``: per-rank compute share and NVLink / inter-node traffic.
* ``comparison_table``: our plan against the baselines, with speedups.
* ``solver_panel``: ILP solve statistics per hierarchy level.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from ultraattn.report.style import fmt_num, format_bytes, format_ms, plain, report_table

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
        return [float(plain(r[key])) for r in rows]

    def max_mean(values: list[float], fmt) -> str:
        return f"{fmt(max(values))}\n{fmt(sum(values) / n)}"

    share, ms, kernels = col("compute_share"), col("compute_ms"), col("kernels")
    mean_share = sum(share) / n
    imbalance = max(share) / mean_share if mean_share > 0 else float("nan")

    one_node = all(int(r["node"]) == 0 for r in rows)
    table = report_table(
        title=title,
        show_footer=True,
        caption=f"compute imbalance (max / mean share) {imbalance:.3f}×\nintra = NVLink, "
        f"inter = inter-node; {HIGHLIGHT.split()[-1]} = busiest rank per column",
        caption_justify="left",
    )
    table.add_column("rank", justify="right", footer="max\nmean")
    if not one_node:
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
            *(() if one_node else (str(int(r["node"])),)),
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
            show as ``—``; ``not_applicable_lines`` says why.
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
    best_baseline = _best_baseline(methods, best_of)
    caption = f"speedup = method time / {best_of} time\n★ = best baseline" + (
        "; — = does not apply (why: below)" if any(m.get("fwd_ms") is None for m in methods.values()) else "")
    table = report_table(title=title, caption=caption, caption_justify="left")
    table.add_column("method", no_wrap=True)
    for col in ("fwd", "fwd+bwd", "max rank\nbytes", "max rank\ninter node", "compute\nimbalance", "speedup\nfwd",
                "speedup\nfwd+bwd"):
        table.add_column(col, justify="right")
    for name in [best_of] + [n for n in methods if n != best_of]:
        cells = _comparison_row(name, methods[name], ours, best_of=best_of, best_baseline=best_baseline)
        table.add_row(*cells, end_section=name == best_of)
    return table


def not_applicable_lines(methods: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """One sentence per method of ``comparison_table`` that does not apply, saying why (printed under the table, one
    line each: ``style.print_line``)."""
    return [f"{name} does not apply: {m.get('note') or 'not applicable'}" for name, m in methods.items()
            if m.get("fwd_ms") is None]


def _best_baseline(methods: Mapping[str, Mapping[str, Any]], best_of: str) -> str | None:
    """The fastest other applicable method: by forward + backward time when all have one, else by forward."""
    applicable = [n for n, m in methods.items() if n != best_of and m.get("fwd_ms") is not None]
    if not applicable:
        return None
    by_total = all(_total(methods[n]) is not None for n in applicable)
    key = (lambda n: _total(methods[n])) if by_total else (lambda n: float(methods[n]["fwd_ms"]))
    return min(applicable, key=key)


def _comparison_row(name: str, m: Mapping[str, Any], ours: Mapping[str, Any], *, best_of: str,
                    best_baseline: str | None) -> list[Text | str]:
    """One method's cells: label, times, traffic, imbalance, the two speedups."""
    if name == best_of:
        label = Text(name, style="bold cyan")
        speed = [Text("(ref)", style="dim"), Text("(ref)", style="dim")]
    elif m.get("fwd_ms") is None:
        label = Text(name, style="dim")
        speed = [Text("—", style="dim"), Text("—", style="dim")]
    else:
        label = Text(name + (" ★" if name == best_baseline else ""), style="bold" if name == best_baseline else "")
        speed = [_speedup_text(float(m["fwd_ms"]), float(ours["fwd_ms"])), _speedup_text(_total(m), _total(ours))]
    imb = m.get("compute_imbalance")
    return [label, format_ms(m.get("fwd_ms")), format_ms(_total(m)), format_bytes(m.get("max_rank_bytes")),
            format_bytes(m.get("max_rank_inter_node_bytes")), "—" if imb is None else f"{float(imb):.2f}", *speed]


# ---------------------------------------------------------------------------------------
# 6. Solver panel
# ---------------------------------------------------------------------------------------


STATUS_MEANING = {
    "Stopped": "Stopped: a time or node limit ended the search; its best solution is used (gap: how far it may be "
               "from the optimum; 0.00% means optimal but not proven so).",
    "Infeasible": "Infeasible: no solution meets that stage's constraints; the fallback column says what was used.",
    "NoSolution": "NoSolution: no solution found within the limits; the fallback column says what was used.",
    "Error": "Error: the solver failed; the fallback column says what was used.",
    "Skipped": "Skipped: not run (switched off, or not needed for this plan).",
}
"""What a solver status other than Optimal means, shown under the solver table when it occurs."""


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
            fmt_num(s.get("objective"), ".4g"),
            "—" if s.get("gap") is None else f"{100 * float(s['gap']):.2f}%",
            "—" if s.get("seconds") is None else f"{float(s['seconds']):.2f} s",
            "—" if s.get("variables") is None else str(int(s["variables"])),
            "—" if s.get("constraints") is None else str(int(s["constraints"])),
            Text("—", style="dim") if fallback is None else Text(str(fallback), style="red"),
        )
    parts: list[RenderableType] = [table]
    legend = [STATUS_MEANING[st] for st in STATUS_MEANING if any(str(s.get("status")) == st for s in stages)]
    parts.extend(Text(line, style="dim") for line in legend)
    notes = [str(n) for n in info.get("notes") or []]
    if notes:
        parts.append(Text(""))
        parts.extend(Text(f"• {n}") for n in notes)
    total = info.get("seconds")
    title = "solver" + ("" if total is None else f" ({float(total):.2f} s)")
    return Panel(Group(*parts), title=title, expand=False)
