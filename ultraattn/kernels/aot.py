"""Ahead-of-time builds of the Triton kernels for a named GPU target, on any machine (no GPU needed).

Triton's interpreter (the CPU test path) checks the arithmetic, not whether a kernel compiles
for a GPU, how many registers it takes, whether it spills or how much shared memory its
pipelining needs. ``triton.compile`` with an explicit ``GPUTarget`` runs the whole NVIDIA
pipeline (TTIR, TTGIR, LLVM, PTX, and the ``ptxas`` inside the triton wheel) without a device,
so each build here reports what ``ptxas -v`` reports on a GPU machine.

A :class:`Variant` is one specialisation the autotuner may launch: kernel, target, dtype, head
dim, GQA group, pattern block and tile config. Arguments are specialised the way a launch on
contiguous, 16-byte aligned tensors specialises them (unit strides along the head dim are
constants, other strides and pointers divisible by 16; lengths never specialised, as in
``triton_kernels._NO_SPEC``), so the build is the one a GPU would run. :func:`build` returns a
:class:`Build` (registers, stack, spill bytes, shared memory, seconds); :func:`sweep` builds many
in worker processes. ``benchmarks/kernels_ptx.py`` writes the table; ``tests/test_kernels_aot.py``
holds the kernels to it in CI.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass

import torch

from ultraattn.kernels import config

KERNELS = ("fwd", "dq", "dkv")
"""The three kernels: forward, dQ, dK/dV."""

# Shared memory one thread block may use (the opt-in maximum), per target: CUDA C++ Programming
# Guide, "Technical Specifications per Compute Capability": 227 KB on 9.0 (H100), 163 KB on 8.0
# (A100). Triton refuses a launch above it (OutOfResources), so a config above it is dead weight.
TARGETS: dict[str, tuple[int, int]] = {"sm90": (90, 227 * 1024), "sm80": (80, 163 * 1024)}
"""name -> (compute capability, shared memory limit in bytes)."""

DTYPES = ("bf16", "fp16", "fp32")
_INDEX_ARGS = re.compile(r"^(PAT|BITS|KV_POS|.*_CNT|.*_IDX|.*_TILE)$")
_FP32_ARGS = {"LSE", "DD", "LSE2", "DLSE", "D0", "D1", "D2", "D3"}
_UNIT_STRIDES = re.compile(r"^s\w*d$")  # strides along the head dim (sqd, skd, sgkd, ...): 1 when contiguous
_NO_ALIGN = {"H", "HK", "q_len", "kv_len", "NQ", "NK", "q0", "h0", "s_last"}


def _softcap(score, b, h, q_idx, kv_idx):
    return 30.0 * torch.tanh(score / 30.0)


def _relbias(score, b, h, q_idx, kv_idx, table):
    return score + table[h, q_idx - kv_idx + 4095]


SCORES = {"softcap": (_softcap, lambda: [], ()),
          "relbias": (_relbias, lambda: [torch.zeros(32, 8191)], (True,))}
"""Sample score_mods the kernels are built with (``Variant.score``): name -> (score_mod, its buffers, which want
a gradient). Gemma 2's soft-capping (arithmetic only), and a learned (head, distance) bias table with its gradient
(a gathered load per score, and atomic adds in dQ): what a score_mod adds to a kernel's registers."""


def has_nvidia_backend() -> tuple[bool, str]:
    """(whether this Triton can build for NVIDIA targets, why not)."""
    if not config.HAS_TRITON:
        return False, "triton is not installed"
    try:
        from triton.backends import backends
    except ImportError as e:  # very old Triton
        return False, f"triton.backends is missing ({e})"
    if "nvidia" not in backends:
        return False, f"this Triton has no NVIDIA backend (backends: {sorted(backends)})"
    return True, ""


