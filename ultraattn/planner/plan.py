"""The planner's data model: mesh, attention shapes, byte accounting and ``TilePlan``.

A ``TilePlan`` says, for one attention call sharded over ``nodes x devices`` ranks:

* which token chunks each rank OWNS (its local shard; equal token counts per rank so
  shapes stay static),
* which rank COMPUTES every non-empty (head group, q chunk, kv chunk) cell,
* the kernels (groups of cells on one rank launched together),
* the transfers (what moves from where to where, forward and backward).

Data unit: ``(tensor, chunk, head_group)``. Plans that split only the sequence use one
head group; Ulysses-style plans split heads into groups and move head slices.

Byte accounting (one place, shared by the simulator, the reports and the runtime):
inputs travel in the model dtype; partial results travel in fp32 so that merging
them stays exact (docs/numerics.md).

    tensor   phase  carries                                   per token and head
    q        fwd    query                                     D * elt
    kv       both   key + value (kv heads)                    2 * D * elt  (per kv head)
    o        fwd    partial output + LSE, fp32                (D + 1) * 4
    out      fwd    final output (model dtype) + LSE fp32     D * elt + 4   (Ulysses: back to the owner)
    qdo      bwd    query + dO (model dtype), LSE + delta fp32  2 * D * elt + 8
    do       bwd    dO (model dtype) + delta fp32             D * elt + 4   (Ulysses: q and LSE are kept)
    dq       bwd    partial dQ, fp32                          D * 4
    dkv      bwd    partial dK + dV, fp32 (kv heads)          2 * D * 4   (per kv head)
    dq_out   bwd    final dQ, model dtype                     D * elt
    dkv_out  bwd    final dK + dV, model dtype (kv heads)     2 * D * elt (per kv head)

``delta`` is ``rowsum(dO * O) - dLSE``: folding the LSE gradient into delta makes the backward
exact for losses that use the LSE at no extra bytes (dS = P * (dP - delta)).

Partial tensors (o, dq, dkv) are REDUCED: a rank forwards a partial only after its own
contributing kernels finished and every partial it receives for the same unit arrived.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Literal

import torch

Phase = Literal["fwd", "bwd"]
TensorKind = Literal["q", "kv", "o", "out", "qdo", "do", "dq", "dkv", "dq_out", "dkv_out"]

#: tensors that are partial sums reduced along their transfers
PARTIAL_TENSORS = frozenset({"o", "dq", "dkv"})
#: tensors indexed by the query chunk (row) vs the key/value chunk (column)
ROW_TENSORS = frozenset({"q", "o", "out", "qdo", "do", "dq", "dq_out"})
COL_TENSORS = frozenset({"kv", "dkv", "dkv_out"})
TENSOR_PHASE: dict[str, Phase] = {
    "q": "fwd", "kv": "fwd", "o": "fwd", "out": "fwd",
    "qdo": "bwd", "do": "bwd", "dq": "bwd", "dkv": "bwd", "dq_out": "bwd", "dkv_out": "bwd",
}
_DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


def padded_chunk(seq_len: int, num_chunks: int, block: int) -> int:
    """Smallest chunk (a multiple of ``block``) with num_chunks * chunk >= seq_len."""
    return math.ceil(seq_len / (num_chunks * block)) * block


@dataclass(frozen=True, slots=True, kw_only=True)
class Mesh:
    """A ``nodes x devices`` mesh; rank r sits on node ``r // devices``."""

    nodes: int
    """Number of nodes (inter-node links are the expensive kind)."""
    devices: int
    """Devices per node."""

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.devices < 1:
            raise ValueError(f"mesh must have at least 1 node and 1 device, got {self.nodes}x{self.devices}")

    @property
    def world(self) -> int:
        return self.nodes * self.devices

    def node_of(self, rank: int) -> int:
        return rank // self.devices

    def same_node(self, a: int, b: int) -> bool:
        return a // self.devices == b // self.devices

    def __str__(self) -> str:
        return f"{self.nodes}x{self.devices}"


