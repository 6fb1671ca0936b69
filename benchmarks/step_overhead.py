"""Host time per attention site per step, on the CPU, beside the kernels' time (issue 51).

transformers' ``LlamaForCausalLM`` (tiny random config: 2 layers, hidden 64, 4/2 heads) compiled with
``backend="ultraattn"`` at world size 1, with ``position_ids`` passed so that transformers builds its mask at run
time (SDPA: a boolean mask; flex_attention: a BlockMask), stepped (forward and backward) after two warm steps under
``torch.profiler``. Per step and site:

* ``host_ms``: the self CPU time of the site's own ops (``ultraattn::site_attention``, its backward op,
  ``ultraattn::mask_block_kinds``): planning, cache lookups, reading the mask, building layouts: what would sit on
  the critical path of every step on a GPU;
* ``kernel_ms``: the self CPU time of the kernel ops (``ultraattn::bsa_fwd`` / ``bsa_bwd``): on the CPU that is
  the attention itself (the kernels' reference), which grows with S by design.

Issue 51's target: ``host_ms`` at most 5 ms per site at S = 4096 and at S = 16384 (before: 47 ms with SDPA and
20 ms with flex at S = 4096 on a quiet machine).

    python benchmarks/step_overhead.py                      # S = 4096 and 16384, SDPA and flex, 5 steps each
    python benchmarks/step_overhead.py --seqlens 1024 --steps 2 --name step_overhead_quick
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from _results import pyplot, write_json  # noqa: E402

OVERHEAD_OPS = ("ultraattn::site_attention", "ultraattn::site_attention_bwd", "ultraattn::mask_block_kinds")
KERNEL_OPS = ("ultraattn::bsa_fwd", "ultraattn::bsa_bwd", "ultraattn::bsa_fwd_ref", "ultraattn::bsa_bwd_ref")


def measure(impl: str, seqlen: int, steps: int) -> dict:
    from client_cases import hf_data, hf_model, hf_step
    from torch.profiler import ProfilerActivity, profile

    import ultraattn
    from ultraattn.passes import side_table

    torch._dynamo.reset()
    ultraattn.reset()
    ids, pos = hf_data(seqlen, True)
    cm = torch.compile(hf_model(impl), backend="ultraattn", options={"compiler": "aot_eager"})
    for _ in range(2):
        hf_step(cm, ids, pos, False)
    sites = sum(1 for g in side_table().graphs for s in g.sites if s.rewritten)
    host, kernels = [], []
    for _ in range(steps):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            hf_step(cm, ids, pos, False)
        by = {e.key: e.self_cpu_time_total / 1e3 for e in prof.key_averages()}
        host.append(sum(by.get(k, 0.0) for k in OVERHEAD_OPS) / max(1, sites))
        kernels.append(sum(by.get(k, 0.0) for k in KERNEL_OPS) / max(1, sites))
    return {"impl": impl, "seqlen": seqlen, "sites": sites, "host_ms": round(statistics.median(host), 3),
            "host_ms_all": [round(x, 3) for x in host], "kernel_ms": round(statistics.median(kernels), 3),
            "host_spread": round((max(host) - min(host)) / max(statistics.median(host), 1e-9), 3)}


def plot(res: dict, png: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for impl in sorted({r["impl"] for r in res["rows"]}):
        rows = [r for r in res["rows"] if r["impl"] == impl]
        ax.plot([r["seqlen"] for r in rows], [r["host_ms"] for r in rows], "o-", label=f"{impl}: host")
        ax.plot([r["seqlen"] for r in rows], [r["kernel_ms"] for r in rows], "x--", label=f"{impl}: kernels (CPU)")
    ax.axhline(5.0, color="gray", lw=0.8, ls=":", label="target: 5 ms host per site")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length")
    ax.set_ylabel("ms per site per step (median)")
    ax.set_title("transformers Llama, world size 1, CPU", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqlens", type=int, nargs="+", default=[4096, 16384])
    p.add_argument("--impls", nargs="+", default=["sdpa", "flex_attention"], choices=["sdpa", "flex_attention"])
    p.add_argument("--steps", type=int, default=5, help="profiled steps per row (after two warm ones)")
    p.add_argument("--name", default="step_overhead")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = p.parse_args(argv)
    if args.steps < 1 or any(s < 128 for s in args.seqlens):
        p.error("--steps must be >= 1 and every --seqlens >= 128")
    rows = []
    for seqlen in args.seqlens:
        for impl in args.impls:
            row = measure(impl, seqlen, args.steps)
            rows.append(row)
            print(f"{impl:15s} S={seqlen:6d}: host {row['host_ms']:8.3f} ms/site (spread {row['host_spread']:.2f}), "
                  f"kernels {row['kernel_ms']:9.3f} ms/site", flush=True)
    res = {"meta": {"threads": torch.get_num_threads()}, "rows": rows}
    write_json(args.out / f"{args.name}.json", res)
    plot(res, args.out / f"{args.name}.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
