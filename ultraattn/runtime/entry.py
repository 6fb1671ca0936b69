"""``ultraattn.plan_attention``: the runtime's planning call as users make it, with ``cost="auto"`` resolved.

``cost="auto"`` is this machine's calibrated profile (``calibrate.auto_profile``: loaded from the user's cache, or
measured once, a collective). Calibrating runs real plans through ``api.py``, so ``api.py`` cannot call it; this
module, above both, resolves ``"auto"`` once per process and configuration (``ONLINE.cost_model``: a step's
planning neither reads the profile again nor meets the other ranks) and hands ``api.plan_attention`` the profile.
Every other argument goes through unchanged, and the function's signature and documentation are ``api``'s.
"""

from __future__ import annotations

import functools

from . import api
from .calibrate import auto_profile
from .comm import resolve_group
from .online import ONLINE


@functools.wraps(api.plan_attention)
def plan_attention(mask, **kwargs) -> api.AttentionPlan:
    cost = kwargs.get("cost")
    if isinstance(cost, str) and cost == "auto":
        kwargs["cost"] = auto_source(mesh=kwargs.get("mesh"), group=kwargs.get("group"),
                                     timeout=kwargs.get("timeout", 300.0))
    return api.plan_attention(mask, **kwargs)


def auto_source(*, mesh=None, group=None, timeout: float = 300.0):
    """This machine's profile for the ranks of ``mesh`` / ``group`` (``calibrate.auto_profile``), once per process
    and configuration."""
    if not (isinstance(timeout, int | float) and not isinstance(timeout, bool) and timeout > 0):
        raise ValueError(f"`timeout` must be positive seconds, got {timeout!r}")
    pmesh, ranks, _group, _me = resolve_group(mesh, group)
    return ONLINE.cost_model(("auto", ranks, pmesh.nodes, pmesh.devices),
                             lambda: auto_profile(group=group, mesh=mesh, timeout=timeout))
