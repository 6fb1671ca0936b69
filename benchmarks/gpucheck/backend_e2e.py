"""Part 3: the backend end to end at world size 1, on the example model (``examples/train_cp.py``).

For each attention kind (a flex_attention document mask, new documents every step; causal SDPA) the same model is
stepped (forward and backward) three ways from the same weights: eagerly in fp64 and fp32 (the references),
compiled with ``backend="ultraattn"`` and compiled plainly. The ultraattn steps must pass the numerics policy
(``ultraattn.testing.check_step``: loss and every gradient) at the first and the last step, and the graphs the
backend compiled must call the kernels: the causal mask, known at compile time, as the block-sparse kernel ops
(``bsa_fwd`` / ``bsa_bwd``) in the graph; the document masks, which arrive at run time, as one site op that calls
them with each step's block lists. A profiled step then shows the kernel ops running (and, on a GPU, our Triton kernels
on the device). Recorded: the first step (compile and run), where its compile time went (per phase), and the
median of the later steps, for ultraattn and for plain ``torch.compile``.

The same-precision reference is the fp32 step further from fp64 of two: eager's, and plain ``torch.compile``'s (the
same program and compiler without ultraattn: on the H200 it missed eager's bound as often as ultraattn did, by the
same amounts). As diagnoses: both compiled steps against eager's error alone (``problems_vs_eager``,
``plain_problems_vs_eager``), and how far Inductor's rotary tables are from eager's (``rope_tables_compiled_vs_eager``).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from train_cp import Llama, batches, document_masks, rope_tables

import ultraattn
from ultraattn.passes import side_table
from ultraattn.passes.opinfo import TILE_OPS
from ultraattn.testing import check_step

from .common import Ctx, error_text, grads_of, sync

NAME = "backend_e2e"
TITLE = "backend, world 1"
CORRECTNESS = True


def _step(model, tokens, mask, device) -> tuple[dict, float]:
    """One forward and backward of ``model`` (a module, or a compiled one); its loss, gradients and seconds."""
    sync(device)
    t0 = time.perf_counter()
    loss = model(tokens, mask)
    loss.backward()
    sync(device)
    seconds = time.perf_counter() - t0
    grads = grads_of(model)
    model.zero_grad(set_to_none=True)
    return {"loss": loss.detach(), "grads": grads}, seconds


def _kernels_ran(model, tokens, mask, device) -> dict:
    """One more step under the profiler: how often the kernel ops ran (called by the graph or inside a site's op),
    and on a GPU the device kernels of ours that ran (Triton names them after their functions: ``bsa_*``)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        _step(model, tokens, mask, device)
    names = [e.name for e in prof.events()]
    ran = {op: sum(n == f"ultraattn::{op}" for n in names) for op in ("bsa_fwd", "bsa_bwd")}
    if device.type == "cuda":
        ran["device_kernels"] = sorted({n for n in names if n.startswith("bsa_") and "kernel" in n})
    return ran


class StackSampler:
    """Where a long call spends its time: a thread samples the calling thread's Python stack every ``every``
    seconds, and each function on a sampled stack (counted once per sample) gets the interval. Cheap enough to
    leave on for a first step that compiles for a minute or more; work in other processes (Inductor's compile
    workers) shows as the wait that calls them."""

    def __init__(self, every: float = 0.2):
        import threading

        self.every, self.seconds, self.leaf, self.samples = every, {}, {}, 0
        self._target = threading.get_ident()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        import sys

        while not self._stop.wait(self.every):
            frame = sys._current_frames().get(self._target)
            seen = []
            while frame is not None:
                code = frame.f_code
                seen.append(f"{'/'.join(code.co_filename.split('/')[-3:])}:{code.co_name}")
                frame = frame.f_back
            if seen:
                self.leaf[seen[0]] = self.leaf.get(seen[0], 0.0) + self.every
            for name in set(seen):
                self.seconds[name] = self.seconds.get(name, 0.0) + self.every
            self.samples += 1

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def top(self, n: int = 60, leaves: int = 20) -> dict:
        """The ``n`` functions with the most sampled seconds on the stack (inclusive), and the ``leaves`` with the
        most at its top (where the thread itself was), largest first."""
        def best(d, k):
            return {name: round(v, 1) for name, v in sorted(d.items(), key=lambda kv: -kv[1])[:k]}
        return {"inclusive": best(self.seconds, n), "leaf": best(self.leaf, leaves)}


def _compile_times() -> dict:
    """Seconds per compile phase so far, summed over calls (``torch._dynamo.utils.compile_times``), largest first."""
    from torch._dynamo.utils import compile_times

    try:
        table = compile_times(repr="csv")
    except Exception as exc:  # noqa: BLE001 - a private helper: its absence is recorded, not fatal
        return {"error": error_text(exc).splitlines()[0]}
    names, values = table if isinstance(table, tuple) and len(table) == 2 else ([], [])
    out = {}
    for name, vals in zip(names, values):
        try:
            out[str(name)] = round(float(vals) if isinstance(vals, str) else sum(float(v) for v in vals), 3)
        except (TypeError, ValueError):
            continue
    return dict(sorted(out.items(), key=lambda kv: -kv[1])[:40])


def rope_diagnosis(seqlen: int, head_dim: int, device: torch.device, compiler: str) -> dict:
    """How far plain ``torch.compile``'s rotary tables are from eager's (max |compiled - eager| of cos and sin).
    The model computes them in fp32 inside its forward, in every precision, so the fp64 reference uses eager's;
    a compiled program that computes them differently starts the q/k path (``wq``, ``wkv``) from other values."""
    cos, sin = rope_tables(seqlen, head_dim, device)
    torch._dynamo.reset()
    ccos, csin = torch.compile(rope_tables, backend=compiler)(seqlen, head_dim, device)
    return {"cos": float((ccos - cos).abs().max()), "sin": float((csin - sin).abs().max())}


def run_kind(ctx: Ctx, kind: str, cfg: dict, compiler: str) -> dict:
    args = argparse.Namespace(seqlen=cfg["seqlen"], steps=cfg["steps"], seed=0, same_mask=False)
    data = batches(args)
    torch.manual_seed(0)
    base = Llama(cfg["dim"], cfg["layers"], cfg["heads"], cfg["kv_heads"]).to(ctx.device)
    models = {"fp64": copy.deepcopy(base).double(), "fp32": copy.deepcopy(base),
              "ultraattn": copy.deepcopy(base), "plain": copy.deepcopy(base)}
    ultraattn.reset()
    options = {"compiler": compiler, "report": "off", "world1": "tiles"}   # (this part checks our kernels)
    run = {"ultraattn": torch.compile(models["ultraattn"], backend="ultraattn", options=options),
           "plain": torch.compile(models["plain"], backend=compiler)}
    res = {"kind": kind, **cfg, "compiler": compiler, "steps": [], "seconds": {"ultraattn": [], "plain": []},
           "problems": [], "problems_vs_eager": [], "plain_problems_vs_eager": [], "baseline_error": None}
    for i, (tokens, lengths) in enumerate(data):
        tokens = tokens.to(ctx.device)
        block_mask, dense = document_masks(lengths, ctx.device) if kind == "document" else (None, None)
        check = i in (0, len(data) - 1)
        if check:
            ref64, _ = _step(models["fp64"], tokens, dense, ctx.device)
            ref32, _ = _step(models["fp32"], tokens, dense, ctx.device)
        if i == 0:   # (the first step only: the later ones are timed, and nothing reads their samples)
            with StackSampler() as sampler:
                got, t = _step(run["ultraattn"], tokens, block_mask, ctx.device)
            res["first_step_sampled_s"] = sampler.top()
        else:
            got, t = _step(run["ultraattn"], tokens, block_mask, ctx.device)
        res["seconds"]["ultraattn"].append(t)
        ctx.note(f"{kind} step {i}: ultraattn {t:.2f} s")   # (progress: a part stopped at its deadline shows where)
        if i == 0:   # where the first step's seconds went (dynamo, AOT autograd, Inductor, ...), per phase
            res["compile_times"] = _compile_times()
        plain = None
        if res["baseline_error"] is None:
            try:
                plain, t = _step(run["plain"], tokens, block_mask, ctx.device)
                res["seconds"]["plain"].append(t)
                ctx.note(f"{kind} step {i}: plain {t:.2f} s")
            except Exception as exc:  # noqa: BLE001 - a baseline that cannot run is recorded, not fatal
                res["baseline_error"] = error_text(exc)
                ctx.note(f"{kind}: plain torch.compile failed: {res['baseline_error'].splitlines()[0]}")
        if check:
            # the policy: 2x the same-precision error, eager's or plain torch.compile's (the same program, the
            # same compiler, no ultraattn), whichever is further from fp64; eager's alone, as a diagnosis
            bad = check_step(got, ref64, ref32, compiled=plain)
            res["steps"].append({"step": i, "loss": float(got["loss"]), "ref_loss": float(ref64["loss"]),
                                 "problems": bad})
            res["problems"] += [f"step {i}: {b}" for b in bad]
            res["problems_vs_eager"] += [f"step {i}: {b}" for b in check_step(got, ref64, ref32)]
            if plain is not None:
                res["plain_problems_vs_eager"] += [f"step {i}: {b}" for b in check_step(plain, ref64, ref32)]
    res["kernels_ran"] = ran = _kernels_ran(run["ultraattn"], tokens, block_mask, ctx.device)
    if ctx.device.type == "cuda":  # Inductor launches the kernels of an op it compiled itself: no op event then
        names = " ".join(ran["device_kernels"])
        if "bsa_fwd" not in names or "bsa_bwd" not in names:
            res["problems"].append(f"a profiled step ran no forward or no backward kernel of ours: {ran}")
    elif not (ran["bsa_fwd"] and ran["bsa_bwd"]):
        res["problems"].append(f"a profiled step did not run the kernel ops: {ran}")
    codes = [g.code for g in side_table().aot_graphs]
    res["ops_in_graph"] = {op: sum(c.count(f"ultraattn.{op}.") for c in codes)
                           for op in (*sorted(TILE_OPS), "site_attention", "site_attention_bwd")}
    res["sites"] = {k: int(v) for k, v in side_table().counters.items() if k in ("sites", "rewritten", "fallbacks")}
    # at world 1 a mask known at compile time (causal) becomes the kernel ops themselves, in the graph; a mask that
    # arrives at run time stays one site op, which builds the step's block lists and calls the same kernel ops inside
    want = ("bsa_fwd", "bsa_bwd") if kind == "causal" else ("site_attention", "site_attention_bwd")
    if not all(res["ops_in_graph"][op] for op in want):
        res["problems"].append(f"the compiled graphs do not call {want}: {res['ops_in_graph']}")
    for who, ts in res["seconds"].items():
        if ts:
            res[f"{who}_first_step_s"] = ts[0]
            res[f"{who}_step_s"] = statistics.median(ts[1:]) if len(ts) > 1 else None
    if res.get("plain_step_s") and res.get("ultraattn_step_s"):
        res["step_vs_plain"] = res["plain_step_s"] / res["ultraattn_step_s"]
        res["first_step_vs_plain"] = res["plain_first_step_s"] / res["ultraattn_first_step_s"]
    return res


def run(ctx: Ctx) -> None:
    cfg = ctx.pick(dict(seqlen=4096, dim=512, heads=8, kv_heads=2, layers=2, steps=5),
                   dict(seqlen=256, dim=64, heads=4, kv_heads=2, layers=2, steps=2))
    compiler = ctx.pick("inductor", "aot_eager")
    rows = []
    try:
        ctx.save(rope_tables_compiled_vs_eager=rope_diagnosis(cfg["seqlen"], cfg["dim"] // cfg["heads"], ctx.device,
                                                                  compiler))
    except Exception as exc:  # noqa: BLE001 - a diagnosis that cannot run is recorded, not fatal
        ctx.save(rope_tables_compiled_vs_eager={"error": error_text(exc)})
    for kind in ("causal", "document"):   # causal first: its kernel ops are compiled by Inductor itself
        try:
            row = run_kind(ctx, kind, cfg, compiler)
        except Exception as exc:  # noqa: BLE001
            row = {"kind": kind, "error": error_text(exc), "problems": []}
        row["ok"] = "error" not in row and not row["problems"]
        if not row["ok"]:
            ctx.fail(f"{kind}: {row.get('error', '').splitlines()[0] if 'error' in row else row['problems']}")
        rows.append(row)
        ctx.save(rows=rows)
    parts = []
    for r in rows:
        s = f"{r['kind']} {'ok' if r['ok'] else 'FAILED'}"
        if r.get("step_vs_plain"):
            s += f" (step {r['ultraattn_step_s'] * 1e3:.0f} ms, {r['step_vs_plain']:.2f}x plain compile's speed)"
        if r.get("plain_problems_vs_eager"):
            s += (f" [against eager's error alone: ultraattn {len(r['problems_vs_eager'])}, plain compile "
                  f"{len(r['plain_problems_vs_eager'])} outside]")
        parts.append(s)
    ctx.save(summary="; ".join(parts))
