"""Running PuLP/CBC with a budget, a warm start and an honest report.

Every ILP of the planner goes through ``solve``: a wall-clock limit, a node limit (CBC
is deterministic for a fixed node limit on one thread; a time limit alone is not, and
every rank must compute the identical plan), warm start from the caller's incumbent,
and a ``SolveInfo`` with status, objective, best bound and gap parsed from CBC's log.
Failures never raise: the caller keeps its heuristic and the info says why.

PuLP is optional: where it is missing, ``import ultraattn``, the kernels, the fast planner and
the runtime still work (the GPU machine has none). The
ILP planner, asked for by name, fails with :func:`require_pulp`'s error; ``planner="auto"``
picks the fast planner there (:func:`have_pulp`).
"""

from __future__ import annotations

import os
import re
import tempfile
import time
from dataclasses import asdict, dataclass

try:  # optional: see the module docstring. Imported here when present, so import order stays as before
    import pulp as _pulp  # (imported later, mid-run, the clean-exit test saw the destroyed WORLD group kept alive)
except ImportError:
    _pulp = None


def have_pulp() -> bool:
    """Whether PuLP (the ILP planner's modelling library and CBC) is installed."""
    return _pulp is not None


def require_pulp(what: str = "the ILP planner"):
    """The ``pulp`` module, or an error that says who needs it and the two ways out."""
    if _pulp is None:
        raise ModuleNotFoundError(
            f"{what} needs PuLP, which is not installed here: `pip install pulp` (it ships the CBC solver), "
            "or plan with planner='fast' (no ILP; `ultraattn plan --planner fast`)", name="pulp")
    return _pulp


@dataclass(slots=True, kw_only=True)
class SolveInfo:
    name: str
    status: str
    """CBC's verdict: Optimal, Stopped (limit hit; incumbent kept), Infeasible, Skipped, Error."""
    objective: float | None = None
    bound: float | None = None
    gap: float | None = None
    """(objective - bound) / objective, 0 when proven optimal, None when unknown."""
    seconds: float = 0.0
    variables: int = 0
    constraints: int = 0
    used: bool = False
    """Whether the ILP's answer was adopted (else the heuristic's)."""
    note: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


_NUM = r"([-+0-9.eE]+)"


def _parse_log(text: str) -> tuple[str | None, float | None, float | None, float | None]:
    result = re.search(r"Result - (.+)", text)
    obj = re.search(r"Objective value:\s+" + _NUM, text)
    bound = re.search(r"Lower bound:\s+" + _NUM, text)
    gap = re.search(r"Gap:\s+" + _NUM, text)
    f = lambda m: float(m.group(1)) if m else None  # noqa: E731
    return (result.group(1).strip() if result else None), f(obj), f(bound), f(gap)


def solve(prob, *, name: str, time_limit: float, max_nodes: int = 2000,
          warm_start: bool = True) -> SolveInfo:
    """Solve ``prob`` with CBC under limits (module docstring). Never raises."""
    pulp = require_pulp()
    info = SolveInfo(name=name, status="Error", variables=len(prob.variables()),
                     constraints=len(prob.constraints))
    fd, log = tempfile.mkstemp(suffix=".log", prefix="ultraattn-cbc-")
    os.close(fd)
    t0 = time.perf_counter()
    try:
        solver = pulp.PULP_CBC_CMD(msg=False, timeLimit=max(1, int(round(time_limit))), threads=1,
                                   warmStart=warm_start, logPath=log, options=[f"maxNodes {max_nodes}"])
        prob.solve(solver)
        with open(log) as fh:
            text = fh.read()
        result, obj, bound, _ = _parse_log(text)
        st = pulp.LpStatus.get(prob.status, str(prob.status))
        has_sol = prob.sol_status in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible)
        if result and result.startswith("Optimal"):
            info.status = "Optimal"
        elif has_sol:
            info.status = "Stopped"
        else:
            info.status = st if st != "Optimal" else "NoSolution"
        info.objective = pulp.value(prob.objective) if has_sol else obj
        info.bound = bound if bound is not None else (info.objective if info.status == "Optimal" else None)
        if info.status == "Optimal":
            info.gap = 0.0
        elif info.objective and info.bound is not None:
            # relative gap; CBC's own "Gap:" line is not always relative
            info.gap = max(0.0, (info.objective - info.bound) / abs(info.objective))
        info.note = result or ""
    except Exception as exc:  # noqa: BLE001 - a solver failure must never break planning
        info.status, info.note = "Error", f"{type(exc).__name__}: {exc}"
    finally:
        info.seconds = time.perf_counter() - t0
        try:
            os.unlink(log)
        except OSError:
            pass
    return info
