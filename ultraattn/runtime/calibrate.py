"""Calibrate the cost model on the machine it plans for: ``ultraattn.calibrate`` and ``ultraattn calibrate``.

The planner is only as good as its cost model. This module times what the runtime really runs, on the
devices and process group it runs on, and fits the model's terms to it (``planner/profile.py``):

* tiles: the runtime's own tile calls (``runtime/tiles.row_forward`` / ``row_backward``: the torch path on CPU,
  the Triton kernels on GPU) over work shapes the planner reasons about: KV tokens per query block row, heads,
  head dim, FULL and PARTIAL blocks. EVERY rank runs each sample at once, so ranks that share hardware (4 CPU
  ranks on 2 cores) are measured sharing it, as they will be in a step;
* messages: every rank sends one message and receives one at once (as in a plan's exchange stage), inside a
  node and, on a mesh of several nodes, across nodes, at the sizes plans send;
* merges: the runtime's LSE merge and partial-gradient sums;
* sharing: a few tile calls again on the first rank while the others wait, against the same call with all ranks
  busy: ranks that share hardware (CPU cores) run faster alone (``CostModel.alone_speedup``);
* steps: real forward + backward steps of the runtime for two baseline plans of a causal mask: kernels inside a
  step run slower than the same calls alone in a loop (other ranks' messages copy on the same cores, the step's
  other tensors take the caches); the kernel rates are scaled so that the model replays these steps in their
  measured time (``planner/profile.fit_step_scale``).

A sample's figure is the median over repetitions on each rank, then the median over ranks. Every wait has a
timeout (``timeout``), so a dead peer fails the call instead of hanging it.

``auto_profile`` (what ``cost="auto"`` resolves to: ``runtime/entry.py``, ``passes/options.py``) calibrates once
per machine and configuration and caches the profile under the user's cache directory (``$ULTRAATTN_CACHE_DIR``,
else ``$XDG_CACHE_HOME/ultraattn``, else ``~/.cache/ultraattn``); later calls (in this process or another) load it.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from ..kernels.reference import softmax_delta
from ..masks.pattern import EMPTY, FULL, PARTIAL
from ..masks.read import ElementMask
from ..planner.api import evaluate
from ..planner.cost import DEFAULT_COST, CostModel, block_flops
from ..planner.plan import Mesh
from ..planner.profile import CostProfile, ProfileError, fit_cost, fit_step_scale, scale_kernels
from .api import plan_attention
from .comm import CommLog, GroupRef, resolve_group
from .tiles import TileGeometry, merge_partial, row_backward, row_forward
from .tokens import dispatch, dist_attention
from .transport import Recv, Send, transport_for

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True, slots=True, kw_only=True)
class Grid:
    """What one calibration measures (``grid_for``)."""

    block: int
    """Mask block size in tokens (the runtime's Q and KV block)."""
    q_tokens: int
    """Query tokens of one tile call (a plan chunk's row)."""
    kv_tokens: tuple[int, ...]
    """KV tokens per query block row (L in the cost model), each a multiple of ``block``."""
    heads: tuple[int, ...]
    head_dims: tuple[int, ...]
    dtype: str
    message_bytes: tuple[int, ...]
    merge_tokens: tuple[int, ...]
    """Query tokens of the partial results merged (heads ``max(heads)``, head dim ``max(head_dims)``)."""
    reps: int
    """Timed repetitions per sample (after one warm-up)."""
    target: float
    """Seconds one repetition lasts at least (short calls are repeated within it)."""

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"ultraattn calibrate: `dtype` must be one of {', '.join(_DTYPES)}, got {self.dtype!r}")
        bad = [n for n in self.kv_tokens if n % self.block or n < self.block]
        if bad or self.q_tokens % self.block:
            raise ValueError(f"ultraattn calibrate: kv_tokens {bad or ''} and q_tokens {self.q_tokens} must be "
                             f"multiples of the block {self.block}")
        if self.reps < 1:
            raise ValueError(f"ultraattn calibrate: `reps` must be >= 1, got {self.reps}")


