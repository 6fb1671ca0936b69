"""What every message and process group of ultraattn shares: message buffers and their byte log, the process
group a plan runs on (``resolve_group``), checks through the rendezvous store, and a clean exit. How bytes move is
``transport.py``'s.

Every message is ONE contiguous uint8 buffer holding the tensors of one planner unit
(plan.py's byte table: ``pack`` / ``unpack``), so the bytes that move are exactly ``buffer.numel()``
and can be compared with the planner's ``Transfer.nbytes`` (``CommLog``).

Every wait is bounded: a peer that died or never joins raises ``RankTimeoutError`` naming
that peer and what was expected from it, instead of hanging.

ultraattn holds process groups only weakly (``GroupRef``) and, at exit, frees groups the user destroyed
that a PyTorch module still holds (``release_destroyed_groups``): a group that outlives
``destroy_process_group()`` into interpreter shutdown can abort the process (see there).
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
import types
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from ..planner.plan import Mesh


class RankTimeoutError(RuntimeError):
    """A peer did not deliver within the timeout (it died, never joined, or planned differently)."""

    def __init__(self, msg: str):
        super().__init__(f"ultraattn: {msg}")


def pack(tensors: Sequence[Tensor]) -> Tensor:
    """Concatenate the raw bytes of ``tensors`` (each made contiguous) into one uint8 buffer."""
    return torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for t in tensors])


def unpack(buf: Tensor, specs: Sequence[tuple[tuple[int, ...], torch.dtype]]) -> list[Tensor]:
    """Inverse of ``pack`` given the (shape, dtype) of each piece."""
    if buf.numel() != spec_bytes(specs):
        raise RuntimeError(f"ultraattn: message of {buf.numel()} bytes does not match its pieces "
                           f"({spec_bytes(specs)} bytes)")
    out, off = [], 0
    for shape, dtype in specs:
        n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        out.append(buf[off:off + n].view(dtype).view(shape))
        off += n
    return out


def spec_bytes(specs: Sequence[tuple[tuple[int, ...], torch.dtype]]) -> int:
    return sum(torch.Size(s).numel() * torch.empty((), dtype=d).element_size() for s, d in specs)


@dataclass(slots=True)
class CommLog:
    """What this rank moved in one call: one record per message, plus totals per phase."""

    records: list[tuple] = field(default_factory=list)
    """(phase, direction 'send'|'recv', tensor, chunk, head_group, src, dst, nbytes, tag)."""

    def totals(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for phase, direction, *_rest, nbytes, _tag in self.records:
            d = out.setdefault(phase, {"sent": 0, "recv": 0, "messages": 0})
            d["sent" if direction == "send" else "recv"] += nbytes
            d["messages"] += 1
        return out


class GroupRef:
    """ultraattn's handle on a process group: a weak reference, so that no plan, layout or cache of ultraattn keeps
    a group alive after ``destroy_process_group()`` (why that matters: ``release_destroyed_groups``). While a
    group is in use, torch.distributed holds it (its registry, a DeviceMesh); ``get`` names the fix when it is
    gone. ``GroupRef(None)``: one process, no group."""

    __slots__ = ("_ref",)

    def __init__(self, group) -> None:
        self._ref = None if group is None else weakref.ref(group)

    def get(self):
        """The group (None for one process); RuntimeError once it was destroyed (freed, or no longer registered)."""
        if self._ref is None:
            return None
        group = self._ref()
        if group is None or not _is_registered(group):
            raise RuntimeError("ultraattn: the process group this plan was made for was destroyed "
                               "(destroy_process_group); make the plan again (plan_attention) in the current process "
                               "group")
        return group

    def __repr__(self) -> str:
        return "GroupRef(None)" if self._ref is None else f"GroupRef({self._ref()!r})"


NO_GROUP = GroupRef(None)


def ranks_differing(key: str, tensors, *, rank: int, world: int, timeout: float) -> list[int]:
    """Ranks whose ``tensors`` differ from rank 0's (a collective through the store: every rank calls it).

    Compares a cheap fingerprint (shape, dtype, fp64 sum and sum of squares of each tensor)."""
    import hashlib

    fp = []
    for t in tensors:
        d = t.detach().double()
        fp.append((tuple(t.shape), str(t.dtype), float(d.sum()), float((d * d).sum())))
    mine = hashlib.blake2b(repr(fp).encode(), digest_size=8).digest()
    got = store_exchange(key, mine, rank=rank, world=world, timeout=timeout)
    return [r for r in range(world) if got[r] != got[0]]


def store_exchange(key: str, value: bytes, *, rank: int, world: int, timeout: float) -> list[bytes]:
    """Every rank publishes ``value`` under ``key`` in the process group's store and reads everyone's.

    Names every rank that has not published within ``timeout`` (RankTimeoutError). The store is
    the rendezvous channel torch.distributed already has; using it leaves the data connections
    untouched, so no rank's failure cascades into unrelated errors on the others.
    """
    store = dist.distributed_c10d._get_default_store()
    store.set(f"{key}/{rank}", value)
    deadline = time.monotonic() + timeout
    missing = [r for r in range(world) if r != rank]
    nap = 1e-3
    while True:
        try:
            missing = [r for r in missing if not store.check([f"{key}/{r}"])]
        except (RuntimeError, OSError) as exc:  # DistNetworkError/DistStoreError subclass RuntimeError
            # The store's host (rank 0 under torchrun) went away, typically because it already
            # failed on the same absent rank and exited. Name what we know instead of a socket error.
            who = ", ".join(f"rank {r}" for r in missing)
            raise RankTimeoutError(
                f"rank {rank}: the rendezvous store closed while waiting for {who} to reach "
                f"dist_attention (its host, rank 0 under torchrun, exited or crashed; "
                f"{type(exc).__name__}: {str(exc).splitlines()[0]})"
            ) from exc
        if not missing:
            break
        if time.monotonic() > deadline:
            who = ", ".join(f"rank {r}" for r in missing)
            raise RankTimeoutError(
                f"rank {rank}: {who} did not reach dist_attention within {timeout:g} s "
                f"(died, never joined, or is stuck elsewhere)"
            )
        time.sleep(nap)
        nap = min(nap * 2, 0.05)
    values = [store.get(f"{key}/{r}") for r in range(world)]
    _host_waits_for_readers(store, key, rank=rank, world=world, deadline=deadline)
    return values


def _host_waits_for_readers(store, key: str, *, rank: int, world: int, deadline: float) -> None:
    """Rank 0 hosts the store: it returns only once every rank has read (or the deadline passed), so a
    rank 0 that goes on to fail and exit (a mismatch the exchange just found) cannot close the store
    under a peer still reading, which then saw a socket error instead of the mismatch."""
    store.set(f"{key}/read/{rank}", b"1")
    if rank != 0:
        return
    waiting = list(range(1, world))
    nap = 1e-3
    while waiting and time.monotonic() < deadline:
        waiting = [r for r in waiting if not store.check([f"{key}/read/{r}"])]
        time.sleep(nap if waiting else 0)
        nap = min(nap * 2, 0.05)


def resolve_group(mesh, group) -> tuple[Mesh, tuple[int, ...], object, int]:
    """The process group a plan runs on: (planner mesh, global ranks in plan order, communication group, this
    plan rank)."""
    if not (dist.is_available() and dist.is_initialized()):
        env_world = int(os.environ.get("WORLD_SIZE", "1") or 1)
        if mesh is not None or group is not None:
            raise RuntimeError(
                "ultraattn.plan_attention: `mesh`/`group` given but torch.distributed is not initialised; call "
                "torch.distributed.init_process_group first (or pass neither for one process)"
            )
        if env_world > 1:
            raise RuntimeError(
                f"ultraattn.plan_attention: WORLD_SIZE={env_world} but torch.distributed is not initialised; call "
                f"torch.distributed.init_process_group(backend='gloo' or 'nccl') before planning"
            )
        return Mesh(nodes=1, devices=1), (0,), None, 0
    me = dist.get_rank()
    if mesh is not None:
        from torch.distributed.device_mesh import DeviceMesh

        if not isinstance(mesh, DeviceMesh):
            raise TypeError(f"ultraattn: `mesh` must be a torch.distributed DeviceMesh or None, got "
                            f"{type(mesh).__name__}")
        grid = mesh.mesh
        if grid.dim() == 1:
            pm = Mesh(nodes=1, devices=grid.numel())
        elif grid.dim() == 2:
            pm = Mesh(nodes=grid.shape[0], devices=grid.shape[1])
        else:
            raise ValueError(f"ultraattn: `mesh` must be 1-D or 2-D (nodes x devices), got {grid.dim()}-D "
                             f"{tuple(grid.shape)}")
        ranks = tuple(int(x) for x in grid.flatten().tolist())
        comm_group = group if group is not None else (mesh.get_group() if grid.dim() == 1 else dist.group.WORLD)
        group_ranks = tuple(dist.get_process_group_ranks(comm_group))
        if sorted(group_ranks) != sorted(ranks):
            raise ValueError(
                f"ultraattn: `mesh` covers ranks {sorted(ranks)} but the process group has ranks "
                f"{sorted(group_ranks)}; pass a mesh over exactly the group's ranks (or the matching `group`)"
            )
    else:
        comm_group = group if group is not None else dist.group.WORLD
        ranks = tuple(dist.get_process_group_ranks(comm_group))
        pm = Mesh(nodes=1, devices=len(ranks))
    if me not in ranks:
        raise ValueError(f"ultraattn: this process (global rank {me}) is not in the plan's ranks {list(ranks)}")
    _register_exit_handler()
    return pm, ranks, comm_group, ranks.index(me)


# ----------------------------------------------------------------------------- a clean exit
# [Note: destroyed groups at exit] ``torch/distributed/nn/functional.py`` (torch 2.11-2.13) binds
# ``group=group.WORLD`` as DEFAULT ARGUMENTS of its functions (broadcast, all_reduce, all_to_all, ... ), evaluated
# when the module is imported. torch._dynamo imports it (via torch.distributed._shard.sharded_tensor.reshard), and
# ultraattn's first kernel launch / compile imports torch._dynamo, typically AFTER init_process_group: the WORLD
# ProcessGroup then stays referenced by those defaults after destroy_process_group() and is freed only while the
# interpreter shuts down. Its gloo worker threads are still alive then; one that drops the last reference to a
# finished work whose tensors have Python objects must take the GIL (TensorImpl::decref_pyobject ->
# pybind11::gil_scoped_acquire), and during Py_FinalizeEx that calls pthread_exit, whose forced unwinding through a
# noexcept frame ends in std::terminate: "terminate called without an active exception", SIGABRT, after the
# program's last line (core dump: gloo runLoop -> ~AsyncAllreduceWork -> decref_pyobject -> take_gil ->
# PyThread_exit_thread -> std::terminate, main thread in Py_FinalizeEx). Plain PyTorch shows it without
# ultraattn (torch 2.13, 2 gloo ranks, 100 steps of collectives, destroy_process_group(), exit): with
# `import torch._dynamo` after init 10 of 30 runs aborted; holding dist.group.WORLD in a variable instead 8 of 30;
# neither 0 of 30; dynamo plus this handler's fix 0 of 30 (all_reduce alone: 5 of 10; with isend/irecv in each
# step 0 of 10, so how often it strikes depends on a program's last operations). Freed at destroy_process_group(),
# the group joins its workers while the interpreter is whole. The workaround is narrow: at exit, after the user
# destroyed the group, drop only those stale defaults (to None: "the default group", what the module binds when
# imported before init). Nothing changes for groups still registered.
_EXIT_LOCK = threading.Lock()
_EXIT_REGISTERED = False
_HOLDERS = ("torch.distributed.nn.functional",)
"""Modules known to hold process groups in function defaults."""


def _register_exit_handler() -> None:
    global _EXIT_REGISTERED
    with _EXIT_LOCK:
        if not _EXIT_REGISTERED:
            atexit.register(release_destroyed_groups)
            _EXIT_REGISTERED = True


def _is_registered(group) -> bool:
    if not (dist.is_available() and dist.is_initialized()):
        return False
    pg_map = getattr(getattr(dist.distributed_c10d, "_world", None), "pg_map", None)
    return group in pg_map if pg_map is not None else True


def _live_groups() -> list:
    """The process groups torch.distributed still has registered (none after destroy_process_group())."""
    if not (dist.is_available() and dist.is_initialized()):
        return []
    world = getattr(dist.distributed_c10d, "_world", None)
    pg_map = getattr(world, "pg_map", None)
    return list(pg_map) if pg_map is not None else [dist.group.WORLD]


def release_destroyed_groups() -> int:
    """Drop the references PyTorch modules keep in function defaults to process groups that were destroyed
    (``[Note: destroyed groups at exit]`` above); returns how many defaults were replaced. Registered with
    ``atexit`` when ultraattn first binds a plan to a group; harmless to call at any time."""
    live = _live_groups()
    pg_type = getattr(dist, "ProcessGroup", None)
    if pg_type is None:
        return 0

    def stale(value) -> bool:
        return isinstance(value, pg_type) and not any(value is g for g in live)

    replaced = 0
    for name in _HOLDERS:
        module = sys.modules.get(name)
        for fn in vars(module).values() if module is not None else ():
            if not isinstance(fn, types.FunctionType):
                continue
            if fn.__defaults__ and any(stale(d) for d in fn.__defaults__):
                replaced += sum(stale(d) for d in fn.__defaults__)
                fn.__defaults__ = tuple(None if stale(d) else d for d in fn.__defaults__)
            if fn.__kwdefaults__ and any(stale(d) for d in fn.__kwdefaults__.values()):
                replaced += sum(stale(d) for d in fn.__kwdefaults__.values())
                fn.__kwdefaults__ = {k: None if stale(d) else d for k, d in fn.__kwdefaults__.items()}
    return replaced
