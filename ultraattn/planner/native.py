"""The schedule simulator's inner loop in C (``simulate.c``), built with the system C compiler and called through
ctypes: on the phases of 128K document masks' plans on 8x8 ranks (3,500 tasks a phase), ``schedule.simulate`` took
5.4 ms instead of 23.1 (2.0 ms in C, the rest converting the graph's tasks to arrays; 2026-11-29).

``schedule.simulate`` is the definition and the fallback; ``simulate.c`` takes the same decisions in the same order,
so a schedule is the same to the last bit either way (tests/test_native_simulate.py). The library is built on first
use into ``$ULTRAATTN_CACHE_DIR`` (default ``$XDG_CACHE_HOME/ultraattn`` or ``~/.cache/ultraattn``), named by a hash
of the source and the compiler, with the compiler ``$CC`` names or else the first of cc, gcc and clang on the PATH
(Triton needs one to build its launchers, so a machine that runs Triton has one). Where none is found or the build
fails, one warning says why and planning goes on in Python, slower. ``ULTRAATTN_NATIVE=0`` turns it off (the Python
loop, no build).

The loaded library is process state (``cache.process_state``: "planner: the native schedule simulator").
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import warnings
from pathlib import Path

import numpy as np

from ..cache import process_state

SOURCE = Path(__file__).with_name("simulate.c")
ENV = "ULTRAATTN_NATIVE"
"""Set to 0 to plan with the Python simulator only."""


def enabled() -> bool:
    return os.environ.get(ENV, "1").strip() not in ("0", "false", "no", "off")


def compiler() -> tuple[str | None, str]:
    """The C compiler to build with: ``$CC``, else cc, gcc or clang on the PATH; (None, why) if there is none."""
    cc = os.environ.get("CC")
    if cc:
        if cc.split() and shutil.which(cc.split()[0]):
            return cc, ""
        return None, f"no C compiler: CC={cc!r} is not a program on the PATH"
    found = next((path for name in ("cc", "gcc", "clang") if (path := shutil.which(name))), None)
    return found, "" if found else "no C compiler: none of cc, gcc, clang is on the PATH"


def cache_dir() -> Path:
    if os.environ.get("ULTRAATTN_CACHE_DIR"):
        return Path(os.environ["ULTRAATTN_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ultraattn"


def build(cc: str, out_dir: Path) -> Path:
    """Compile ``simulate.c`` with ``cc`` into ``out_dir`` (unless built there already; written under a temporary
    name, then renamed, so processes building at once never load half a file); the library's path."""
    source = SOURCE.read_bytes()
    tag = hashlib.sha256(source + cc.encode() + sys.platform.encode()).hexdigest()[:16]
    lib = out_dir / f"ultraattn_simulate_{tag}.so"
    if lib.exists():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        cmd = [*cc.split(), "-O2", "-shared", "-fPIC", "-o", tmp, str(SOURCE)]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if res.returncode != 0:
            raise RuntimeError(f"`{' '.join(cmd)}` exited with {res.returncode}: {res.stderr.strip()[-800:]}")
        os.replace(tmp, lib)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


_P_INT = np.ctypeslib.ndpointer(np.int32, flags="C_CONTIGUOUS")
_P_LONG = np.ctypeslib.ndpointer(np.int64, flags="C_CONTIGUOUS")
_P_DBL = np.ctypeslib.ndpointer(np.float64, flags="C_CONTIGUOUS")


class _Library:
    """The built library, loaded once per process (``get``); ``clear()`` forgets it (``ultraattn.reset``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lib: ctypes.CDLL | None = None
        self._failed: str | None = None

    def clear(self) -> None:
        with self._lock:
            self._lib, self._failed = None, None

    def get(self) -> ctypes.CDLL | None:
        """The library, or None (disabled, or it could not be built: said once in a warning)."""
        if not enabled():
            return None
        if self._lib is not None or self._failed is not None:
            return self._lib
        with self._lock:
            if self._lib is None and self._failed is None:
                try:
                    self._lib = self._load()
                except Exception as exc:  # noqa: BLE001 - any build or load failure: the Python loop instead
                    self._failed = str(exc)
                    warnings.warn(f"ultraattn: the planner's native schedule simulator is not available ({exc}); "
                                  f"planning uses the Python one, several times slower. Install a C compiler or set "
                                  f"CC to one; {ENV}=0 silences this", RuntimeWarning, stacklevel=4)
        return self._lib

    @staticmethod
    def _load() -> ctypes.CDLL:
        cc, why = compiler()
        if cc is None:
            raise RuntimeError(why)
        try:
            path = build(cc, cache_dir())
        except OSError:   # (the cache folder is not writable: a private temporary one)
            path = build(cc, Path(tempfile.gettempdir()) / f"ultraattn-{getattr(os, 'getuid', lambda: 0)()}")
        lib = ctypes.CDLL(str(path))
        lib.ua_simulate.argtypes = [ctypes.c_long, ctypes.c_int, _P_INT, _P_INT, _P_DBL, _P_DBL, _P_LONG, _P_LONG,
                                    _P_INT, _P_DBL, _P_DBL]
        lib.ua_simulate.restype = ctypes.c_int
        lib.ua_bottom_levels.argtypes = [ctypes.c_long, _P_DBL, _P_LONG, _P_LONG, _P_DBL]
        lib.ua_bottom_levels.restype = ctypes.c_int
        return lib


LIBRARY = process_state("planner: the native schedule simulator (a loaded C library)", _Library())


def successors(succ: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Successor lists as (offsets [n + 1], flat ids) int64 arrays."""
    off = np.zeros(len(succ) + 1, dtype=np.int64)
    np.cumsum(np.fromiter(map(len, succ), dtype=np.int64, count=len(succ)), out=off[1:])
    flat = np.fromiter((j for s in succ for j in s), dtype=np.int64, count=int(off[-1]))
    return off, flat


def simulate(lib: ctypes.CDLL, nstreams: int, first: list[int], second: list[int], dur: list[float],
             priority: list[float] | None, succ: list[list[int]], missing: list[int]) -> tuple[list, list]:
    """(start, end) of every task (``simulate.c``; the arguments as ``schedule.simulate`` has them; ``priority``
    None: the bottom-level rule). Raises RuntimeError on a cycle, MemoryError when C runs out of memory."""
    n = len(first)
    off, flat = successors(succ)
    dur_a = np.array(dur, dtype=np.float64)
    if priority is None:
        bl = np.zeros(n, dtype=np.float64)
        if lib.ua_bottom_levels(n, dur_a, off, flat, bl) != 0:
            raise MemoryError("ultraattn: the native simulator ran out of memory (bottom levels)")
        prio = -bl
    else:
        prio = np.array(priority, dtype=np.float64)
    start, end = np.zeros(n, dtype=np.float64), np.zeros(n, dtype=np.float64)
    rc = lib.ua_simulate(n, nstreams, np.array(first, dtype=np.int32), np.array(second, dtype=np.int32), dur_a,
                         prio, off, flat, np.array(missing, dtype=np.int32), start, end)
    if rc == 1:
        raise RuntimeError("schedule simulation stalled: the task graph has a cycle")
    if rc != 0:
        raise MemoryError("ultraattn: the native simulator ran out of memory")
    return start.tolist(), end.tolist()
