"""Part 2 (in the runner's order): two ranks on one GPU, exact against one process.

NCCL refuses two ranks on one device, so the two ranks talk over gloo, and gloo moves host memory only: ultraattn's
``StagedTransport`` (``runtime/transport.py``) copies each message through the host, which ``transport_for``
picks for gloo on a CUDA machine. Each rank compiles the example model (``examples/train_cp.py``) with
``backend="ultraattn"`` (Inductor; ``aot_eager`` in the dry run): the sequence sharded through the graph, each
attention an explicit per-rank program whose tiles are the Triton kernels. One step each with causal SDPA (a plan
made at compile time), with a flex document mask (planned at run time), and with that mask and tanh soft-capping
(a score_mod, generated into the kernels: ``kernels/score_codegen.py``); every rank's loss and
gradients must pass the numerics policy against the single-process step: the fp64 eager oracle, and as the
same-precision reference the fp32 step further from it of eager's and plain ``torch.compile``'s (as in
``backend_e2e``).
The bandwidth is the host's, so no time here says anything about NCCL.
"""

from __future__ import annotations

import argparse
import copy
import os
import threading
import time

import torch
import torch.distributed as dist
from train_cp import Llama, batches, document_masks

import ultraattn
from ultraattn.passes.opinfo import TILE_OPS
from ultraattn.testing import RankFailure, check_step, run_ranks

from .common import Ctx, error_text, grads_of, sync

NAME = "two_ranks"
TITLE = "two ranks, one GPU"
CORRECTNESS = True
KINDS = ("causal", "document", "softcap", "document_flex")
"""``document_flex``: the document mask with every tile row on FlexAttention (``ULTRAATTN_TILE_KERNEL=flex``)."""
SOFTCAP = 20.0


def _data(cfg: dict):
    (tokens, lengths), = batches(argparse.Namespace(seqlen=cfg["seqlen"], steps=1, seed=1, same_mask=False))
    return tokens, lengths


def worker(rank: int, world: int, cfg: dict, compiler: str, cuda: bool) -> dict:
    from ultraattn.passes import side_table
    from ultraattn.runtime.comm import GroupRef
    from ultraattn.runtime.transport import transport_for

    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    transport = type(transport_for(rank=rank, global_ranks=range(world), group_ref=GroupRef(dist.group.WORLD)))
    tokens, lengths = _data(cfg)
    tokens = tokens.to(device)
    out = {"transport": transport.__name__, "device": str(device)}
    from ultraattn.kernels import flex_tile

    flex_calls = [0]
    flex_forward = flex_tile.flex_forward

    def counted(*args, **kwargs):
        flex_calls[0] += 1
        return flex_forward(*args, **kwargs)

    flex_tile.flex_forward = counted
    for kind in KINDS:
        ultraattn.reset()
        if kind == "document_flex":
            os.environ["ULTRAATTN_TILE_KERNEL"] = "flex"
        else:
            os.environ.pop("ULTRAATTN_TILE_KERNEL", None)
        flex_calls[0] = 0
        torch.manual_seed(0)
        model = Llama(cfg["dim"], cfg["layers"], cfg["heads"], cfg["kv_heads"],
                      softcap=SOFTCAP if kind == "softcap" else None).to(device)
        run = torch.compile(model, backend="ultraattn", options={"compiler": compiler, "report": "off"})
        mask = document_masks(lengths, device)[0] if kind != "causal" else None
        sync(device)
        print(f"[two_ranks] rank {rank}: {kind}: compiling and running the first step", flush=True)
        t0 = time.perf_counter()
        loss = run(tokens, mask)
        loss.backward()
        sync(device)
        first = time.perf_counter() - t0
        print(f"[two_ranks] rank {rank}: {kind}: first step {first:.1f} s", flush=True)
        codes = [g.code for g in side_table().aot_graphs]
        out[kind] = {"loss": loss.detach().double().cpu(), "grads": grads_of(run),
                     "first_step_s": first,
                     "ops": {op: n for op in sorted(TILE_OPS | {"cp_start", "site_attention_local"})
                             if (n := sum(c.count(f"ultraattn.{op}.") for c in codes))},
                     "sharded_ops": int(side_table().counters["sharded_ops"]), "flex_rows": flex_calls[0]}
    os.environ.pop("ULTRAATTN_TILE_KERNEL", None)
    return out


