"""Runtime: execute a plan across ranks (dispatch, exchange, tile compute, LSE merge, autograd)."""

from ultraattn.runtime.api import METHODS, AttentionPlan, check_consistent
from ultraattn.runtime.comm import RankTimeoutError
from ultraattn.runtime.entry import plan_attention
from ultraattn.runtime.executor import PlanExecutionError
from ultraattn.runtime.online import plan_ahead
from ultraattn.runtime.tokens import dispatch, dist_attention, undispatch

__all__ = [
    "METHODS",
    "AttentionPlan",
    "PlanExecutionError",
    "RankTimeoutError",
    "check_consistent",
    "dispatch",
    "dist_attention",
    "plan_ahead",
    "plan_attention",
    "undispatch",
]
