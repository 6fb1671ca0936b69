"""Run a function on N local ranks over gloo (127.0.0.1), for tests and CPU benchmarks.

    results = run_ranks(worker, world=4, args=(case,), timeout=120)

``worker(rank, world, *args)`` runs in a fresh process with the default process
group initialised (gloo, a free port, ``pg_timeout`` seconds on every collective); its return
value comes back (via ``torch.save`` bytes, so tensors survive). An exception in any rank is
re-raised in the caller with that rank's traceback; a rank that hangs or dies is killed at
``timeout`` and reported by rank number. Nothing is left running.

    with CommSpy() as spy: ...                    # which torch.distributed calls ran, and their bytes
    with HostReads() as reads: ...                # what ultraattn's code read onto the host (D2H on a GPU)

And the numerics policy (docs/numerics.md), which the tests and ``benchmarks/gpu_check.py`` apply:

    ref = dense_attention(q, k, v, allowed, dout, dlse, torch.float64)   # the oracle: out, lse, dq, dk, dv
    problems = check_2x(got, ref64, ref_same_precision, "bf16")           # attention outputs and gradients
    problems = check_step(got, ref64, ref32)                              # a training step's loss and grads
"""

from __future__ import annotations

import datetime
import io
import math
import os
import queue
import socket
import traceback
from collections.abc import Callable

import torch
import torch.multiprocessing as mp

#: torch.distributed functions ultraattn's runtime communicates with (``CommSpy`` counts them)
COMM_FUNCTIONS = ("broadcast_object_list", "broadcast", "all_gather_object", "all_gather_into_tensor",
                  "all_gather_single", "all_gather", "all_reduce", "barrier", "isend", "irecv", "send", "recv",
                  "batch_isend_irecv", "_all_gather_base")


class CommSpy:
    """Records the calls of ``COMM_FUNCTIONS`` and of the process group's store while active (a context manager):
    ``calls`` (names, in order) and ``nbytes`` (per call: the bytes of its first argument, a tensor or a list of
    tensors, such as an all-gather's output buffer; 0 otherwise)."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.nbytes: list[int] = []
        self._saved: list[tuple[object, str, object]] = []

    def _wrap(self, owner, name: str) -> None:
        fn = getattr(owner, name, None)
        if fn is None:
            return

        def counted(*args, **kwargs):
            self.calls.append(name)
            first = args[0] if args else None
            ts = first if isinstance(first, list | tuple) else [first]
            self.nbytes.append(sum(t.numel() * t.element_size() for t in ts if isinstance(t, torch.Tensor)))
            return fn(*args, **kwargs)

        self._saved.append((owner, name, fn))
        setattr(owner, name, counted)

    def __enter__(self) -> CommSpy:
        import torch.distributed as dist

        for name in COMM_FUNCTIONS:
            self._wrap(dist, name)
        self._wrap(dist.distributed_c10d, "_get_default_store")
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, fn in reversed(self._saved):
            setattr(owner, name, fn)
        self._saved.clear()

    def count(self, *names: str) -> tuple[int, int]:
        """(calls, bytes) of the functions named."""
        hits = [b for c, b in zip(self.calls, self.nbytes) if c in names]
        return len(hits), sum(hits)


class RankFailure(RuntimeError):
    """A rank raised, died, or did not finish in time."""


class HostReads:
    """Counts what ultraattn's own code reads from tensors onto the host while active (a context manager): calls of
    ``Tensor.cpu``, ``.tolist``, ``.item`` and ``bool`` / ``int`` / ``float`` of a tensor (``.numpy`` needs a host
    tensor: the ``.cpu()`` before it is what moves it; ``.to(device)`` is not counted, as on a CPU machine it cannot
    tell a move to the host from one to where the step runs, and the package moves nothing to the host with it),
    made from a frame inside the ``ultraattn``
    package (``SKIP`` excepted). On a GPU each one is a device-to-host
    transfer and a wait for the device; on a CPU they cost nothing, which is why a test must count them (issue 51:
    every site copied and hashed the S x S mask every step). ``calls`` (method names, in order) and ``nbytes``
    (the bytes each read: the tensor's, one element for the scalar reads)."""

    METHODS = ("cpu", "tolist", "item", "__bool__", "__int__", "__float__")
    SKIP = ("testing.py", os.path.join("kernels", "reference.py"))
    """Not counted: this module, and the kernels' CPU reference (what runs the tiles where Triton cannot; on a GPU the
    Triton kernels read nothing onto the host)."""

    def __init__(self) -> None:
        self.root = os.path.dirname(os.path.abspath(__file__))   # the package (this module imports none of it)
        self.calls: list[str] = []
        self.nbytes: list[int] = []
        self.where: list[str] = []
        self._saved: dict[str, object] = {}

    def _ours(self) -> str | None:
        import sys

        frame = sys._getframe(2)
        path = frame.f_code.co_filename
        if path.startswith(self.root) and not path.endswith(self.SKIP):
            return f"{os.path.relpath(path, self.root)}:{frame.f_lineno}"
        return None

    def _wrap(self, name: str) -> None:
        fn = getattr(torch.Tensor, name)
        self._saved[name] = torch.Tensor.__dict__.get(name)

        def counted(t, *args, **kwargs):
            where = self._ours()
            if where is not None:
                self.calls.append(name)
                scalar = name in ("item", "__bool__", "__int__", "__float__")
                self.nbytes.append(t.element_size() if scalar else t.numel() * t.element_size())
                self.where.append(where)
            return fn(t, *args, **kwargs)

        setattr(torch.Tensor, name, counted)

    def __enter__(self) -> HostReads:
        for name in self.METHODS:
            self._wrap(name)
        return self

    def __exit__(self, *exc) -> None:
        for name, old in self._saved.items():
            if old is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, old)
        self._saved.clear()

    @property
    def total(self) -> int:
        return sum(self.nbytes)

    def largest(self, n: int = 5) -> list[tuple[int, str, str]]:
        """The ``n`` largest reads: (bytes, method, where)."""
        return sorted(zip(self.nbytes, self.calls, self.where, strict=True), reverse=True)[:n]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "torch._inductor.compile_fx", "ultraattn.passes.backend")
