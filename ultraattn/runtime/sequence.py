"""Sequence shards of any tensor: a ``TokenSharding`` bound to this rank and its process group.

    seq = SequenceShards(layout, rank=r, global_ranks=ranks, group_ref=GroupRef(pg), timeout=300)
    x_local = seq.shard(x, dim=1, length=S)       # this rank's tokens (the tail zero-padded)
    x = seq.gather(x_local, dim=1, length=S)      # every rank's tokens, in order (an all-gather)
    total = seq.all_reduce(partial)               # sum over the ranks

A dimension "carries the sequence" when its global size is ``outer * length * inner``:
``length`` token positions (0 .. length-1, the global sequence coordinate), each repeated over
``inner`` trailing and ``outer`` leading elements. That covers flattened tensors such as
logits viewed as ``[batch * seq, vocab]`` (outer = batch) or ``[batch, seq * hidden]``
(inner = hidden). The local tensor has ``outer * local_len * inner`` there, positions in the
layout's local order; positions at or past ``length`` (the tail padding, or tokens cut off by
a prefix slice such as ``logits[:, :-1]``) are padding, which ``valid`` marks. ``shard`` fills the
tail with copies of the last real position.

Every collective waits at most ``timeout`` seconds and names what it waited for.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from ..planner.plan import TokenSharding
from .comm import NO_GROUP, GroupRef, ranks_differing
from .transport import Transport, transport_for


def _split_dim(x: Tensor, dim: int, length: int, inner: int) -> tuple[Tensor, int]:
    """View ``x`` with its dim ``dim`` as (outer, length, inner); returns the view and ``outer``."""
    size = x.shape[dim]
    if size % (length * inner):
        raise ValueError(f"dim {dim} of size {size} is not outer x {length} positions x {inner}")
    outer = size // (length * inner)
    return x.reshape(*x.shape[:dim], outer, length, inner, *x.shape[dim + 1:]), outer


@dataclass(eq=False)
class SequenceShards:
    """Where a sharded sequence lives (``layout``) and how this rank talks to the others."""

    layout: TokenSharding
    rank: int
    """This process's rank in the layout (its position in ``global_ranks``)."""
    global_ranks: tuple[int, ...]
    """Global rank of each layout rank."""
    group_ref: GroupRef = NO_GROUP
    """The process group, held weakly (``group``; None: one process)."""
    timeout: float = 300.0
    checks: dict = None
    """name -> calls checked so far (``check_same``)."""

    @property
    def group(self):
        """Process group (None: one process)."""
        return self.group_ref.get()

    @functools.cached_property
    def transport(self) -> Transport:
        """How this rank's all-gathers and all-reduces move (``runtime/transport.py``)."""
        return transport_for(rank=self.rank, global_ranks=self.global_ranks, group_ref=self.group_ref,
                             timeout=self.timeout)

    @property
    def world(self) -> int:
        return self.layout.world

    @property
    def local_len(self) -> int:
        return self.layout.local_len

    def positions(self, device=None) -> Tensor:
        """Global positions of this rank's tokens, int64 [local_len], in local order."""
        c = self.layout.chunk_size
        return torch.cat([torch.arange(i * c, (i + 1) * c, device=device) for i in self.layout.local_chunks(self.rank)])

    def valid(self, length: int, device=None) -> Tensor:
        """bool [local_len]: which local tokens are real positions of a ``length``-token coordinate."""
        return self.positions(device) < length

    def check_same(self, x: Tensor, name: str) -> None:
        """Raise naming the ranks whose global ``x`` differs from rank 0's (the ``debug`` option: every rank of a
        context-parallel group must run the same batch)."""
        if self.world == 1:
            return
        self.checks = self.checks if self.checks is not None else {}
        n = self.checks[name] = self.checks.get(name, 0) + 1
        key = f"ultraattn/debug/{'-'.join(map(str, self.global_ranks))}/{self.layout.to_string()}/{name}/{n}"
        bad = ranks_differing(key, [x], rank=self.rank, world=self.world, timeout=self.timeout)
        if bad:
            raise RuntimeError(
                f"ultraattn: rank(s) {bad} got a different `{name}` than rank 0 (call {n}). Every rank of a "
                f"context-parallel group must run the same batch: give all of them the same data (same seed, no "
                f"DistributedSampler across the CP group)")

    # ------------------------------------------------------------------ data movement
    def shard(self, x: Tensor, dim: int, length: int, inner: int = 1, zero_pad: bool = False) -> Tensor:
        """This rank's tokens of the global ``x`` (its dim ``dim`` carries ``length`` positions).

        ``zero_pad``: the padding is zeros (a gradient: padding positions contribute nothing), not copies of the
        last position (values, see the [Note])."""
        lay = self.layout
        if length > lay.padded_len:
            raise ValueError(f"{length} positions do not fit the layout's {lay.padded_len}")
        v, outer = _split_dim(x, dim, length, inner)
        d = dim + 1  # the positions' axis in the view
        if length < lay.padded_len:
            # [Note] padding repeats the last real position, not zeros: every op then sees at the padding
            # what it sees in real data, so nothing non-finite appears there (x / positions would divide
            # by zero), which attention's 0-weighted products would carry into real tokens
            edge = v.narrow(d, length - 1, 1)
            if zero_pad:
                edge = torch.zeros_like(edge)
            v = torch.cat([v, edge.expand(*v.shape[:d], lay.padded_len - length, *v.shape[d + 1:])], dim=d)
        c = lay.chunk_size
        local = torch.cat([v.narrow(d, i * c, c) for i in lay.local_chunks(self.rank)], dim=d)
        return local.reshape(*x.shape[:dim], outer * lay.local_len * inner, *x.shape[dim + 1:])

    def gather(self, x_local: Tensor, dim: int, length: int, inner: int = 1) -> Tensor:
        """The global tensor from every rank's tokens (an all-gather), positions past ``length`` dropped."""
        lay = self.layout
        v, outer = _split_dim(x_local, dim, lay.local_len, inner)
        d = dim + 1
        moved = v.movedim(d, 0).contiguous()  # [local_len, ...]
        pieces = self.transport.all_gather(moved, "the sequence all-gather")
        c = lay.chunk_size
        slot = {}
        for r in range(self.world):
            for m, i in enumerate(lay.local_chunks(r)):
                slot[i] = (r, m)
        full = torch.cat([pieces[r][m * c:(m + 1) * c] for r, m in (slot[i] for i in range(lay.num_chunks))])
        full = full[:length].movedim(0, d)
        return full.reshape(*x_local.shape[:dim], outer * length * inner, *x_local.shape[dim + 1:])

    def all_reduce(self, x: Tensor) -> Tensor:
        """Sum of ``x`` over the ranks (a new tensor)."""
        return self.transport.all_reduce(x, "the sequence all-reduce")
