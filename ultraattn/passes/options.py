"""Options of the ``ultraattn`` backend: ``torch.compile(model, backend="ultraattn", options={...})``."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field, fields
from typing import Any

import torch.distributed as dist

from ultraattn.planner.cost import DEFAULT_COST, CostModel
from ultraattn.planner.tiling import PlannerOptions

_REPORTS = ("off", "summary", "full")
_OUTPUTS = ("global", "sharded")


@dataclass
class BackendOptions:
    """Validated backend options (see ``parse_options`` for the keys users pass)."""

    mesh: Any = None
    """A DeviceMesh (1-D, or 2-D nodes x devices); None: the default group as one node, or split by LOCAL_WORLD_SIZE."""
    report: str = "off"
    """off | summary | full: what is printed (rich) when a graph is compiled."""
    shard: bool = True
    """Sequence sharding (``shard.py``): every activation that carries the sequence lives on this rank's tokens,
    so memory scales with the ranks. False: attention-only context parallelism (each attention gathers its
    output; the rest of the model runs replicated on the full sequence)."""
    outputs: str = "global"
    """global: graph outputs that carry the sequence are all-gathered, so every rank returns what one process
    would. sharded: they are returned as this rank's shard (``ultraattn.undispatch(x)`` gathers one later), so
    logits need not be materialised in full."""
    ilp_time_limit: float | None = None
    balance_tol: float | None = None
    time_budget: float | None = None
    cost: dict = field(default_factory=dict)
    """Cost-model overrides (fields of ultraattn.planner.cost.CostModel)."""
    method: str = "ultraattn"
    """ultraattn or a baseline plan (ring, zigzag, allgather, ulysses, usp), for comparisons."""
    block_size: int = 128
    """Block size of masks the backend builds (SDPA sites); a BlockMask keeps its own."""
    timeout: float = 300.0
    """Seconds any rank waits for another before failing with the missing rank's name."""
    debug: bool = False
    """Check on every call that all ranks got the same inputs' shapes and mask (a cheap hash)."""
    world_size: int | None = None
    """Ranks to plan for; default: the process group's size (1 without one)."""
    report_file: str | None = None
    """Write the report as JSON here (rank 0), updated as plans are made; ``ultraattn report FILE`` renders it."""
    explicit: bool = True
    """Expand sites whose plan is known at compile time into explicit per-rank tile and communication nodes
    in the forward and backward graphs Inductor compiles (False: one opaque op per site)."""
    compiler: str = "inductor"
    """What compiles the rewritten graph: inductor, aot_eager (debugging) or eager (run the FX graph as is)."""

    def planner_options(self) -> PlannerOptions:
        kw = {}
        if self.ilp_time_limit is not None:
            kw["ilp_time_limit"] = self.ilp_time_limit
        if self.balance_tol is not None:
            kw["balance_tol"] = self.balance_tol
        if self.time_budget is not None:
            kw["time_budget"] = self.time_budget
        return PlannerOptions(**kw)

    def cost_model(self) -> CostModel:
        return dataclasses.replace(DEFAULT_COST, **self.cost) if self.cost else DEFAULT_COST


VALID = tuple(f.name for f in fields(BackendOptions))


def parse_options(options: dict | None, *, require_group: bool = True) -> BackendOptions:
    """Check ``options`` and fill defaults. Unknown keys or bad values raise ``ValueError`` naming them.

    ``require_group=False`` (``ultraattn.explain``) plans for ``world_size`` ranks without a process group.
    """
    options = dict(options or {})
    unknown = sorted(set(options) - set(VALID))
    if unknown:
        raise ValueError(f"unknown ultraattn backend option(s) {unknown}; valid options: {', '.join(VALID)}")
    opts = BackendOptions(**options)
    if opts.report not in _REPORTS:
        raise ValueError(f"options['report']={opts.report!r}: expected one of {', '.join(_REPORTS)}")
    if opts.compiler not in ("inductor", "aot_eager", "eager"):
        raise ValueError(f"options['compiler']={opts.compiler!r}: expected inductor, aot_eager or eager")
    if opts.outputs not in _OUTPUTS:
        raise ValueError(f"options['outputs']={opts.outputs!r}: expected one of {', '.join(_OUTPUTS)}")
    if not isinstance(opts.shard, bool):
        raise ValueError(f"options['shard']={opts.shard!r}: expected True or False")
    if opts.outputs == "sharded" and not opts.shard:
        raise ValueError("options['outputs']='sharded' needs the sequence-sharding pass: drop options['shard']=False")
    from ultraattn.runtime.api import METHODS

    if opts.method not in METHODS:
        raise ValueError(f"options['method']={opts.method!r}: expected one of {', '.join(METHODS)}")
    if not isinstance(opts.cost, dict):
        raise ValueError(f"options['cost'] must be a dict of CostModel fields, got {type(opts.cost).__name__}")
    if opts.cost:
        cm_fields = {f.name for f in fields(CostModel)}
        bad = sorted(set(opts.cost) - cm_fields)
        if bad:
            raise ValueError(f"options['cost'] has unknown field(s) {bad}; CostModel fields: {', '.join(sorted(cm_fields))}")
    for nm in ("ilp_time_limit", "balance_tol", "time_budget", "timeout"):
        v = getattr(opts, nm)
        if v is not None and (not isinstance(v, int | float) or v <= 0):
            raise ValueError(f"options[{nm!r}]={v!r}: expected a positive number")
    if opts.report_file is not None and not isinstance(opts.report_file, str | os.PathLike):
        raise ValueError(f"options['report_file'] must be a path, got {type(opts.report_file).__name__}")
    if opts.block_size < 16 or opts.block_size & (opts.block_size - 1):
        raise ValueError(f"options['block_size']={opts.block_size}: expected a power of two >= 16")
    world = opts.world_size
    if world is None:
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if world == 1 and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise ValueError(
                f"WORLD_SIZE={os.environ['WORLD_SIZE']} but torch.distributed is not initialised: call "
                f"torch.distributed.init_process_group() before running the compiled model"
            )
        opts.world_size = world
    elif world > 1 and require_group and not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            f"options['world_size']={world} needs an initialised process group: call "
            f"torch.distributed.init_process_group() first"
        )
    if opts.mesh is None and require_group and world > 1:
        opts.mesh = default_mesh(world)
    return opts


_MESHES: dict = {}


def default_mesh(world: int):
    """None (the group as one node), or nodes x devices from ``LOCAL_WORLD_SIZE`` (set by torchrun) when it
    splits the world into several nodes. Created once per process (a collective: every rank compiles the same graphs)."""
    try:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "0"))
    except ValueError:
        raise ValueError(f"LOCAL_WORLD_SIZE={os.environ['LOCAL_WORLD_SIZE']!r} is not an integer") from None
    if not 1 < local < world or world % local:
        return None
    key = (world, local)
    if key not in _MESHES:
        import torch
        from torch.distributed.device_mesh import init_device_mesh

        dev = "cuda" if torch.cuda.is_available() and dist.get_backend() == "nccl" else "cpu"
        _MESHES[key] = init_device_mesh(dev, (world // local, local), mesh_dim_names=("node", "device"))
    return _MESHES[key]
