"""The full report of one planning result (used by ``ultraattn plan``, the backend and ``ultraattn.explain``)."""

from __future__ import annotations

from rich.rule import Rule

from ultraattn.planner.api import method_summaries
from ultraattn.report.gantt import gantt
from ultraattn.report.heatmaps import assignment_heatmap, mask_heatmap
from ultraattn.report.tables import comparison_table, rank_table, solver_panel


def print_plan_result(console, res, mesh, *, backward: bool = True, title: str | None = None) -> None:
    """Mask heat map, tile assignment, per-rank table, node 0's schedule, solver panel, baselines."""
    ours = res.ours
    plan = res.plan
    pat = res.pattern
    console.print(Rule(title or f"ultraattn plan · {pat.name} · S={pat.q_len} · CP {mesh}"))
    console.print(mask_heatmap(pat.kind_BGQK[0, 0].tolist(), title=f"mask {pat.name}"))
    console.print(assignment_heatmap(plan.assign_GPP[0].tolist(), list(plan.owner), nodes=mesh.nodes,
                                            devices=mesh.devices, title="tile assignment (head group 0)"))
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
    info["notes"] = list(res.notes) + [f"plan structure: {plan.meta.get('structure')}",
                                       f"plan hash: {plan.content_hash()[:16]}"]
    if res.compute_bound_ms:
        t = ours.total_ms() if backward else ours.fwd_ms
        info["notes"].append(f"compute bound {res.compute_bound_ms:.3f} ms (the whole attention spread evenly, "
                             f"nothing moved): the plan models {t / res.compute_bound_ms:.3f}x it")
    console.print(solver_panel(info))
    console.print(comparison_table(method_summaries(res), title="modeled time against the baselines"))