@dataclass(frozen=True, order=True)
class Variant:
    """One kernel specialisation: what the autotuner may launch for one (dtype, head dim, group, block)."""

    kernel: str
    target: str
    dtype: str
    head_dim: int
    group: int
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    q_block: int = 128
    kv_block: int = 128
    score: str = ""
    """A sample score_mod generated into the kernel (``SCORES``), or "" for none."""
    scale_type: str = "fp32"
    """How the two softmax scales arrive: "fp32" from an eager launch (Triton types a Python float so), "fp64" from
    Inductor's lowering of the op inside ``torch.compile`` (it types a Python float argument fp64 on CUDA)."""

    def __post_init__(self) -> None:
        if self.kernel not in KERNELS:
            raise ValueError(f"kernel={self.kernel!r}: expected one of {KERNELS}")
        if self.target not in TARGETS:
            raise ValueError(f"target={self.target!r}: expected one of {sorted(TARGETS)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r}: expected one of {sorted(DTYPES)}")
        if self.score and self.score not in SCORES:
            raise ValueError(f"score={self.score!r}: expected one of {sorted(SCORES)} or ''")
        if self.scale_type not in ("fp32", "fp64"):
            raise ValueError(f"scale_type={self.scale_type!r}: expected 'fp32' (eager) or 'fp64' (Inductor)")

    @property
    def config(self) -> tuple[int, int, int, int]:
        return (self.block_m, self.block_n, self.num_warps, self.num_stages)

    def label(self) -> str:
        return (f"{self.kernel} {self.target} {self.dtype} D={self.head_dim} g={self.group} "
                f"{self.block_m}x{self.block_n} w{self.num_warps} s{self.num_stages}"
                + (f" score={self.score}" if self.score else "")
                + (f" scales={self.scale_type}" if self.scale_type != "fp32" else ""))


@dataclass(frozen=True)
class Build:
    """What building one variant gave: ptxas's resource report, Triton's shared memory, time."""

    variant: Variant
    ok: bool
    registers: int = 0
    stack_bytes: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    shared_bytes: int = 0
    shared_limit: int = 0
    seconds: float = 0.0
    cached: bool = False
    """Triton's cache had it; it was built again in an empty cache for the numbers (``seconds`` is that build)."""
    wgmma: bool = False
    error: str = ""

    @property
    def spills(self) -> bool:
        return self.spill_stores > 0 or self.spill_loads > 0

    @property
    def fits(self) -> bool:
        return self.shared_bytes <= self.shared_limit

    def to_json(self) -> dict:
        d = asdict(self)
        d["variant"] = asdict(self.variant)
        d["spills"], d["fits"] = self.spills, self.fits
        return d


def variants(kernels: Iterable[str] = KERNELS, targets: Iterable[str] = tuple(TARGETS),
             dtypes: Iterable[str] = ("bf16",), head_dims: Iterable[int] = (64, 128),
             groups: Iterable[int] = (1,), q_block: int = 128, kv_block: int = 128,
             scores: Iterable[str] = ("",)) -> list[Variant]:
    """Every variant of the autotune spaces (``config.tile_configs``) for the given axes; ``scores``: "" for the
    kernels without a score_mod, names of ``SCORES`` for those with one (on the score_mod spaces)."""
    out = []
    for kernel in kernels:
        for target in targets:
            for dtype in dtypes:
                for d in head_dims:
                    for g in groups:
                        for sc in scores:   # a score_mod's kernels have their own spaces
                            for c in config.tile_configs(kernel, q_block, kv_block, config.row_class(d, dtype),
                                                         score=bool(sc)):
                                out.append(Variant(kernel, target, dtype, d, g, *c, q_block=q_block,
                                                   kv_block=kv_block, score=sc))
    return out


def _jit_fn(kernel: str):
    from ultraattn.kernels import triton_kernels as tk

    return {"fwd": tk.bsa_fwd_kernel, "dq": tk.bsa_bwd_dq_kernel, "dkv": tk.bsa_bwd_dkv_kernel}[kernel]


