"""Report renderings: text content of the rich output and the PNG file.

Everything renders to a recording console (no terminal), so these run anywhere in well
under a second, except the PNG tests, which need matplotlib and skip without it.
"""

from __future__ import annotations

import io
import re
import sys

import pytest
import torch
from rich.console import Console

from ultraattn.report import (
    assignment_heatmap,
    comparison_table,
    format_bytes,
    format_ms,
    gantt,
    mask_heatmap,
    not_applicable_lines,
    rank_table,
    solver_panel,
)
from ultraattn.report import png as report_png

EMPTY, PARTIAL, FULL = 0, 1, 2


def render(renderable, *, styles: bool = False) -> str:
    console = Console(record=True, width=120, file=io.StringIO(), force_terminal=styles, color_system="standard")
    console.print(renderable)
    return console.export_text(styles=styles)


def grid_lines(text: str) -> list[str]:
    """The heatmap rows: panel lines holding at least one FULL/PARTIAL glyph, legend excluded."""
    return [ln for ln in text.splitlines() if ("█" in ln or "▒" in ln) and "FULL" not in ln]


# --- formatting helpers -----------------------------------------------------------------


@pytest.mark.parametrize(
    "n, want",
    [(0, "0 B"), (1023, "1023 B"), (1536, "1.5 KiB"), (3 * 2**20, "3.0 MiB"), (2**30 - 1, "1.0 GiB"),
     (5 * 2**40, "5.0 TiB")],
)
def test_format_bytes(n, want):
    assert format_bytes(n) == want


def test_format_bytes_rejects_negative():
    with pytest.raises(ValueError, match="`n` must be a non-negative"):
        format_bytes(-1)


def test_format_ms():
    assert format_ms(0.1234) == "0.123 ms"
    assert format_ms(12.346) == "12.35 ms"
    assert format_ms(1234.56) == "1234.6 ms"
    assert format_ms(None) == "—"
    assert format_ms(0.00042) == "0.42 us" and format_ms(0.0) == "0.000 ms"  # tiny plans: never "0.000 ms" for >0


# --- mask heatmap -----------------------------------------------------------------------


def test_mask_heatmap_legend_and_stats():
    # 4x4 causal: 6 FULL below the diagonal, 4 PARTIAL on it, 6 EMPTY above.
    grid = [[FULL if j < i else PARTIAL if j == i else EMPTY for j in range(4)] for i in range(4)]
    text = render(mask_heatmap(grid, title="causal"))
    assert "causal" in text
    assert "FULL 37.5%" in text and "PARTIAL 25.0%" in text and "EMPTY 37.5%" in text
    assert "density 62.5%" in text
    rows = grid_lines(text)
    assert len(rows) == 4  # no downsampling at this size; the empty top-right is blank
    assert rows[0].count("▒▒") == 1 and "██" not in rows[0]
    assert rows[3].count("██") == 3 and rows[3].count("▒▒") == 1


