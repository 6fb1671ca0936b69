"""Planning time alone: the fast planner on new document masks, one core, nothing else timed.

    python benchmarks/plan_time.py [--configs 128k:8x8,512k:8x8,128k:1x8,128k:2x8] [--masks 20] [--repeat 3]
                                   [--name plan_time] [--out benchmarks/results] [--breakdown]

``benchmarks/replan.py`` times planning among its quality measurements; this times only planning, from the
``BlockMask`` as ``replan.py`` does (its cells read, ``cells_from_block_mask``, then ``FastPlanner.plan``), on the
same masks (``replan.doc_lengths``, ``replan.document_block_mask``, seed 7; one planner per configuration,
warmed on one extra mask, as a training loop reuses it). Each mask is planned ``--repeat`` times in rounds over all
masks; per mask the least time is kept (this VM's neighbours add noise that only ever adds time). Reported per
configuration: the median and p95 over masks of those minima, the median of the first round alone (what
``replan.py``'s single pass measures), and how many masks had a near-tie decided by replays (one more replay each).
Issue 53's target: a 128K mask on 8x8 in <= 150 ms median.

Writes ``<name>.json`` with every time. ``--breakdown``: also where the time goes, per plan, in the planner's main
steps (each timed around its calls; nested steps are inside their callers' figures: ``simulate`` holds
``bottom_levels``), from one extra round that is not in the times above.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # one core: before numpy and torch load their thread pools

import argparse  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
from _results import write_json  # noqa: E402
from replan import MESHES, SEQS, doc_lengths, document_block_mask  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from ultraattn.masks.cells import cells_from_block_mask  # noqa: E402
from ultraattn.planner.fast import FastPlanner  # noqa: E402
from ultraattn.planner.plan import AttnShape, Mesh  # noqa: E402

#: the planner's steps ``--breakdown`` times: (module, function), each looked up where its callers find it
STEPS = (("fast", "place"), ("fast", "place_flat"), ("fast", "route"), ("fast", "price"), ("fast", "band_prices"),
         ("fast", "with_order"), ("schedule", "build_graph"), ("schedule", "simulate"), ("schedule", "bottom_levels"))


def breakdown(planner: FastPlanner, blocks: list) -> dict[str, float]:
    """Milliseconds per plan in each of ``STEPS`` over one round of ``blocks``."""
    import ultraattn.planner.fast as fast_mod
    import ultraattn.planner.schedule as schedule_mod

    mods = {"fast": fast_mod, "schedule": schedule_mod}
    spent = {name: 0.0 for _, name in STEPS}
    saved = []

    def timed(name, fn):
        def call(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - t0
        return call

    for mod, name in STEPS:
        saved.append((mods[mod], name, getattr(mods[mod], name)))
        setattr(mods[mod], name, timed(name, getattr(mods[mod], name)))
    try:
        for bm in blocks:
            planner.plan(cells_from_block_mask(bm))
    finally:
        for mod, name, fn in saved:
            setattr(mod, name, fn)
    return {name: sec * 1e3 / len(blocks) for name, sec in spent.items()}


def run_config(seq_name: str, mesh_name: str, masks: int, repeat: int, steps: bool = False) -> dict:
    seq = SEQS[seq_name]
    nodes, devices = (int(x) for x in mesh_name.split("x"))
    rng = np.random.default_rng(7)
    blocks = [document_block_mask(doc_lengths(seq, rng), seq) for _ in range(masks + 1)]
    planner = FastPlanner(shape=AttnShape(seq_len=seq, num_heads=32, head_dim=128, num_kv_heads=8, dtype="bf16"),
                          mesh=Mesh(nodes=nodes, devices=devices))
    planner.plan(cells_from_block_mask(blocks[0]))   # warm: per-grid constants, the baselines' fixed parts
    times = [[] for _ in range(masks)]
    replayed = [False] * masks   # a near-tie decided by replays (``fast.NEAR_TIE``, ``fast.PRICE_TIE``): costlier
    for _ in range(repeat):
        for n, bm in enumerate(blocks[1:]):
            t0 = time.perf_counter()
            tp = planner.plan(cells_from_block_mask(bm))
            times[n].append((time.perf_counter() - t0) * 1e3)
            replayed[n] = bool(tp.meta["replayed"])
    least = sorted(min(t) for t in times)
    out = {"seq": seq_name, "mesh": mesh_name, "masks": masks, "repeat": repeat, "ms": times,
           "median_ms": statistics.median(least), "p95_ms": least[min(len(least) - 1, int(0.95 * len(least)))],
           "first_round_median_ms": statistics.median(t[0] for t in times), "load": os.getloadavg(),
           "replayed_ties": sum(replayed)}
    print(f"{seq_name} {mesh_name}: median {out['median_ms']:.1f} ms, p95 {out['p95_ms']:.1f} ms "
          f"(first round alone: median {out['first_round_median_ms']:.1f} ms; {out['replayed_ties']} of {masks} masks "
          f"a near-tie replayed)", flush=True)
    if steps:   # (--breakdown)
        out["breakdown_ms"] = breakdown(planner, blocks[1:])
        print("  per plan: " + ", ".join(f"{k} {v:.1f} ms" for k, v in out["breakdown_ms"].items()), flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default="128k:8x8,512k:8x8,128k:1x8,128k:2x8",
                    help="comma list of SEQ:MESH, e.g. 128k:8x8 (SEQ in 32k/128k/512k, MESH in 1x4/1x8/2x8/8x8)")
    ap.add_argument("--masks", type=int, default=20)
    ap.add_argument("--repeat", type=int, default=3, help="plan each mask this many times, keep the least")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--name", default="plan_time", help="output file stem")
    ap.add_argument("--breakdown", action="store_true", help="also time the planner's main steps (one more round)")
    args = ap.parse_args()
    if args.masks < 1 or args.repeat < 1:
        ap.error(f"--masks and --repeat must be >= 1, got {args.masks} and {args.repeat}")
    configs = [c.split(":") for c in args.configs.split(",")]
    for c in configs:
        if len(c) != 2 or c[0] not in SEQS or c[1] not in MESHES:
            ap.error(f"--configs entries must be SEQ:MESH with SEQ in {list(SEQS)} and MESH in {list(MESHES)}, "
                     f"got {':'.join(c)}")
    torch.set_num_threads(1)
    results = [run_config(s, m, args.masks, args.repeat, args.breakdown) for s, m in configs]
    path = os.path.join(args.out, f"{args.name}.json")
    write_json(path, {"meta": {"machine": platform.machine(),
                               "cpu_count": os.cpu_count(), "torch": torch.__version__}, "configs": results})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
