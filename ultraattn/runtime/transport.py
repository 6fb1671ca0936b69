"""How ranks move bytes: one interface, one class per kind of process group.

Everything that communicates goes through a ``Transport``: the executor's stages, the exchange of masks known at
run time, the sequence layouts' all-gathers and all-reduces, and the calibration (so calibration times the
transport the runtime uses). A stage posts all of its messages at once and waits on a handle::

    handle = transport.post(sends, recvs)   # nothing waits
    bufs = transport.wait(handle)           # the stage's receives, in posting order
    transport.settle(handle)                # its sends (their buffers may be freed after this)

Implementations, chosen by the process group's backend (``transport_for``):

* ``TaggedTransport`` (gloo, and any backend but NCCL): one ``isend`` / ``irecv`` per message, each tagged with its
  transfer's index, so matching never depends on posting order; every wait bounded by the timeout and naming the
  peer (a gloo timeout raises; NCCL's would not).
* ``StagedTransport`` (gloo with CUDA tensors): the tagged messages and the collectives, staged through host
  memory, since gloo moves host buffers only. It is what lets two ranks share one GPU (NCCL refuses two ranks on
  one device): ``benchmarks/gpu_check.py`` runs the explicit programs that way. On CPU tensors it is the tagged one.
* ``BatchedTransport`` (NCCL): a stage's messages as one ``batch_isend_irecv``, which NCCL runs as one fused group
  of point-to-point calls. NCCL ignores tags and matches in posting order, which both sides keep by walking the
  plan's transfers in the same order. It also runs on gloo, which is how the tests exercise it on CPU.

Byte accounting is exact per message: every posted buffer is one record of ``log`` (``CommLog``), whose size is the
buffer's, compared by the callers with the planner's byte tables.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from .comm import NO_GROUP, CommLog, GroupRef, RankTimeoutError


@dataclass(frozen=True, slots=True)
class Send:
    """One message to post: ``buf`` (one contiguous uint8 buffer) to plan rank ``peer``."""

    buf: Tensor
    peer: int
    tag: int
    record: tuple
    """(phase, tensor, chunk, head group, src, dst): the ``CommLog`` record."""
    what: str = "message"


@dataclass(frozen=True, slots=True)
class Recv:
    """One message to expect: ``nbytes`` from plan rank ``peer``, into a new buffer on ``device``."""

    nbytes: int
    peer: int
    tag: int
    device: torch.device
    record: tuple
    what: str = "message"


@dataclass(slots=True)
class Handle:
    """A posted stage: its sends and receives with their works (``post``)."""

    sends: list[tuple[Send, object]] = field(default_factory=list)
    recvs: list[tuple[Recv, Tensor, object]] = field(default_factory=list)
    settled: bool = False
    landing: list | None = None
    """The devices the receives go to, where the transport took them into host memory (``StagedTransport``)."""


class Transport:
    """Messages and collectives among the plan ranks ``global_ranks`` of one process group (module docstring).

    ``rank`` is this process's plan rank; ``peer`` arguments are plan ranks too."""

    def __init__(self, *, rank: int, global_ranks: Sequence[int], group_ref: GroupRef = NO_GROUP,
                 timeout: float = 300.0) -> None:
        self.rank = rank
        self.global_ranks = tuple(global_ranks)
        self.group_ref = group_ref
        self.timeout = timeout
        self.log = CommLog()

    @property
    def group(self):
        return self.group_ref.get()

    @property
    def world(self) -> int:
        return len(self.global_ranks)

    # ------------------------------------------------------------------ point to point
    def post(self, sends: Sequence[Send], recvs: Sequence[Recv]) -> Handle:
        """Post a stage's messages (nothing waits); every message is logged."""
        for s in sends:
            self.log.records.append((s.record[0], "send", *s.record[1:], s.buf.numel(), s.tag))
        bufs = [torch.empty(r.nbytes, dtype=torch.uint8, device=r.device) for r in recvs]
        for r in recvs:
            self.log.records.append((r.record[0], "recv", *r.record[1:], r.nbytes, r.tag))
        try:
            send_works, recv_works = self._post(sends, recvs, bufs)
        except Exception as exc:  # noqa: BLE001 - a closed connection fails at post time
            peers = sorted({m.peer for m in (*sends, *recvs)})
            raise RankTimeoutError(f"rank {self.rank}: cannot post messages to/from rank(s) {peers} (a peer died "
                                   f"or timed out earlier): {exc}") from exc
        return Handle(sends=list(zip(sends, send_works)), recvs=list(zip(recvs, bufs, recv_works)))

    def wait(self, handle: Handle) -> list[Tensor]:
        """The stage's received buffers, in posting order (waits for each, bounded, naming its peer)."""
        for r, _buf, work in handle.recvs:
            self._finish(work, f"no {r.what} from rank {r.peer}")
        return [buf for _r, buf, _w in handle.recvs]

    def settle(self, handle: Handle) -> None:
        """Wait for the stage's sends (a peer that never receives is named)."""
        if not handle.settled:
            for s, work in handle.sends:
                self._finish(work, f"rank {s.peer} did not take the {s.what}")
            handle.settled = True

    def _post(self, sends, recvs, bufs) -> tuple[list, list]:
        raise NotImplementedError

    # ------------------------------------------------------------------ collectives
    def all_gather(self, x: Tensor, what: str) -> list[Tensor]:
        """Every rank's ``x`` (same shape everywhere), in plan-rank order."""
        if self.world == 1:
            return [x]
        x = x.contiguous()
        buf = torch.empty((self.world * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # (torch < 2.13: the latter)
        group = self.group
        self._finish(fn(buf, x, group=group, async_op=True), f"{what} did not complete")
        order = ([dist.get_group_rank(group, g) for g in self.global_ranks] if group is not dist.group.WORLD
                 else list(self.global_ranks))
        n = x.shape[0]
        return [buf[order[r] * n:(order[r] + 1) * n] for r in range(self.world)]

    def all_reduce(self, x: Tensor, what: str) -> Tensor:
        """The sum of ``x`` over the ranks (a new tensor)."""
        out = x.detach().clone().contiguous()
        if self.world > 1:
            self._finish(dist.all_reduce(out, group=self.group, async_op=True), f"{what} did not complete")
        return out

    def barrier(self) -> None:
        if self.world > 1:
            self._finish(dist.barrier(group=self.group, async_op=True), "a barrier did not complete")

    # ------------------------------------------------------------------ waits
    def _finish(self, work, what: str) -> None:
        """Wait for ``work`` within the timeout; ``RankTimeoutError`` saying ``what`` did not happen.

        (Polling ``is_completed`` is no alternative: gloo's point-to-point works only complete inside ``wait``. A
        gloo timeout closes the connections, so the plan check uses the store instead: ``comm.store_exchange``.)"""
        try:
            ok = work.wait(timeout=datetime.timedelta(seconds=self.timeout))
        except Exception as exc:  # noqa: BLE001 - gloo raises RuntimeError subclasses with varied text
            raise RankTimeoutError(f"rank {self.rank}: {what} within {self.timeout:g} s (a rank died, never "
                                   f"joined, or runs a different plan): {exc}") from exc
        if ok is False:
            raise RankTimeoutError(f"rank {self.rank}: {what} within {self.timeout:g} s")


class TaggedTransport(Transport):
    """One tagged ``isend`` / ``irecv`` per message (gloo)."""

    def _post(self, sends, recvs, bufs):
        group = self.group
        send_works = [dist.isend(s.buf, dst=self.global_ranks[s.peer], group=group, tag=s.tag) for s in sends]
        recv_works = [dist.irecv(b, src=self.global_ranks[r.peer], group=group, tag=r.tag)
                      for r, b in zip(recvs, bufs, strict=True)]
        return send_works, recv_works


class StagedTransport(TaggedTransport):
    """Gloo on device tensors: each send copied to host memory first, each receive taken into host memory and
    copied to its device at ``wait``; collectives likewise. Byte accounting is the tagged transport's (the staging
    copies have the device buffers' sizes)."""

    def post(self, sends: Sequence[Send], recvs: Sequence[Recv]) -> Handle:
        cpu = torch.device("cpu")
        handle = super().post([dataclasses.replace(s, buf=s.buf.cpu()) for s in sends],
                              [dataclasses.replace(r, device=cpu) for r in recvs])
        handle.landing = [r.device for r in recvs]
        return handle

    def wait(self, handle: Handle) -> list[Tensor]:
        return [b.to(d) for b, d in zip(super().wait(handle), handle.landing, strict=True)]

    def all_gather(self, x: Tensor, what: str) -> list[Tensor]:
        if x.device.type == "cpu":
            return super().all_gather(x, what)
        return [p.to(x.device) for p in super().all_gather(x.cpu(), what)]

    def all_reduce(self, x: Tensor, what: str) -> Tensor:
        if x.device.type == "cpu":
            return super().all_reduce(x, what)
        return super().all_reduce(x.cpu(), what).to(x.device)


class BatchedTransport(Transport):
    """A stage's messages as one ``batch_isend_irecv`` (NCCL: one fused group call).

    Not yet run on NCCL (no GPU so far): PyTorch documents that when this is the first collective of a group, every
    rank of the group must take part, and a rank with nothing to send in a stage skips the call here. Warm the
    group first (any collective, e.g. the plan's broadcast) until a GPU run says otherwise."""

    def _post(self, sends, recvs, bufs):
        if not sends and not recvs:
            return [], []
        group = self.group
        ops = [dist.P2POp(dist.isend, s.buf, self.global_ranks[s.peer], group, s.tag) for s in sends]
        ops += [dist.P2POp(dist.irecv, b, self.global_ranks[r.peer], group, r.tag)
                for r, b in zip(recvs, bufs, strict=True)]
        works = dist.batch_isend_irecv(ops)
        if len(works) != len(ops):  # one work for the whole group (NCCL's coalesced call): every message waits on it
            works = [works[-1]] * len(ops)
        return works[:len(sends)], works[len(sends):]

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        group = self.group
        self._stream_waits = group is not None and dist.get_backend(group) == "nccl"
        """NCCL: a wait makes the stream wait, and NCCL's watchdog bounds it (the group's timeout)."""

    def _finish(self, work, what: str) -> None:
        if self._stream_waits:
            work.wait()
        else:
            super()._finish(work, what)


TRANSPORTS: dict[str, type[Transport]] = {"tagged": TaggedTransport, "staged": StagedTransport,
                                          "batched": BatchedTransport}
"""Every transport by name: a new one is a ``Transport`` subclass with its ``_post``, registered here."""


def transport_for(*, rank: int, global_ranks: Sequence[int], group_ref: GroupRef = NO_GROUP,
                  timeout: float = 300.0, kind: str = "auto") -> Transport:
    """The transport for a process group: ``kind`` "auto" picks by its backend (NCCL: batched; gloo on a machine
    with CUDA: staged, which is the tagged one for host tensors; else tagged), unless
    the environment variable ``ULTRAATTN_TRANSPORT`` names one (e.g. "batched" to run NCCL's on gloo)."""
    if kind == "auto":
        kind = os.environ.get("ULTRAATTN_TRANSPORT", "auto") or "auto"
    if kind == "auto":
        group = group_ref.get()
        backend = dist.get_backend(group) if group is not None else None
        kind = ("batched" if backend == "nccl" else
                "staged" if backend == "gloo" and torch.cuda.is_available() else "tagged")
    if kind not in TRANSPORTS:
        raise ValueError(f"ultraattn: transport {kind!r} (ULTRAATTN_TRANSPORT or `kind`) is not one of "
                         f"{sorted(TRANSPORTS)} or 'auto'; unset ULTRAATTN_TRANSPORT to choose by the group's backend")
    return TRANSPORTS[kind](rank=rank, global_ranks=global_ranks, group_ref=group_ref, timeout=timeout)