"""What the fork server imports once, so that each rank starts without importing it again (about 3.7 s of CPU per
rank here). Nothing in it reads the environment when imported that a test changes (the Triton kernels, which read
``TRITON_INTERPRET`` when decorated, are not in it), and importing it starts no thread."""


def _context():
    """Ranks fork from a server that has imported ``_PRELOAD`` where the platform has one and there is no CUDA device;
    else they are spawned. On a CUDA machine something ``_PRELOAD`` imports asks for the device count, which marks
    every later fork of the server as unable to use CUDA ("Cannot re-initialize CUDA in forked subprocess", seen on
    an H200 with torch 2.11, though ``torch.cuda.is_initialized()`` stays False there). Asking here marks this
    process the same way, which does not matter: its ranks are spawned."""
    if "forkserver" not in mp.get_all_start_methods() or torch.cuda.is_available():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(_PRELOAD))
    return ctx


def _entry(fn: Callable, rank: int, world: int, port: int, pg_timeout: float, threads: int, args: tuple,
           out: mp.Queue, environ: dict[str, str]) -> None:
    try:
        os.environ.clear()   # the caller's environment as it is now (the fork server holds the one it started with)
        os.environ.update(environ)
        torch.set_num_threads(threads)
        import torch.distributed as dist

        if world > 0:
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                    timeout=datetime.timedelta(seconds=pg_timeout))
        try:
            res = fn(rank, world, *args)
        finally:
            if world > 0 and dist.is_initialized():
                dist.destroy_process_group()
        buf = io.BytesIO()
        torch.save(res, buf)
        out.put((rank, True, buf.getvalue()))
    except BaseException:  # noqa: BLE001 - everything goes back to the caller
        out.put((rank, False, traceback.format_exc()))