@dataclass(frozen=True, slots=True, kw_only=True)
class AttnShape:
    """Shapes of one attention call (dims: batch, heads, seq, dim)."""

    seq_len: int
    num_heads: int
    head_dim: int
    num_kv_heads: int | None = None
    """None means num_heads (no GQA)."""
    batch: int = 1
    dtype: Literal["bf16", "fp16", "fp32"] = "bf16"

    def __post_init__(self) -> None:
        for nm in ("seq_len", "num_heads", "head_dim", "batch"):
            if getattr(self, nm) < 1:
                raise ValueError(f"{nm} must be positive, got {getattr(self, nm)}")
        if self.dtype not in _DTYPE_BYTES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPE_BYTES)}, got {self.dtype!r}")
        if self.num_kv_heads is not None and (self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads):
            raise ValueError(
                f"num_kv_heads must divide num_heads={self.num_heads}, got {self.num_kv_heads}"
            )

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def elt(self) -> int:
        return _DTYPE_BYTES[self.dtype]

    def unit_bytes(self, tensor: str, tokens: int, head_groups: int = 1) -> int:
        """Bytes of one (tensor, chunk, head group) unit holding ``tokens`` tokens."""
        hq = self.num_heads // head_groups
        hk = self.kv_heads // head_groups
        d, e, b = self.head_dim, self.elt, self.batch * tokens
        per = {
            "q": hq * d * e,
            "kv": hk * 2 * d * e,
            "o": hq * (d + 1) * 4,
            "out": hq * (d * e + 4),
            "qdo": hq * (2 * d * e + 8),
            "do": hq * (d * e + 4),
            "dq": hq * d * 4,
            "dkv": hk * 2 * d * 4,
            "dq_out": hq * d * e,
            "dkv_out": hk * 2 * d * e,
        }
        if tensor not in per:
            raise ValueError(f"tensor must be one of {sorted(per)}, got {tensor!r}")
        return b * per[tensor]


@dataclass(frozen=True, slots=True, kw_only=True)
class Transfer:
    """One point-to-point message."""

    tensor: str
    """Which tensor (see the module table)."""
    chunk: int
    """Token chunk (the row for row tensors, the column for column tensors)."""
    head_group: int
    src: int
    dst: int
    nbytes: int
    phase: Phase


@dataclass(frozen=True, slots=True, kw_only=True)
class Kernel:
    """Cells of one head group computed by one launch on one rank."""

    rank: int
    head_group: int
    cells: tuple[tuple[int, int], ...]
    """(q chunk, kv chunk) pairs."""
    stage: int = 0
    """Order hint: kernels of lower stage need fewer remote inputs."""


