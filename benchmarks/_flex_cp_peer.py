"""PyTorch's own FlexAttention context parallelism, run on CPU with gloo: a benchmark peer.

This module drives the *private* context-parallel (CP) API that ships in
``torch.distributed.tensor.experimental._context_parallel`` (checked against torch 2.13):

* ``_HeadTailLoadBalancer(seq_len, world, device)`` -- the head/tail ("zigzag") reordering
  of the sequence, so that causal work is balanced across ranks;
* ``_create_cp_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device_mesh, load_balancer)`` --
  each rank's BlockMask for its local query shard against the *global* (gathered) K/V,
  built by ``torch.compile(create_block_mask)`` on a rewritten mask_mod;
* ``_context_parallel_shard(mesh, buffers, seq_dims, load_balancer)`` -- reorder and shard
  q/k/v (and grad_out) along the sequence dimension;
* ``parallelize_module(module, mesh, _ContextParallel(seq_dim=2,
  attention_type=_ContextParallel.AttentionType.FLEX))`` -- a forward pre-hook on a tiny
  module that wraps ``flex_attention``; the hook all-gathers K and V
  (``cplib::flex_cp_allgather``, whose backward is a reduce-scatter of dK/dV);
* ``context_parallel_unshard(mesh, buffers, seq_dims, load_balancer)`` -- all-gather the
  local shards and undo the reordering.

So the peer's algorithm is "all-gather K/V, local attention of Q_shard against full K/V,
reduce-scatter dK/dV". Gradients through this path are exact (no approximation; the only
numerical difference to single-process attention is summation order).

On CPU, ``flex_attention`` runs eagerly through its unfused math implementation (it
materialises the ``[B, H, S/world, S]`` score matrix, in fp32 for fp32/bf16 inputs), and its
backward is refused by a front-end guard ``_validate_device``. ``_cpu_flex_backward_allowed``
lifts that guard narrowly and only for the duration of one step: see its docstring. With the
guard lifted, eager backward is correct (the dense math backward, ``sdpa_dense_backward``).

Everything here is a *benchmark peer only*; nothing in ``ultraattn`` depends on it.

Caveats (measured on the 2-core CPU machine, torch 2.13, fp32):

* Memory: each rank materialises fp32 scores/probabilities of shape
  ``[B, H, S/world, S]`` several times over in forward and backward; S=8192, H=8, D=64,
  4 ranks peaked at ~4.7 GB RSS per rank (~17 GB for the machine). Memory grows as S^2/world.
* Work: K/V are all-gathered, so every rank holds full K/V and grad buffers for them; the
  block mask's sparsity is *not* exploited by the eager math path (masked entries are still
  computed, then set to -inf), so causal and sliding-window masks cost the same as full.
* The first call for a given (mask_mod, B, H, S, world) builds the CP BlockMask with
  ``torch.compile`` (seconds to tens of seconds, reported as ``setup_seconds``; cached
  afterwards in this module); the first forward also pays Dynamo tracing of the eager
  flex_attention wrapper, so time a warm-up step and report later ones.
* torch warns once per process that flex_attention runs without torch.compile.

Requirements: the default process group is already initialised with the gloo backend,
every rank passes the same global q/k/v, ``seq_len`` divides by ``world * 128`` (the CP
BlockMask's restriction: ``_DEFAULT_SPARSE_BLOCK_SIZE`` is 128), and ``mask_mod`` is a
FlexAttention mask_mod ``(b, h, q_idx, kv_idx) -> bool`` over *global* indices.
"""

import contextlib
import time

import torch

__all__ = ["flex_cp_available", "flex_cp_step", "default_grad_out", "GRAD_OUT_SEED"]

#: Seed of the default ``grad_out`` (see :func:`default_grad_out`).
GRAD_OUT_SEED = 1234

_CP_BLOCK = 128  # torch.nn.attention.flex_attention._DEFAULT_SPARSE_BLOCK_SIZE in 2.11-2.13