def grid_for(device: torch.device, *, quick: bool = False, dtype: str | None = None) -> Grid:
    """The calibration grid of a device: sizes where its tile path spends from a millisecond to about a second.

    ``quick``: a few tiny samples (tests; the fit is then a smoke test, not a profile to plan with).
    """
    if quick:
        # sizes far enough apart that a loaded 2-core machine cannot swap their order
        return Grid(block=64, q_tokens=128, kv_tokens=(64, 512), heads=(1, 2), head_dims=(32,),
                    dtype=dtype or "fp32", message_bytes=(1 << 12, 1 << 20, 1 << 24), merge_tokens=(128, 512), reps=2,
                    target=0.005)
    if device.type == "cuda":
        return Grid(block=128, q_tokens=2048, kv_tokens=(256, 1024, 4096, 16384), heads=(8, 32), head_dims=(64, 128),
                    dtype=dtype or "bf16", message_bytes=(1 << 16, 1 << 20, 1 << 23, 1 << 26),
                    merge_tokens=(4096, 16384), reps=5, target=0.05)
    # CPU: the torch tile path computes in fp32 whatever the input dtype; 512-token rows are a plan chunk's
    return Grid(block=128, q_tokens=1024, kv_tokens=(128, 512, 2048, 4096), heads=(2, 8), head_dims=(64,),
                dtype=dtype or "fp32", message_bytes=(1 << 16, 1 << 19, 1 << 22, 1 << 24),
                merge_tokens=(512, 2048), reps=3, target=0.2)


def default_device() -> torch.device:
    """This rank's CUDA device when there is one, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Ranks:
    """The calibration's view of its process group: barriers, gathers and messages through the transport the runtime
    uses (``runtime/transport.py``: what is timed is what runs), each with a timeout; nothing without a group."""

    def __init__(self, group, ranks: Sequence[int], me: int, mesh: Mesh, timeout: float, device: torch.device):
        self.group, self.ranks, self.me, self.mesh, self.timeout = group, tuple(ranks), me, mesh, timeout
        self.world = len(self.ranks)
        self.device = device if group is not None and dist.get_backend(group) == "nccl" else torch.device("cpu")
        self.transport = (transport_for(rank=me, global_ranks=self.ranks, group_ref=GroupRef(group), timeout=timeout)
                          if group is not None else None)

    def barrier(self) -> None:
        if self.transport is not None:
            self.transport.barrier()

    def gather(self, value: float) -> list[float]:
        if self.transport is None or self.world == 1:
            return [value]
        t = torch.tensor([float(value)], dtype=torch.float64, device=self.device)
        return [float(x) for x in self.transport.all_gather(t, "a gather of timings")]

    def median_over_ranks(self, value: float) -> float:
        return statistics.median(self.gather(value))

    def max_over_ranks(self, value: float) -> float:
        return max(self.gather(value))


def _repeat(fn: Callable[[], object], reps: int, iters: int, device: torch.device, before=lambda: None) -> list[float]:
    """Seconds per ``fn`` call in each of ``reps`` repetitions of ``iters`` calls (``before`` runs ahead of each)."""
    times = []
    for _ in range(reps):
        before()
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        _sync(device)
        times.append((time.perf_counter() - t0) / iters)
    return times


def _iters(target: float, warm: float) -> int:
    """Calls per repetition: enough to last ``target`` seconds at the warm-up's pace (1 to 1000)."""
    return max(1, min(1000, round(target / max(warm, 1e-6))))


def _timed(ranks: _Ranks, fn: Callable[[], object], reps: int, device: torch.device, target: float) -> float:
    """Seconds of one ``fn`` call on this rank, every rank running it at once: after a warm-up, each of ``reps``
    repetitions starts on all ranks together and runs ``fn`` enough times to last about ``target`` seconds (the same
    count everywhere, from the slowest rank's warm-up); the median repetition per call, then the median over ranks."""
    warm = ranks.max_over_ranks(_repeat(fn, 1, 1, device, before=ranks.barrier)[0])
    times = _repeat(fn, reps, _iters(target, warm), device, before=ranks.barrier)
    return ranks.median_over_ranks(statistics.median(times))


def _timed_alone(ranks: _Ranks, fn: Callable[[], object], reps: int, device: torch.device, target: float) -> float:
    """Seconds of one ``fn`` call on the first rank while every other rank waits (at a barrier)."""
    t = 0.0
    if ranks.me == 0:
        t = statistics.median(_repeat(fn, reps, _iters(target, _repeat(fn, 1, 1, device)[0]), device))
    ranks.barrier()
    return max(ranks.gather(t))


def _checker_mask(b, h, q_idx, kv_idx):
    """Every block of it is PARTIAL (the mask_mod is evaluated), every row attends half its keys."""
    return (q_idx + kv_idx) % 2 == 0


