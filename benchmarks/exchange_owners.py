"""Owners of a run-time-mask site: chosen per batch, or fixed per graph? Exchange plans of document masks, modelled.

An explicit site whose mask arrives each batch (``passes/explicit/per_mask.py``) computes every cell where its
query rows live; who owns which chunk is either fixed for the graph (head-tail, balanced for causal masks) or
chosen per mask by the balancer (``planner.balance.ownership``). On this 2-core CPU the end-to-end benchmark
(``dynamic_masks.py --attention-only``) cannot tell them apart: four ranks share two cores, so a rank's idle
time goes to the others and only the total work counts, which ownership does not change. On a machine with a
device per rank the slowest rank sets the step. This study plans the masks and models each rank's attention time
with the cost model's cited H100 figures (``planner/cost.py``; not a GPU measurement):

    forward  = max(own tile, K/V messages in or out) + received-keys tile
    backward = received-keys tile + max(own tile, dK/dV messages in or out)
    step     = slowest rank's forward + slowest rank's backward
    ideal    = the same kernels' total time / ranks (perfect balance, no communication)

Masks: packed documents at S tokens, two packings: ``example`` (2-6 documents, uniform cuts: the example's
``--mask document``) and ``pretraining`` (log-normal lengths, median 1K tokens, packed until full: many short
documents and a few long ones). Llama-3-8B's attention (32 query heads, 8 KV heads, head dim 128, bf16),
128-token blocks. Owners (``POLICIES``): per batch (the balancer, 4 chunks per rank, the global view's
default), head-tail (two contiguous ranges per rank), head-tail stripes with 4 and 16 chunks per rank (a
sequence-sharded graph's layout for run-time masks).

    python benchmarks/exchange_owners.py            # -> benchmarks/results/exchange_owners.json and .png
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from _results import pyplot, save

from ultraattn.masks import generate_document
from ultraattn.masks.convert import to_block_pattern
from ultraattn.planner.baselines import striped_owner, zigzag_owner
from ultraattn.planner.cost import DEFAULT_COST, block_flops
from ultraattn.planner.exchange import pattern_weights, plan_exchange
from ultraattn.planner.plan import Mesh, padded_chunk

HERE = Path(__file__).resolve().parent
HEADS, KV_HEADS, HEAD_DIM, ELT = 32, 8, 128, 2
BLOCK = 128
POLICIES = (
    ("per-batch", 4, lambda world, per: None),                                   # the balancer, per mask
    ("head-tail", 4, lambda world, per: tuple(zigzag_owner(world, per // 2))),   # two contiguous ranges each
    ("stripes", 4, lambda world, per: tuple(striped_owner(world, per // 2))),
    ("stripes-16", 16, lambda world, per: tuple(striped_owner(world, per // 2))),  # RUNTIME_MASK_STRIPES = 8
)
"""(name, chunks per rank, owners of ``world`` ranks with ``per`` chunks each; None: chosen per mask)."""


def lengths_of(kind: str, seqlen: int, g: torch.Generator) -> list[int]:
    if kind == "example":  # examples/train_cp.py's batches()
        docs = int(torch.randint(2, 7, (), generator=g))
        cuts = torch.randperm(seqlen - 1, generator=g)[:docs - 1].add(1).sort().values.tolist()
        return [b - a for a, b in zip([0, *cuts], [*cuts, seqlen], strict=True)]
    out, left = [], seqlen
    while left:
        n = int(torch.empty(()).log_normal_(np.log(1024), 1.2, generator=g))
        n = min(max(n, 16), left)
        out.append(n)
        left -= n
    return out


def model(weights: np.ndarray, plan, world: int, chunk: int) -> dict:
    """Modelled attention seconds (forward + backward, slowest rank each) of one exchange plan."""
    cost = DEFAULT_COST
    own = np.asarray(plan.layout.owner)
    per_q = chunk // BLOCK
    fl = block_flops(BLOCK, BLOCK, HEAD_DIM, 1, 1)  # weights count (batch, head) blocks
    fwd, bwd, busy_s = [], [], 0.0
    for r in range(world):
        rows = own == r
        tiles = {"own": weights[np.ix_(rows, own == r)], "remote": weights[np.ix_(rows, own != r)]}
        t = {}
        for name, w in tiles.items():
            busy = (w.sum(1) > 0).sum()
            kv_tokens = w.sum() / max(1, HEADS * per_q * busy) * BLOCK  # KV tokens per query block row
            t[name] = {ph: cost.kernel_seconds(flops=w.sum() * fl, kv_tokens_per_row=max(kv_tokens, 1.0), phase=ph)
                       for ph in ("fwd", "bwd")}
            busy_s += t[name]["fwd"] + t[name]["bwd"]
        by = {ph: plan.bytes(ph, r) for ph in ("fwd", "bwd")}
        msg = {ph: cost.message_seconds(max(by[ph].values()), inter_node=False) if max(by[ph].values()) else 0.0
               for ph in by}
        fwd.append(max(t["own"]["fwd"], msg["fwd"]) + t["remote"]["fwd"])
        bwd.append(t["remote"]["bwd"] + max(t["own"]["bwd"], msg["bwd"]))
    ideal = busy_s / world  # the same kernels perfectly balanced, no communication
    return {"seconds": max(fwd) + max(bwd), "imbalance": plan.imbalance(),
            "fwd_mib": plan.stage_bytes("fwd") / 2**20, "ideal_seconds": ideal}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqlens", default="32768,131072")
    p.add_argument("--worlds", default="4,8")
    p.add_argument("--masks", type=int, default=24, help="masks per (packing, seqlen, world)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(HERE / "results" / "exchange_owners.json"))
    a = p.parse_args()
    rows = []
    t0 = time.time()
    for packing in ("example", "pretraining"):
        for seqlen in (int(x) for x in a.seqlens.split(",")):
            g = torch.Generator().manual_seed(a.seed)
            masks = [lengths_of(packing, seqlen, g) for _ in range(a.masks)]
            patterns = [to_block_pattern(generate_document(ls), q_len=seqlen, kv_len=seqlen, block_size=BLOCK)
                        for ls in masks]
            for world in (int(x) for x in a.worlds.split(",")):
                mesh = Mesh(nodes=1, devices=world)
                res = {name: [] for name, _, _ in POLICIES}
                for pat in patterns:
                    for name, per, owner_of in POLICIES:
                        num = per * world
                        chunk = padded_chunk(seqlen, num, BLOCK)
                        w = pattern_weights(pat, batch=1, num_heads=HEADS, chunk=chunk, num_chunks=num,
                                            partial_overhead=DEFAULT_COST.partial_block_overhead)
                        kvb = 2 * KV_HEADS * chunk * HEAD_DIM * ELT
                        plan = plan_exchange(w, mesh=mesh, chunk=chunk, owner=owner_of(world, per),
                                             kv_chunk_bytes=kvb, dkv_chunk_bytes=2 * kvb)
                        res[name].append(model(w, plan, world, chunk))
                row = {"packing": packing, "seqlen": seqlen, "world": world, "masks": len(masks),
                       "docs_median": statistics.median(len(m) for m in masks)}
                for name, rs in res.items():
                    ratio = [x["seconds"] / y["seconds"] for x, y in zip(rs, res["per-batch"])]
                    row[name] = {k: statistics.median(x[k] for x in rs) for k in rs[0]}
                    row[name]["over_ideal"] = statistics.median(x["seconds"] / x["ideal_seconds"] for x in rs)
                    row[name]["over_per_batch"] = {"median": statistics.median(ratio), "min": min(ratio),
                                                   "max": max(ratio)}
                rows.append(row)
                print(f"{packing:>11} S={seqlen:>6} W={world}: modelled step / perfectly balanced (imbalance, "
                      f"fwd MiB): " + "; ".join(f"{n} {row[n]['over_ideal']:.2f} ({row[n]['imbalance']:.2f}, "
                                                 f"{row[n]['fwd_mib']:.0f})" for n in res))
    out = Path(a.out)
    save(out, {"model": f"{HEADS}/{KV_HEADS} heads, head dim {HEAD_DIM}, bf16, block {BLOCK}, policies in POLICIES",
               "cost": "DEFAULT_COST (H100 figures, planner/cost.py)", "note": "modelled, not measured on a GPU",
               "seconds": round(time.time() - t0, 1)}, rows)
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(8, 3.8))
    labels = [f"{r['packing'][:4]}\nS={r['seqlen'] // 1024}K W={r['world']}" for r in rows]
    x = np.arange(len(rows))
    colors = ("tab:blue", "tab:grey", "tab:olive", "tab:green")
    bw = 0.8 / len(POLICIES)
    for k, ((name, per, _), color) in enumerate(zip(POLICIES, colors)):
        ax.bar(x + (k - (len(POLICIES) - 1) / 2) * bw, [r[name]["over_ideal"] for r in rows], bw,
               label=f"{name} ({per} chunks/rank)", color=color)
    ax.axhline(1.0, color="k", lw=0.6)
    ax.set_xticks(x, labels, fontsize=7)
    ax.set_ylabel("modelled step / perfectly balanced")
    ax.set_title("document masks: owner-computes exchange plans (H100 cost model, median of masks)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