def run_ranks(fn: Callable, world: int, *, args: tuple = (), timeout: float = 180.0, pg_timeout: float = 60.0,
              threads: int = 1, env: dict[str, str] | None = None, may_exit: frozenset[int] = frozenset()) -> list:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks in processes of their own (forked from a server that
    has imported torch, or spawned on a CUDA machine: ``_context``), each with this process's environment plus
    ``env``; returns the results in rank order. Forked ranks print to the stdout and stderr the fork server started
    with (the first call's): a later redirection of this process's file descriptors, e.g. pytest's ``capfd``, does
    not reach them.

    ``world=0`` runs one process without a process group (rank 0, "world" argument 0). Ranks in
    ``may_exit`` may die without a result (tests of failure handling): their result is None.
    """
    ctx = _context()
    port = free_port()
    out = ctx.Queue()
    n = max(world, 1)
    old = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    try:
        environ = dict(os.environ)
        procs = [ctx.Process(target=_entry, args=(fn, r, world, port, pg_timeout, threads, args, out, environ),
                             daemon=True) for r in range(n)]
        for p in procs:
            p.start()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    results: dict[int, object] = {}
    errors: dict[int, str] = {}
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
    try:
        while len(results) + len(errors) < n:
            left = (deadline - datetime.datetime.now()).total_seconds()
            if left <= 0:
                break
            try:
                rank, ok, payload = out.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in results and r not in errors]
                if dead and all(not p.is_alive() for r, p in enumerate(procs) if r not in results and r not in errors):
                    # drain anything that arrived late, then report the silent ranks
                    try:
                        while True:
                            rank, ok, payload = out.get(timeout=0.5)
                            (results if ok else errors)[rank] = (torch.load(io.BytesIO(payload), weights_only=False)
                                                                 if ok else payload)
                    except queue.Empty:
                        pass
                    for r in dead:
                        if r not in results and r not in errors:
                            errors[r] = f"rank {r} exited with code {procs[r].exitcode} without a result"
                    break
                continue
            if ok:
                results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
            else:
                errors[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=0.5 if errors or len(results) < n else 5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    for r in may_exit:
        if r not in results and (r in errors and "without a result" in errors[r] or r not in errors):
            errors.pop(r, None)
            results[r] = None
    missing = [r for r in range(n) if r not in results and r not in errors]
    if errors or missing:
        msg = [f"rank {r} failed:\n{errors[r]}" for r in sorted(errors)]
        msg += [f"rank {r} did not finish within {timeout:g} s" for r in missing]
        raise RankFailure("\n".join(msg))
    return [results[r] for r in range(n)]


# ----------------------------------------------------------------------------- random masks the checks draw
def random_block_dense(seed: int, seqlen: int, block: int) -> torch.Tensor:
    """A random block-structured bool mask ``[S, S]``: each block EMPTY, FULL or random PARTIAL; every row attends."""
    g = torch.Generator().manual_seed(seed)
    nb = -(-seqlen // block)
    kind = torch.randint(0, 3, (nb, nb), generator=g)
    fine = torch.rand(nb * block, nb * block, generator=g) < 0.5
    kind_el = kind.repeat_interleave(block, 0).repeat_interleave(block, 1)
    dense = (kind_el == 2) | ((kind_el == 1) & fine)
    dense = dense[:seqlen, :seqlen].clone()
    dense.fill_diagonal_(True)
    return dense


def random_block_table(seed: int, heads: int, seqlen: int, block: int) -> torch.Tensor:
    """bool ``[heads, nb, nb]``: the KV blocks each Q block of each head attends (about half, always its own), as in
    attn-gym's VSA masks, whose BlockMask says it all and whose mask_mod is ``noop_mask``."""
    g = torch.Generator().manual_seed(seed)
    nb = -(-seqlen // block)
    table = torch.rand(heads, nb, nb, generator=g) < 0.5
    table[:, torch.arange(nb), torch.arange(nb)] = True
    return table


def block_select_mask(table: torch.Tensor, block: int, seqlen: int):
    """The BlockMask of per-head KV block lists ``table`` (``random_block_table``) under ``noop_mask``: its blocks
    alone carry the mask."""
    from torch.nn.attention.flex_attention import BlockMask, noop_mask

    order = torch.sort(table.to(torch.int8), dim=-1, descending=True, stable=True).indices
    return BlockMask.from_kv_blocks(table.sum(-1)[None].to(torch.int32), order[None].to(torch.int32),
                                    BLOCK_SIZE=block, mask_mod=noop_mask, seq_lengths=(seqlen, seqlen))


# ----------------------------------------------------------------------------- the numerics policy
_EPS = {"fp32": torch.finfo(torch.float32).eps, "bf16": torch.finfo(torch.bfloat16).eps,
        "fp16": torch.finfo(torch.float16).eps}


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, dout: torch.Tensor,
                    dlse: torch.Tensor, dtype: torch.dtype, score_mod=None) -> dict:
    """Dense single-device attention in ``dtype`` (torch.float64: the oracle) and its gradients under the loss
    ``sum(out * dout) + sum(lse * dlse)`` (so dLSE is exercised): ``out``, ``lse``, ``dq``, ``dk``, ``dv``.

    ``q`` ``[B, H, S, D]``, ``k`` / ``v`` ``[B, Hkv, S, D]`` (grouped-query attention when ``Hkv < H``), ``allowed``
    a bool mask broadcastable to ``[B, H, S, S]``; the LSE is fp32 below fp64, as the kernels keep it.
    ``score_mod``: fn(scaled scores ``[B, H, S, S]``) -> modified scores, applied before the mask (a FlexAttention
    score_mod with its indices bound by the caller); tensors it closes over that require grad get theirs."""
    q, k, v = (x.detach().to(dtype).requires_grad_() for x in (q, k, v))
    r = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(r, 1), v.repeat_interleave(r, 1)
    scores = (q @ kk.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
    if score_mod is not None:
        scores = score_mod(scores.double() if dtype == torch.float64 else scores.float()).to(scores.dtype)
    scores = scores.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores.float() if dtype != torch.float64 else scores, -1)
    out = torch.softmax(scores, -1).nan_to_num(0.0) @ vv
    ((out.double() * dout.double()).sum() + (lse.double() * dlse.double()).sum()).backward()
    return {"out": out.detach(), "lse": lse.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def check_2x(got: dict, ref64: dict, ref: dict, dtype: str) -> list[str]:
    """The numerics policy (docs/numerics.md): each of out, lse, dq, dk, dv within 2x the same-precision single-device
    reference's error against fp64 (plus a floor of 4 ulps of the tensor's scale, for a reference that happens to be
    exact). Equal infinities (the LSE of a row that attends nowhere) count as no error. The violations."""
    eps = _EPS[dtype]

    def max_err(a, b):
        a, b = a.double().cpu(), b.double().cpu()
        same_inf = torch.isinf(a) & torch.isinf(b) & (a == b)
        d = torch.where(same_inf, torch.zeros_like(a), (a - b).abs())
        return float(d.max()) if d.numel() else 0.0

    bad = []
    for name in ("out", "lse", "dq", "dk", "dv"):
        if tuple(got[name].shape) != tuple(ref64[name].shape):
            bad.append(f"{name}: shape {tuple(got[name].shape)} != reference {tuple(ref64[name].shape)}")
            continue
        err, base = max_err(got[name], ref64[name]), max_err(ref[name], ref64[name])
        scale = float(ref64[name].double().abs().nan_to_num(0, 0, 0).max()) or 1.0
        tol = 2 * base + 4 * eps * scale
        if not err <= tol:
            bad.append(f"{name}: err {err:.3g} > 2 x same-precision reference err {base:.3g} (+floor) = {tol:.3g}")
    return bad


def check_step(got: dict, ref64: dict, ref32: dict, compiled: dict | None = None) -> list[str]:
    """A training step by the policy: ``got``'s loss and every gradient (dicts with ``loss`` and ``grads``) against
    the fp64 eager single-process step, within 2x the fp32 same-precision step's error, plus a floor of 16 fp32
    ulps of each tensor's scale (Inductor legitimately reorders the reductions around attention, layer norm and
    cross entropy, which moves fp32 results by a few ulps without ultraattn). The same-precision step is the fp32
    eager one, or, given ``compiled`` (the fp32 step of the same program compiled without ultraattn, by the same
    compiler), the one of the two further from fp64: on a GPU Inductor's own code for the rest of the model can
    move some gradients several times further than eager does (docs/numerics.md). The violations."""

    def err(a, b):
        return float((a.double().cpu() - b.double().cpu()).abs().max())

    def parts(step: dict) -> dict:
        return {"loss": step["loss"], **step["grads"]}

    g, p64, p32 = parts(got), parts(ref64), parts(ref32)
    pc = parts(compiled) if compiled is not None else None
    bad = []
    for name in p64:
        base = err(p32[name], p64[name])
        if pc is not None:
            base = max(base, err(pc[name], p64[name]))
        tol = 2 * base + 16 * _EPS["fp32"] * (float(p64[name].abs().max()) or 1.0)
        e = err(g[name], p64[name])
        if not e <= tol:
            bad.append(f"{name}: err {e:.3g} > {tol:.3g}")
    return bad
