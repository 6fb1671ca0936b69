"""Plans of an explicit site whose mask is known only at run time: one fixed plan, and each mask's data.

A compiled graph cannot change shape per batch, so a site whose mask is new every batch (packed
documents) runs one fixed ``TilePlan`` for every mask, ``owner_computes_plan``: every rank computes the
rows of its own chunks against every chunk, and each chunk's K/V may go to every other rank (and its
dK/dV partials come back). The executor runs and traces that plan like any other; this module's
``ExchangePlan``, made per mask in milliseconds, is the data that specialises it:

* every rank owns ``chunks_per_rank`` chunks of ``chunk`` tokens (static local shapes). The owners are
  either fixed per graph (the layout of a sequence-sharded graph) or chosen per mask by the online
  planner's balancer (``balance.ownership``: work-balanced, document-affine across nodes);
* every non-empty cell is computed where its query rows live (owner computes): only K/V move, the cheap
  side with GQA, and the partial dK/dV come back to their owners in the backward;
* so the forward has ONE exchange stage (each rank sends each other rank the K/V chunks it needs, a message
  per chunk) and the backward one (the dK/dV partials of the same chunks, fp32).

``need[dst][src]``: the chunks of ``src`` that ``dst`` needs, ascending: the fixed plan's messages that
carry data for this mask (``live``); the others are never posted, so the bytes that move are the needed
chunks' only, while the memory held for received chunks is every other rank's (all-gather CP's
footprint: a bound that holds for every mask).

The fixed plan is written in VIRTUAL chunks: rank r's i-th local chunk is virtual chunk ``r * n + i``
(``n`` chunks per rank), whichever global chunk the mask's owners give it (``global_chunks``).

Pure numpy over a chunk-level work matrix; deterministic (stable sorts, ties to the lower index), so
every rank computes the identical plan from the identical mask.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np
import torch

from ..masks.pattern import EMPTY, FULL, BlockPattern
from .balance import ownership
from .plan import AttnShape, Kernel, Mesh, TilePlan, TokenSharding, Transfer

Route = tuple[int, tuple[int, ...]]
"""(peer rank, chunks): one message of an exchange."""


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class ExchangePlan:
    """Owners, the chunks each rank needs from each other rank, bytes and balance (module docstring)."""

    layout: TokenSharding
    """Who owns (and computes the query rows of) which chunk."""
    need: tuple[tuple[tuple[int, ...], ...], ...]
    """need[dst][src]: chunks of ``src`` whose K/V ``dst`` needs (ascending; empty for src == dst)."""
    work: tuple[float, ...]
    """Cost-weighted blocks each rank computes."""
    kv_chunk_bytes: int
    """Bytes of one chunk's K and V in the model dtype (forward messages)."""
    dkv_chunk_bytes: int
    """Bytes of one chunk's dK and dV partials in fp32 (backward messages)."""
    ownership: str
    """'per-batch' or 'fixed'."""
    seconds: float = 0.0
    """Time it took to plan (set by the caller; reports show it)."""
    _hash: list = field(default_factory=list, repr=False)

    @property
    def world(self) -> int:
        return len(self.need)

    def global_chunks(self) -> tuple[int, ...]:
        """The global chunk of every virtual chunk of ``owner_computes_plan`` (rank r's i-th chunk is r * n + i)."""
        return tuple(c for r in range(self.world) for c in self.layout.local_chunks(r))

    def live(self) -> frozenset[tuple[str, int, int, int]]:
        """(tensor, virtual chunk, src, dst) of the messages of ``owner_computes_plan`` that carry data under this
        mask: the K/V of a chunk a rank needs, and the dK/dV partials of the same chunk coming back."""
        virtual = {c: v for v, c in enumerate(self.global_chunks())}
        out = set()
        for d in range(self.world):
            for s in range(self.world):
                for c in self.need[d][s]:
                    out.add(("kv", virtual[c], s, d))
                    out.add(("dkv", virtual[c], d, s))
        return frozenset(out)

    def imbalance(self) -> float:
        """Busiest rank's work over the mean (1.0: perfect)."""
        mean = sum(self.work) / self.world
        return max(self.work) / mean if mean > 0 else 1.0

    def routes(self, phase: str, rank: int) -> tuple[list[Route], list[Route]]:
        """(messages ``rank`` sends, messages it receives) in the ``phase`` ('fwd' | 'bwd') exchange, each as (peer,
        chunks), peers ascending. In the forward a rank sends what others need from it; in the backward the partial
        gradients of the same chunks come back."""
        gives = [(d, self.need[d][rank]) for d in range(self.world) if self.need[d][rank]]
        gets = [(s, self.need[rank][s]) for s in range(self.world) if self.need[rank][s]]
        return (gives, gets) if phase == "fwd" else (gets, gives)

    def chunk_bytes(self, phase: str) -> int:
        return self.kv_chunk_bytes if phase == "fwd" else self.dkv_chunk_bytes

    def bytes(self, phase: str, rank: int) -> dict[str, int]:
        """{'sent', 'recv'}: bytes ``rank`` moves in the ``phase`` exchange (``routes``)."""
        out, inc = self.routes(phase, rank)
        per = self.chunk_bytes(phase)
        return {"sent": per * sum(len(c) for _, c in out), "recv": per * sum(len(c) for _, c in inc)}

    def stage_bytes(self, phase: str) -> int:
        """Bytes all ranks send in the ``phase`` exchange (its one stage)."""
        return sum(self.bytes(phase, r)["sent"] for r in range(self.world))

    def content_hash(self) -> str:
        if not self._hash:
            h = hashlib.sha256(repr((self.layout.chunk_size, self.layout.owner, self.need)).encode())
            self._hash.append(h.hexdigest())
        return self._hash[0]

    def summary(self) -> str:
        return (f"exchange ({self.ownership} owners, {self.layout.num_chunks} chunks of {self.layout.chunk_size}): "
                f"fwd {self.stage_bytes('fwd') / 2**20:.2f} MiB, bwd {self.stage_bytes('bwd') / 2**20:.2f} MiB, "
                f"imbalance {self.imbalance():.2f}")


