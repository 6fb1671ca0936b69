"""What a benchmark does with its results: a JSON file that names the command, host and date that made them, and
pyplot (headless) where matplotlib is installed."""

from __future__ import annotations

import json
import platform
import sys
import time
from pathlib import Path


def write_json(out: Path, payload: dict) -> None:
    """Write ``payload`` to ``out`` (its folders made if missing), its ``"meta"`` stamped with the command, host and
    date that made it: ``"meta"`` comes first, made if absent, and keeps every key the script set (the stamp only
    fills the ones it lacks). ``payload`` itself is left as it was."""
    stamp = {"command": " ".join(["python", *sys.argv]), "host": platform.node(),
             "date": time.strftime("%Y-%m-%d %H:%M")}
    doc = {"meta": {**stamp, **payload.get("meta", {})}, **{k: v for k, v in payload.items() if k != "meta"}}
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))


def save(out: Path, meta: dict, rows) -> None:
    """Write ``{"meta": command, host, date and meta, "rows": rows}`` to ``out`` (``write_json``)."""
    write_json(out, {"meta": meta, "rows": rows})


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
