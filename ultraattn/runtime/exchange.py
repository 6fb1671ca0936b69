"""Run an ``ExchangePlan`` on one rank: its tiles' layouts, its dispatch index, its two exchanges.

The explicit program of a site whose mask arrives at run time (``passes/explicit/dynamic.py``) is a
fixed skeleton; what its nodes do comes from an ``ExchangeRun`` made per mask:

    rows = layout_from_pattern(pattern, mask_mod, ..., q_blocks=rank_rows(plan, r, ...))  # r's rows only
    run = make_run(rows, plan, rank=r, device=dev, transport=transport, seq=...)
    h = post_kv(run, k_l, v_l)                 # one message per rank pair: the K/V chunks it needs
    ... local tile (q_l x k_l, run.local) ...   # overlaps the messages
    kbuf, vbuf = wait_kv(run, h)               # other ranks' chunks by slot (zeros where not needed)
    ... remote tile (q_l x kbuf, run.remote), LSE merge ...
    h = post_dkv(run, dkbuf, dvbuf)            # backward: partial dK/dV of the same chunks go home
    dk_in, dv_in = wait_dkv(run, h)            # summed at this rank's local positions

Every message is one contiguous buffer; its bytes are logged (``CommLog``) and must equal the plan's
(``ExchangePlan.bytes``). Every wait is bounded by the transport's timeout and names the peer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..kernels.block_lists import BlockLists, sub_layout, tile_grid
from ..planner.exchange import ExchangePlan
from .comm import CommLog, pack, unpack
from .sequence import SequenceShards
from .transport import Handle, Recv, Send, Transport

KV_TAG = 1 << 20
"""Message tag of the forward K/V exchange (the backward's is ``KV_TAG + 1``); one message per rank pair."""


def _blocks(chunks: list[int], per: int, limit: int) -> Tensor:
    """Block indices of ``chunks`` in order (-1 past ``limit``: padding)."""
    b = torch.tensor([c * per + i for c in chunks for i in range(per)], dtype=torch.int64)
    return torch.where(b < limit, b, -1)


@dataclass(eq=False)
class ExchangeRun:
    """One rank's part of an ``ExchangePlan`` (module docstring)."""

    plan: ExchangePlan
    rank: int
    local: BlockLists
    """This rank's queries x its own keys."""
    remote: BlockLists
    """This rank's queries x the receive buffer (``plan.slots(rank)``)."""
    index: Tensor
    """int64 [local_len]: the global (padded) position of each local token (the dispatch)."""
    transport: Transport | None
    seq: SequenceShards
    """The plan's token layout on this rank's group (the gathers)."""
    log: dict = field(default_factory=dict)
    """phase -> CommLog of the last exchange."""

    @property
    def local_position(self) -> dict[int, int]:
        """chunk -> its position among this rank's own chunks."""
        return {c: i for i, c in enumerate(self.plan.layout.local_chunks(self.rank))}

    @property
    def slot_position(self) -> dict[int, int]:
        """chunk -> its slot in this rank's receive buffer (``ExchangePlan.slots``)."""
        return {c: i for i, c in enumerate(self.plan.slots(self.rank))}


def make_run(rows: BlockLists, plan: ExchangePlan, *, rank: int, device: torch.device,
             transport: Transport | None, seq: SequenceShards) -> ExchangeRun:
    """Cut ``rows`` (the layout of this rank's query rows, ``rank_rows``, against every key)
    into its local and remote tiles and place them on ``device``."""
    grid = tile_grid(rows)
    chunk = plan.layout.chunk_size
    per_k = chunk // rows.kv_block
    nk = rows.grid[1]
    mine = plan.layout.local_chunks(rank)
    local_rows = torch.arange(rows.grid[0])
    local = sub_layout(rows, local_rows, _blocks(mine, per_k, nk), grid)
    remote = sub_layout(rows, local_rows, _blocks(plan.slots(rank), per_k, nk), grid)
    pos = torch.arange(chunk)
    index = torch.cat([c * chunk + pos for c in mine])
    return ExchangeRun(plan=plan, rank=rank, local=local.to(device), remote=remote.to(device),
                       index=index.to(device), transport=transport, seq=seq)


def rank_rows(plan: ExchangePlan, rank: int, q_block: int, num_q_blocks: int) -> Tensor:
    """The Q blocks of ``rank``'s chunks under ``plan``, in local order (-1: padding): the rows of its layout."""
    return _blocks(plan.layout.local_chunks(rank), plan.layout.chunk_size // q_block, num_q_blocks)


def _chunk_slices(x: Tensor, positions: list[int], chunk: int) -> list[Tensor]:
    """The chunks at ``positions`` (in units of ``chunk`` tokens, dim 2) of ``x``."""
    return [x[:, :, p * chunk:(p + 1) * chunk] for p in positions]


def _post(run: ExchangeRun, phase: str, a: Tensor, b: Tensor, position: dict[int, int]) -> Handle:
    """Post this rank's messages of the ``phase`` exchange (``ExchangePlan.routes``) through the transport: per peer,
    the chunks of ``a`` then of ``b`` (chunk -> its position in them: ``position``), in one buffer; and its
    receives."""
    transport, plan = run.transport, run.plan
    transport.log = CommLog()
    tag = KV_TAG + (phase == "bwd")
    chunk = plan.layout.chunk_size
    out, inc = plan.routes(phase, run.rank)
    sends = []
    for dst, chunks in out:
        pos = [position[c] for c in chunks]
        sends.append(Send(pack(_chunk_slices(a, pos, chunk) + _chunk_slices(b, pos, chunk)), dst, tag,
                          (phase, "exchange", -1, 0, run.rank, dst), f"{phase} exchange message"))
    recvs = [Recv(len(chunks) * plan.chunk_bytes(phase), src, tag, a.device, (phase, "exchange", -1, 0, src, run.rank),
                  f"{phase} exchange message") for src, chunks in inc]
    return transport.post(sends, recvs)


def _receive(run: ExchangeRun, phase: str, handle: Handle, a: Tensor, b: Tensor, position: dict[int, int],
             add: bool) -> None:
    """Wait for the ``phase`` exchange (the receives, then the sends: every rank posted all of its messages before
    waiting) and write (``add``: add) each received chunk into ``a`` / ``b`` at ``position[chunk]``, peers in
    ascending order (sums come out the same on every run)."""
    transport, plan = run.transport, run.plan
    inc = plan.routes(phase, run.rank)[1]
    got = dict(zip((src for src, _chunks in inc), transport.wait(handle), strict=True))
    transport.settle(handle)
    run.log[phase] = transport.log
    c = plan.layout.chunk_size
    B, Hk, _, D = a.shape
    for src, chunks in inc:
        n = len(chunks)
        pieces = unpack(got[src], [((B, Hk, c, D), a.dtype)] * (2 * n))
        for i, ch in enumerate(chunks):
            p = position[ch]
            for dst, piece in ((a, pieces[i]), (b, pieces[n + i])):
                if add:
                    dst[:, :, p * c:(p + 1) * c] += piece
                else:
                    dst[:, :, p * c:(p + 1) * c] = piece


def post_kv(run: ExchangeRun, k: Tensor, v: Tensor) -> Handle:
    """Post the forward exchange: to every rank the K/V chunks of this rank it needs; its receives."""
    return _post(run, "fwd", k, v, run.local_position)


def wait_kv(run: ExchangeRun, handle: Handle, heads: tuple[int, int, int], dtype: torch.dtype, device: torch.device
            ) -> tuple[Tensor, Tensor]:
    """(K, V) receive buffers [B, Hk, slots * chunk, D] (``heads`` = (B, Hk, D)): received chunks in their slots,
    zeros in the others (never read: the remote tile has no cells there)."""
    B, Hk, D = heads
    slot = run.slot_position
    kbuf = torch.zeros(B, Hk, len(slot) * run.plan.layout.chunk_size, D, dtype=dtype, device=device)
    vbuf = torch.zeros_like(kbuf)
    _receive(run, "fwd", handle, kbuf, vbuf, slot, add=False)
    return kbuf, vbuf


def post_dkv(run: ExchangeRun, dk: Tensor, dv: Tensor) -> Handle:
    """Post the backward exchange: the fp32 dK/dV partials of the received chunks back to their owners."""
    return _post(run, "bwd", dk.float(), dv.float(), run.slot_position)


def wait_dkv(run: ExchangeRun, handle: Handle, heads: tuple[int, int, int], device: torch.device
             ) -> tuple[Tensor, Tensor]:
    """(dK, dV) fp32 [B, Hk, local_len, D] (``heads`` = (B, Hk, D)): the partials other ranks sent for this rank's
    chunks, summed."""
    B, Hk, D = heads
    dk = torch.zeros(B, Hk, run.plan.layout.local_len, D, dtype=torch.float32, device=device)
    dv = torch.zeros_like(dk)
    _receive(run, "bwd", handle, dk, dv, run.local_position, add=True)
    return dk, dv
