"""What a ``cost=`` argument resolves to below the calibration: a ``CostModel``, a ``CostProfile`` or its path.

``"auto"`` (this machine's calibrated profile) is measured with the runtime itself (``calibrate.py`` times real
steps through ``api.py``), so it is resolved above both, where the call enters: ``ultraattn.plan_attention``
(``runtime/entry.py``) and the backend's options (``passes/options.py``) call ``calibrate.auto_profile`` and hand
the profile down. Nothing here measures, and no module installs anything into another on import.
"""

from __future__ import annotations

import os

from ..planner.cost import CostModel
from ..planner.profile import CostProfile, cost_model_of
from ..planner.robust import DEFAULT_BAND, Band


def resolve_source(cost) -> CostModel | CostProfile:
    """A model or a profile from what users pass as ``cost``: a model, a profile, or a profile's path (its fits'
    errors set the planner's band: ``Band.of_profile``)."""
    if isinstance(cost, str) and cost == "auto":
        raise ValueError("ultraattn: cost='auto' (this machine's calibrated profile) is resolved where planning "
                         "enters: call ultraattn.plan_attention(..., cost='auto'), or pass the profile "
                         "ultraattn.runtime.calibrate.auto_profile() returns, or a profile path")
    if isinstance(cost, CostModel | CostProfile):
        return cost
    if isinstance(cost, str | os.PathLike):
        return CostProfile.load(cost)
    return cost_model_of(cost)   # raises the TypeError naming `cost`


def band_of(source: CostModel | CostProfile) -> Band:
    """The cost-model band the fast planner chooses robustly over: a profile's fit errors, else the default."""
    return Band.of_profile(source.fit) if isinstance(source, CostProfile) else DEFAULT_BAND
