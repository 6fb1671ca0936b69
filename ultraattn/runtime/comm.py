"""Point-to-point messages over torch.distributed with byte accounting and bounded waits.

Every message is ONE contiguous uint8 buffer holding the tensors of one planner unit
(plan.py's byte table), so the bytes that move are exactly ``buffer.numel()`` and can be
compared with the planner's ``Transfer.nbytes``. Each message carries the index of its
transfer in the plan as its tag, so matching never depends on posting order (gloo honours
tags; NCCL ignores them and matches in order, which both sides keep by walking the plan's
transfer list in the same order).

Every wait is bounded: a peer that died or never joins raises ``RankTimeoutError`` naming
that peer and what was expected from it, instead of hanging.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor


class RankTimeoutError(RuntimeError):
    """A peer did not deliver within the timeout (it died, never joined, or planned differently)."""


def pack(tensors: Sequence[Tensor]) -> Tensor:
    """Concatenate the raw bytes of ``tensors`` (each made contiguous) into one uint8 buffer."""
    return torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for t in tensors])


def unpack(buf: Tensor, specs: Sequence[tuple[tuple[int, ...], torch.dtype]]) -> list[Tensor]:
    """Inverse of ``pack`` given the (shape, dtype) of each piece."""
    out, off = [], 0
    for shape, dtype in specs:
        n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        out.append(buf[off:off + n].view(dtype).view(shape))
        off += n
    if off != buf.numel():
        raise RuntimeError(f"message of {buf.numel()} bytes does not match its layout ({off} bytes)")
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


class Comm:
    """Messages between plan ranks over a process group (or none at world size 1)."""

    def __init__(self, *, rank: int, global_ranks: Sequence[int], group, timeout: float) -> None:
        self.rank = rank
        self.global_ranks = list(global_ranks)
        self.group = group
        self.timeout = timeout
        self.log = CommLog()

    def _td(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=self.timeout)

    def isend(self, buf: Tensor, *, dst: int, tag: int, record: tuple) -> object:
        self.log.records.append((record[0], "send", *record[1:], buf.numel(), tag))
        return dist.isend(buf, dst=self.global_ranks[dst], group=self.group, tag=tag)

    def irecv(self, nbytes: int, *, src: int, tag: int, device: torch.device, record: tuple) -> tuple[Tensor, object]:
        buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.log.records.append((record[0], "recv", *record[1:], nbytes, tag))
        return buf, dist.irecv(buf, src=self.global_ranks[src], group=self.group, tag=tag)

    def wait(self, work, *, peer: int, what: str) -> None:
        """Wait for one message with the timeout; name the peer on failure."""
        try:
            ok = work.wait(timeout=self._td())
        except Exception as exc:  # noqa: BLE001 - gloo raises RuntimeError subclasses with varied text
            raise RankTimeoutError(
                f"rank {self.rank}: no {what} from rank {peer} within {self.timeout:g} s "
                f"(rank {peer} died, never joined, or runs a different plan): {exc}"
            ) from exc
        if ok is False:
            raise RankTimeoutError(f"rank {self.rank}: no {what} from rank {peer} within {self.timeout:g} s")


def all_gather_bytes(payload: Tensor, *, group, world: int, timeout: float, what: str, rank: int) -> Tensor:
    """All-gather a small uint8 vector with a bounded wait: [world, n]. Names silent ranks on timeout."""
    out = torch.empty(world * payload.numel(), dtype=torch.uint8, device=payload.device)
    work = _all_gather_single(out, payload, group=group, async_op=True)
    try:
        work.wait(timeout=datetime.timedelta(seconds=timeout))
    except Exception as exc:  # noqa: BLE001
        raise RankTimeoutError(
            f"rank {rank}: {what} did not complete within {timeout:g} s; a rank died or never joined: {exc}"
        ) from exc
    return out.view(world, payload.numel())


def _all_gather_single(out: Tensor, inp: Tensor, *, group, async_op: bool):
    """``all_gather_single`` (torch >= 2.13) or ``all_gather_into_tensor`` (older: the GPU machine's 2.11)."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, inp, group=group, async_op=async_op)