def _import_private_api():
    """Import the private names this peer needs, or raise RuntimeError naming what is missing."""
    try:
        import torch.distributed as dist
    except Exception as exc:  # pragma: no cover - torch without distributed
        raise RuntimeError(f"flex CP peer: torch.distributed cannot be imported ({exc!r})") from exc
    if not dist.is_available():
        raise RuntimeError("flex CP peer: torch.distributed is not available in this torch build")
    try:
        import torch.nn.attention.flex_attention as fa
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor.experimental import _context_parallel as cp
        from torch.distributed.tensor.parallel import parallelize_module
    except Exception as exc:
        raise RuntimeError(
            "flex CP peer: cannot import torch's private context-parallel / flex_attention "
            f"modules in torch {torch.__version__} ({exc!r})"
        ) from exc
    needed_cp = ("_ContextParallel", "_context_parallel_shard", "context_parallel_unshard",
                 "_HeadTailLoadBalancer")
    missing = [n for n in needed_cp if not hasattr(cp, n)]
    # _create_cp_block_mask lives in the _attention submodule (not re-exported in __init__)
    attn_mod = getattr(cp, "_attention", None)
    create_cp_block_mask = getattr(attn_mod, "_create_cp_block_mask", None) or getattr(
        cp, "_create_cp_block_mask", None)
    if create_cp_block_mask is None:
        missing.append("_create_cp_block_mask")
    if not missing:
        attn_type = getattr(cp._ContextParallel, "AttentionType", None)
        if attn_type is None or not hasattr(attn_type, "FLEX"):
            missing.append("_ContextParallel.AttentionType.FLEX")
    for n in ("flex_attention", "_validate_device"):
        if not hasattr(fa, n):
            missing.append(f"torch.nn.attention.flex_attention.{n}")
    if missing:
        raise RuntimeError(
            f"flex CP peer: torch {torch.__version__} lacks the private API this peer uses: "
            + ", ".join(missing) + " (written against torch 2.13)"
        )
    return {
        "dist": dist, "cp": cp, "fa": fa, "parallelize_module": parallelize_module,
        "DeviceMesh": DeviceMesh, "create_cp_block_mask": create_cp_block_mask,
    }


def flex_cp_available():
    """Return ``(ok, reason)``: whether this torch build has everything the peer needs.

    Checks the private context-parallel names, the flex_attention guard this peer lifts,
    and the gloo backend. Does not need an initialised process group.
    """
    try:
        api = _import_private_api()
    except RuntimeError as exc:
        return False, str(exc)
    if not api["dist"].is_gloo_available():
        return False, "flex CP peer: the gloo backend is not available in this torch build"
    return True, f"ok (torch {torch.__version__})"


@contextlib.contextmanager
def _cpu_flex_backward_allowed():
    """Temporarily allow FlexAttention *backward on CPU tensors* (benchmark peer only).

    ``torch.nn.attention.flex_attention.flex_attention`` calls the module-level function
    ``_validate_device(query, key, value)``, which raises NotImplementedError when a CPU
    input requires grad. The eager math forward/backward behind it are correct on CPU; the
    guard exists because no *compiled* CPU backward kernel exists. Inside this context the
    module attribute is replaced by a wrapper that

    * for CPU queries, runs the original check on ``detach()``-ed views (so every other
      device/type check still runs, only the requires-grad refusal is skipped);
    * for any other device, calls the original unchanged.

    The original function is restored on exit (also on error). Not thread-safe: the
    patch is process-global while active.
    """
    import torch.nn.attention.flex_attention as fa

    original = getattr(fa, "_validate_device", None)
    if original is None:
        raise RuntimeError(
            "flex CP peer: torch.nn.attention.flex_attention._validate_device not found in "
            f"torch {torch.__version__}; the CPU-backward guard this peer lifts has changed"
        )

    def _validate_device_cpu_backward_ok(query, key, value):
        if query.device.type == "cpu":
            return original(query.detach(), key.detach(), value.detach())
        return original(query, key, value)

    fa._validate_device = _validate_device_cpu_backward_ok
    try:
        yield
    finally:
        fa._validate_device = original


def default_grad_out(shape, dtype=torch.float32):
    """The fixed upstream gradient used when ``flex_cp_step`` gets no ``grad_out``.

    ``torch.randn(shape, generator=torch.Generator().manual_seed(GRAD_OUT_SEED))`` in fp32,
    cast to ``dtype``: identical on every rank and every call, so a reference can rebuild it.
    """
    g = torch.Generator().manual_seed(GRAD_OUT_SEED)
    return torch.randn(tuple(shape), generator=g, dtype=torch.float32).to(dtype)


class _FlexAttention(torch.nn.Module):
    """``flex_attention`` as a module, so ``_ContextParallel``'s pre-hook can all-gather K/V.

    The forward mirrors flex_attention's leading parameters ``(query, key, value,
    score_mod, block_mask)``: some torch versions' hook (seen in older 2.x sources) moves
    ``score_mod``/``block_mask`` from kwargs to positional args, 2.13's leaves kwargs alone;
    this signature accepts both.
    """

    def __init__(self, flex_attention):
        super().__init__()
        self._flex = flex_attention

    def forward(self, query, key, value, score_mod=None, block_mask=None):
        return self._flex(query, key, value, score_mod=score_mod, block_mask=block_mask)