def test_mask_heatmap_downsamples_to_max_cells():
    text = render(mask_heatmap(torch.full((100, 100), FULL), title="dense"))
    rows = grid_lines(text)
    assert 0 < len(rows) <= 48
    assert all(row.count("█") // 2 <= 48 for row in rows)  # two characters per cell
    assert "100×100 blocks" in text and "FULL 100.0%" in text


def test_mask_heatmap_single_partial_makes_its_cell_partial():
    grid = [[FULL] * 96 for _ in range(96)]
    grid[0][1] = PARTIAL  # inside the top-left 2x2 bin
    text = render(mask_heatmap(grid, title="t"))
    rows = grid_lines(text)
    assert len(rows) == 48
    assert sum(row.count("▒▒") for row in rows) == 1
    assert rows[0].split("│")[1].strip().startswith("▒▒")
    # a bin mixing FULL and EMPTY is PARTIAL too; an all-EMPTY bin stays blank
    grid = [[FULL] * 96 for _ in range(96)]
    grid[95][95] = EMPTY
    rows = grid_lines(render(mask_heatmap(grid, title="t")))
    assert rows[-1].split("│")[1].rstrip().endswith("▒▒")


def test_mask_heatmap_rejects_bad_input():
    with pytest.raises(ValueError, match="`kind_grid` must hold block kinds"):
        mask_heatmap([[0, 3]], title="t")
    with pytest.raises(ValueError, match="`kind_grid` must be rectangular"):
        mask_heatmap([[0, 1], [2]], title="t")


# --- assignment heatmap -----------------------------------------------------------------


def test_assignment_heatmap_chars_and_stats():
    # 2 nodes x 2 devices, 4 chunks; causal; one tile moved to rank 3 (node 1, device 1).
    owner = [0, 1, 2, 3]
    grid = [[owner[i] if j <= i else -1 for j in range(4)] for i in range(4)]
    grid[1][0] = 3
    text = render(assignment_heatmap(grid, owner, nodes=2, devices=2, title="assign"))
    lines = text.splitlines()
    header = next(ln for ln in lines if re.search(r"0 1 0 1", ln))
    assert "0 1 0 1" in header  # owners' device indices along the top
    body = [ln for ln in lines if re.match(r"│ \d │", ln)]
    assert [ln[2] for ln in body] == ["0", "1", "0", "1"]  # left owner strip
    assert body[1].split("│")[2].split() == ["1", "1"]  # tile (1,0) -> rank 3 = device 1
    assert "node 0" in text and "node 1" in text
    # 10 tiles; 9 on the query owner's rank; 9 on its node (rank 3 is on node 1, owner 1 on node 0)
    assert "10 tiles: 90.0% on the query owner's rank, 90.0% on its node" in text


def test_assignment_heatmap_downsamples_by_majority():
    p = 100
    owner = [i * 8 // p for i in range(p)]
    grid = torch.tensor([[owner[i] for _ in range(p)] for i in range(p)])
    text = render(assignment_heatmap(grid, owner, nodes=2, devices=4, title="big", max_cells=48))
    body = [ln for ln in text.splitlines() if re.match(r"│ \w │", ln)]
    assert len(body) == 34  # ceil(100 / 3) bins of 3 chunks
    assert all(len(ln.split("│")[2].split()) == 34 for ln in body)


def test_assignment_heatmap_validates():
    with pytest.raises(ValueError, match="`owner` must have one entry per chunk"):
        assignment_heatmap([[0, 0], [0, 0]], [0], nodes=1, devices=1, title="t")
    with pytest.raises(ValueError, match=r"`assign_grid` must hold ranks in \[0, 2\)"):
        assignment_heatmap([[0, 5], [0, 0]], [0, 1], nodes=1, devices=2, title="t")


# --- rank table -------------------------------------------------------------------------


def _rank_rows():
    return [
        dict(
            rank=r,
            node=r // 2,
            compute_share=0.25,
            compute_ms=2.0 + r,
            intra_in_bytes=1024 * (r + 1),
            intra_out_bytes=0,
            inter_in_bytes=3 * 2**20 if r == 2 else 2**20,
            inter_out_bytes=2**20,
            kernels=4,
        )
        for r in range(4)
    ]


def test_rank_table_highlights_the_max_bytes():
    text = render(rank_table(_rank_rows(), title="ranks"), styles=True)
    # bold (1) red (31) on the busiest inter-in cell; the uniform column gets no highlight.
    assert re.search(r"\x1b\[1;31m\s*3\.0 MiB", text)
    assert re.search(r"\x1b\[1;31m\s*4\.0 KiB", text)
    assert not re.search(r"\x1b\[1;31m\s*1\.0 MiB", text)
    plain = render(rank_table(_rank_rows(), title="ranks"))
    assert "max" in plain and "mean" in plain
    assert "1.5 MiB" in plain  # inter-in mean (3 + 1 + 1 + 1) / 4 MiB in the footer
    assert "5.00 ms" in plain  # compute max


def test_rank_table_requires_keys():
    rows = _rank_rows()
    del rows[1]["kernels"]
    with pytest.raises(ValueError, match=r"`rows\[1\]` must have keys .* missing \['kernels'\]"):
        rank_table(rows, title="t")


# --- gantt ------------------------------------------------------------------------------


def _tasks():
    return [
        dict(rank=1, stream="recv_inter", start=0.0, end=0.002, kind="kv"),
        dict(rank=0, stream="compute", start=0.0, end=0.004, kind="attn"),
        dict(rank=0, stream="compute", start=0.004, end=0.005, kind="merge"),
        dict(rank=0, stream="send_intra", start=0.001, end=0.002, kind="q"),
        dict(rank=1, stream="compute", start=0.002, end=0.005, kind="attn"),
        dict(rank=1, stream="compute", start=0.003, end=0.0035, kind="dq"),  # overlaps: drawn on top
    ]


def test_gantt_rows_legend_and_axis():
    text = render(gantt(_tasks(), title="sched", width=50))
    rows = re.findall(r"^│ (r\d+ \S+)\s*│", text, flags=re.M)
    assert rows == ["r0 compute", "r0 send_intra", "r1 compute", "r1 recv_inter"]
    legend = next(ln for ln in text.splitlines() if "attn" in ln)
    for kind in ("attn", "merge", "q", "kv", "dq"):
        assert re.search(rf"\b{kind}\b", legend)
    axis = next(ln for ln in text.splitlines() if ln.rstrip(" │").endswith("ms"))
    assert axis.split() == ["│", "0", "1", "2", "3", "4", "5", "ms", "│"]  # nice 1 ms ticks up to 5 ms
    r1 = next(ln for ln in text.splitlines() if ln.startswith("│ r1 compute"))
    cells = r1.split("│")[2]
    assert len(cells) == 50
    assert cells[:20].strip() == ""  # idle until 2 ms (20 of 50 chars)
    assert "Q" in cells[30:35]  # dq over attn at 3.0-3.5 ms: later task wins
    assert "100.0%" in next(ln for ln in text.splitlines() if ln.startswith("│ r0 compute"))


def test_gantt_shrinks_to_console_and_validates():
    text = render(gantt(_tasks(), title="sched", width=500))
    assert max(len(ln) for ln in text.splitlines()) <= 120
    with pytest.raises(ValueError, match="`tasks\\[0\\]` must end at or after its start"):
        gantt([dict(rank=0, stream="compute", start=2.0, end=1.0, kind="attn")], title="t")
    with pytest.raises(ValueError, match="`width` must be an int >= 10"):
        gantt(_tasks(), title="t", width=3)


# --- comparison table -------------------------------------------------------------------


def _methods():
    return {
        "ultraattn": dict(fwd_ms=2.0, bwd_ms=6.0, max_rank_bytes=2**30, max_rank_inter_node_bytes=2**28,
                          compute_imbalance=1.01),
        "ring": dict(fwd_ms=10.0, bwd_ms=30.0, max_rank_bytes=2**31, max_rank_inter_node_bytes=2**30,
                     compute_imbalance=1.9),
        "zigzag": dict(fwd_ms=5.0, bwd_ms=11.0, max_rank_bytes=2**31, max_rank_inter_node_bytes=2**30,
                       compute_imbalance=1.0),
        "ulysses": dict(
            fwd_ms=None,
            bwd_ms=None,
            max_rank_bytes=None,
            max_rank_inter_node_bytes=None,
            compute_imbalance=None,
            note="8 ranks do not divide 6 heads",
        ),
    }


def test_comparison_table_speedups_best_and_note():
    text = render(comparison_table(_methods(), title="vs baselines"))
    ring = next(ln for ln in text.splitlines() if "ring" in ln).split()
    assert ring[-2:] == ["5.00x", "5.00x"]  # 10 / 2 fwd, (10 + 30) / (2 + 6)
    zigzag = next(ln for ln in text.splitlines() if "zigzag" in ln)
    assert "★" in zigzag and "★" not in ring  # fastest baseline by fwd+bwd
    assert zigzag.split()[-2:] == ["2.50x", "2.00x"]
    ulysses = next(ln for ln in text.splitlines() if "ulysses" in ln)
    assert "x" not in ulysses and set(ulysses.split()[1:]) == {"—"}
    assert "does not apply" in text  # the caption points to the reasons, printed one line each:
    assert not_applicable_lines(_methods()) == ["ulysses does not apply: 8 ranks do not divide 6 heads"]


def test_every_plan_report_fits_80_columns_and_keeps_its_sentences_whole(capsys, monkeypatch):
    """Piped at 80 or 120 columns: no header or title cut short ("compu…"), no table wider than the page, and every
    note of the planner on one line (a pipe gets whole sentences; a terminal wraps them itself)."""
    from ultraattn.cli import main

    for width in (80, 120):
        monkeypatch.setenv("COLUMNS", str(width))
        for args in (["--mask", "causal", "--seqlen", "2k", "--cp", "4", "--heads", "1", "--head-dim", "32"],
                     ["--mask", "document:lengths=3000+9000+4384", "--seqlen", "16k", "--cp", "2x2", "--backward",
                      "--ilp-time-limit", "1", "--time-budget", "4"]):
            assert main(["plan", *args]) == 0
            out = capsys.readouterr().out
            assert "…" not in out, out
            lines = out.splitlines()
            sentences = [ln for ln in lines if ln.startswith(("• ", "planned in ", "ulysses does not apply"))]
            assert any(ln.startswith("planned in ") for ln in sentences) and len(sentences) >= 3, out
            assert all(len(ln) <= width for ln in lines if ln not in sentences and not ln.startswith("ultraattn plan"))
            for ln in sentences:  # one sentence: it ends with its own last word, the next line starts a new one
                nxt = lines[lines.index(ln) + 1] if lines.index(ln) + 1 < len(lines) else ""
                assert nxt in sentences or not nxt[:1].islower(), (ln, nxt)


def test_comparison_table_validates_best_of():
    with pytest.raises(ValueError, match="`best_of` must name one of the methods"):
        comparison_table(_methods(), best_of="ours", title="t")


# --- solver panel -----------------------------------------------------------------------


def test_solver_panel():
    info = {
        "seconds": 1.2,
        "levels": [
            dict(level="node", status="Optimal", objective=1.0e9, gap=0.0, seconds=0.4, variables=120,
                 constraints=300, fallback=None),
            dict(level="device", status="Not Solved", objective=None, gap=0.05, seconds=0.7, variables=900,
                 constraints=2000, fallback="time limit: greedy"),
        ],
        "schedule": dict(status="Optimal", objective=3.2e-3, gap=0.001, seconds=0.1, variables=50, constraints=90,
                         fallback=None),
        "notes": ["12 kernels"],
    }
    text = render(solver_panel(info))
    assert "solver (1.20 s)" in text
    assert re.search(r"node\s+Optimal\s+1e\+09\s+0\.00%\s+0\.40 s\s+120\s+300", text)
    assert "time limit: greedy" in text and "5.00%" in text
    assert re.search(r"schedule\s+Optimal", text)
    assert "• 12 kernels" in text


# --- PNG --------------------------------------------------------------------------------


def _plan_inputs():
    owner = [i % 4 for i in range(8)]
    grid = [[owner[i] if j <= i else -1 for j in range(8)] for i in range(8)]
    return dict(assign_grid=grid, owner=owner, nodes=2, devices=2, tasks=_tasks(), title="plan")


def test_draw_plan_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "plan.png"
    assert report_png.draw_plan_png(path, **_plan_inputs()) == path
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert 10_000 < len(data) < 2_000_000
    with pytest.raises(ValueError, match="`node_to_draw` must be a node index"):
        report_png.draw_plan_png(tmp_path / "x.png", **_plan_inputs(), node_to_draw=2)


def test_draw_plan_png_without_matplotlib(tmp_path, monkeypatch):
    # None in sys.modules makes ``import matplotlib`` raise ImportError.
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(RuntimeError, match=r"--png needs matplotlib: pip install 'ultraattn\[plot\]'"):
        report_png.draw_plan_png(tmp_path / "plan.png", **_plan_inputs())
    assert not (tmp_path / "plan.png").exists()
