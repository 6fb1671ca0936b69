"""How much a plan can lose when the cost model is wrong: worst-case regret over a band of cost models.

The planners price candidates with one cost model (the cited H100 figures, or a calibrated profile). Each
parameter may be off: a kernel runs slower than FlashAttention-3's curves, NCCL reaches less of NVLink than 80 %,
latencies double under load. ``Band`` perturbs the model independently per axis and takes every corner:

* compute: kernel and merge time x 1/f .. x f (``rate``, default 1.5): the kernels' priced seconds are scaled
  (launch overhead with them; a coarse model of "the rates are off");
* intra-node bandwidth and inter-node bandwidth, each x 1/f .. x f (``rate``);
* latencies (intra and inter together) x 1/f .. x f (``latency``, default 2).

Under each corner model every candidate is priced in closed form (``price.price``, the planners' own price);
a candidate's regret there is its price over the cheapest candidate's under the same model, and its worst-case
regret is the largest over the corners and the nominal model. A plan with worst-case regret 1.1 is never more
than 10 % slower than the best candidate would have been, whichever corner the hardware is in (as far as the
price can tell).

The fast planner chooses by it: among its finalists (the candidates priced near the cheapest) the one with the
smallest worst-case regret (``FastPlanner.plan``; ``meta["regret"]``). ``FastPlanner.regrets`` gives every
candidate's regret against all the others, priced in full (for reports: ``benchmarks/replan.py``). A calibrated
profile knows how wrong it is: ``Band.of_profile`` narrows the band to its fits' worst relative errors.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

import numpy as np

from .cost import CostModel
from .plan import Mesh
from .price import Draft, price


@dataclass(frozen=True, slots=True)
class Band:
    """The corners of the cost-model band (module docstring)."""

    rate: float = 1.5
    """Compute rates and bandwidths are off by at most this factor, either way."""
    latency: float = 2.0
    """Latencies are off by at most this factor, either way."""

    def __post_init__(self) -> None:
        for name in ("rate", "latency"):
            if not getattr(self, name) >= 1:
                raise ValueError(f"ultraattn: Band.{name} must be >= 1 (a factor either way), got "
                                 f"{getattr(self, name)!r}")

    @classmethod
    def of_profile(cls, fit) -> Band:
        """The band of a calibrated profile (``CostProfile.fit``): compute and bandwidth off by at most 1 + the
        worst relative error of the kernel, message and merge fits; latencies by 1 + the message fits' worst
        (each at least 1 %: no fit is exact). A term the profile did not fit keeps the default band's factor."""
        def worst(*terms) -> float | None:
            errs = [float(fit[t]["max_rel_err"]) for t in terms if isinstance(fit.get(t), dict)
                    and "max_rel_err" in fit[t]]
            return max(errs) if errs else None

        def links(msg) -> list:
            return [v for v in (msg or {}).values() if isinstance(v, dict) and "max_rel_err" in v]

        kern = worst("kernel")
        msgs = [float(v["max_rel_err"]) for v in links(fit.get("message"))]
        merge = [float(v["max_rel_err"]) for v in links(fit.get("merge"))]
        rate_errs = [e for e in (kern, *msgs, *merge) if e is not None]
        rate = 1 + max(0.01, max(rate_errs)) if kern is not None and msgs else DEFAULT_BAND.rate
        latency = 1 + max(0.01, max(msgs)) if msgs else DEFAULT_BAND.latency
        return cls(rate=rate, latency=latency)

    def corners(self, cost: CostModel, nodes: int = 2, half: bool = False) -> list[tuple[float, CostModel]]:
        """(compute factor, model) for the nominal model and every corner: 1 + 2^4 models; 1 + 2^3 on one node,
        where the inter-node bandwidth prices nothing (its corners would repeat the others' prices). ``half``: on
        several nodes, the half of the corners whose latency is slow exactly when an odd number of the three rates
        is (a 2^(4-1) design: every pair of axes still meets in all four combinations), 1 + 2^3 models."""
        out = [(1.0, cost)]
        r, lat = self.rate, self.latency
        inter = (1 / r, r) if nodes > 1 else (1.0,)
        for c, fi, fo, fl in itertools.product((1 / r, r), (1 / r, r), inter, (1 / lat, lat)):
            if half and nodes > 1 and ((c < 1) + (fi < 1) + (fo < 1)) % 2 != (fl > 1):
                continue
            out.append((c, dataclasses.replace(
                cost, hbm_GBps=cost.hbm_GBps * c, lse_merge_GBps=cost.lse_merge_GBps * c,
                intra_bw_GBps=cost.intra_bw_GBps * fi, inter_bw_GBps=cost.inter_bw_GBps * fo,
                intra_latency_us=cost.intra_latency_us * fl, inter_latency_us=cost.inter_latency_us * fl)))
        return out


#: the band the issue names: rates and bandwidths x 1/1.5 .. x 1.5, latencies x 1/2 .. x 2
DEFAULT_BAND = Band()


def band_prices(drafts: dict[str, Draft], mesh: Mesh, cost: CostModel, band: Band = DEFAULT_BAND, *,
                half: bool = False, nominal: dict[str, float] | None = None) -> dict[str, np.ndarray]:
    """Each draft's price under every model of ``band.corners(cost, mesh.nodes, half)`` (seconds, in that order);
    ``nominal``: prices under ``cost`` itself already known (the first model's, not computed again)."""
    models = band.corners(cost, mesh.nodes, half)
    out = {}
    for name, d in drafts.items():
        groups = d.assign_GPP.shape[0]
        # what no model changes, made once for all of them
        replays = d.replays(mesh)
        prices = []
        for n, (c, model) in enumerate(models):
            if n == 0 and nominal is not None and name in nominal:
                prices.append(nominal[name])
                continue
            kern = dataclasses.replace(d.kernels, seconds={ph: s / c for ph, s in d.kernels.seconds.items()})
            prices.append(price(kern, d.messages, d.owner, groups, mesh, model, replays))
        out[name] = np.array(prices)
    return out


def regrets(prices: dict[str, np.ndarray]) -> dict[str, float]:
    """Worst-case regret of each candidate: max over the models of its price over the cheapest one's."""
    if not prices:
        return {}
    best = np.min(np.stack(list(prices.values())), axis=0)
    best = np.where(best > 0, best, np.inf)   # (a model under which everything is free: no regret)
    return {name: float(np.max(np.where(np.isfinite(best), p / best, 1.0))) for name, p in prices.items()}
