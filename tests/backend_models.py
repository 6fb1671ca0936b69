"""Small transformer models and rank workers shared by the backend tests (plain data in, plain data out)."""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from ultraattn.passes.records import SiteForm
from ultraattn.planner.program import Launch, Post


class Block(nn.Module):
    """Pre-norm attention + MLP block; ``attn`` picks how attention is called."""

    def __init__(self, dim: int, heads: int, kv_heads: int, attn: str):
        super().__init__()
        self.h, self.hk, self.d = heads, kv_heads, dim // heads
        self.norm1 = nn.LayerNorm(dim)
        self.q = nn.Linear(dim, heads * self.d, bias=False)
        self.kv = nn.Linear(dim, 2 * kv_heads * self.d, bias=False)
        self.o = nn.Linear(heads * self.d, dim, bias=False)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.attn = attn

    def forward(self, x, mask=None):
        B, S, _ = x.shape
        y = self.norm1(x)
        q = self.q(y).view(B, S, self.h, self.d).transpose(1, 2)
        k, v = self.kv(y).view(B, S, 2, self.hk, self.d).permute(2, 0, 3, 1, 4)
        gqa = self.h != self.hk
        if self.attn == "causal":
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        elif self.attn == "dense_mask":  # the oracle for flex models: SDPA with the dense bool mask
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        elif self.attn == "float_mask":
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        elif self.attn == "dropout":
            a = F.scaled_dot_product_attention(q, k, v, dropout_p=0.5, is_causal=True, enable_gqa=gqa)
        elif self.attn == "flex":
            a = flex_attention(q, k, v, block_mask=mask, enable_gqa=gqa)
        elif self.attn == "flex_score_mod":
            a = flex_attention(q, k, v, score_mod=lambda s, b, h, qi, kv: s + (qi - kv) * 0.01, block_mask=mask,
                               enable_gqa=gqa)
        else:
            raise ValueError(self.attn)
        x = x + self.o(a.transpose(1, 2).reshape(B, S, -1))
        return x + self.mlp(self.norm2(x))


class Tiny(nn.Module):
    def __init__(self, attn: str = "causal", layers: int = 2, dim: int = 32, heads: int = 4, kv_heads: int = 4,
                 vocab: int = 64, checkpoint: bool = False):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, kv_heads, attn) for _ in range(layers))
        self.head = nn.Linear(dim, vocab, bias=False)
        self.checkpoint = checkpoint

    def forward(self, tokens, mask=None):
        x = self.emb(tokens)
        for blk in self.blocks:
            if self.checkpoint:
                x = torch.utils.checkpoint.checkpoint(blk, x, mask, use_reentrant=False)
            else:
                x = blk(x, mask)
        logits = self.head(x)
        return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten())


def doc_ids(lengths: list[int]) -> torch.Tensor:
    return torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])


def doc_mask_mod(ids: torch.Tensor):
    def document_causal(b, h, q_idx, kv_idx):
        return (ids[q_idx] == ids[kv_idx]) & (q_idx >= kv_idx)

    return document_causal


def sliding_mask_mod(window: int):
    def sliding(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < window)

    return sliding


