"""Cost profiles: the cost model's parameters fitted to measurements of one machine.

``ultraattn.calibrate`` (``runtime/calibrate.py``) times the runtime's own tile calls, messages and merges on
the devices and process group it runs on and hands the samples to the fits here, which are pure (numpy, no
torch.distributed), so the planner can load a profile anywhere::

    profile = CostProfile.load("h100.json")      # or ultraattn.calibrate(...)
    plan(pattern, shape, mesh, cost=profile.cost)

Each ``CostModel`` field a profile sets is a least-squares fit to samples, never a value chosen for a target:

* kernels: ``seconds = launch_us * launches + (F_full + F_partial * (1 + partial_block_overhead)) / (rate * eff)``
  with ``eff = L / (L + eff_half_tokens)`` (``cost.py``), ``rate`` = ``fwd_tflops`` or ``bwd_tflops`` per phase
  (the backward's FLOPs are ``bwd_flops_factor`` times the forward's). For each (``eff_half_tokens``,
  ``partial_block_overhead``) on a grid, the rest is linear (launch and one reciprocal rate per phase) and solved
  by least squares on RELATIVE errors (a 1 ms and a 1 s sample count alike); the grid point with the smallest
  error wins, refined on a finer grid around it. The phases share launch cost, short-row efficiency and the
  PARTIAL overhead.
* messages, per link (intra/inter node): ``seconds = latency + bytes / bandwidth``, the same relative fit.
* merges: ``seconds = bytes / bandwidth`` (through the origin), one bandwidth for the forward's LSE merge
  (``lse_merge_GBps``) and one for gradient sums (``hbm_GBps``).
* sharing: ``alone_speedup`` is the median of (all ranks busy) / (one rank alone) over the samples timed both ways,
  at least 1 (what the hardware gives a rank when its neighbours wait).
* steps: with several ranks, two real steps of the runtime (``fit_step_scale``) fix how much slower kernels run
  inside a step than alone in a loop; both kernel rates are divided by that factor, which the profile records.

The profile keeps its samples and each fit's median and worst relative error, so a reader sees how well the
model's form describes the machine. A link the calibration could not measure (one node: no inter-node pair)
keeps the measured link's figures and says so in ``notes``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

import numpy as np

from .cost import DEFAULT_COST, CostModel

PROFILE_FORMAT = "ultraattn-cost-profile"
PROFILE_VERSION = 1

#: the grids the kernel fit searches (the linear part is solved exactly at each point)
EFF_HALF_GRID = np.concatenate([[0.0], np.geomspace(1.0, 1 << 15, 76)])
PARTIAL_GRID = np.linspace(0.0, 4.0, 81)

KERNEL_SAMPLE_KEYS = ("phase", "flops_full", "flops_partial", "kv_tokens_per_row", "launches", "seconds")
MESSAGE_SAMPLE_KEYS = ("link", "nbytes", "seconds")
MERGE_SAMPLE_KEYS = ("nbytes", "seconds")


class ProfileError(ValueError):
    """A cost profile that cannot be used: the message names the file and the field."""


def _rel_errors(pred: np.ndarray, meas: np.ndarray) -> dict:
    err = np.abs(pred - meas) / meas
    return {"samples": int(err.size), "median_rel_err": float(np.median(err)) if err.size else 0.0,
            "max_rel_err": float(err.max(initial=0.0))}


def _kernel_columns(samples: Sequence[Mapping], eff_half: float, partial: float, bwd_factor: float):
    """Design matrix [launches, fwd work, bwd work] (work = FLOPs / efficiency, in TFLOP) of the kernel form."""
    ph = np.array([s["phase"] == "bwd" for s in samples])
    work = np.array([s["flops_full"] + s["flops_partial"] * (1.0 + partial) for s in samples], dtype=np.float64)
    kv = np.array([s["kv_tokens_per_row"] for s in samples], dtype=np.float64)
    work = work * (kv + eff_half) / kv * np.where(ph, bwd_factor, 1.0) / 1e12
    launches = np.array([s["launches"] for s in samples], dtype=np.float64)
    return np.stack([launches, np.where(ph, 0.0, work), np.where(ph, work, 0.0)], axis=1)


def _check_samples(samples: Sequence[Mapping], keys: tuple[str, ...], what: str) -> None:
    if not samples:
        raise ValueError(f"no {what} samples to fit")
    for n, s in enumerate(samples):
        missing = [k for k in keys if k not in s]
        if missing:
            raise ValueError(f"{what} sample #{n} lacks {missing}")
        if not s["seconds"] > 0 or not math.isfinite(s["seconds"]):
            raise ValueError(f"{what} sample #{n} has seconds={s['seconds']!r}; timings must be positive and finite")


def fit_kernels(samples: Sequence[Mapping], *, bwd_flops_factor: float = DEFAULT_COST.bwd_flops_factor
                ) -> tuple[dict[str, float], dict]:
    """Fit ``launch_us``, ``fwd_tflops``, ``bwd_tflops``, ``eff_half_tokens`` and ``partial_block_overhead`` to
    tile timings (module docstring). Needs forward and backward samples; PARTIAL samples fix the overhead (without
    any it stays 0), short and long rows fix the efficiency curve.

    Returns the fields and the fit's errors ({samples, median_rel_err, max_rel_err}).
    """
    _check_samples(samples, KERNEL_SAMPLE_KEYS, "kernel")
    phases = {s["phase"] for s in samples}
    if phases != {"fwd", "bwd"}:
        raise ValueError(f"kernel samples must cover both phases 'fwd' and 'bwd', got {sorted(phases)}")
    t = np.array([s["seconds"] for s in samples], dtype=np.float64)
    has_partial = any(s["flops_partial"] > 0 for s in samples)

    def solve(eh: float, po: float):
        a = _kernel_columns(samples, eh, po, bwd_flops_factor) / t[:, None]   # relative residuals
        x, *_ = np.linalg.lstsq(a, np.ones_like(t), rcond=None)
        if (x <= 0).any():   # a non-positive launch cost or rate is no model of a machine: fit without launch
            x = np.r_[0.0, np.linalg.lstsq(a[:, 1:], np.ones_like(t), rcond=None)[0]]
            if (x[1:] <= 0).any():
                return None
        return float(np.sum((a @ x - 1.0) ** 2)), eh, po, x

    def search(ehs, pos):
        fits = [f for eh in ehs for po in pos if (f := solve(float(eh), float(po))) is not None]
        return min(fits, key=lambda f: f[0]) if fits else None

    best = search(EFF_HALF_GRID, PARTIAL_GRID if has_partial else (0.0,))
    if best is None:
        raise ValueError("kernel samples admit no positive rates: the timings do not grow with the work")
    # refine between the coarse grid's neighbours of the best point
    i = int(np.searchsorted(EFF_HALF_GRID, best[1]))
    j = int(np.searchsorted(PARTIAL_GRID, best[2]))
    ehs = np.linspace(EFF_HALF_GRID[max(i - 1, 0)], EFF_HALF_GRID[min(i + 1, EFF_HALF_GRID.size - 1)], 41)
    pos = (np.linspace(PARTIAL_GRID[max(j - 1, 0)], PARTIAL_GRID[min(j + 1, PARTIAL_GRID.size - 1)], 21)
           if has_partial else (0.0,))
    best = min(best, search(ehs, pos) or best, key=lambda f: f[0])
    _, eh, po, (launch, inv_f, inv_b) = best
    fields_ = {"launch_us": max(float(launch) * 1e6, 1e-3), "fwd_tflops": 1.0 / float(inv_f),
               "bwd_tflops": 1.0 / float(inv_b), "eff_half_tokens": max(float(eh), 1e-3),
               "partial_block_overhead": float(po)}
    cm = dataclasses.replace(DEFAULT_COST, bwd_flops_factor=bwd_flops_factor, **fields_)
    pred = np.array([kernel_sample_seconds(cm, s) for s in samples])
    return fields_, _rel_errors(pred, t)


def kernel_sample_seconds(cost: CostModel, s: Mapping) -> float:
    """What ``cost`` predicts for one kernel sample (the planner's formula, launches included)."""
    flops = s["flops_full"] + s["flops_partial"] * (1.0 + cost.partial_block_overhead)
    return cost.kernel_seconds(flops=flops, kv_tokens_per_row=s["kv_tokens_per_row"], phase=s["phase"],
                               launches=s["launches"])


def fit_messages(samples: Sequence[Mapping]) -> tuple[dict[str, float], dict]:
    """Per link, ``latency_us`` and ``bw_GBps`` of ``latency + bytes / bandwidth`` (relative least squares)."""
    _check_samples(samples, MESSAGE_SAMPLE_KEYS, "message")
    out: dict[str, float] = {}
    stats: dict = {}
    for link in sorted({s["link"] for s in samples}):
        if link not in ("intra", "inter"):
            raise ValueError(f"message sample link must be 'intra' or 'inter', got {link!r}")
        sub = [s for s in samples if s["link"] == link]
        t = np.array([s["seconds"] for s in sub], dtype=np.float64)
        nb = np.array([s["nbytes"] for s in sub], dtype=np.float64)
        a = np.stack([np.ones_like(t), nb], axis=1) / t[:, None]
        lat, inv_bw = np.linalg.lstsq(a, np.ones_like(t), rcond=None)[0]
        if inv_bw <= 0:
            raise ValueError(f"{link} message timings do not grow with the size: cannot fit a bandwidth")
        if lat <= 0:   # sizes too large to see the latency: fit the bandwidth alone, latency at the floor
            lat, inv_bw = 0.0, float(np.linalg.lstsq(a[:, 1:], np.ones_like(t), rcond=None)[0][0])
        out[f"{link}_latency_us"] = max(float(lat) * 1e6, 1e-3)
        out[f"{link}_bw_GBps"] = 1.0 / float(inv_bw) / 1e9
        stats[link] = _rel_errors(lat + nb * inv_bw, t)
    return out, stats


def fit_merges(samples: Sequence[Mapping]) -> tuple[dict[str, float], dict]:
    """``hbm_GBps`` (sums of partial gradients: ``what`` dq/dkv) and ``lse_merge_GBps`` (the forward's LSE merge:
    ``what`` o): bytes touched per second, each a least-squares fit through the origin on relative errors."""
    _check_samples(samples, MERGE_SAMPLE_KEYS, "merge")
    out: dict[str, float] = {}
    stats: dict = {}
    for field_, kinds in (("lse_merge_GBps", ("o",)), ("hbm_GBps", ("dq", "dkv"))):
        sub = [s for s in samples if s.get("what", "dq") in kinds]
        if not sub:
            continue
        t = np.array([s["seconds"] for s in sub], dtype=np.float64)
        nb = np.array([s["nbytes"] for s in sub], dtype=np.float64)
        inv = float(np.sum(nb / t) / np.sum((nb / t) ** 2))   # min sum((inv * nb / t - 1)^2)
        out[field_] = 1.0 / inv / 1e9
        stats[field_] = _rel_errors(inv * nb, t)
    return out, stats


def fit_cost(samples: Mapping[str, Sequence[Mapping]], *, base: CostModel = DEFAULT_COST) -> tuple[CostModel, dict,
                                                                                                      list[str]]:
    """Every fit of the samples there are (keys ``kernel``, ``message``, ``merge``); fields without samples keep
    ``base``'s value (noted). Returns the model, the fits' errors and the notes."""
    changes: dict[str, float] = {}
    fit: dict = {}
    notes: list[str] = []
    if samples.get("kernel"):
        f, fit["kernel"] = fit_kernels(samples["kernel"], bwd_flops_factor=base.bwd_flops_factor)
        changes.update(f)
    else:
        notes.append("kernels not measured: kernel fields are the base model's")
    if samples.get("message"):
        f, fit["message"] = fit_messages(samples["message"])
        changes.update(f)
        for have, lack in (("intra", "inter"), ("inter", "intra")):
            if f"{lack}_bw_GBps" not in f and f"{have}_bw_GBps" in f:
                changes[f"{lack}_bw_GBps"] = f[f"{have}_bw_GBps"]
                changes[f"{lack}_latency_us"] = f[f"{have}_latency_us"]
                notes.append(f"no {lack}-node pair to measure: {lack}-node messages use the {have}-node fit")
    else:
        notes.append("messages not measured (one rank): message fields are the base model's")
    if samples.get("merge"):
        f, fit["merge"] = fit_merges(samples["merge"])
        changes.update(f)
    else:
        notes.append("merges not measured: hbm_GBps and lse_merge_GBps are the base model's")
    if samples.get("sharing"):
        ratios = [s["seconds_all"] / s["seconds_alone"] for s in samples["sharing"]]
        if not all(r > 0 and math.isfinite(r) for r in ratios):
            raise ValueError(f"sharing samples must have positive, finite timings, got ratios {ratios}")
        changes["alone_speedup"] = max(1.0, float(np.median(ratios)))
        fit["sharing"] = {"samples": len(ratios), "ratios": ratios}
    else:
        notes.append("sharing not measured (one rank): alone_speedup is the base model's")
    return dataclasses.replace(base, **changes), fit, notes


#: the scales ``fit_step_scale`` tries (kernel time inside a step over the isolated calls' time)
STEP_SCALES = np.geomspace(0.25, 4.0, 161)


def fit_step_scale(measured: Sequence[float], predict) -> tuple[float, dict]:
    """The factor ``k`` by which kernels run slower inside a real step than the isolated calls the kernel fit saw
    (other ranks' messages copying on the same cores, caches the step's other tensors take): the ``k`` on
    ``STEP_SCALES`` whose ``predict(k)`` (the model's step times with kernel rates divided by ``k``) is closest to
    ``measured`` in log ratio. Returns ``k`` and the probes' ratios before and after."""
    meas = np.asarray(measured, dtype=np.float64)
    if not meas.size or not (meas > 0).all():
        raise ValueError(f"step samples must have positive timings, got {list(measured)}")
    loss = [float(np.sum(np.log(np.asarray(predict(float(k))) / meas) ** 2)) for k in STEP_SCALES]
    k = float(STEP_SCALES[int(np.argmin(loss))])
    return k, {"scale": k, "predicted_over_measured_before": (np.asarray(predict(1.0)) / meas).tolist(),
               "predicted_over_measured_after": (np.asarray(predict(k)) / meas).tolist()}


def scale_kernels(cost: CostModel, k: float) -> CostModel:
    """``cost`` with kernels ``k`` times slower (both rates divided by ``k``)."""
    return dataclasses.replace(cost, fwd_tflops=cost.fwd_tflops / k, bwd_tflops=cost.bwd_tflops / k)


@dataclass(frozen=True, slots=True, kw_only=True)
class CostProfile:
    """A cost model fitted on one machine, with what it was fitted to (saved as JSON, ``ultraattn calibrate``)."""

    cost: CostModel
    """The fitted model the planner uses."""
    machine: Mapping = field(default_factory=lambda: MappingProxyType({}))
    """Where it was measured: host, device, ranks and mesh, threads, library versions."""
    created: str = ""
    """ISO 8601 time of the calibration."""
    fit: Mapping = field(default_factory=lambda: MappingProxyType({}))
    """Per term (kernel, message links, merge): samples, median and worst relative error of the fit."""
    samples: Mapping = field(default_factory=lambda: MappingProxyType({}))
    """The raw timings (``kernel``, ``message``, ``merge`` lists of dicts)."""
    notes: tuple[str, ...] = ()
    """What the fit could not measure and took from the base model."""

    def __repr__(self) -> str:
        n = {k: len(v) for k, v in self.samples.items()}
        return f"CostProfile(machine={self.machine.get('key', '?')!r}, created={self.created!r}, samples={n})"

    def to_json(self) -> dict:
        return {"format": PROFILE_FORMAT, "version": PROFILE_VERSION, "created": self.created,
                "machine": dict(self.machine), "cost": dataclasses.asdict(self.cost), "fit": dict(self.fit),
                "notes": list(self.notes), "samples": {k: list(v) for k, v in self.samples.items()}}

    @classmethod
    def from_json(cls, data, *, source: str = "profile") -> CostProfile:
        """Validate and load; every error names ``source`` and the field."""
        if not isinstance(data, Mapping):
            raise ProfileError(f"{source}: expected a JSON object, got {type(data).__name__}")
        if data.get("format") != PROFILE_FORMAT:
            raise ProfileError(f"{source}: field 'format' must be {PROFILE_FORMAT!r}, got {data.get('format')!r}; "
                               f"write a profile with `ultraattn calibrate`")
        if data.get("version") != PROFILE_VERSION:
            raise ProfileError(f"{source}: field 'version' must be {PROFILE_VERSION}, got {data.get('version')!r}; "
                               f"calibrate again with this ultraattn")
        cost = data.get("cost")
        if not isinstance(cost, Mapping):
            raise ProfileError(f"{source}: field 'cost' must be an object of CostModel fields, got {cost!r}")
        names = set(CostModel.field_names())
        unknown = sorted(set(cost) - names)
        if unknown:
            raise ProfileError(f"{source}: field 'cost' has unknown field(s) {unknown}; CostModel fields: "
                               f"{', '.join(sorted(names))}")
        for k, v in cost.items():
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
                raise ProfileError(f"{source}: field 'cost.{k}' must be a finite number, got {v!r}")
        try:
            model = CostModel(**{k: float(v) for k, v in cost.items()})
        except ValueError as exc:
            raise ProfileError(f"{source}: field 'cost': {exc}") from None
        if "async_kernels" not in cost and dict(data.get("machine") or {}).get("device_type") == "cpu":
            model = dataclasses.replace(model, async_kernels=0.0)   # a profile written before the field existed
        for k, typ, what in (("machine", Mapping, "an object"), ("fit", Mapping, "an object"), ("samples", Mapping,
                             "an object"), ("notes", list, "a list"), ("created", str, "a string")):
            if k in data and not isinstance(data[k], typ):
                raise ProfileError(f"{source}: field {k!r} must be {what}, got {type(data[k]).__name__}")
        return cls(cost=model, machine=MappingProxyType(dict(data.get("machine", {}))), created=data.get("created", ""),
                   fit=MappingProxyType(dict(data.get("fit", {}))),
                   samples=MappingProxyType(dict(data.get("samples", {}))), notes=tuple(data.get("notes", ())))

    def save(self, path: str | os.PathLike) -> Path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(p.name + f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(self.to_json(), indent=1))
        tmp.replace(p)   # atomic: a reader never sees half a profile
        return p

    @classmethod
    def load(cls, path: str | os.PathLike) -> CostProfile:
        p = Path(path)
        try:
            text = p.read_text()
        except FileNotFoundError:
            raise ProfileError(f"cost profile {str(p)!r} does not exist; write one with `ultraattn calibrate --out "
                               f"{p}`") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ProfileError(f"cost profile {str(p)!r} is not JSON ({exc})") from None
        return cls.from_json(data, source=f"cost profile {str(p)!r}")


def cost_model_of(cost) -> CostModel:
    """A ``CostModel`` from a model, a profile or a profile's path (``"auto"`` is resolved by the runtime, which can
    measure: ``ultraattn.runtime.calibrate.auto_profile``)."""
    match cost:
        case CostModel():
            return cost
        case CostProfile():
            return cost.cost
        case "auto":
            raise ValueError("cost='auto' calibrates this machine, which needs the runtime: call "
                             "ultraattn.runtime.calibrate.auto_profile() or pass a profile path")
        case str() | os.PathLike():
            return CostProfile.load(cost).cost
        case _:
            raise TypeError(f"`cost` must be a CostModel, a CostProfile, a profile path or 'auto', got "
                            f"{type(cost).__name__}")
