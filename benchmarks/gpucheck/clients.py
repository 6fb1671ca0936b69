"""Part 0, run first: real clients under the backend at world size 1, as a new user meets them.

transformers' ``LlamaForCausalLM`` (random weights, no download) with ``attn_implementation="sdpa"`` and
``"flex_attention"``, in two configurations:

* **exact**: a small fp32 model (the dry run's sizes on the CPU) stepped once with ``backend="ultraattn"``, checked by
  the numerics policy (``ultraattn.testing.check_step``: loss and every gradient against the fp64 eager step, within
  2x the further of the fp32 eager and plain ``torch.compile`` steps);
* **speed**: the model of issue 51 (4 layers, hidden 2048, 16 query / 4 K/V heads, vocab 32000, S = 8192, bf16,
  batch 1), stepped (forward, ``loss.backward()``) eagerly, with plain ``torch.compile`` and with
  ``backend="ultraattn"``: the first step (compile and run), the median of the later steps, peak memory, the loss
  against plain compile's, how each site ran (the backend's records), and one profiled ultraattn step (host time in
  ``ultraattn::`` ops, device-to-host copies).

``step_vs_plain`` is plain compile's median step over ultraattn's (above 1: ultraattn is faster); ``first_vs_plain``
ultraattn's first step over plain's. Issue 51's targets: ``step_vs_plain`` >= 1/1.05 and ``first_vs_plain`` <= 1.5.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import ultraattn
from ultraattn.passes import side_table
from ultraattn.testing import check_step

from .common import Ctx, error_text, grads_of, sync

BENCH = Path(__file__).resolve().parents[1]

NAME = "clients"
TITLE = "real clients, world 1"
CORRECTNESS = True

def _llama(impl: str, cfg: dict, dtype, device):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    conf = LlamaConfig(vocab_size=cfg["vocab"], hidden_size=cfg["hidden"], intermediate_size=cfg["ffn"],
                       num_hidden_layers=cfg["layers"], num_attention_heads=cfg["heads"],
                       num_key_value_heads=cfg["kv_heads"], max_position_embeddings=cfg["seqlen"],
                       attn_implementation=impl)
    with torch.device(device):   # (initialised where it runs: a 300M-parameter model initialises slowly on a CPU)
        return LlamaForCausalLM(conf).to(dtype=dtype).train()


def _data(cfg: dict, device):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg["vocab"], (1, cfg["seqlen"]), generator=g)
    return ids.to(device), torch.arange(cfg["seqlen"])[None].to(device)


def _step(model, ids, pos, device, grads: bool = True) -> tuple[dict, float]:
    sync(device)
    t0 = time.perf_counter()
    kw = {} if pos is None else {"position_ids": pos}   # (none: transformers counts positions itself)
    out = model(input_ids=ids, labels=ids, use_cache=False, **kw)
    out.loss.backward()
    sync(device)
    seconds = time.perf_counter() - t0
    got = {"loss": out.loss.detach().double().cpu(), "grads": grads_of(model) if grads else {}}
    model.zero_grad(set_to_none=True)
    return got, seconds


def _sites() -> list[dict]:
    return [{"name": s.name, "mask": s.mask, "rewritten": s.rewritten, "why": s.why, "form": s.form}
            for g in side_table().graphs for s in g.sites]


def exact(ctx: Ctx, impl: str, cfg: dict, compiler: str, positions: bool) -> dict:
    """One step of the small fp32 model under the backend, against fp64 and fp32 eager (SDPA: the same attention)
    and plain ``torch.compile``."""
    ids, pos = _data(cfg, ctx.device)
    pos = pos if positions else None
    ref64, _ = _step(_llama("sdpa", cfg, torch.float64, ctx.device), ids, pos, ctx.device)
    ref32, _ = _step(_llama("sdpa", cfg, torch.float32, ctx.device), ids, pos, ctx.device)
    torch._dynamo.reset()
    plain, _ = _step(torch.compile(_llama(impl, cfg, torch.float32, ctx.device), backend=compiler), ids, pos,
                     ctx.device)
    torch._dynamo.reset()
    ultraattn.reset()
    got, seconds = _step(torch.compile(_llama(impl, cfg, torch.float32, ctx.device), backend="ultraattn",
                                       options={"compiler": compiler}), ids, pos, ctx.device)
    problems = check_step(got, ref64, ref32, compiled=plain)
    return {"impl": impl, "position_ids": positions, **cfg, "problems": problems,
            "problems_vs_eager": check_step(got, ref64, ref32), "loss": float(got["loss"]),
            "ref_loss": float(ref64["loss"]), "first_step_s": seconds, "sites": _sites()}


def _profiled(model, ids, pos, device) -> dict:
    """One more step under the profiler: host time in ``ultraattn::`` ops (self CPU), the device-to-host copies."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        _step(model, ids, pos, device, grads=False)
    ops, dtoh = {}, {"count": 0, "device_ms": 0.0}
    for e in prof.key_averages():
        if e.key.startswith("ultraattn::"):
            ops[e.key] = {"calls": e.count, "self_cpu_ms": round(e.self_cpu_time_total / 1e3, 3)}
        if "DtoH" in e.key or "Device -> Pageable" in e.key or "Device -> Pinned" in e.key:
            dtoh["count"] += e.count
            dtoh["device_ms"] += getattr(e, "device_time_total", getattr(e, "cuda_time_total", 0.0)) / 1e3
    return {"ultraattn_ops": ops, "host_ms_in_ultraattn_ops": round(sum(o["self_cpu_ms"] for o in ops.values()), 3),
            "dtoh": dtoh}