def _tile_case(grid: Grid, *, heads: int, head_dim: int, kv_tokens: int, kind: int, q_tokens: int,
               device: torch.device):
    """A tile call of ``q_tokens`` queries, each query block attending ``kv_tokens`` keys of one ``kind``.

    Returns (geometry, q, kvs, cols, do, sample fields): the row is chunk 0, its KV columns chunks 1..n.
    """
    c, b = q_tokens, grid.block
    ncols = math.ceil(kv_tokens / c)
    seq = c * (1 + ncols)
    nqb, nkb = c // b, kv_tokens // b
    kinds = torch.full((seq // b, seq // b), EMPTY, dtype=torch.int8)
    kinds[:nqb, nqb:nqb + nkb] = kind
    geo = TileGeometry(seq_len=seq, chunk=c, q_block=b, kv_block=b, batch=1, num_heads=heads, num_kv_heads=heads,
                       head_groups=1, head_dim=head_dim, kind_gQK=[kinds],
                       element=ElementMask(_checker_mask) if kind == PARTIAL else None)
    dt = _DTYPES[grid.dtype]
    g = torch.Generator(device="cpu").manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dt)

    q = rand(1, heads, c, head_dim)
    kvs = [(rand(1, heads, c, head_dim), rand(1, heads, c, head_dim)) for _ in range(ncols)]
    do = rand(1, heads, c, head_dim)
    blocks = nqb * nkb * heads
    flops = blocks * block_flops(b, b, head_dim, 1, 1)
    fields = {"heads": heads, "head_dim": head_dim, "dtype": grid.dtype, "q_tokens": c,
              "kind": "partial" if kind == PARTIAL else "full", "kv_tokens_per_row": float(kv_tokens),
              "flops_full": flops if kind == FULL else 0.0, "flops_partial": flops if kind == PARTIAL else 0.0,
              "launches": 1}
    return geo, q, kvs, list(range(1, ncols + 1)), do, fields


def tile_cases(grid: Grid) -> list[dict]:
    """The grid's tile samples: FULL and PARTIAL at every (head dim, heads, keys per row), and two tiny calls (one
    query block of one head), whose time is mostly the cost of a launch: without them the fit cannot tell launch
    cost from work, and a plan of many small tiles would look as cheap as one of few large ones."""
    cases = [{"head_dim": d, "heads": h, "kv_tokens": kv, "kind": kind, "q_tokens": grid.q_tokens}
             for d in grid.head_dims for h in grid.heads for kv in grid.kv_tokens for kind in (FULL, PARTIAL)]
    return cases + [{"head_dim": grid.head_dims[0], "heads": 1, "kv_tokens": kv, "kind": FULL, "q_tokens": grid.block}
                    for kv in (grid.block, 4 * grid.block)]


def measure_tiles(ranks: _Ranks, grid: Grid, device: torch.device, advance: Callable[[], None],
                  sharing: list[dict]) -> list[dict]:
    """Forward and backward tile samples over ``tile_cases`` (module docstring); appends to ``sharing`` the largest
    FULL calls timed again on one rank alone."""
    out = []
    scale = 1.0
    for case in tile_cases(grid):
        geo, q, kvs, cols, do, fields = _tile_case(grid, **case, device=device)
        o, lse = row_forward(geo, 0, 0, cols, q, kvs, scale)
        delta = softmax_delta(o, do)

        def fwd(geo=geo, q=q, kvs=kvs, cols=cols):
            return row_forward(geo, 0, 0, cols, q, kvs, scale)

        def bwd(geo=geo, q=q, kvs=kvs, cols=cols, do=do, lse=lse, delta=delta):
            return row_backward(geo, 0, 0, cols, q, do, lse, delta, kvs, scale)

        t_f = _timed(ranks, fwd, grid.reps, device, grid.target)
        t_b = _timed(ranks, bwd, grid.reps, device, grid.target)
        out.append({**fields, "phase": "fwd", "seconds": t_f})
        out.append({**fields, "phase": "bwd", "seconds": t_b})
        if (ranks.world > 1 and case["kind"] == FULL and case["heads"] == max(grid.heads)
                and case["head_dim"] == grid.head_dims[0] and case["kv_tokens"] in grid.kv_tokens[-2:]):
            # the same calls on one rank while the others wait: how much of the hardware they share
            for phase, fn, t_all in (("fwd", fwd, t_f), ("bwd", bwd, t_b)):
                alone = _timed_alone(ranks, fn, grid.reps, device, grid.target)
                sharing.append({**fields, "phase": phase, "seconds_all": t_all, "seconds_alone": alone})
        advance()
    return out


def _peer_pairs(mesh: Mesh, me: int) -> dict[str, tuple[int, int]]:
    """(send to, receive from) per link: the next device of this node, and the same device of the next node."""
    n, d = divmod(me, mesh.devices)
    pairs = {}
    if mesh.devices > 1:
        pairs["intra"] = (n * mesh.devices + (d + 1) % mesh.devices, n * mesh.devices + (d - 1) % mesh.devices)
    if mesh.nodes > 1:
        pairs["inter"] = (((n + 1) % mesh.nodes) * mesh.devices + d, ((n - 1) % mesh.nodes) * mesh.devices + d)
    return pairs


def measure_messages(ranks: _Ranks, grid: Grid, device: torch.device, advance: Callable[[], None]) -> list[dict]:
    """Every rank sends one message and receives one at once, per link and size."""
    out = []
    if ranks.world == 1:
        return out
    for link, (to, frm) in _peer_pairs(ranks.mesh, ranks.me).items():
        for nbytes in grid.message_bytes:
            send = torch.ones(nbytes, dtype=torch.uint8, device=device)
            what = f"calibration message ({link})"

            def exchange(send=send, nbytes=nbytes, to=to, frm=frm, what=what):
                tr = ranks.transport
                tr.log = CommLog()
                h = tr.post([Send(send, to, 0, ("calibrate", "message", -1, 0, ranks.me, to), what)],
                            [Recv(nbytes, frm, 0, device, ("calibrate", "message", -1, 0, frm, ranks.me), what)])
                tr.wait(h)
                tr.settle(h)

            t = _timed(ranks, exchange, grid.reps + 2, device, grid.target)
            out.append({"link": link, "nbytes": nbytes, "seconds": t})
            advance()
    return out


def measure_merges(ranks: _Ranks, grid: Grid, device: torch.device, advance: Callable[[], None]) -> list[dict]:
    """The runtime's LSE merge of a partial (o, lse) and a partial-gradient sum; ``nbytes`` is what the planner
    charges (twice the partial's message bytes)."""
    out = []
    h, d = max(grid.heads), max(grid.head_dims)
    for tokens in grid.merge_tokens:
        o = [torch.randn(1, h, tokens, d, device=device) for _ in range(2)]
        lse = [torch.randn(1, h, tokens, device=device) for _ in range(2)]
        acc = torch.zeros(1, h, tokens, d, device=device)
        msg_o = (o[0].numel() + lse[0].numel()) * 4
        out.append({"what": "o", "nbytes": 2 * msg_o, "seconds": _timed(
            ranks, lambda o=o, lse=lse: merge_partial((o[0], lse[0]), (o[1], lse[1])), grid.reps, device, grid.target)})
        out.append({"what": "dq", "nbytes": 2 * o[0].numel() * 4, "seconds": _timed(
            ranks, lambda acc=acc, o=o: acc.add_(o[1]), grid.reps, device, grid.target)})
        advance()
    return out


#: the plans of the step probes: an unbalanced one (ranks wait: sharing) and one that moves every K/V (messages)
STEP_METHODS = ("ring", "allgather")


def measure_steps(ranks: _Ranks, grid: Grid, device: torch.device, cost: CostModel, mesh,
                  advance: Callable[[], None]) -> tuple[list[dict], list]:
    """Real steps of the runtime (``dist_attention`` forward + backward) for the ``STEP_METHODS`` plans of a causal
    mask over ``grid.q_tokens`` tokens per rank; each sample's ``seconds`` is the slowest rank's median step.
    Returns the samples and their (plan, pattern) pairs for the model to replay."""
    if ranks.world == 1:
        return [], []

    h, d, s = max(grid.heads), grid.head_dims[0], grid.q_tokens * ranks.world
    dt = _DTYPES[grid.dtype]
    g = torch.Generator(device="cpu").manual_seed(1)
    q, k, v, go = (torch.randn(1, h, s, d, generator=g).to(device=device, dtype=dt) for _ in range(4))
    samples, plans = [], []
    for method in STEP_METHODS:
        plan = plan_attention("causal", seqlen=s, num_heads=h, head_dim=d, dtype=dt, block_size=grid.block,
                              method=method, cost=cost, mesh=mesh, group=None if mesh is not None else ranks.group,
                              timeout=ranks.timeout)
        ql, kl, vl = (dispatch(x, plan).requires_grad_() for x in (q, k, v))
        gl = dispatch(go, plan)

        def step(plan=plan, ql=ql, kl=kl, vl=vl, gl=gl):
            out, _ = dist_attention(ql, kl, vl, plan)
            out.backward(gl)

        times = []
        for n in range(grid.reps + 1):
            ranks.barrier()
            _sync(device)
            t0 = time.perf_counter()
            step()
            _sync(device)
            ranks.barrier()
            if n:
                times.append(time.perf_counter() - t0)
        samples.append({"method": method, "seqlen": s, "heads": h, "head_dim": d,
                        "seconds": max(ranks.gather(statistics.median(times)))})
        plans.append((plan.tile_plan, plan.pattern))
        advance()
    return samples, plans


def machine_info(device: torch.device, mesh: Mesh) -> dict:
    """Where a profile is measured; ``key`` names the configuration ``cost="auto"`` caches it under."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = platform.processor() or platform.machine()
        try:
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
        except OSError:
            pass
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    info = {"host": platform.node(), "device_type": device.type, "device": name, "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "nodes": mesh.nodes, "devices_per_node": mesh.devices,
            "world": mesh.world, "torch": torch.__version__, "triton": triton_version,
            "python": platform.python_version(), "platform": platform.platform()}
    ident = {k: info[k] for k in ("host", "device_type", "device", "cpus", "torch_threads", "nodes",
                                  "devices_per_node", "torch")}
    info["key"] = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]
    return info


def _progress(enabled: bool, total: int):
    """A rich progress bar (rank 0 only) on a terminal; elsewhere (a log, a pipe, where rich draws nothing until the
    end) one line per measurement on stderr; or nothing."""
    if not enabled:
        return nullcontext(lambda: None)
    if not sys.stderr.isatty():
        t0, done = time.perf_counter(), [0]

        def line() -> None:
            done[0] += 1
            print(f"ultraattn calibrate: {done[0]}/{total} measured, {time.perf_counter() - t0:.1f} s",
                  file=sys.stderr, flush=True)
        return nullcontext(line)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    class _Bar:
        def __enter__(self):
            self.p = Progress(TextColumn("calibrating the cost model"), BarColumn(), MofNCompleteColumn(),
                              TimeElapsedColumn(), transient=False)
            self.p.__enter__()
            self.task = self.p.add_task("calibrate", total=total)
            return lambda: self.p.advance(self.task)

        def __exit__(self, *exc):
            return self.p.__exit__(*exc)

    return _Bar()


def _setup(group, device, mesh, timeout: float, quick: bool, dtype: str | None):
    """What ``calibrate`` and ``reference_steps`` measure on: the device, the mesh, this rank, its ``_Ranks``, the
    grid."""
    device = default_device() if device is None else torch.device(device)
    if group is None and mesh is None:
        pmesh, ranks, comm_group, me = Mesh(nodes=1, devices=1), (0,), None, 0
    else:
        pmesh, ranks, comm_group, me = resolve_group(mesh, group)
    return device, pmesh, me, _Ranks(comm_group, ranks, me, pmesh, timeout, device), grid_for(device, quick=quick,
                                                                                          dtype=dtype)


def reference_steps(group=None, device=None, *, mesh=None, quick: bool = False, dtype: str | None = None,
                    timeout: float = 300.0, cost: CostModel = DEFAULT_COST) -> list[dict]:
    """The real steps ``calibrate`` times to fix how much slower kernels run inside a step (``measure_steps``), timed
    again the same way on their own: a profile's ``samples["step"]`` against these says how far the machine has moved
    since it was made (``benchmarks/runtime_cpu.py``). A collective over ``group``; empty on one rank."""
    device, _pmesh, _me, r, grid = _setup(group, device, mesh, timeout, quick, dtype)
    return measure_steps(r, grid, device, cost, mesh, lambda: None)[0]


def calibrate(group=None, device=None, *, mesh=None, quick: bool = False, dtype: str | None = None,
              progress: bool = True, out: str | os.PathLike | None = None, timeout: float = 300.0,
              base: CostModel = DEFAULT_COST) -> CostProfile:
    """Measure this machine and fit the cost model to it (module docstring).

    Args:
        group: a process group: a collective, every rank of it calls; None: this process alone (no messages).
        device: where tiles run (default: this rank's CUDA device when there is one, else the CPU).
        mesh: a DeviceMesh over ``group`` (nodes x devices) when the group spans nodes.
        quick: a tiny grid (seconds; for tests: not a profile to plan with).
        dtype: "bf16", "fp16" or "fp32" (default: bf16 on GPU, fp32 on CPU, whose tile path computes in fp32).
        progress: a progress bar on the first rank.
        out: also save the profile there (the first rank writes).
        timeout: seconds any wait for a peer may take.
        base: the model whose fields stand where nothing could be measured.

    Returns:
        The ``CostProfile`` (``.cost`` is the fitted ``CostModel``), the same on every rank.
    """
    device, pmesh, me, r, grid = _setup(group, device, mesh, timeout, quick, dtype)
    total = (len(tile_cases(grid)) + (len(_peer_pairs(pmesh, me)) * len(grid.message_bytes) if r.world > 1 else 0)
             + len(grid.merge_tokens) + (len(STEP_METHODS) if r.world > 1 else 0))
    t0 = time.perf_counter()
    with _progress(progress and me == 0, total) as advance:
        sharing: list[dict] = []
        samples = {"kernel": measure_tiles(r, grid, device, advance, sharing),
                   "message": measure_messages(r, grid, device, advance),
                   "merge": measure_merges(r, grid, device, advance), "sharing": sharing}
        cost, fit, notes = fit_cost(samples, base=base)
        cost = dataclasses.replace(cost, async_kernels=1.0 if device.type == "cuda" else 0.0)
        probes, plans = measure_steps(r, grid, device, cost, mesh, advance)
    if probes:
        samples["step"] = probes

        def predict(k: float) -> list[float]:
            model = scale_kernels(cost, k)
            return [evaluate(tp, pattern, cost=model).total_ms() / 1e3 for tp, pattern in plans]

        k, fit["step"] = fit_step_scale([st["seconds"] for st in probes], predict)
        cost = scale_kernels(cost, k)
        notes.append(f"kernel rates divided by {k:.3g}: inside real steps ({', '.join(STEP_METHODS)} plans of a causal "
                     f"mask) kernels ran that much slower than alone in a loop")
    else:
        notes.append("steps not measured (one rank): kernel rates are the isolated calls'")
    info = machine_info(device, pmesh)
    info["calibration_seconds"] = round(time.perf_counter() - t0, 3)
    info["grid"] = {"block": grid.block, "q_tokens": grid.q_tokens, "dtype": grid.dtype, "quick": quick}
    profile = CostProfile(cost=cost, machine=info, fit=fit, samples=samples, notes=tuple(notes),
                          created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    if out is not None and me == 0:
        profile.save(out)
    return profile


# ----------------------------------------------------------------------------- cost="auto" and paths
def cache_dir() -> Path:
    """Where ``cost="auto"`` keeps profiles (module docstring)."""
    if os.environ.get("ULTRAATTN_CACHE_DIR"):
        return Path(os.environ["ULTRAATTN_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ultraattn"


def profile_path(key: str) -> Path:
    """Where ``cost="auto"`` keeps the profile of configuration ``key`` (``machine_info``'s, ``profile.machine``)."""
    return cache_dir() / "profiles" / f"{key}.json"


def cached_profile_path(device: torch.device, mesh: Mesh) -> Path:
    return profile_path(machine_info(device, mesh)["key"])


def auto_profile(*, group=None, mesh=None, device=None, progress: bool = True, timeout: float = 300.0,
                 quick: bool = False) -> CostProfile:
    """The cached profile of this machine and configuration, calibrating it first if there is none (a collective
    over ``group``: the first rank decides, every rank gets the same profile). ``quick``: see ``calibrate``."""
    device = default_device() if device is None else torch.device(device)
    grouped = (group is not None or mesh is not None) or (dist.is_available() and dist.is_initialized())
    if grouped:
        pmesh, ranks, comm_group, me = resolve_group(mesh, group)
    else:
        pmesh, ranks, comm_group, me = Mesh(nodes=1, devices=1), (0,), None, 0
    path = cached_profile_path(device, pmesh)
    box = [None]
    if me == 0 and path.exists():
        try:
            box[0] = CostProfile.load(path).to_json()
        except ProfileError:
            box[0] = None   # a broken cache entry is measured again and overwritten
    if comm_group is not None and pmesh.world > 1:
        dist.broadcast_object_list(box, src=ranks[0], group=comm_group)
    if box[0] is not None:
        return CostProfile.from_json(box[0], source=f"cost profile {str(path)!r}")
    return calibrate(comm_group if pmesh.world > 1 else None, device, mesh=mesh, progress=progress, out=path,
                     timeout=timeout, quick=quick)

