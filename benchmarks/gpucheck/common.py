"""What every part of the GPU check shares: its context (device, sizes, deadline) and its progressive JSON.

A part is a module with ``NAME``, ``TITLE``, ``CORRECTNESS`` (whether a failure of its checks fails the run) and
``run(ctx) -> dict``. It records as it goes (``ctx.save``), so a part stopped at its deadline leaves what it had
measured; ``ctx.time_left()`` tells it when to stop starting new work.
"""

from __future__ import annotations

import json
import os
import platform
import re
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch


def ensure_backend() -> str:
    """``backend="ultraattn"`` works where the package is not installed (a GPU machine running the source tree): the
    name comes from the package's entry point, else it is registered here. Says which."""
    from torch._dynamo.backends.registry import lookup_backend, register_backend

    try:
        lookup_backend("ultraattn")
        return "entry point"
    except Exception:  # noqa: BLE001 - InvalidBackend (its module moved between torch versions)
        import ultraattn

        register_backend(compiler_fn=ultraattn.backend, name="ultraattn")
        return "registered from the source tree"


BACKEND = ensure_backend()


def gpu_slug(name: str) -> str:
    """A file-name word for a device name: "NVIDIA H100 80GB HBM3" -> "h100", "NVIDIA H200" -> "h200"."""
    words = [w for w in re.split(r"[^A-Za-z0-9]+", name.lower()) if w and w not in ("nvidia", "tesla", "geforce")]
    return words[0] if words else "gpu"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({os.cpu_count()} cores, {platform.processor() or platform.machine()})"


@dataclass
class Ctx:
    """One part's run: where it writes, on what, at which sizes, and until when."""

    name: str
    out: Path
    dry_run: bool
    deadline: float
    """``time.monotonic()`` by which the part should have written its last row."""
    device: torch.device = field(init=False)
    record: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        from ultraattn.planner.ilp import have_pulp

        self.device = torch.device("cpu") if self.dry_run else torch.device("cuda", 0)
        self.record = {"part": self.name, "dry_run": self.dry_run, "device": device_name(self.device),
                       "torch": torch.__version__, "python": platform.python_version(),
                       "triton": _triton_version(), "pulp": have_pulp(), "backend": BACKEND,
                       "started": time.strftime("%Y-%m-%d %H:%M:%S"), "status": "running", "failures": []}

    @property
    def slug(self) -> str:
        return gpu_slug(device_name(self.device)) if self.device.type == "cuda" else "cpu"

    def pick(self, gpu, dry):
        """The GPU run's value, or the dry run's."""
        return dry if self.dry_run else gpu

    def time_left(self) -> float:
        return self.deadline - time.monotonic()

    def path(self, stem: str | None = None, suffix: str = ".json") -> Path:
        return self.out / f"{stem or self.name}{suffix}"

    def save(self, **fields) -> None:
        """Merge ``fields`` into the part's record and write it (``<out>/<name>.json``) at once."""
        self.record.update(fields)
        write(self.path(), self.record)

    def fail(self, what: str) -> None:
        """Record a failed check (the part goes on; its status becomes "fail")."""
        self.record["failures"].append(what)
        print(f"[{self.name}] FAIL {what}", flush=True)

    def note(self, what: str) -> None:
        self.record.setdefault("notes", []).append(what)
        print(f"[{self.name}] {what}", flush=True)


def _triton_version() -> str | None:
    try:
        import triton

        return triton.__version__
    except ImportError:
        return None


def write(path: Path, doc: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str))
    tmp.replace(path)


def grads_of(model) -> dict:
    """Every parameter's gradient by name, fp64 on the host (``model`` a module or a compiled one)."""
    model = getattr(model, "_orig_mod", model)
    return {n: p.grad.detach().double().cpu().clone() for n, p in model.named_parameters()}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def error_text(exc: BaseException) -> str:
    """An exception as one line and the end of its traceback."""
    tb = "".join(traceback.format_exception(exc))
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}\n{tb[-2000:]}"
