"""Options of the ``ultraattn`` backend: ``torch.compile(model, backend="ultraattn", options={...})``.

``parse_options`` checks a user's dict and returns a frozen ``BackendOptions`` with every default
filled in (the world size from the process group, the default mesh). Errors name the option,
the value and the valid choices.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Literal, get_args

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from ultraattn.planner.baselines import Method
from ultraattn.planner.cost import DEFAULT_COST, CostModel
from ultraattn.planner.plan import Mesh
from ultraattn.planner.profile import CostProfile, cost_model_of
from ultraattn.planner.tiling import PlannerOptions
from ultraattn.runtime.calibrate import auto_profile, cached_profile_path, default_device
from ultraattn.runtime.costs import resolve_source

ReportMode = Literal["off", "summary", "full"]
Outputs = Literal["global", "sharded"]
Compiler = Literal["inductor", "aot_eager", "eager"]
PlannerName = Literal["auto", "fast", "ilp"]
World1 = Literal["auto", "tiles", "original"]


@dataclass(frozen=True, slots=True, kw_only=True)
class BackendOptions:
    """Validated backend options (``parse_options`` builds them from the dict users pass)."""

    mesh: Any = None
    """A DeviceMesh (1-D, or 2-D nodes x devices); None: the default group as one node, or split by LOCAL_WORLD_SIZE."""
    report: ReportMode = "off"
    """What is printed (rich) when a graph is compiled and when a site is planned."""
    shard: bool = True
    """Sequence sharding (``passes/shard/``): every activation that carries the sequence lives on this rank's
    tokens, so memory scales with the ranks. False: attention-only context parallelism (each attention gathers
    its output; the rest of the model runs replicated on the full sequence)."""
    outputs: Outputs = "sharded"
    """sharded: a graph output that carries the sequence is returned as a ``SeqShard`` (``passes/carrier.py``): a
    tensor with the global shape holding this rank's tokens. The next compiled region takes it as it is (a model
    compiled block by block hands shards from block to block with no communication); eager code gets the exact
    global value, all-gathered once on first use; ``ultraattn.undispatch(x)`` returns that value as a plain tensor.
    global: such outputs are all-gathered inside the graph and returned as plain tensors. Without sequence
    sharding (``shard=False``, one rank) every output is global."""
    ilp_time_limit: float | None = None
    balance_tol: float | None = None
    time_budget: float | None = None
    cost: CostModel | CostProfile = DEFAULT_COST
    """The cost model the planner uses. Users pass a dict of ``CostModel`` fields (overrides of the H100 defaults),
    a ``CostModel``, a ``CostProfile`` or its path (``ultraattn calibrate``), or ``"auto"``: this machine's
    calibrated profile, cached under the user's cache directory and measured at the first compile when missing
    (every rank compiles, so the measurement is a collective). ``parse_options`` resolves it to the model, or to
    the profile (whose fit errors also narrow the fast planner's band: ``runtime.costs.band_of``)."""
    method: Method = "ultraattn"
    """The planner, or a baseline plan for comparisons."""
    planner: PlannerName = "auto"
    """Which planner plans ``method="ultraattn"``: auto (the ILP planner for masks known at compile time, i.e.
    causal or no mask, planned once; the fast planner for masks met at run time: BlockMask and boolean-mask
    sites, new every batch for packed documents), fast (``planner.fast``: milliseconds, every rank plans for
    itself) or ilp (hierarchical ILPs: seconds, rank 0 plans and broadcasts)."""
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
    compiler: Compiler = "inductor"
    """What compiles the rewritten graph: inductor, aot_eager (debugging) or eager (run the FX graph as is)."""
    world1: World1 = "auto"
    """At world size 1 (nothing to split), what runs a site: auto (on a GPU the original op where it is faster
    than the tiles, i.e. flex_attention, and SDPA without a boolean mask; the tiles elsewhere and on the CPU),
    tiles (always the block-sparse tiles) or original (always the op the model called). The report says which
    and why."""

    def planner_options(self) -> PlannerOptions:
        kw = {nm: getattr(self, nm) for nm in ("ilp_time_limit", "balance_tol", "time_budget")
              if getattr(self, nm) is not None}
        return PlannerOptions(**kw)

    def cost_model(self) -> CostModel:
        return cost_model_of(self.cost)


VALID = tuple(f.name for f in fields(BackendOptions))
_CHOICES = {"report": ReportMode, "outputs": Outputs, "compiler": Compiler, "method": Method, "world1": World1,
            "planner": PlannerName}


def _check_values(opts: BackendOptions) -> None:
    for nm, lit in _CHOICES.items():
        if getattr(opts, nm) not in get_args(lit):
            raise ValueError(f"options[{nm!r}]={getattr(opts, nm)!r}: expected one of {', '.join(get_args(lit))}")
    for nm in ("shard", "debug", "explicit"):
        if not isinstance(getattr(opts, nm), bool):
            raise ValueError(f"options[{nm!r}]={getattr(opts, nm)!r}: expected True or False")
    for nm in ("ilp_time_limit", "balance_tol", "time_budget", "timeout"):
        v = getattr(opts, nm)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int | float) or v <= 0):
            raise ValueError(f"options[{nm!r}]={v!r}: expected a positive number")
    if opts.report_file is not None and not isinstance(opts.report_file, str | os.PathLike):
        raise ValueError(f"options['report_file'] must be a path, got {type(opts.report_file).__name__}")
    if not isinstance(opts.block_size, int) or opts.block_size < 16 or opts.block_size & (opts.block_size - 1):
        raise ValueError(f"options['block_size']={opts.block_size!r}: expected a power of two >= 16")
    w = opts.world_size
    if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
        raise ValueError(f"options['world_size']={w!r}: expected a positive int (or leave it unset)")