def cell_weights(kind_UQK: np.ndarray, uses_U: np.ndarray, *, per_q: int, per_k: int, num_chunks: int,
                 partial_overhead: float = 0.1) -> np.ndarray:
    """float64 [P, P]: cost-weighted blocks of every (q chunk, kv chunk) cell, summed over the (batch, head) pairs.

    ``kind_UQK``: the unique block grids (EMPTY / PARTIAL / FULL), ``uses_U``: how many (batch, head) pairs have
    each; a PARTIAL block costs ``1 + partial_overhead``; ``per_q`` x ``per_k`` blocks per chunk cell, on a grid of
    ``num_chunks`` chunks (blocks past the mask are empty: padding)."""
    kind = np.asarray(kind_UQK)
    _, nq, nk = kind.shape
    w = np.where(kind == FULL, 1.0, 1.0 + partial_overhead) * (kind != EMPTY)
    w = np.tensordot(np.asarray(uses_U, dtype=np.float64), w, axes=1)  # [NQ, NK]
    grid = np.zeros((num_chunks * per_q, num_chunks * per_k))
    grid[:nq, :nk] = w
    return grid.reshape(num_chunks, per_q, num_chunks, per_k).sum((1, 3))


def pattern_weights(pattern: BlockPattern, *, batch: int, num_heads: int, chunk: int, num_chunks: int,
                    partial_overhead: float = 0.1) -> np.ndarray:
    """``cell_weights`` of a ``BlockPattern`` at ``batch`` x ``num_heads`` (no element masks needed: planning
    studies of long sequences, ``benchmarks/exchange_owners.py``)."""
    bp, g = pattern.kind_BGQK.shape[:2]
    groups = pattern.head_group_of if pattern.head_group_of is not None else [0] * num_heads
    uses = np.zeros(bp * g)
    for b in range(batch):
        for h in range(num_heads):
            uses[(b % bp) * g + groups[h]] += 1
    kind = pattern.kind_BGQK.numpy().reshape(bp * g, *pattern.grid)
    return cell_weights(kind, uses, per_q=chunk // pattern.q_block, per_k=chunk // pattern.kv_block,
                        num_chunks=num_chunks, partial_overhead=partial_overhead)


