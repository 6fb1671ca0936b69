"""Shared pieces of the runtime tests: case specs, mask builders, the dense reference, rank workers.

Workers run in spawned processes (``ultraattn.testing.run_ranks``), so everything they take is
plain data: a case names its mask by factory and arguments and rebuilds it in the process.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.nn.attention.flex_attention import create_block_mask

import ultraattn
from ultraattn.masks import convert
from ultraattn.planner.tiling import PlannerOptions
from ultraattn.testing import (
    block_select_mask,
    check_2x,
    dense_attention,
    random_block_dense,
    random_block_table,
)

FAST = PlannerOptions(time_budget=2.0, ilp_time_limit=1.0, schedule_time_limit=0.5, heuristic_seconds=0.2)

_DT = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Case:
    mask: str
    kwargs: tuple = ()
    seqlen: int = 200
    heads: int = 4
    kv_heads: int = 4
    head_dim: int = 16
    batch: int = 1
    dtype: str = "fp32"
    method: str = "ultraattn"
    block: int = 32
    mesh: tuple[int, int] | None = None
    seed: int = 0
    planner: str = "auto"
    extra: dict = field(default_factory=dict, hash=False, compare=False)

    @property
    def name(self) -> str:
        kw = ",".join(f"{k}={v}" for k, v in self.kwargs)
        gqa = f"-gqa{self.heads // self.kv_heads}" if self.kv_heads != self.heads else ""
        m = f"-{self.mesh[0]}x{self.mesh[1]}" if self.mesh else ""
        pl = "" if self.planner == "auto" else f"-{self.planner}"
        return f"{self.mask}({kw})-S{self.seqlen}{gqa}-{self.dtype}-{self.method}{m}{pl}"


LIB = [
    ("full", ()),
    ("causal", ()),
    ("sliding_window", (("window", 48),)),
    ("strided", (("block", 32),)),
    ("global_local", (("num_global", 16), ("window", 40))),
    ("star", (("block", 32),)),
    ("streaming", (("sink", 8), ("window", 2), ("block", 32))),
    ("document", (("lengths", (50, 90, 60)),)),
    ("prefix_lm", (("prefix", 60),)),
    ("random", ()),
    ("block_select", ()),
]


def check_numerics(case: Case, res: dict) -> list[str]:
    """The 2x rule for out, lse, dq, dk, dv (``ultraattn.testing.check_2x``); returns the violations (empty = pass)."""
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[case.dtype]
    names = ("out", "lse", "dq", "dk", "dv")
    ref64 = dict(zip(names, reference(case, torch.float64)))
    ref = dict(zip(names, reference(case, dt)))
    return [f"{case.name} {m}" for m in check_2x(res, ref64, ref, case.dtype)]


def block_table(case: Case) -> torch.Tensor:
    """The case's per-head KV block table (``ultraattn.testing.random_block_table``)."""
    return random_block_table(case.seed, case.heads, case.seqlen, case.block)