def one_way(way: str, impl: str, cfg: dict, positions: bool, compiler: str, device: torch.device) -> dict:
    """One way (eager, plain, ultraattn) of one speed row, in this process: the first step (compile and run), the
    later steps, peak memory, the first loss; for ultraattn the sites and a profiled step."""
    ids, pos = _data(cfg, device)
    pos = pos if positions else None
    model = _llama(impl, cfg, cfg["dtype"], device)
    if way == "plain":
        model = torch.compile(model, backend=compiler)
    elif way == "ultraattn":
        model = torch.compile(model, backend="ultraattn", options={"compiler": compiler})
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, loss = [], None
    for _ in range(cfg["steps"]):
        got, t = _step(model, ids, pos, device, grads=False)
        loss = float(got["loss"]) if loss is None else loss
        times.append(t)
    later = times[2:] or times[1:] or times
    res = {"first_step_s": round(times[0], 2), "step_ms": round(1e3 * statistics.median(later), 2),
           "steps_ms": [round(1e3 * t, 2) for t in later], "loss": loss,
           "peak_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None}
    if way == "ultraattn":
        res["sites"] = _sites()
        try:
            res["profile"] = _profiled(model, ids, pos, device)
        except Exception as exc:  # noqa: BLE001 - a diagnosis, not a check
            res["profile"] = {"error": error_text(exc).splitlines()[0]}
    return res


def _way_main(argv: list[str]) -> None:
    """``one_way`` in a child process (``speed``): arguments as JSON, the result as JSON into a file."""
    args = json.loads(argv[0])
    cfg = {**args["cfg"], "dtype": getattr(torch, args["cfg"]["dtype"])}
    device = torch.device(args["device"])
    res = one_way(args["way"], args["impl"], cfg, args["positions"], args["compiler"], device)
    Path(args["out"]).write_text(json.dumps(res, default=str))


def speed(ctx: Ctx, impl: str, cfg: dict, compiler: str, positions: bool) -> dict:
    """Eager (SDPA only), plain ``torch.compile`` and ``backend="ultraattn"`` on the same model and batch, each in
    a process of its own with empty compile caches (Inductor's and Triton's): every first step is a cold start, as
    a new user's is, and no way compiles with kernels another one built. ``positions``: whether the call passes
    ``position_ids`` (transformers then derives its mask from them at run time; without them its mask depends on
    the length alone)."""
    res = {"impl": impl, "position_ids": positions, **cfg, "dtype": str(cfg["dtype"]).removeprefix("torch."),
           "first_step_s": {}, "step_ms": {}, "steps_ms": {}, "peak_gib": {}, "loss": {}}
    ways = (["eager"] if impl == "sdpa" else []) + ["plain", "ultraattn"]
    for way in ways:
        if ctx.time_left() < 30:
            ctx.note(f"{impl}: no time left for {way}")
            break
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "way.json"
            args = {"way": way, "impl": impl, "positions": positions, "compiler": compiler, "device": str(ctx.device),
                    "cfg": {k: v for k, v in res.items() if k in cfg}, "out": str(out)}
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": f"{tmp}/inductor", "TRITON_CACHE_DIR": f"{tmp}/triton"}
            code = (f"import sys; sys.path.insert(0, {str(BENCH)!r}); from gpucheck.clients import _way_main; "
                    f"_way_main(sys.argv[1:])")
            try:
                proc = subprocess.run([sys.executable, "-c", code, json.dumps(args)], env=env, capture_output=True,
                                      text=True, timeout=max(10.0, ctx.time_left() - 5))
                got = json.loads(out.read_text()) if proc.returncode == 0 else \
                    {"error": (proc.stdout + proc.stderr)[-3000:]}
            except subprocess.TimeoutExpired:
                got = {"error": "stopped at the part's deadline"}
        if "error" in got:
            res.setdefault("errors", {})[way] = got["error"]
            ctx.note(f"{impl} {way}: {got['error'].strip().splitlines()[-1] if got['error'].strip() else 'error'}")
            _keep(ctx, res)
            continue
        for key in ("first_step_s", "step_ms", "steps_ms", "peak_gib", "loss"):
            res[key][way] = got[key]
        for key in ("sites", "profile"):
            if key in got:
                res[key] = got[key]
        ctx.note(f"{impl} {way}: first step {got['first_step_s']} s, step {got['step_ms']} ms, loss {got['loss']:.5f}")
        _keep(ctx, res)   # (as it goes: a part stopped at its deadline keeps what it measured)
    if "plain" in res["step_ms"] and "ultraattn" in res["step_ms"]:
        res["step_vs_plain"] = round(res["step_ms"]["plain"] / res["step_ms"]["ultraattn"], 3)
        res["first_vs_plain"] = round(res["first_step_s"]["ultraattn"] / res["first_step_s"]["plain"], 3)
        res["loss_vs_plain"] = abs(res["loss"]["ultraattn"] - res["loss"]["plain"])
    return res


SPEED_ROWS = (("sdpa", False), ("flex_attention", False), ("sdpa", True))
"""(attn_implementation, position_ids passed), in the order they run."""
EXACT_ROWS = (("sdpa", False), ("sdpa", True), ("flex_attention", True))
ROW_NAMES = ("sdpa", "flex", "sdpa+pos", "exact")
"""What ``gpu_check.py --client-rows`` names: the three speed rows, and the exact rows together."""


def _row_name(impl: str, positions: bool) -> str:
    return ("flex" if impl == "flex_attention" else impl) + ("+pos" if positions else "")


def chosen_rows() -> set[str]:
    """The rows ``--client-rows`` asked for (all when it was not given)."""
    asked = os.environ.get("ULTRAATTN_GPUCHECK_CLIENT_ROWS")
    return set(asked.split(",")) if asked else set(ROW_NAMES)


def _keep(ctx: Ctx, res: dict) -> None:
    ctx.save(speed=[r for r in ctx.record.get("speed", []) if (r.get("impl"), r.get("position_ids")) !=
                    (res["impl"], res.get("position_ids"))] + [res])


def run(ctx: Ctx) -> None:
    compiler = ctx.pick("inductor", "aot_eager")
    small = {"layers": 2, "hidden": 128, "ffn": 256, "heads": 4, "kv_heads": 2, "vocab": 256,
             "seqlen": ctx.pick(1024, 256)}
    big = ctx.pick({"layers": 4, "hidden": 2048, "ffn": 5632, "heads": 16, "kv_heads": 4, "vocab": 32000,
                    "seqlen": 8192, "dtype": torch.bfloat16, "steps": 8},
                   {**small, "dtype": torch.float32, "steps": 2})
    import transformers

    ctx.save(transformers=transformers.__version__, exact=[], speed=[])
    # (the dry run times one row, the run-time mask on the tiles: its ways are processes of their own, each a minute
    # of imports and interpreted kernels on two cores)
    chosen = chosen_rows()
    ctx.save(rows_asked=sorted(chosen))
    for impl, positions in ctx.pick(SPEED_ROWS, SPEED_ROWS[2:]):   # speed first: what the issue measures
        if _row_name(impl, positions) not in chosen:
            continue
        if ctx.time_left() < 60:
            ctx.note(f"speed {impl} position_ids={positions}: no time left")
            continue
        try:
            res = speed(ctx, impl, big, compiler, positions)
        except Exception as exc:  # noqa: BLE001 - one client's failure is its row
            res = {"impl": impl, "position_ids": positions, "error": error_text(exc)}
            ctx.fail(f"speed {impl}: {res['error'].splitlines()[0]}")
        _keep(ctx, res)
        if "loss_vs_plain" in res and res["loss_vs_plain"] > 0.05 * abs(res["loss"]["plain"]):
            ctx.fail(f"speed {impl}: loss {res['loss']['ultraattn']} vs plain compile's {res['loss']['plain']}")
    for impl, positions in EXACT_ROWS if "exact" in chosen else ():
        if ctx.time_left() < 20:
            ctx.note(f"exact {impl} position_ids={positions}: no time left")
            continue
        try:
            res = exact(ctx, impl, small, compiler, positions)
        except Exception as exc:  # noqa: BLE001
            res = {"impl": impl, "position_ids": positions, "error": error_text(exc), "problems": ["error"]}
        ctx.save(exact=ctx.record["exact"] + [res])
        for p in res["problems"]:
            ctx.fail(f"exact {impl} position_ids={positions}: {p}")
    rows = ctx.record["speed"]
    plot(ctx.record, ctx.path(suffix=".png"))
    ctx.save(summary="; ".join(
        f"{r['impl']}{' +pos' if r.get('position_ids') else ''}: step {r.get('step_ms')} ms, vs plain "
        f"{r.get('step_vs_plain')}, first {r.get('first_vs_plain')}"
        for r in rows))


def plot(record: dict, png: Path) -> None:
    """Median step (ms) and first step (s) of each speed row, by way (eager, plain compile, ultraattn)."""
    from _results import pyplot

    plt = pyplot()
    rows = [r for r in record.get("speed", []) if r.get("step_ms")]
    if plt is None or not rows:
        return
    ways = ("eager", "plain", "ultraattn")
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, unit in ((axes[0], "step_ms", "median step (ms)"), (axes[1], "first_step_s", "first step (s)")):
        for j, way in enumerate(ways):
            xs = [i + 0.27 * (j - 1) for i, r in enumerate(rows) if way in r[key]]
            ys = [r[key][way] for r in rows if way in r[key]]
            ax.bar(xs, ys, width=0.27, label=way)
        ax.set_xticks(range(len(rows)))
        ax.set_xticklabels([f"{r['impl']}{' + position_ids' if r.get('position_ids') else ''}" for r in rows])
        ax.set_ylabel(unit)
    axes[0].legend()
    fig.suptitle(f"transformers Llama (S = {rows[0].get('seqlen')}, {rows[0].get('dtype')}), world size 1, "
                 f"{record.get('device', '')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
