"""Run an ``ExchangePlan`` on one rank: its tiles' layouts, its dispatch index, its two exchanges.

The explicit program of a site whose mask arrives at run time (``passes/explicit/runtime.py``) is a
fixed skeleton; what its nodes do comes from an ``ExchangeRun`` made per mask:

    run = make_run(mask_layout, plan, rank=r, device=dev, comm=comm, seq=...)
    h = post_kv(run, k_l, v_l)                 # one message per rank pair: the K/V chunks it needs
    ... local tile (q_l x k_l, run.local) ...   # overlaps the messages
    kbuf, vbuf = wait_kv(run, h)               # other ranks' chunks by slot (zeros where not needed)
    ... remote tile (q_l x kbuf, run.remote), LSE merge ...
    h = post_dkv(run, dkbuf, dvbuf)            # backward: partial dK/dV of the same chunks go home
    dk_in, dv_in = wait_dkv(run, h)            # summed at this rank's local positions

Every message is one contiguous buffer; its bytes are logged (``CommLog``) and must equal the plan's
(``ExchangePlan.bytes``). Every wait is bounded by the comm's timeout and names the peer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from ..kernels.layout import BlockSparseLayout, sub_layout, tile_grid
from ..masks.pattern import EMPTY, FULL
from ..planner.exchange import ExchangePlan
from .comm import Comm, CommLog, pack, unpack
from .sequence import SequenceShards

KV_TAG = 1 << 20
"""Message tag of the forward K/V exchange (the backward's is ``KV_TAG + 1``); one message per rank pair."""


def chunk_weights(layout: BlockSparseLayout, chunk: int, num_chunks: int, partial_overhead: float = 0.1
                  ) -> np.ndarray:
    """float64 [P, P]: cost-weighted blocks of every (q chunk, kv chunk) cell of ``layout`` summed over its (batch,
    head) pairs (a PARTIAL block costs ``1 + partial_overhead``), on a grid of ``num_chunks`` chunks of ``chunk``
    tokens (blocks past the layout are empty)."""
    kind = layout.kind.cpu()
    u, nq, nk = kind.shape
    uses = torch.bincount(layout.pattern_of.cpu().long(), minlength=u).double()
    w = torch.where(kind == FULL, 1.0, 1.0 + partial_overhead).double() * (kind != EMPTY)
    w = (w * uses[:, None, None]).sum(0)  # [NQ, NK]
    per_q, per_k = chunk // layout.q_block, chunk // layout.kv_block
    grid = torch.zeros(num_chunks * per_q, num_chunks * per_k, dtype=torch.float64)
    grid[:nq, :nk] = w
    return grid.view(num_chunks, per_q, num_chunks, per_k).sum((1, 3)).numpy()


def _blocks(chunks: list[int], per: int, limit: int) -> Tensor:
    """Block indices of ``chunks`` in order (-1 past ``limit``: padding)."""
    b = torch.tensor([c * per + i for c in chunks for i in range(per)], dtype=torch.int64)
    return torch.where(b < limit, b, -1)


@dataclass(eq=False)
class ExchangeRun:
    """One rank's part of an ``ExchangePlan`` (module docstring)."""

    plan: ExchangePlan
    rank: int
    local: BlockSparseLayout
    """This rank's queries x its own keys."""
    remote: BlockSparseLayout
    """This rank's queries x the receive buffer (``plan.slots(rank)``)."""
    index: Tensor
    """int64 [local_len]: the global (padded) position of each local token (the dispatch)."""
    comm: Comm | None
    seq: SequenceShards
    """The plan's token layout on this rank's group (the gathers)."""
    log: dict = field(default_factory=dict)
    """phase -> CommLog of the last exchange."""

    @property
    def computes_remote(self) -> bool:
        return bool(int(self.remote.full_cnt.sum()) + int(self.remote.part_cnt.sum()))


def make_run(layout: BlockSparseLayout, plan: ExchangePlan, *, rank: int, device: torch.device, comm: Comm | None,
             seq: SequenceShards) -> ExchangeRun:
    """Cut ``layout`` (the whole mask) into this rank's local and remote tiles and place them on ``device``."""
    grid = tile_grid(layout)
    per_q, per_k = plan.chunk // layout.q_block, plan.chunk // layout.kv_block
    nq, nk = layout.grid
    mine = plan.local_chunks(rank)
    rows = _blocks(mine, per_q, nq)
    local = sub_layout(layout, rows, _blocks(mine, per_k, nk), grid)
    remote = sub_layout(layout, rows, _blocks(plan.slots(rank), per_k, nk), grid)
    pos = torch.arange(plan.chunk)
    index = torch.cat([c * plan.chunk + pos for c in mine])
    return ExchangeRun(plan=plan, rank=rank, local=local.to(device), remote=remote.to(device),
                       index=index.to(device), comm=comm, seq=seq)


def _chunk_slices(x: Tensor, positions: list[int], chunk: int) -> list[Tensor]:
    """The chunks at ``positions`` (in units of ``chunk`` tokens, dim 2) of ``x``."""
    return [x[:, :, p * chunk:(p + 1) * chunk] for p in positions]


def _post(run: ExchangeRun, phase: str, sends: list[tuple[int, list[Tensor]]], recvs: list[tuple[int, int]],
          device: torch.device) -> list:
    comm = run.comm
    comm.log = CommLog()
    tag = KV_TAG + (phase == "bwd")
    works = []
    for dst, pieces in sends:
        buf = pack(pieces)
        works.append(("send", dst, buf, comm.isend(buf, dst=dst, tag=tag, record=(phase, "exchange", -1, 0,
                                                                                  run.rank, dst))))
    for src, nbytes in recvs:
        buf, work = comm.irecv(nbytes, src=src, tag=tag, device=device, record=(phase, "exchange", -1, 0, src,
                                                                                run.rank))
        works.append(("recv", src, buf, work))
    return works


def _wait(run: ExchangeRun, phase: str, works: list) -> dict[int, Tensor]:
    """Wait for the receives, then the sends (every rank posted all of its messages before waiting)."""
    got = {}
    for kind, peer, buf, work in sorted(works, key=lambda w: w[0] == "send"):
        run.comm.wait(work, peer=peer, what=f"{phase} exchange message" if kind == "recv" else
                      f"receipt of the {phase} exchange message")
        if kind == "recv":
            got[peer] = buf
    run.log[phase] = run.comm.log
    return got


def post_kv(run: ExchangeRun, k: Tensor, v: Tensor) -> list:
    """Post the forward exchange: to every rank the K/V chunks of this rank it needs; its receives."""
    plan, me = run.plan, run.rank
    mine = plan.local_chunks(me)
    at = {c: i for i, c in enumerate(mine)}
    sends = []
    for dst in range(plan.world):
        chunks = plan.need[dst][me]
        if chunks:
            pos = [at[c] for c in chunks]
            sends.append((dst, _chunk_slices(k, pos, plan.chunk) + _chunk_slices(v, pos, plan.chunk)))
    recvs = [(src, len(plan.need[me][src]) * plan.kv_chunk_bytes) for src in range(plan.world)
             if plan.need[me][src]]
    return _post(run, "fwd", sends, recvs, k.device)


def wait_kv(run: ExchangeRun, works: list, heads: tuple[int, int, int], dtype: torch.dtype, device: torch.device
            ) -> tuple[Tensor, Tensor]:
    """(K, V) receive buffers [B, Hk, slots * chunk, D] (``heads`` = (B, Hk, D)): received chunks in their slots,
    zeros in the others (never read: the remote tile has no cells there)."""
    plan, me = run.plan, run.rank
    got = _wait(run, "fwd", works)
    B, Hk, D = heads
    c = plan.chunk
    slot = {ch: i for i, ch in enumerate(plan.slots(me))}
    kbuf = torch.zeros(B, Hk, len(slot) * c, D, dtype=dtype, device=device)
    vbuf = torch.zeros_like(kbuf)
    for src, buf in got.items():
        chunks = plan.need[me][src]
        n = len(chunks)
        spec = [((B, Hk, c, D), dtype)] * (2 * n)
        pieces = unpack(buf, spec)
        for i, ch in enumerate(chunks):
            s = slot[ch]
            kbuf[:, :, s * c:(s + 1) * c] = pieces[i]
            vbuf[:, :, s * c:(s + 1) * c] = pieces[n + i]
    return kbuf, vbuf


def post_dkv(run: ExchangeRun, dk: Tensor, dv: Tensor) -> list:
    """Post the backward exchange: the fp32 dK/dV partials of the received chunks back to their owners."""
    plan, me = run.plan, run.rank
    slot = {ch: i for i, ch in enumerate(plan.slots(me))}
    dk, dv = dk.float(), dv.float()
    sends = []
    for src in range(plan.world):
        chunks = plan.need[me][src]
        if chunks:
            pos = [slot[c] for c in chunks]
            sends.append((src, _chunk_slices(dk, pos, plan.chunk) + _chunk_slices(dv, pos, plan.chunk)))
    recvs = [(dst, len(plan.need[dst][me]) * plan.dkv_chunk_bytes) for dst in range(plan.world)
             if plan.need[dst][me]]
    return _post(run, "bwd", sends, recvs, dk.device)


def wait_dkv(run: ExchangeRun, works: list, heads: tuple[int, int, int], device: torch.device
             ) -> tuple[Tensor, Tensor]:
    """(dK, dV) fp32 [B, Hk, local_len, D] (``heads`` = (B, Hk, D)): the partials other ranks sent for this rank's
    chunks, summed."""
    plan, me = run.plan, run.rank
    got = _wait(run, "bwd", works)
    B, Hk, D = heads
    c = plan.chunk
    at = {ch: i for i, ch in enumerate(plan.local_chunks(me))}
    dk = torch.zeros(B, Hk, plan.local_len, D, dtype=torch.float32, device=device)
    dv = torch.zeros_like(dk)
    for dst, buf in sorted(got.items()):  # a fixed order: the sums are the same on every run
        chunks = plan.need[dst][me]
        n = len(chunks)
        pieces = unpack(buf, [((B, Hk, c, D), torch.float32)] * (2 * n))
        for i, ch in enumerate(chunks):
            p = at[ch]
            dk[:, :, p * c:(p + 1) * c] += pieces[i]
            dv[:, :, p * c:(p + 1) * c] += pieces[n + i]
    return dk, dv