def mask_mod_of(case: Case):
    """The case's mask_mod (and, for random masks, the dense table it reads)."""
    kw = dict(case.kwargs)
    if case.mask in ("causal", "full"):
        return getattr(ultraattn.masks, f"generate_{case.mask}")()
    if case.mask == "random":
        dense = random_block_dense(case.seed, case.seqlen, case.block)

        def random_mask(b, h, q_idx, kv_idx):
            return dense[q_idx, kv_idx]

        return random_mask
    if case.mask == "block_select":  # what its BlockMask (``plan_mask``) means, as a mask_mod
        table, blk = block_table(case), case.block

        def block_select(b, h, q_idx, kv_idx):
            return table[h, q_idx // blk, kv_idx // blk]

        return block_select
    if case.mask == "head_mix":  # heads of one GQA group with different masks; batch entry 1 differs from 0

        def head_mix(b, h, q_idx, kv_idx):
            causal = q_idx >= kv_idx
            return torch.where((h == 3) | ((b == 1) & (h == 0)), causal & (q_idx - kv_idx < 48), causal)

        return head_mix
    return getattr(ultraattn.masks, f"generate_{case.mask}")(**kw)


def plan_mask(case: Case):
    """What the rank passes to plan_attention: a BlockMask for random masks and for the fast planner (the
    FlexAttention path), the string for causal/full, else the mask_mod. ``block_select``: a BlockMask of per-head
    KV block lists whose mask_mod is ``noop_mask`` (the blocks alone carry the mask)."""
    if case.mask == "block_select":
        return block_select_mask(block_table(case), case.block, case.seqlen)
    if case.mask == "random" or case.planner == "fast":
        mm = mask_mod_of(case)
        per_batch = case.batch if getattr(mm, "num_batch", 1) > 1 else None
        return create_block_mask(mm, per_batch, None, case.seqlen, case.seqlen, device="cpu", BLOCK_SIZE=case.block)
    if case.mask in ("causal", "full"):
        return case.mask
    return mask_mod_of(case)


def inputs(case: Case):
    g = torch.Generator().manual_seed(1000 + case.seed)
    dt = _DT[case.dtype]
    b, s, d = case.batch, case.seqlen, case.head_dim
    q = torch.randn(b, case.heads, s, d, generator=g).to(dt)
    k = torch.randn(b, case.kv_heads, s, d, generator=g).to(dt)
    v = torch.randn(b, case.kv_heads, s, d, generator=g).to(dt)
    go = torch.randn(b, case.heads, s, d, generator=g).to(dt)
    gl = torch.randn(b, case.heads, s, generator=g)
    return q, k, v, go, gl


def dense_mask(case: Case) -> torch.Tensor:
    s = case.seqlen
    mm = mask_mod_of(case)
    return convert.eval_mask(mm, torch.arange(case.batch).view(-1, 1, 1, 1),
                              torch.arange(case.heads).view(1, -1, 1, 1), torch.arange(s).view(1, 1, -1, 1),
                              torch.arange(s).view(1, 1, 1, -1))


def reference(case: Case, dtype: torch.dtype):
    """Single-device dense attention in ``dtype`` (fp64: the oracle): out, lse, dq, dk, dv."""
    q, k, v, go, gl = inputs(case)
    r = dense_attention(q, k, v, dense_mask(case), go, gl, dtype)
    return r["out"], r["lse"], r["dq"], r["dk"], r["dv"]


def run_case(case: Case, rank: int, world: int, timeout: float = 60.0) -> dict:
    mesh = None
    if case.mesh is not None:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", case.mesh, mesh_dim_names=("node", "device"))
    t0 = time.perf_counter()
    plan = ultraattn.plan_attention(plan_mask(case), seqlen=case.seqlen, num_heads=case.heads, head_dim=case.head_dim,
                                    num_kv_heads=case.kv_heads, batch=case.batch, dtype=_DT[case.dtype],
                                    block_size=case.block, method=case.method, mesh=mesh, options=FAST,
                                    timeout=timeout, planner=case.planner)
    t_plan = time.perf_counter() - t0
    if "remake" in case.extra:   # the same mask and shapes, another plan (``REMAKE``)
        plan.tile_plan = REMAKE[case.extra["remake"]](plan.tile_plan)
    q, k, v, go, gl = inputs(case)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    ql, kl, vl = (ultraattn.dispatch(x, plan) for x in (q, k, v))
    o, lse = ultraattn.dist_attention(ql, kl, vl, plan)
    out = ultraattn.undispatch(o, plan)
    lse_g = ultraattn.undispatch(lse, plan)
    ((out.double() * go.double()).sum() + (lse_g.double() * gl.double()).sum()).backward()
    grads = [x.grad.clone() for x in (q, k, v)]
    if world > 1:
        for g in grads:  # each rank holds its own tokens' gradient: the sum is the full one
            dist.all_reduce(g)
    log = plan.comm_log
    records = [r[:8] for ph in ("fwd", "bwd") for r in log[ph].records]
    res = {"records": records, "rank": plan.rank, "plan_seconds": t_plan, "planner": plan.planner,
           "hash": plan.tile_plan.content_hash()}
    if rank == 0:
        tp = plan.tile_plan
        res.update(out=out.detach(), lse=lse_g.detach(), dq=grads[0], dk=grads[1], dv=grads[2],
                   transfers=[(t.phase, t.tensor, t.chunk, t.head_group, t.src, t.dst, t.nbytes) for t in tp.transfers],
                   structure=tp.meta.get("structure", tp.method), world=tp.world, relays=pure_relays(tp),
                   kernel_batch=tp.meta.get("kernel_batch", 1))
    return res


def node_one_on_its_last_rank(tp):
    """A causal plan for 2x2 ranks with chunks owned in sequence order (``chunk_size`` 16: four per rank), every
    cell computed where its row lives, except two blocks: the last rank computes all of the second node's cells on
    the first node's columns (it alone needs eight K/V units from the other node), and the first rank computes the
    second rank's cells on its own columns (so that the second rank does not use them). ``build.NodeLinks`` lands
    some of the eight on the other rank of the last rank's node and sends some from the second rank (pure relays:
    they hold a unit they neither own nor use)."""
    from ultraattn.planner.build import make_plan

    chunk = 16
    p = tp.shape.seq_len // chunk
    owner = [c // (p // 4) for c in range(p)]
    assign = torch.full((1, p, p), -1, dtype=torch.int32)
    for i in range(p):
        for j in range(i + 1):
                assign[0, i, j] = 3 if (i >= p // 2 and j < p // 2) else 0 if owner[i] == 1 and owner[j] == 0 \
                    else owner[i]
    return make_plan(method="ultraattn", owner=owner, assign_GPP=assign, mesh=tp.mesh, shape=tp.shape, chunk=chunk,
                     meta={"structure": "hand-routed"})


#: plans a case may replace the planner's with (``Case.extra["remake"]``): pure functions of the planner's plan
REMAKE = {"node_one_on_its_last_rank": node_one_on_its_last_rank}


def pure_relays(tp) -> dict[str, int]:
    """Input messages to a rank that neither owns nor uses their unit, by whether they cross a node link (a landing
    relay) or stay inside the owner's node (a sending relay)."""
    a = tp.assign_GPP
    out = {"landing": 0, "sending": 0}
    for t in tp.transfers:
        if t.tensor in ("q", "qdo", "kv"):
            line = a[t.head_group, :, t.chunk] if t.tensor == "kv" else a[t.head_group, t.chunk, :]
            if tp.owner[t.chunk] != t.dst and not bool((line == t.dst).any()):
                out["sending" if tp.mesh.same_node(t.dst, tp.owner[t.chunk]) else "landing"] += 1
    return out


def check_bytes(results: list[dict]) -> list[str]:
    """Per rank: the messages moved == the plan's transfers touching that rank (exact, with byte counts)."""
    transfers = results[0]["transfers"]
    bad = []
    for rank, res in enumerate(results):
        want = []
        for ph, tn, c, g, s, d, nb in transfers:
            if s == rank:
                want.append((ph, "send", tn, c, g, s, d, nb))
            if d == rank:
                want.append((ph, "recv", tn, c, g, s, d, nb))
        got = [tuple(r) for r in res["records"]]
        if sorted(got) != sorted(want):
            bad.append(f"rank {rank}: moved {len(got)} messages / {sum(r[7] for r in got)} B, plan says "
                       f"{len(want)} / {sum(w[7] for w in want)} B")
    return bad


def cases_worker(rank: int, world: int, cases: list[Case]) -> list[dict]:
    return [run_case(c, rank, world) for c in cases]


# ----------------------------------------------------------------------------- failure workers
def mismatch_worker(rank: int, world: int) -> str:
    """Rank 1 plans a different mask: every rank must get an error naming the difference."""
    mask = "causal" if rank != 1 else "full"
    plan = ultraattn.plan_attention(mask, seqlen=128, num_heads=2, head_dim=16, dtype=torch.float32, block_size=32,
                                    options=FAST, timeout=20)
    q = torch.randn(1, 2, plan.local_len, 16)
    try:
        ultraattn.dist_attention(q, q, q, plan)
    except ValueError as exc:
        return str(exc)
    return "no error"


def absent_worker(rank: int, world: int, how: str, timeout: float, absent: int) -> dict | None:
    """Rank ``absent`` plans but then never calls dist_attention (``how='stall'``) or dies (``'die'``)."""
    plan = ultraattn.plan_attention("causal", seqlen=128, num_heads=2, head_dim=16, dtype=torch.float32,
                                    block_size=32, options=FAST, timeout=timeout)
    if rank == absent:
        if how == "die":
            os._exit(3)
        time.sleep(timeout + 6)
        return None
    q = torch.randn(1, 2, plan.local_len, 16)
    t0 = time.perf_counter()
    try:
        ultraattn.dist_attention(q, q, q, plan)
    except Exception as exc:  # noqa: BLE001 - the test inspects type and text
        return {"error": f"{type(exc).__name__}: {exc}", "seconds": time.perf_counter() - t0}
    return {"error": None, "seconds": time.perf_counter() - t0}


def group_errors_worker(rank: int, world: int) -> dict:
    """Mesh/group mismatches and stale plans raise clear errors."""
    from torch.distributed.device_mesh import init_device_mesh

    out = {}
    mesh = init_device_mesh("cpu", (world,))
    sub = dist.new_group([0, 1])
    try:
        ultraattn.plan_attention("causal", seqlen=128, num_heads=2, head_dim=16, mesh=mesh, group=sub)
        out["mesh_vs_group"] = "no error"
    except ValueError as exc:
        out["mesh_vs_group"] = str(exc)
    plan = ultraattn.plan_attention("causal", seqlen=128, num_heads=2, head_dim=16, dtype=torch.float32,
                                    block_size=32, options=FAST, timeout=20)
    q = torch.randn(1, 2, plan.local_len, 16)
    ultraattn.dist_attention(q, q, q, plan)  # fine
    try:
        ultraattn.dist_attention(q.to(torch.bfloat16), q, q, plan)
        out["dtype"] = "no error"
    except ValueError as exc:
        out["dtype"] = str(exc)
    try:
        ultraattn.dist_attention(torch.randn(1, 2, 128, 16), q, q, plan)
        out["shape"] = "no error"
    except ValueError as exc:
        out["shape"] = str(exc)
    return out
