"""What a ``cost=`` argument resolves to: a ``CostModel``, a ``CostProfile`` or its path, or ``"auto"`` (this
machine's calibrated profile, measured on first use and cached).

Why a module of its own: "auto" is measured with the runtime itself (``calibrate.py`` times real steps through
``api.py``), and the runtime resolves "auto" when a plan asks for it. So ``calibrate.py`` hands its measuring
function to this module when it is imported (``provide_auto``; importing ``ultraattn`` imports it), and neither
module imports the other's caller: the import graph stays acyclic.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from ..planner.cost import CostModel
from ..planner.profile import CostProfile, cost_model_of
from ..planner.robust import DEFAULT_BAND, Band

_AUTO: list[Callable] = []
"""The function that returns this machine's ``CostProfile`` (``calibrate.auto_profile``), once provided."""


def provide_auto(fn: Callable) -> None:
    """Install ``fn(group=, mesh=, device=, timeout=) -> CostProfile`` as what ``"auto"`` resolves through."""
    _AUTO[:] = [fn]


def resolve_cost(cost, *, group=None, mesh=None, device=None, timeout: float = 300.0) -> CostModel:
    """A ``CostModel`` from what users pass as ``cost``: a model, a profile, a profile's path, or ``"auto"`` (the
    cached calibration of this machine, measured now if missing; a collective when ranks are grouped)."""
    return cost_model_of(resolve_source(cost, group=group, mesh=mesh, device=device, timeout=timeout))


def resolve_source(cost, *, group=None, mesh=None, device=None, timeout: float = 300.0) -> CostModel | CostProfile:
    """``resolve_cost`` keeping a profile whole (its fits' errors set the planner's band: ``Band.of_profile``)."""
    if isinstance(cost, str) and cost == "auto":
        if not _AUTO:
            raise RuntimeError("ultraattn: cost='auto' needs ultraattn.runtime.calibrate, which provides it when "
                               "imported; `import ultraattn` first")
        return _AUTO[0](group=group, mesh=mesh, device=device, timeout=timeout)
    if isinstance(cost, CostModel | CostProfile):
        return cost
    if isinstance(cost, str | os.PathLike):
        return CostProfile.load(cost)
    return cost_model_of(cost)   # raises the TypeError naming `cost`


def band_of(source: CostModel | CostProfile) -> Band:
    """The cost-model band the fast planner chooses robustly over: a profile's fit errors, else the default."""
    return Band.of_profile(source.fit) if isinstance(source, CostProfile) else DEFAULT_BAND
