"""How a rank's messages are ordered with its kernels on one device: a communication stream beside the compute one.

On a GPU the host thread only enqueues work. Posting a message on the compute stream would make it leave after
every kernel the host enqueued before the post, even when its bytes were there long before. A unit relayed from
rank to rank is such a message: it lands while this rank computes, and the program posts it where its turn comes,
behind launches that have nothing to do with it. So on CUDA the executor's IO (``executor.EagerIO``, which both
eager and compiled programs use) moves bytes on a communication stream of its own:

* ``take``: a stage's receives are waited for and unpacked on the communication stream; then the compute stream
  waits for that stream (an event, not a host wait), so the launches after the wait see the bytes;
* ``post``: a stage's sends are packed and posted on the communication stream. If every piece was made there (a
  received unit sent on: a relay) it waits for nothing else; otherwise it first waits for the compute stream, as
  a post on the compute stream would (partials, and units the rank holds, are made by kernels).

Which tensors the communication stream made is known by identity (``_made``: the tensors ``take`` returned, held
weakly), so a piece that went through a copy on the compute stream is ordered after it, never raced.

Memory: a piece made on the compute stream and read by the communication stream is recorded for it
(``record_stream``), and so is a received tensor for the compute stream, so the caching allocator does not hand
either block out again while the other stream may still read it.

Elsewhere (CPU ranks, or ``ULTRAATTN_COMM_STREAM=0``) nothing changes: the host runs each kernel to its end and
posts after it. The planner's replay as executed models both (``planner.program.executed_graph``, selected by
``CostModel.async_kernels``). The communication stream has not yet been run on a GPU: ``benchmarks/gpu_check.py``'s
two-rank part checks it exactly on the next one.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor


def comm_stream_enabled() -> bool:
    """``ULTRAATTN_COMM_STREAM`` (default "1"): "0" posts every message on the compute stream."""
    value = os.environ.get("ULTRAATTN_COMM_STREAM", "1").strip()
    if value not in ("0", "1"):
        raise ValueError(f"ultraattn: ULTRAATTN_COMM_STREAM={value!r} must be '0' (messages on the compute stream) "
                         f"or '1' (a communication stream on CUDA); unset it for the default")
    return value == "1"


class CudaStreams:
    """The stream operations ``CommStreams`` needs, on one CUDA device (a test passes a recorder instead)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.comm = torch.cuda.Stream(device=device)

    def compute(self):
        """The compute stream: the current one (so call it outside ``on_comm``)."""
        return torch.cuda.current_stream(self.device)

    @contextmanager
    def on_comm(self) -> Iterator[None]:
        with torch.cuda.stream(self.comm):
            yield

    def comm_waits_compute(self) -> None:
        self.comm.wait_stream(self.compute())

    def compute_waits_comm(self) -> None:
        self.compute().wait_stream(self.comm)

    def read_by_comm(self, t: Tensor) -> None:
        t.record_stream(self.comm)

    def read_by_compute(self, t: Tensor) -> None:
        t.record_stream(self.compute())


class CommStreams:
    """One rank's ordering of messages and kernels on one device (module docstring). ``api``: the stream
    operations (default: ``CudaStreams`` on a CUDA device with the stream enabled, else none: the host order)."""

    def __init__(self, device: torch.device, api=None):
        if api is None and device.type == "cuda" and comm_stream_enabled():
            api = CudaStreams(device)
        self.api = api
        self._made: weakref.WeakValueDictionary[int, Tensor] = weakref.WeakValueDictionary()

    @property
    def active(self) -> bool:
        return self.api is not None

    def made_here(self, t: Tensor) -> bool:
        """Whether the communication stream made ``t`` (``take`` returned it, and it is still that tensor)."""
        return self._made.get(id(t)) is t

    def post(self, pieces: Sequence[Tensor], fn: Callable[[], object]):
        """``fn()`` (pack and post a stage's sends) on the communication stream, after what ``pieces`` need."""
        if self.api is None:
            return fn()
        foreign = [p for p in pieces if not self.made_here(p)]
        if foreign:   # (before switching: inside ``on_comm`` the current stream is the communication one)
            self.api.comm_waits_compute()
            for p in foreign:
                self.api.read_by_comm(p)
        with self.api.on_comm():
            return fn()

    def take(self, fn: Callable[[], list[tuple[object, list[Tensor]]]]) -> list[tuple[object, list[Tensor]]]:
        """``fn()`` (wait for a stage's receives and unpack them: [(transfer, pieces)]) on the communication stream;
        the compute stream then waits for it. The pieces are remembered as made there."""
        if self.api is None:
            return fn()
        with self.api.on_comm():
            got = fn()
        self.api.compute_waits_comm()
        for _t, pieces in got:
            for p in pieces:
                self.api.read_by_compute(p)
                self._made[id(p)] = p
        return got