@dataclass(frozen=True, slots=True)
class RunOrder:
    """The order every rank runs one phase of a plan in (``planner.program``): a key per kernel and per message, the
    time the planner's replay starts the kernel and has the message's payload ready. Every rank sorts by the same
    keys, so all post in one global order."""

    kernels: tuple[float, ...]
    """Per ``TilePlan.kernels`` entry."""
    transfers: tuple[float, ...]
    """Per ``TilePlan.transfers_for(phase)`` entry."""
    leaves: tuple[float, ...] = ()
    """Per ``TilePlan.transfers_for(phase)`` entry, when its link starts carrying it in the replay (the order a link
    serves the messages posted to it)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TokenSharding:
    """Which rank holds which token chunks: the part of a plan the rest of a sharded model shares.

    The sequence (padded to ``num_chunks * chunk_size``) is cut into chunks; rank r holds
    ``local_chunks(r)`` in ascending order. Every rank holds the same number of chunks, so
    local tensors have one static length. The sequence-sharding pass keeps every activation of
    a compiled graph in one layout, so every attention of that graph is planned with it.
    """

    chunk_size: int
    """Tokens per chunk."""
    owner: tuple[int, ...]
    """owner[i]: the rank holding chunk i."""

    def __post_init__(self) -> None:
        if not isinstance(self.chunk_size, int) or self.chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive int, got {self.chunk_size!r}")
        if not self.owner:
            raise ValueError("owner must list at least one chunk")
        w = max(self.owner) + 1
        counts = [0] * w
        for r in self.owner:
            if r < 0:
                raise ValueError(f"owner entries must be ranks >= 0, got {r}")
            counts[r] += 1
        if len(set(counts)) != 1:
            raise ValueError(f"every rank must hold the same number of chunks, got {counts}")

    @property
    def world(self) -> int:
        return max(self.owner) + 1

    @property
    def num_chunks(self) -> int:
        return len(self.owner)

    @property
    def chunks_per_rank(self) -> int:
        return len(self.owner) // self.world

    @property
    def padded_len(self) -> int:
        return self.num_chunks * self.chunk_size

    @property
    def local_len(self) -> int:
        return self.chunks_per_rank * self.chunk_size

    def local_chunks(self, rank: int) -> list[int]:
        """Chunks of ``rank``'s shard in local order (ascending chunk index)."""
        return [i for i, r in enumerate(self.owner) if r == rank]

    def local_positions(self, rank: int) -> list[int]:
        """Global (padded) token positions held by ``rank``, in local order."""
        c = self.chunk_size
        return [p for i in self.local_chunks(rank) for p in range(i * c, (i + 1) * c)]

    def to_string(self) -> str:
        """One character per chunk: the rank holding it (base 36)."""
        digits = "0123456789abcdefghijklmnopqrstuvwxyz"
        return "".join(digits[r] if r < 36 else "+" for r in self.owner) + f" x {self.chunk_size}"

    def __repr__(self) -> str:
        return f"TokenSharding({self.to_string()})"


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class TilePlan:
    """Who owns which tokens, who computes which cell, and what moves (module docstring)."""

    method: str
    """Planner or baseline name (ultraattn or one of ``baselines.BASELINES``: ring, zigzag, allgather, ulysses, usp)."""
    mesh: Mesh
    shape: AttnShape
    chunk_size: int
    """Tokens per chunk (a multiple of the pattern block size)."""
    num_chunks: int
    """Chunks in the padded sequence; num_chunks * chunk_size >= seq_len."""
    owner: tuple[int, ...]
    """owner[i]: the rank whose local shard holds chunk i."""
    num_head_groups: int
    assign_GPP: torch.Tensor
    """int32 [G, P, P]: rank computing each cell, -1 for EMPTY cells."""
    kernels: tuple[Kernel, ...]
    transfers: tuple[Transfer, ...]
    meta: dict = field(default_factory=dict)
    """Free-form planner facts (solver status, ...); not part of the content hash."""
    order: dict[str, RunOrder] = field(default_factory=dict)
    """The run order of each phase (``planner.program.with_order``: from the planner's replay); a phase without one
    runs in ``planner.program.unit_order``. Dropped when it does not fit the kernels and transfers."""

    def __post_init__(self) -> None:
        p, w = self.num_chunks, self.mesh.world
        if len(self.owner) != p:
            raise ValueError(f"owner must list {p} chunks, got {len(self.owner)}")
        if p % w:
            raise ValueError(f"num_chunks must be a multiple of the world size {w}, got {p}")
        counts = [0] * w
        for r in self.owner:
            if not 0 <= r < w:
                raise ValueError(f"owner entries must be ranks in [0, {w}), got {r}")
            counts[r] += 1
        if len(set(counts)) != 1:
            raise ValueError(f"every rank must own the same number of chunks, got {counts}")
        if self.assign_GPP.shape != (self.num_head_groups, p, p):
            raise ValueError(
                f"assign_GPP must have shape {(self.num_head_groups, p, p)}, got {tuple(self.assign_GPP.shape)}"
            )
        if any(len(o.kernels) != len(self.kernels) or len(o.transfers) != sum(t.phase == ph for t in self.transfers)
               for ph, o in self.order.items()):
            # a plan made from an ordered one with other kernels or transfers (``dataclasses.replace``): its order
            # no longer fits, so it runs in ``program.unit_order`` until it is ordered again (``program.ordered``)
            object.__setattr__(self, "order", {})

    @property
    def world(self) -> int:
        return self.mesh.world

    @property
    def chunks_per_rank(self) -> int:
        return self.num_chunks // self.mesh.world

    def local_chunks(self, rank: int) -> list[int]:
        """Chunks of ``rank``'s shard in local order (ascending chunk index)."""
        return [i for i, r in enumerate(self.owner) if r == rank]

    @property
    def layout(self) -> TokenSharding:
        """Which rank holds which tokens (what a sharded model shares between its attentions)."""
        return TokenSharding(chunk_size=self.chunk_size, owner=tuple(self.owner))

    def transfers_for(self, phase: Phase) -> list[Transfer]:
        return [t for t in self.transfers if t.phase == phase]

    def content_hash(self) -> str:
        """sha256 over everything a rank executes (not ``meta``): ranks must agree on it."""
        h = hashlib.sha256()
        head = {
            "method": self.method, "mesh": [self.mesh.nodes, self.mesh.devices],
            "shape": [self.shape.seq_len, self.shape.num_heads, self.shape.head_dim, self.shape.kv_heads,
                      self.shape.batch, self.shape.dtype],
            "chunk": self.chunk_size, "P": self.num_chunks, "G": self.num_head_groups, "owner": list(self.owner),
        }
        h.update(json.dumps(head, sort_keys=True).encode())
        h.update(self.assign_GPP.to(torch.int32).contiguous().numpy().tobytes())
        for k in self.kernels:
            h.update(repr((k.rank, k.head_group, k.stage, k.cells)).encode())
        for t in self.transfers:
            h.update(repr((t.tensor, t.chunk, t.head_group, t.src, t.dst, t.nbytes, t.phase)).encode())
        for ph in sorted(self.order):
            o = self.order[ph]
            h.update(repr((ph, o.kernels, o.transfers, o.leaves)).encode())
        return h.hexdigest()

    def __repr__(self) -> str:
        return (
            f"TilePlan(method={self.method!r}, mesh={self.mesh}, seq_len={self.shape.seq_len}, "
            f"chunks={self.num_chunks}x{self.chunk_size}, head_groups={self.num_head_groups}, "
            f"kernels={len(self.kernels)}, transfers={len(self.transfers)})"
        )

    def to_dense(self) -> torch.Tensor:
        """The assignment grid int32 [G, P, P] (a copy)."""
        return self.assign_GPP.clone()

    def to_string(self, head_group: int = 0) -> str:
        """Assignment grid as text: computing rank per cell in base 36, ``.`` empty; owners on top."""
        digits = "0123456789abcdefghijklmnopqrstuvwxyz"

        def ch(r: int) -> str:
            return "." if r < 0 else (digits[r] if r < 36 else "+")

        lines = ["owner " + "".join(ch(r) for r in self.owner)]
        for i, row in enumerate(self.assign_GPP[head_group].tolist()):
            lines.append(f"{i:5d} " + "".join(ch(r) for r in row))
        return "\n".join(lines)