def _signature(fn, v: Variant) -> tuple[dict, dict, dict]:
    """(signature, constexprs, attrs) of ``fn`` as a launch on contiguous aligned tensors specialises them."""
    const = config.launch_constexprs(v.dtype, v.head_dim, v.group, v.q_block, v.kv_block, interpret=False)
    const.update(BLOCK_M=v.block_m, BLOCK_N=v.block_n, SCORE=None, SCORE_BWD=None)
    ptr_types = {}
    if v.score:
        from ultraattn.kernels.score_codegen import MAX_BUFFERS, generate

        score_mod, buffers, grads = SCORES[v.score]
        bufs = buffers()
        sk = generate(score_mod, bufs, grads)
        const.update(SCORE=sk.fwd, SCORE_BWD=sk.bwd)
        tensors = bufs + list(sk.constants)
        ptr_types = {f"P{n}": "*" + _TYPE[t.dtype] for n, t in enumerate(tensors)}
        ptr_types.update({f"P{n}": "*i32" for n in range(len(tensors), MAX_BUFFERS)})   # (kv_pos stands in)
    sig, constexprs, attrs = {}, {}, {}
    for i, (name, p) in enumerate(zip(fn.arg_names, fn.params)):
        if p.is_constexpr:
            if name not in const:
                raise KeyError(f"{fn.__name__}: no value for constexpr {name}")
            sig[name], constexprs[(i,)] = "constexpr", const[name]
        elif _UNIT_STRIDES.match(name):
            sig[name], constexprs[(i,)] = "constexpr", 1
        elif name in ptr_types or re.match(r"^P\d$", name):   # a score_mod's buffers (no score_mod: stand-ins)
            sig[name] = ptr_types.get(name, "*i32")
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name.isupper() and (_INDEX_ARGS.match(name) or name in _FP32_ARGS) and name not in _NO_ALIGN:
            sig[name] = "*i32" if _INDEX_ARGS.match(name) else "*fp32"
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name.isupper() and name not in _NO_ALIGN:  # Q, K, V, DO, OUT, DQ, DK, DV
            sig[name] = "*" + v.dtype
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in ("qk_scale", "scale"):
            sig[name] = v.scale_type
        else:
            sig[name] = "i32"
            if name not in _NO_ALIGN:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, constexprs, attrs


_TYPE = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int32: "i32", torch.int64: "i64"}

_PTXAS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS = re.compile(r"Used (\d+) registers")


def _parse_ptxas(log: str) -> tuple[int, int, int, int] | None:
    """(registers, stack, spill stores, spill loads) from ``ptxas -v`` output, or None."""
    regs, frame = _REGS.search(log), _PTXAS.search(log)
    if not regs or not frame:
        return None
    return int(regs.group(1)), int(frame.group(1)), int(frame.group(2)), int(frame.group(3))


def _compile(src, cap: int, v: Variant) -> tuple[object, str]:
    """(the compiled kernel, what ``ptxas -v`` printed: empty when Triton's cache served it)."""
    import triton
    from triton.backends.compiler import GPUTarget

    log = io.StringIO()
    knobs = triton.knobs.nvidia
    old = knobs.dump_ptxas_log
    try:
        knobs.dump_ptxas_log = True
        with contextlib.redirect_stdout(log):
            k = triton.compile(src, target=GPUTarget("cuda", cap, 32),
                               options={"num_warps": v.num_warps, "num_stages": v.num_stages})
    finally:
        knobs.dump_ptxas_log = old
    return k, log.getvalue()


@contextlib.contextmanager
def _env(name: str, value: str):
    """``os.environ[name] = value`` for the duration, then as it was."""
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


@contextlib.contextmanager
def _fresh_cache():
    """Triton's cache in an empty directory for the duration (TRITON_CACHE_DIR is read at each compile)."""
    with tempfile.TemporaryDirectory(prefix="ultraattn-aot-") as d, _env("TRITON_CACHE_DIR", d):
        yield


