"""The parts of ``benchmarks/gpu_check.py``, in the order they run (see its docstring).

Importing the package puts the source tree, ``benchmarks`` and ``examples`` on ``sys.path`` (a GPU machine runs the
check from the source tree, ultraattn not installed); it imports nothing heavy, so the runner answers bad arguments at
once.
"""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
for _extra in (REPO, REPO / "benchmarks", REPO / "examples"):
    if str(_extra) not in sys.path:
        sys.path.insert(0, str(_extra))

PARTS = ("clients", "kernels_correct", "two_ranks", "backend_e2e", "kernels_speed", "calibration", "tiles",
         "flex_tiles")
"""Module names under this package; each has NAME, TITLE, CORRECTNESS and run(ctx)."""

WAVES = (("clients",), ("kernels_correct", "two_ranks"), ("backend_e2e",), ("kernels_speed",), ("calibration",),
         ("tiles",), ("flex_tiles",))
"""Parts that run at the same time: real clients first (issue 51: what a user meets first), then two parts that
only check numbers (no timing), which share the machine; every part that times something runs alone."""

WEIGHTS = {"clients": 0.5, "kernels_correct": 0.35, "two_ranks": 0.35, "backend_e2e": 0.2, "kernels_speed": 0.3,
           "calibration": 0.15, "tiles": 0.3, "flex_tiles": 0.3}
"""Each part's share of the time budget (a wave takes its largest share); time a part leaves goes to the next."""
