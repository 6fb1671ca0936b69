"""Part 5: ``ultraattn calibrate --device cuda`` at one rank, the fitted profile kept in the JSON.

The calibration times the runtime's own tile calls (the Triton kernels on a GPU) over KV tokens per query row,
heads and head dims, FULL and PARTIAL blocks, and the LSE merges, and fits the planner's cost model to them
(kernel rates, launch cost); with one rank there are no messages to time. The JSON holds the whole profile (what
``--cost FILE`` reads: save its ``profile`` field as a file) and each fitted field beside the default's, which
comes from H100 datasheet figures. The dry run uses the calibration's quick grid on the CPU.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from ultraattn import cli
from ultraattn.planner.cost import DEFAULT_COST

from .common import Ctx

NAME = "calibration"
TITLE = "calibration"
CORRECTNESS = False


def run(ctx: Ctx) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "profile.json"
        argv = ["calibrate", "--device", ctx.device.type, "--out", str(path),
                "--timeout", f"{max(30.0, ctx.time_left()):.0f}"] + (["--quick"] if ctx.dry_run else [])
        rc = cli.main(argv)   # its progress goes to the part's log as it comes (kept there if the deadline stops it)
        if rc != 0 or not path.exists():
            ctx.fail(f"`ultraattn {' '.join(argv)}` exited with {rc} and no profile")
            return
        profile = json.loads(path.read_text())
    cost = profile["cost"]
    versus = {k: {"fitted": v, "default": getattr(DEFAULT_COST, k), "ratio": v / getattr(DEFAULT_COST, k)}
              for k, v in cost.items() if isinstance(v, (int, float)) and getattr(DEFAULT_COST, k, 0)}
    fits = {term: st.get("median_rel_err") for term, st in profile.get("fit", {}).items()
            if isinstance(st, dict) and "median_rel_err" in st}
    head = ", ".join(f"{k} {d['fitted']:.3g} ({d['ratio']:.2f}x default)" for k, d in list(versus.items())[:3])
    hidden = ("--out", "--timeout")  # (a temporary path and a deadline: not part of the command to repeat)
    shown = [a for i, a in enumerate(argv) if a not in hidden and (i == 0 or argv[i - 1] not in hidden)]
    ctx.save(command="ultraattn " + " ".join(shown),
             profile=profile, versus_default=versus, fit_median_rel_err=fits,
             seconds_calibrating=profile["machine"].get("calibration_seconds"), summary=head)