def random_mask_mod(S: int, seed: int, cell: int = 32, density: float = 0.3):
    """Random cells of ``cell`` tokens (so 64-token blocks are FULL, PARTIAL or EMPTY), a sparse element pattern
    inside, and the diagonal (every row attends somewhere)."""
    g = torch.Generator().manual_seed(seed)
    cells = torch.rand(S // cell + 1, S // cell + 1, generator=g) < density
    dense = torch.rand(S // cell + 1, S // cell + 1, generator=g) < 0.5

    def random_cells(b, h, q_idx, kv_idx):
        c = cells[q_idx // cell, kv_idx // cell]
        return (c & (dense[q_idx // cell, kv_idx // cell] | ((q_idx + 2 * kv_idx) % 3 != 0))) | (q_idx == kv_idx)

    return random_cells


def make_masks(kind: str, S: int, lengths=None, window: int = 48, block: int = 64, seed: int = 0):
    """(BlockMask for flex models, dense bool [S, S] for the SDPA oracle) of a library-style mask."""
    mm = {"document": lambda: doc_mask_mod(doc_ids(lengths)), "sliding": lambda: sliding_mask_mod(window),
          "random": lambda: random_mask_mod(S, seed)}[kind]()
    bm = create_block_mask(mm, None, None, S, S, device="cpu", BLOCK_SIZE=block)
    qi = torch.arange(S)
    dense = mm(torch.tensor(0), torch.tensor(0), qi[:, None], qi[None, :])
    return bm, dense


def step(model: nn.Module, tokens, mask=None) -> dict:
    """One forward + backward: the loss and every parameter's gradient (by name)."""
    model.zero_grad(set_to_none=True)
    loss = model(tokens, mask)
    loss.backward()
    return {"loss": loss.detach().double(), "grads": {n.removeprefix("_orig_mod."): p.grad.detach().double().clone()
                                                      for n, p in model.named_parameters()}}


def build(spec: dict, dtype=torch.float32) -> Tiny:
    torch.manual_seed(spec.get("seed", 0))
    m = Tiny(attn=spec["attn"], layers=spec.get("layers", 2), dim=spec.get("dim", 32), heads=spec.get("heads", 4),
             kv_heads=spec.get("kv_heads", 4), checkpoint=spec.get("checkpoint", False))
    return m.to(dtype)


def inputs(spec: dict):
    g = torch.Generator().manual_seed(123)
    S = spec["seqlen"]
    tokens = torch.randint(0, 64, (spec.get("batch", 1), S), generator=g)
    if spec["attn"] == "causal":
        return tokens, None, None
    bm, dense = make_masks(spec["mask"], S, spec.get("lengths"), spec.get("window", 48), spec.get("block", 64),
                           spec.get("mask_seed", 0))
    return tokens, bm, dense


def oracle(spec: dict) -> tuple[dict, dict]:
    """fp64 and fp32 eager single-device results (flex models: SDPA with the dense mask)."""
    tokens, _, dense = inputs(spec)
    ref_spec = dict(spec, attn="causal" if spec["attn"] == "causal" else "dense_mask")
    out = []
    for dt in (torch.float64, torch.float32):
        m = build(ref_spec, dt)
        out.append(step(m, tokens, dense))
    return out[0], out[1]


_FACTORIES = ("aten.full", "aten.zeros", "aten.empty", "aten.scalar_tensor", "aten.arange", "prims.iota",
              "aten.lift_fresh_copy", "aten._to_copy")


@contextlib.contextmanager
def host_scalars_spliced(found: list[str]):
    """Appends to ``found`` each int64 scalar that the expansion splices into an AOT graph as an aten/prims factory
    (a token or ticket made by ``torch.zeros`` or ``torch.tensor``). Such a value lives on the host: in a CUDA graph
    Inductor would build a C++ kernel for it, at a compiler run's cost on the first step. Tokens come from ops."""
    from ultraattn.passes import backend

    orig = backend.expand_graph

    def recording(rec, g, *args, **kwargs):
        before = set(g.graph.nodes)
        out = orig(rec, g, *args, **kwargs)
        for n in g.graph.nodes:
            val = n.meta.get("val")
            if (n not in before and n.op == "call_function" and str(n.target).startswith(_FACTORIES)
                    and isinstance(val, torch.Tensor) and val.dim() == 0 and val.dtype == torch.int64):
                found.append(f"{out.kind}: {n.format_node()}")
        return out

    backend.expand_graph = recording
    try:
        yield found
    finally:
        backend.expand_graph = orig


def comm_chain_breaks(code: str) -> list[str]:
    """The ops of the communication chain in a graph's code (``code`` as FX prints it: ops taking a token or an
    ``after`` argument, and waits) whose token or ``after`` is not the previous chained op's output: every rank must
    post them in one order (``explicit/order.py``)."""
    import re

    from ultraattn.passes.opinfo import AFTER_OPS, TOKEN_OPS, WAIT_OPS

    prev: set[str] = set()
    breaks = []
    for line in code.splitlines():
        m = re.match(r"\s*(\w+) = (\w+)\[0\]", line)
        if m and m.group(2) in prev:
            prev.add(m.group(1))
            continue
        m = re.match(r"\s*(\w+) = torch\.ops\.ultraattn\.(\w+)\.default\((.*)\)", line)
        if not m or m.group(2) not in AFTER_OPS | TOKEN_OPS | WAIT_OPS:
            continue
        name, op, args = m.groups()
        if op in TOKEN_OPS:
            tok = args.split(",")[0].strip()
        elif op in AFTER_OPS:
            after = re.search(r"after = (\w+)", args)
            tok = after[1] if after else "no after argument"
        else:
            tok = None
        if prev and tok is not None and tok not in prev:
            breaks.append(f"{name} ({op}) takes {tok}, not the previous chained op's output {sorted(prev)}")
        prev = {name}
    return breaks


def compiled_worker(rank: int, world: int, spec: dict, options: dict) -> dict:
    """Compile the spec's model with the ultraattn backend on this rank and take one step (``host_scalars``: what
    ``host_scalars_spliced`` found)."""
    from torch._dynamo.utils import counters

    tokens, bm, _ = inputs(spec)
    model = build(spec)
    cm = torch.compile(model, backend="ultraattn", options=dict(options), fullgraph=spec.get("fullgraph", False))
    with host_scalars_spliced([]) as host:
        res = step(cm, tokens, bm)
    res["host_scalars"] = host
    res["rewritten"] = counters["ultraattn"]["rewritten"]
    res["graphs"] = counters["ultraattn"]["graphs"]
    from ultraattn.passes import side_table

    res["planners"] = sorted({ev.planner for ev in side_table().plan_events})
    return res


def mismatch_worker(rank: int, world: int, shard: bool = True) -> str:
    """debug=True: rank 1 feeds different tokens; every rank must get an error naming rank 1."""
    spec = {"attn": "causal", "seqlen": 128}
    tokens, _, _ = inputs(spec)
    if rank == 1:
        tokens = (tokens + 1) % 64
    cm = torch.compile(build(spec), backend="ultraattn",
                       options={"debug": True, "ilp_time_limit": 1.0, "time_budget": 2.0, "timeout": 30.0,
                                "shard": shard})
    try:
        cm(tokens)
    except Exception as exc:  # noqa: BLE001 - the test reads the message
        return str(exc)
    return "no error"


def local_world_worker(rank: int, world: int) -> dict:
    """LOCAL_WORLD_SIZE=2 with 4 ranks: the backend plans on a 2 x 2 mesh (two 'nodes')."""
    import os

    os.environ["LOCAL_WORLD_SIZE"] = "2"
    from ultraattn.passes import side_table

    spec = {"attn": "causal", "seqlen": 128}
    # aot_eager: the mesh is what is tested here (Inductor compiles 4-rank graphs in test_ranks_match_single_device)
    res = compiled_worker(rank, world, spec, {"ilp_time_limit": 1.0, "time_budget": 2.0, "compiler": "aot_eager"})
    meshes = {(plan.tile_plan.mesh.nodes, plan.tile_plan.mesh.devices)
              for st in side_table().sites.values() for plan in st.plans.values()}
    res["meshes"] = sorted(meshes)
    return res


def explicit_worker(rank: int, world: int, spec: dict, options: dict) -> dict:
    """One step with explicit site graphs: the graphs Inductor received, stage counts, bytes moved vs planned."""
    from ultraattn.passes import side_table

    res = compiled_worker(rank, world, spec, options)
    table = side_table()
    rec = table.graphs[-1]
    res["aot"] = [{"kind": g.kind, "expanded": list(g.expanded), "code": g.code}
                  for g in table.aot_graphs_of(rec.index)]
    res["sites"] = {}
    for st in table.sites_of(rec):
        e = st.program
        if e is None:
            continue
        if st.form is SiteForm.PROGRAM_PER_MASK:  # a run-time program: the latest call's plan and messages
            run = e.last
            res["sites"][st.spec.name] = {
                "moved": {ph: e.executor.log[ph].totals().get(ph, {"sent": 0, "recv": 0}) for ph in ("fwd", "bwd")},
                "planned": {ph: run.plan.bytes(ph, run.rank) for ph in ("fwd", "bwd")},
                "plan": run.plan.content_hash(), "ownership": run.plan.ownership}
            continue
        prog = e.executor.program
        ap = e.runner
        res["sites"][st.spec.name] = {
            "rows": sum(len(s.rows) for s in prog.steps["fwd"] if isinstance(s, Launch)),
            "stages": {ph: sum(isinstance(s, Post) for s in prog.steps[ph]) for ph in ("fwd", "bwd")},
            "moved": {ph: e.executor.log[ph].totals().get(ph, {"sent": 0, "recv": 0}) for ph in ("fwd", "bwd")},
            "planned": {ph: ap.predicted_bytes(ph) for ph in ("fwd", "bwd")},
        }
    return res


def runtime_mask_worker(rank: int, world: int, specs: list[dict], options: dict, mode: str = "plain") -> dict:
    """One compiled model, one step per spec (the same model and tokens, a new mask each): per step the loss,
    gradients, each run-time site's bytes moved and planned and its plan; the graphs Inductor received and the
    compile counts. ``mode``: "plain" (the model), "break" (a graph break between its blocks), "sharded"
    (options outputs="sharded": logits stay local, ``ultraattn.undispatch`` gathers them)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    import ultraattn
    from ultraattn.passes import side_table

    spec0 = specs[0]
    model = build(spec0)
    dense_sites = spec0["attn"] == "dense_mask"

    def forward(tokens, mask):
        x = model.emb(tokens)
        x = model.blocks[0](x, mask)
        if mode == "break":
            torch._dynamo.graph_break()
        x = model.blocks[1](x, mask)
        return model.head(x)

    opts = dict(options, outputs="sharded") if mode == "sharded" else dict(options)
    fn = torch.compile(model if mode == "plain" else forward, backend="ultraattn", options=opts)
    steps, frames = [], []
    for spec in specs:
        tokens, bm, dense = inputs(spec)
        mask = dense if dense_sites else bm
        model.zero_grad(set_to_none=True)
        if mode == "plain":
            loss = fn(tokens, mask)
        else:
            logits = fn(tokens, mask)
            if mode == "sharded":
                logits = ultraattn.undispatch(logits)
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        sites = {}
        for st in side_table().sites.values():
            e = st.program
            if e is not None and st.form is SiteForm.PROGRAM_PER_MASK:
                run = e.last
                sites[st.spec.name] = {
                    "moved": {ph: e.executor.log[ph].totals().get(ph, {"sent": 0, "recv": 0})
                              for ph in ("fwd", "bwd")},
                    "planned": {ph: run.plan.bytes(ph, run.rank) for ph in ("fwd", "bwd")},
                    "plan": run.plan.content_hash(), "ownership": run.plan.ownership, "calls": st.calls,
                    # tile rows that ran the block-sparse Triton kernels (their block lists, cached per mask)
                    "kernel_rows": sum(k[0] == "kernel" for k in run.geo.mask_cache)}
        steps.append({"loss": loss.detach().double(), "sites": sites,
                      "grads": {n: p.grad.detach().double().clone() for n, p in model.named_parameters()}})
        frames.append((counters["ultraattn"]["graphs"], counters["stats"]["unique_graphs"]))
    table = side_table()
    return {"steps": steps, "frames": frames,
            "aot": [{"kind": g.kind, "expanded": list(g.expanded), "code": g.code} for g in table.aot_graphs],
            "events": [ev.to_json() for ev in table.plan_events]}