def plan_exchange(weight_PP: np.ndarray, *, mesh: Mesh, chunk: int, owner: tuple[int, ...] | None = None,
                  kv_chunk_bytes: int, dkv_chunk_bytes: int, balance_tol: float = 0.05) -> ExchangePlan:
    """The exchange plan of one mask.

    Args:
        weight_PP: float [P, P], cost-weighted blocks of every (q chunk, kv chunk) cell summed over batch entries
            and heads (0: the cell is empty).
        mesh: the ranks.
        chunk: tokens per chunk.
        owner: the owner of every chunk (fixed per graph), or None to balance the owners for this mask.
        kv_chunk_bytes, dkv_chunk_bytes: message bytes per chunk (``ExchangePlan``).
        balance_tol: the balancer's tolerance (``balance.ownership``).
    """
    weight_PP = np.asarray(weight_PP, dtype=np.float64)
    p = weight_PP.shape[0]
    w = mesh.world
    if weight_PP.ndim != 2 or weight_PP.shape[1] != p:
        raise ValueError(f"`weight_PP` must be a square [P, P] matrix, got shape {weight_PP.shape}")
    if p % w:
        raise ValueError(f"{p} chunks cannot be split evenly over {w} ranks; pad the sequence to a multiple of "
                         f"{w} chunks")
    if owner is None:
        own = ownership(weight_PP, mesh, p // w, balance_tol)
        how = "per-batch"
    else:
        own = np.asarray(owner, dtype=np.int64)
        if own.shape != (p,) or np.bincount(own, minlength=w).tolist() != [p // w] * w:
            raise ValueError(f"`owner` must give each of the {w} ranks {p // w} of the {p} chunks, got {owner}")
        how = "fixed"
    ii, jj = np.nonzero(weight_PP > 0)
    work = np.bincount(own[ii], weight_PP[ii, jj], minlength=w)
    dst, src = own[ii], own[jj]
    cross = dst != src
    # (dst, chunk) pairs, unique and sorted: dst major, then chunk ascending
    pairs = np.unique(dst[cross] * p + jj[cross])
    need = [[[] for _ in range(w)] for _ in range(w)]
    for d, c in zip((pairs // p).tolist(), (pairs % p).tolist()):
        need[d][int(own[c])].append(c)
    return ExchangePlan(layout=TokenSharding(chunk_size=chunk, owner=tuple(own.tolist())),
                        need=tuple(tuple(tuple(x) for x in row) for row in need), work=tuple(work.tolist()),
                        kv_chunk_bytes=kv_chunk_bytes, dkv_chunk_bytes=dkv_chunk_bytes, ownership=how)


def owner_computes_plan(*, mesh: Mesh, shape: AttnShape, chunk: int, chunks_per_rank: int) -> TilePlan:
    """The one ``TilePlan`` of every mask of a run-time-mask site, in virtual chunks (module docstring).

    Rank r owns virtual chunks ``r * n .. r * n + n - 1`` and computes their rows against every chunk: its own
    chunks in one kernel (stage 0: no input to wait for) and every other rank's in another (stage 1). Every
    chunk's K/V goes to every other rank in the forward, and the dK/dV partials of the same chunk come back in
    the backward; the mask's ``ExchangePlan.live`` says which of these messages carry data.
    """
    w, n = mesh.world, chunks_per_rank
    p = w * n
    owner = tuple(v // n for v in range(p))
    kernels = []
    for r in range(w):
        mine = range(r * n, (r + 1) * n)
        kernels.append(Kernel(rank=r, head_group=0, cells=tuple((i, j) for i in mine for j in mine), stage=0))
        others = [j for j in range(p) if owner[j] != r]
        if others:
            kernels.append(Kernel(rank=r, head_group=0, cells=tuple((i, j) for i in mine for j in others), stage=1))
    kv, dkv = shape.unit_bytes("kv", chunk), shape.unit_bytes("dkv", chunk)
    transfers = [Transfer(tensor="kv", chunk=j, head_group=0, src=owner[j], dst=d, nbytes=kv, phase="fwd")
                 for j in range(p) for d in range(w) if d != owner[j]]
    transfers += [Transfer(tensor="dkv", chunk=j, head_group=0, src=d, dst=owner[j], nbytes=dkv, phase="bwd")
                  for j in range(p) for d in range(w) if d != owner[j]]
    assign = torch.tensor(owner, dtype=torch.int32)[None, :, None].expand(1, p, p).contiguous()
    return TilePlan(method="exchange", mesh=mesh, shape=shape, chunk_size=chunk, num_chunks=p, owner=owner,
                    num_head_groups=1, assign_GPP=assign, kernels=tuple(kernels), transfers=tuple(transfers))