def flex_cp_step(q, k, v, mask_mod, *, seq_len: int, rank: int, world: int, mesh=None,
                 grad_out=None, load_balance: bool = True) -> dict:
    """One forward+backward step of PyTorch's FlexAttention context parallel (CPU, gloo).

    Runs on the already-initialised default gloo process group of ``world`` ranks.

    Args:
        q, k, v: the GLOBAL tensors ``[B, H, S, D]`` on CPU, identical on every rank;
            ``requires_grad`` need not be set (local leaf shards are made here).
        mask_mod: FlexAttention mask_mod ``(b, h, q_idx, kv_idx) -> bool`` over global
            indices (e.g. causal ``q_idx >= kv_idx``). It is evaluated for every (b, h):
            the CP BlockMask is built with the real B and H.
        seq_len: S (checked against ``q.shape[2]``); must divide by ``world * 128``.
        rank, world: this process's rank and the group size (checked against the group).
        mesh: an optional 1-D CPU ``DeviceMesh`` over the ``world`` ranks; built with
            ``DeviceMesh("cpu", list(range(world)))`` when None.
        grad_out: optional global upstream gradient ``[B, H, S, D]``; default
            :func:`default_grad_out` (seeded randn, seed ``GRAD_OUT_SEED``).
        load_balance: use ``_HeadTailLoadBalancer`` (torch's default for CP; True) or
            plain contiguous shards (False).

    The loss is ``(out_local * grad_out_local).sum()`` on each rank, i.e. the global
    ``(out * grad_out).sum()``, so the returned grads are d/d{q,k,v} of that.

    Returns:
        dict with ``out``, ``dq``, ``dk``, ``dv`` (global, unsharded, original order,
        ``[B, H, S, D]``, same dtype as q), ``seconds`` (wall seconds of forward+backward
        only, between two barriers, max over ranks), ``setup_seconds`` (BlockMask creation
        and sharding, max over ranks; the first call includes torch.compile of
        create_block_mask), and ``local_seq`` (S / world).

    Raises:
        RuntimeError: if the private API is missing, the process group is not initialised
            or not gloo, tensors are not CPU/4-D/consistent, or S is not a multiple of
            ``world * 128``.
    """
    api = _import_private_api()
    dist, cp = api["dist"], api["cp"]

    if not dist.is_initialized():
        raise RuntimeError("flex CP peer: the default process group is not initialised")
    backend = dist.get_backend()
    if backend != "gloo":
        raise RuntimeError(f"flex CP peer: expects a gloo process group, got {backend!r}")
    if dist.get_world_size() != world or dist.get_rank() != rank:
        raise RuntimeError(
            f"flex CP peer: rank/world ({rank}/{world}) disagree with the process group "
            f"({dist.get_rank()}/{dist.get_world_size()})")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.device.type != "cpu":
            raise RuntimeError(f"flex CP peer: {name} must be a CPU tensor, got {t.device}")
        if t.dim() != 4:
            raise RuntimeError(f"flex CP peer: {name} must be [B, H, S, D], got {tuple(t.shape)}")
    if q.shape[2] != seq_len or k.shape[2] != seq_len or v.shape[2] != seq_len:
        raise RuntimeError(
            f"flex CP peer: seq_len={seq_len} but q/k/v have S = "
            f"{q.shape[2]}/{k.shape[2]}/{v.shape[2]}")
    if not (q.shape[:3] == k.shape[:3] == v.shape[:3] and q.shape[3] == k.shape[3]):
        raise RuntimeError(
            f"flex CP peer: q/k/v shapes must agree on B, H (no GQA here): "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if seq_len % (world * _CP_BLOCK) != 0:
        raise RuntimeError(
            f"flex CP peer: Q_LEN = {seq_len} must be divisible by world * {_CP_BLOCK} = "
            f"{world * _CP_BLOCK} (restriction of torch's _create_cp_block_mask)")

    B, H = q.shape[0], q.shape[1]
    if mesh is None:
        mesh = api["DeviceMesh"]("cpu", list(range(world)))
    elif mesh.ndim != 1 or mesh.size() != world or mesh.device_type != "cpu":
        raise RuntimeError(
            f"flex CP peer: mesh must be a 1-D CPU DeviceMesh over all {world} ranks, got {mesh}")
    if grad_out is None:
        grad_out = default_grad_out(q.shape, q.dtype)
    elif tuple(grad_out.shape) != tuple(q.shape[:3]) + (v.shape[3],):
        raise RuntimeError(f"flex CP peer: grad_out has shape {tuple(grad_out.shape)}")

    lb = cp._HeadTailLoadBalancer(seq_len, world, torch.device("cpu")) if load_balance else None

    with _load_balance_option(cp, load_balance):
        return _step(api, cp, dist, q, k, v, grad_out, mask_mod, B, H, seq_len, rank, world,
                     mesh, lb, bool(load_balance))


@contextlib.contextmanager
def _load_balance_option(cp, enabled):
    """Pin torch's global ``_cp_options.enable_load_balance`` to ``enabled`` for one step.

    ``_create_cp_block_mask(load_balancer=None)`` and ``context_parallel_unshard(
    load_balancer=None)`` fall back to a *default* head/tail balancer whenever that global
    flag is True (its default), so without pinning it, ``load_balance=False`` would build
    a reordered BlockMask for contiguous shards (wrong results).
    """
    opts = getattr(cp, "_cp_options", None)
    if opts is None or not hasattr(opts, "enable_load_balance"):
        raise RuntimeError(
            f"flex CP peer: torch {torch.__version__} lacks _cp_options.enable_load_balance")
    old = opts.enable_load_balance
    opts.enable_load_balance = bool(enabled)
    try:
        yield
    finally:
        opts.enable_load_balance = old


# (mask_mod, B, H, S, world, rank, load_balance) -> BlockMask; building one costs seconds
# (torch.compile of create_block_mask, recompiled for every new rewritten mask_mod).
_BLOCK_MASK_CACHE = {}
_BLOCK_MASK_CACHE_MAX = 8


def _cp_block_mask(api, mask_mod, B, H, seq_len, rank, world, mesh, lb, load_balance):
    """Rank-local CP BlockMask, cached per (mask_mod, B, H, S, world, rank, load_balance)."""
    key = (mask_mod, B, H, seq_len, world, rank, load_balance)
    bm = _BLOCK_MASK_CACHE.get(key)
    if bm is None:
        bm = api["create_cp_block_mask"](mask_mod, B, H, seq_len, seq_len, mesh,
                                         load_balancer=lb)
        if len(_BLOCK_MASK_CACHE) >= _BLOCK_MASK_CACHE_MAX:
            _BLOCK_MASK_CACHE.pop(next(iter(_BLOCK_MASK_CACHE)))
        _BLOCK_MASK_CACHE[key] = bm
    return bm


def _step(api, cp, dist, q, k, v, grad_out, mask_mod, B, H, seq_len, rank, world, mesh, lb,
          load_balance):
    """Shard, run forward+backward (timed), unshard. See :func:`flex_cp_step`."""
    dist.barrier()
    t_setup = time.perf_counter()
    block_mask = _cp_block_mask(api, mask_mod, B, H, seq_len, rank, world, mesh, lb,
                                load_balance)
    q_l, k_l, v_l, go_l = cp._context_parallel_shard(
        mesh, [q.detach(), k.detach(), v.detach(), grad_out.detach()], [2, 2, 2, 2],
        load_balancer=lb)
    q_l = q_l.detach().clone().requires_grad_(True)
    k_l = k_l.detach().clone().requires_grad_(True)
    v_l = v_l.detach().clone().requires_grad_(True)
    go_l = go_l.detach().contiguous()
    attn = _FlexAttention(api["fa"].flex_attention)
    attn = api["parallelize_module"](
        attn, mesh, cp._ContextParallel(seq_dim=2,
                                        attention_type=cp._ContextParallel.AttentionType.FLEX))
    setup_seconds = time.perf_counter() - t_setup

    with _cpu_flex_backward_allowed():
        dist.barrier()
        t0 = time.perf_counter()
        out_l = attn(q_l, k_l, v_l, block_mask=block_mask)
        (out_l * go_l).sum().backward()
        dist.barrier()
        seconds = time.perf_counter() - t0

    times = torch.tensor([seconds, setup_seconds], dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)

    out, dq, dk, dv = cp.context_parallel_unshard(
        mesh, [out_l.detach(), q_l.grad, k_l.grad, v_l.grad], [2, 2, 2, 2], load_balancer=lb)
    return {
        "out": out, "dq": dq, "dk": dk, "dv": dv,
        "seconds": float(times[0]), "setup_seconds": float(times[1]),
        "local_seq": seq_len // world,
    }