def references(cfg: dict, device: torch.device, compiler: str) -> dict:
    """The single-process steps per kind: eager in fp64 and fp32 (the document mask as SDPA's dense mask), and the
    fp32 model compiled plainly by ``compiler`` (the same program as the ranks', flex mask and all, without
    ultraattn), or the error that stopped it."""
    tokens, lengths = _data(cfg)
    tokens = tokens.to(device)
    refs = {}
    for kind in KINDS:
        if kind == "document_flex":  # the same model and mask as "document": its references
            refs[kind] = refs["document"]
            continue
        torch.manual_seed(0)
        base = Llama(cfg["dim"], cfg["layers"], cfg["heads"], cfg["kv_heads"],
                     softcap=SOFTCAP if kind == "softcap" else None).to(device)
        block_mask, dense = document_masks(lengths, device) if kind != "causal" else (None, None)
        steps = []
        for dt, mask, compiled in ((torch.float64, dense, False), (torch.float32, dense, False),
                                   (torch.float32, block_mask, True)):
            m = copy.deepcopy(base).to(dt)
            try:
                loss = (torch.compile(m, backend=compiler) if compiled else m)(tokens, mask)
                loss.backward()
                steps.append({"loss": loss.detach().double().cpu(), "grads": grads_of(m)})
            except Exception as exc:  # noqa: BLE001 - a plain compile that fails leaves eager's bound, recorded
                if not compiled:
                    raise
                steps.append({"error": error_text(exc)})
        refs[kind] = steps
    return refs


def run(ctx: Ctx) -> None:
    cfg = ctx.pick(dict(seqlen=4096, dim=512, heads=8, kv_heads=2, layers=2),
                   dict(seqlen=256, dim=64, heads=4, kv_heads=2, layers=2))
    compiler = ctx.pick("inductor", "aot_eager")
    cuda = ctx.device.type == "cuda"
    ctx.save(config=cfg, compiler=compiler,
             how="2 spawned processes, gloo on 127.0.0.1, both on " + ("cuda:0" if cuda else "the CPU"))
    env = {} if cuda else {"ULTRAATTN_TRANSPORT": "staged"}  # a GPU machine picks it by itself (recorded)
    # an exactness part, timed by nobody: each kernel key compiles its space's first tile config instead of
    # autotuning over five or six (session 3's causal first step took 98 s, most of the part's time)
    env["ULTRAATTN_TUNE"] = os.environ.get("ULTRAATTN_TUNE", "first")
    ctx.save(tune=env["ULTRAATTN_TUNE"])
    # the single-process references compile while the ranks do (session 3's H200 run spent its 219 s on the ranks'
    # first steps and then these, one after the other)
    refs: dict = {}
    failed: list[BaseException] = []

    def make_refs() -> None:
        try:
            refs.update(references(cfg, ctx.device, compiler))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the part's thread below
            failed.append(exc)

    beside = threading.Thread(target=make_refs, name="two_ranks references", daemon=True)
    beside.start()
    try:
        res = run_ranks(worker, 2, args=(cfg, compiler, cuda), timeout=max(30.0, ctx.time_left()),
                        pg_timeout=120.0, env=env)
    except RankFailure as exc:
        ctx.fail(f"the ranks failed: {str(exc)[:2000]}")
        return
    beside.join(timeout=max(1.0, ctx.time_left()))
    if failed:
        raise failed[0]
    if beside.is_alive():
        ctx.fail("the single-process references did not finish before the deadline")
        return
    rows = []
    for kind in KINDS:
        ref64, ref32, plain = refs[kind]
        for rank, r in enumerate(res):
            got = r[kind]
            # the policy against the further of eager's and plain torch.compile's fp32 steps (backend_e2e's rule)
            bad = check_step(got, ref64, ref32, compiled=None if "error" in plain else plain)
            row = {"kind": kind, "rank": rank, "transport": r["transport"], "problems": bad,
                   "problems_vs_eager": check_step(got, ref64, ref32),
                   "plain_problems_vs_eager": check_step(plain, ref64, ref32) if "error" not in plain else None,
                   "plain_error": plain.get("error"),
                   "loss": float(got["loss"]), "ref_loss": float(ref64["loss"]),
                   "first_step_s": got["first_step_s"], "ops": got["ops"], "sharded_ops": got["sharded_ops"]}
            row["flex_rows"] = got["flex_rows"]
            if (got["flex_rows"] > 0) != (kind == "document_flex"):
                bad.append(f"{got['flex_rows']} tile rows ran on FlexAttention")
            tiles = sum(got["ops"].get(op, 0) for op in TILE_OPS)
            if not tiles:
                bad.append(f"no tile ops in the compiled graphs: {got['ops']}")
            if r["transport"] != "StagedTransport":
                bad.append(f"the ranks communicated over {r['transport']}, not the host-staged transport")
            row["ok"] = not bad
            if bad:
                ctx.fail(f"{kind} rank {rank}: {bad}")
            rows.append(row)
    ctx.save(rows=rows, summary=f"{sum(r['ok'] for r in rows)}/{len(rows)} (mask, rank) steps within the policy, "
                                f"over {res[0]['transport']}")


