"""Invariants every plan must meet (shared by the planner tests): what the runtime relies on."""

from __future__ import annotations

from collections import defaultdict

import torch

from ultraattn.masks.pattern import BlockPattern
from ultraattn.planner.api import rank_bytes, workload
from ultraattn.planner.baselines import REGISTRY
from ultraattn.planner.plan import TilePlan


def check_plan(p: TilePlan, pattern: BlockPattern, backward: bool = True) -> None:
    """Every invariant the runtime relies on (asserts)."""
    work = workload(pattern, p.shape, num_chunks=p.num_chunks, head_groups=p.num_head_groups, chunk=p.chunk_size)
    nonempty = work.nonempty_GPP()
    a = p.assign_GPP
    # each non-empty cell computed exactly once, nothing else computed
    assert torch.equal(a >= 0, nonempty)
    seen = defaultdict(int)
    for k in p.kernels:
        for i, j in k.cells:
            assert int(a[k.head_group, i, j]) == k.rank
            seen[(k.head_group, i, j)] += 1
    assert len(seen) == int(nonempty.sum()) and set(seen.values()) <= {1}  # (empty: a mask with no block)
    # equal token counts
    counts = defaultdict(int)
    for r in p.owner:
        counts[r] += 1
    assert set(counts.values()) == {p.chunks_per_rank} and len(counts) == p.world
    # every needed input reaches its computing rank (following relays), per phase
    phases = ("fwd", "bwd") if backward else ("fwd",)
    for phase in phases:
        has = defaultdict(set)  # (tensor, chunk, g) -> ranks holding it
        msgs = p.transfers_for(phase)
        inputs = [m for m in msgs if m.tensor in ("q", "kv", "qdo", "do")]
        for m in inputs:
            assert m.nbytes == p.shape.unit_bytes(m.tensor, p.chunk_size, p.num_head_groups)
        changed = True
        while changed:
            changed = False
            for m in inputs:
                key = (m.tensor, m.chunk, m.head_group)
                if (p.owner[m.chunk] == m.src or m.src in has[key]) and m.dst not in has[key]:
                    has[key].add(m.dst)
                    changed = True
        head_parallel = {name for name, base in REGISTRY.items() if base.head_parallel}  # ulysses, usp
        kept_q = p.method in head_parallel or p.meta.get("structure") in head_parallel
        row_t = {"fwd": "q", "bwd": "do" if kept_q else "qdo"}[phase]
        for g, i, j in nonempty.nonzero().tolist():
            r = int(a[g, i, j])
            if phase == "bwd" and kept_q:
                continue  # head-parallel plans keep Q/K/V from the forward pass
            for t, c in ((row_t, i), ("kv", j)):
                assert p.owner[c] == r or r in has[(t, c, g)], f"{t} chunk {c} never reaches rank {r} ({phase})"
    # byte accounting equals an independent recount
    rb = rank_bytes(p, phases)
    recount = defaultdict(int)
    for m in p.transfers:
        if m.phase in phases:
            recount[m.src] += m.nbytes
            recount[m.dst] += m.nbytes
    for r in range(p.world):
        b = rb[r]
        assert b["intra_in"] + b["inter_in"] + b["intra_out"] + b["inter_out"] == recount[r]
    # every message carries exactly its unit's bytes
    for m in p.transfers:
        assert m.nbytes == p.shape.unit_bytes(m.tensor, p.chunk_size, p.num_head_groups), m
