"""What a benchmark does with its results: a JSON file that names the command, host and date that made them, and
pyplot (headless) where matplotlib is installed."""

from __future__ import annotations

import json
import platform
import sys
import time
from pathlib import Path


def save(out: Path, meta: dict, rows) -> None:
    """Write ``{"meta": command, host, date and meta, "rows": rows}`` to ``out`` (its folder made if missing)."""
    meta = {"command": " ".join(["python", *sys.argv]), "host": platform.node(),
            "date": time.strftime("%Y-%m-%d %H:%M"), **meta}
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend, or None (said on stdout) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no PNG)")
        return None
    return plt