# ----------------------------------------------------------------------------- message levels
# [Note] Levels are how the executor (``runtime/executor.py``) orders a phase's messages, and the simulator replays a
# plan "as executed" by the same rule (``schedule.build_graph(executed=True)``): one rule, here.


def kernel_rows(kernels) -> list[tuple[int, int, int, list[int]]]:
    """Each kernel's rows as the executor launches them: (rank, head group, q chunk, sorted kv chunks), kernel after
    kernel in plan order, a kernel's rows in the order its cells first name them."""
    out = []
    for k in kernels:
        rows: dict[int, list[int]] = {}
        for i, j in k.cells:
            rows.setdefault(i, []).append(j)
        out.extend((k.rank, k.head_group, i, sorted(js)) for i, js in rows.items())
    return out


def input_levels(steps: list[tuple[int, Transfer]],
                 have: set[tuple[str, int, int, int]]) -> tuple[dict[int, int], list[tuple[int, Transfer]]]:
    """The level of each input message ``(index, transfer)``: the level at which its source holds the unit. The
    units in ``have`` ((tensor, chunk, head group, rank): owners, and what a rank kept from the forward) are held at
    level 0; a unit received at level L is held from L + 1. Also the messages whose source never holds their unit
    (an inconsistent plan; empty when every message has a level)."""
    avail = {k: 0 for k in have}
    level: dict[int, int] = {}
    todo = list(steps)
    while todo:
        rest = []
        for idx, t in todo:
            key = (t.tensor, t.chunk, t.head_group, t.src)
            if key in avail:
                level[idx] = avail[key]
                dkey = (t.tensor, t.chunk, t.head_group, t.dst)
                avail[dkey] = min(avail.get(dkey, 1 << 30), level[idx] + 1)
            else:
                rest.append((idx, t))
        if len(rest) == len(todo):
            return level, rest
        todo = rest
    return level, []


def partial_levels(steps: list[tuple[int, Transfer]]) -> dict[int, int]:
    """The level of each partial message: one after the last partial its source receives for the same unit (the
    reduction tree); a ``ValueError`` if they form a cycle."""
    level: dict[int, int] = {}
    incoming: dict[tuple, list[int]] = {}
    for idx, t in steps:
        incoming.setdefault((t.tensor, t.chunk, t.head_group, t.dst), []).append(idx)
    by_idx = dict(steps)

    def lev(idx: int, depth: int = 0) -> int:
        if idx in level:
            return level[idx]
        if depth > len(steps):
            raise ValueError("ultraattn: partial transfers form a cycle")
        t = by_idx[idx]
        ins = incoming.get((t.tensor, t.chunk, t.head_group, t.src), [])
        level[idx] = 1 + max((lev(j, depth + 1) for j in ins), default=-1)
        return level[idx]

    for idx, _ in steps:
        lev(idx)
    return level