def build(v: Variant) -> Build:
    """Compile one variant for its target and read its resources (never raises for a failed build)."""
    ok, why = has_nvidia_backend()
    if not ok:
        return Build(v, ok=False, error=why)
    if config.interpret():
        return Build(v, ok=False, error="TRITON_INTERPRET=1 in this process: the kernels are interpreter functions; "
                                        "build through sweep(), whose workers turn the interpreter off")
    from triton.compiler import ASTSource

    fn = _jit_fn(v.kernel)
    cap, limit = TARGETS[v.target]
    sig, constexprs, attrs = _signature(fn, v)
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    t0 = time.perf_counter()
    try:
        k, log = _compile(src, cap, v)
        cached = _parse_ptxas(log) is None
        if cached:
            # Served from Triton's cache, which skips ptxas: build again in an empty cache, so the numbers
            # are those of ptxas run with Triton's own flags (re-running ptxas on the PTX by hand would not
            # be: Triton 3.9 passes --regAllocOptLevel=2, which changes the allocation).
            t0 = time.perf_counter()
            with _fresh_cache():
                k, log = _compile(src, cap, v)
    except Exception as e:  # noqa: BLE001 - a build that fails is a result to report, not a crash
        return Build(v, ok=False, shared_limit=limit, seconds=time.perf_counter() - t0,
                     error=f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}")
    seconds = time.perf_counter() - t0
    res = _parse_ptxas(log)
    if res is None:
        return Build(v, ok=False, shared_limit=limit, seconds=seconds, error="no resource line in ptxas -v output")
    regs, stack, st, ld = res
    return Build(v, ok=True, registers=regs, stack_bytes=stack, spill_stores=st, spill_loads=ld,
                 shared_bytes=int(k.metadata.shared), shared_limit=limit, seconds=seconds, cached=cached,
                 wgmma="warp_group_dot" in k.asm.get("ttgir", ""))


def sweep(vs: Sequence[Variant], *, jobs: int = 1, progress: Callable[[Build], None] | None = None) -> list[Build]:
    """Build every variant in ``jobs`` fresh worker processes (spawned with TRITON_INTERPRET=0, so this
    works from a process that runs the kernels in Triton's interpreter, like the test suite: Triton reads
    the variable when a kernel is decorated, and interpreter functions cannot be compiled for a GPU).
    Builds are CPU-bound, mostly in ptxas."""
    import multiprocessing

    out = []
    # inherited by the workers, spawned when map submits
    with _env("TRITON_INTERPRET", "0"), ProcessPoolExecutor(max_workers=max(1, jobs),
                                                            mp_context=multiprocessing.get_context("spawn")) as pool:
        for b in pool.map(build, vs):
            out.append(b)
            if progress:
                progress(b)
    return out


def summary(builds: Iterable[Build], key: Callable[[Build], tuple] | None = None) -> dict[tuple, dict]:
    """Per group of builds (default: per kernel and target): builds, failures, worst registers, spilling
    builds, largest spill and stack, largest shared memory, builds over it, head dims, median compile
    seconds."""
    key = key or (lambda b: (b.variant.kernel, b.variant.target))
    rows: dict[tuple, dict] = {}
    for b in builds:
        r = rows.setdefault(key(b), {"builds": 0, "failed": 0, "max_registers": 0, "spilling": 0,
                                     "max_spill_stores": 0, "max_stack": 0, "max_shared": 0,
                                     "shared_limit": b.shared_limit, "over_shared": 0, "head_dims": set(),
                                     "seconds": []})
        r["builds"] += 1
        r["head_dims"].add(b.variant.head_dim)
        if not b.ok:
            r["failed"] += 1
            continue
        r["max_registers"] = max(r["max_registers"], b.registers)
        r["spilling"] += b.spills
        r["max_spill_stores"] = max(r["max_spill_stores"], b.spill_stores)
        r["max_stack"] = max(r["max_stack"], b.stack_bytes)
        r["max_shared"] = max(r["max_shared"], b.shared_bytes)
        r["over_shared"] += not b.fits
        r["seconds"].append(b.seconds)
    for r in rows.values():
        r["head_dims"] = sorted(r["head_dims"])
        secs = sorted(r.pop("seconds"))
        r["median_compile_s"] = secs[len(secs) // 2] if secs else None
    return rows


def to_json(builds: Sequence[Build], **meta) -> str:
    return json.dumps({"meta": meta, "summary": {" ".join(k): r for k, r in summary(builds).items()},
                       "builds": [b.to_json() for b in builds]}, indent=1)