def _check_cost(cost, *, grouped: bool, mesh, world: int) -> CostModel | CostProfile:
    """``options['cost']`` as a model or a profile (see ``BackendOptions.cost``)."""
    if isinstance(cost, Mapping):
        names = {f.name for f in fields(CostModel)}
        bad = sorted(set(cost) - names)
        if bad:
            raise ValueError(f"options['cost'] has unknown field(s) {bad}; CostModel fields: "
                             f"{', '.join(sorted(names))}")
        try:
            return dataclasses.replace(DEFAULT_COST, **cost)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"options['cost']: {exc}") from None
    if isinstance(cost, str) and cost == "auto" and world == 1:
        return DEFAULT_COST   # one rank plans nothing (the site is one kernel): nothing to measure
    if isinstance(cost, str) and cost == "auto" and not grouped:
        # no process group (ultraattn.explain): only a profile measured before can stand for the ranks
        path = cached_profile_path(default_device(), Mesh(nodes=1, devices=world))
        if not path.exists():
            raise ValueError(f"options['cost']='auto' needs this machine's profile for {world} ranks, and none is "
                             f"cached ({path}); run `ultraattn calibrate --nproc {world}` first, or pass a profile "
                             f"path or a dict of CostModel fields")
        cost = path
    if isinstance(cost, str) and cost == "auto":
        return auto_profile(mesh=mesh)   # measured once per machine and configuration (a collective), then cached
    try:
        return resolve_source(cost)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"options['cost']: {exc}") from None


def parse_options(options: dict | None, *, require_group: bool = True, meshes: dict | None = None) -> BackendOptions:
    """Check ``options`` and fill defaults. Unknown keys or bad values raise ``ValueError`` naming them.

    Args:
        require_group: False (``ultraattn.explain``): plan for ``world_size`` ranks without a process group.
        meshes: where default meshes are cached (the side table's), so each is created once per process.
    """
    options = dict(options or {})
    unknown = sorted(set(options) - set(VALID))
    if unknown:
        guess = [m for u in unknown for m in difflib.get_close_matches(str(u), VALID, n=1)]
        raise ValueError(f"unknown ultraattn backend option(s) {unknown}"
                         + (f" (did you mean {', '.join(map(repr, guess))}?)" if guess else "")
                         + f"; valid options: {', '.join(VALID)}")
    if "report_file" in options and isinstance(options["report_file"], os.PathLike):
        options["report_file"] = os.fspath(options["report_file"])
    opts = BackendOptions(**{**options, "cost": DEFAULT_COST})
    _check_values(opts)
    world = opts.world_size
    grouped = dist.is_available() and dist.is_initialized()
    if world is None:
        world = dist.get_world_size() if grouped else 1
        if world == 1 and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise ValueError(
                f"WORLD_SIZE={os.environ['WORLD_SIZE']} but torch.distributed is not initialised: call "
                f"torch.distributed.init_process_group() before running the compiled model")
    elif world > 1 and require_group and not grouped:
        raise ValueError(f"options['world_size']={world} needs an initialised process group: call "
                         f"torch.distributed.init_process_group() first")
    elif require_group and grouped and world > dist.get_world_size():
        raise ValueError(f"options['world_size']={world}, but the process group has {dist.get_world_size()} ranks: "
                         f"leave world_size unset (it defaults to the group's size) or launch {world} ranks")
    mesh = opts.mesh
    if mesh is not None:
        from torch.distributed.device_mesh import DeviceMesh

        if not isinstance(mesh, DeviceMesh):
            raise ValueError(f"options['mesh']={mesh!r}: expected a torch.distributed DeviceMesh (1-D, or 2-D nodes x "
                             f"devices: init_device_mesh('cuda', (nodes, devices))); to plan for a cluster you are "
                             f"not on, use `ultraattn plan --cp NODESxDEVICES` or ultraattn.explain(..., world_size=N)")
    if mesh is None and require_group and world > 1:
        mesh = default_mesh(world, {} if meshes is None else meshes)
    cost = _check_cost(options.get("cost", {}), grouped=grouped and require_group, mesh=mesh, world=world)
    return dataclasses.replace(opts, world_size=world, mesh=mesh, cost=cost)


def default_mesh(world: int, cache: dict):
    """None (the group as one node), or nodes x devices from ``LOCAL_WORLD_SIZE`` (set by torchrun) when it
    splits the world into several nodes. Created once per ``cache`` (a collective: every rank compiles the
    same graphs)."""
    try:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "0"))
    except ValueError:
        raise ValueError(f"LOCAL_WORLD_SIZE={os.environ['LOCAL_WORLD_SIZE']!r} is not an integer") from None
    if not 1 < local < world or world % local:
        return None
    key = (world, local)
    if key not in cache:
        dev = "cuda" if torch.cuda.is_available() and dist.get_backend() == "nccl" else "cpu"
        cache[key] = init_device_mesh(dev, (world // local, local), mesh_dim_names=("node", "device"))
    return cache[key]
