"""The Triton kernels build for Hopper (sm_90) and Ampere (sm_80) on this CPU machine, and every
config the autotuner may launch fits: no register spills, shared memory within the target.

The interpreter tests (test_kernels.py) check the arithmetic; these check what only a compiler for
a real GPU shows (kernels/aot.py: triton.compile for a named target, then ptxas -v). A subset,
chosen to cover each axis once within about a minute on 2 cores with a cold Triton cache: every
config of the head-dim-128 space in bf16 on both targets (the common case, the largest tiles),
the padded-128 space (head dim 80) in fp16 at GQA group 8 on sm_90, the 256 space on sm_90, and the
head-dim-128 score_mod spaces on sm_90 with both sample score_mods generated in (``aot.SCORES``), and the
fp32 head-dim-64 space on sm_90 (the example model's).
``python benchmarks/kernels_ptx.py`` builds the whole matrix (every head dim, dtype, group, both
targets) and writes the table (benchmarks/results/kernels_ptx.json).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ultraattn.kernels import aot, config

_OK, _WHY = aot.has_nvidia_backend()
pytestmark = pytest.mark.skipif(not _OK, reason=f"no NVIDIA backend in this Triton: {_WHY}")


@pytest.fixture(scope="module")
def builds() -> list[aot.Build]:
    vs = (aot.variants(targets=("sm90", "sm80"), dtypes=("bf16",), head_dims=(128,))
          + aot.variants(targets=("sm90",), dtypes=("fp16",), head_dims=(80,), groups=(8,))
          + aot.variants(targets=("sm90",), dtypes=("bf16",), head_dims=(256,))
          + aot.variants(targets=("sm90",), dtypes=("bf16",), head_dims=(128,), scores=tuple(aot.SCORES))
          + aot.variants(targets=("sm90",), dtypes=("fp32",), head_dims=(64,)))
    return aot.sweep(vs, jobs=2)


def _owned(v: aot.Variant) -> int:
    """The tile a program owns (its MMA's M): query rows for fwd and dQ, keys for dK/dV."""
    return v.block_n if v.kernel == "dkv" else v.block_m


def test_every_autotune_config_builds_without_spills_within_shared_memory(builds):
    seen = {(b.variant.kernel, b.variant.target, config.row_class(b.variant.head_dim, b.variant.dtype),
             b.variant.score) for b in builds}
    assert seen == ({(k, t, "d128", "") for k in aot.KERNELS for t in ("sm90", "sm80")}
                    | {(k, "sm90", rows, "") for k in aot.KERNELS for rows in ("d128p", "d256")}
                    | {(k, "sm90", "d128", sc) for k in aot.KERNELS for sc in aot.SCORES}
                    | {(k, "sm90", "f64", "") for k in aot.KERNELS})
    # every entry of those spaces (for 128 x 128 blocks) is among the builds
    for kernel, _, rows, sc in seen:
        built = {b.variant.config for b in builds if b.variant.kernel == kernel and b.variant.score == sc
                 and config.row_class(b.variant.head_dim, b.variant.dtype) == rows}
        assert built == set(config.tile_configs(kernel, 128, 128, rows, score=bool(sc))), (kernel, rows, sc)
    failed = [f"{b.variant}: {b.error}" for b in builds if not b.ok]
    assert not failed, "\n".join(failed)
    spilled = [f"{b.variant}: {b.registers} regs, {b.spill_stores} B stores, {b.spill_loads} B loads"
               for b in builds if b.spills]
    assert not spilled, "\n".join(spilled)
    over = [f"{b.variant}: {b.shared_bytes} B > {b.shared_limit} B" for b in builds if not b.fits]
    assert not over, "\n".join(over)
    assert all(0 < b.registers <= 255 and b.shared_bytes > 0 for b in builds)


def test_hopper_builds_use_warp_group_mma(builds):
    """On sm_90 a program that owns 64 or more rows runs its dots as wgmma (Hopper's warp-group MMA,
    what its tensor-core throughput needs); below 64 Triton falls back to mma.sync, on sm_80 always. fp32's
    dots are exact (``input_precision="ieee"``): no tensor cores at all."""
    for b in builds:
        want = b.variant.target == "sm90" and _owned(b.variant) >= 64 and b.variant.dtype != "fp32"  # (ieee: FMAs)
        assert b.wgmma == want, b.variant


_AUTOTUNED = """
import json
from ultraattn.kernels import config, triton_kernels as tk
assert not config.interpret()
print(json.dumps({f"{k} {qb} {kb} {rows} {int(sc)}": [[c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps,
                                                      c.num_stages] for c in tk.tuned(k, qb, kb, rows, sc).configs]
                  for k in ("fwd", "dq", "dkv") for rows in config.ROW_CLASSES
                  for qb, kb in ((128, 128), (64, 128), (32, 32)) for sc in (False, True)}))
"""


def test_the_autotuner_launches_exactly_the_checked_spaces():
    """What ``triton_kernels.tuned`` hands triton.autotune is ``config.tile_configs`` (so the builds
    above are the configs a GPU may run), per row class, with and without a score_mod, and for blocks the
    tiles must divide. In a
    process without the interpreter (under it, kernels are launched with a given tile, untuned)."""
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    r = subprocess.run([sys.executable, "-c", _AUTOTUNED], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(got) == 3 * len(config.ROW_CLASSES) * 3 * 2
    for key, configs in got.items():
        kernel, qb, kb, rows, sc = key.split()
        want = config.tile_configs(kernel, int(qb), int(kb), rows, score=sc == "1")
        assert [tuple(c) for c in configs] == want and want, key
        assert all(int(qb) % m == 0 and int(kb) % n == 0 for m, n, *_ in want), key
    assert [config.row_class(d, "bf16") for d in (16, 32, 48, 64, 80, 96, 128, 144, 256)] == [
        "d32", "d32", "d64", "d64", "d128p", "d128p", "d128", "d256", "d256"]
    assert [config.row_class(d, "fp32") for d in (16, 32, 48, 64, 80, 128, 200, 256, 512)] == [
        "f32", "f32", "f64", "f64", "f128", "f128", "f256", "f256", "f256"]
    assert config.row_class(96, "fp16") == "d128p"


def test_tiles_env_replaces_a_kernels_space_and_bad_values_are_named(monkeypatch):
    monkeypatch.setenv(config.TILES_ENV, "dkv=64x128x8x3, dkv=32x128x8x2,fwd=128X64x8x3")
    assert config.tile_override() == {"dkv": [(64, 128, 8, 3), (32, 128, 8, 2)], "fwd": [(128, 64, 8, 3)]}
    assert config.tile_configs("dkv", 128, 128, "d128") == [(64, 128, 8, 3), (32, 128, 8, 2)]
    assert config.tile_configs("dq", 128, 128, "d128") == config._SPACES[("dq", "d128")]   # not named: its space
    with pytest.raises(ValueError, match=r"dkv tiles \['64x128', '32x128'\] do not divide the mask's 64 x 64"):
        config.tile_configs("dkv", 64, 64, "d128")
    for bad, what in (("dkv=64x128x8", "is not kernel=MxNxWxS"), ("bwd=64x64x4x2", "is not kernel=MxNxWxS"),
                      ("fwd=48x64x4x2", "powers of two"), ("fwd=64x0x4x2", "positive integers")):
        monkeypatch.setenv(config.TILES_ENV, bad)
        with pytest.raises(ValueError, match=f"ultraattn: ULTRAATTN_TILES=.*{what}"):
            config.tile_override()


_PINNED = """
import json
from ultraattn.kernels import triton_kernels as tk
print(json.dumps([[c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages]
                  for k in ("dkv", "dq") for c in tk.tuned(k, 128, 128, "d128").configs]))
"""


def test_the_autotuner_launches_the_tiles_env_configs():
    env = {**os.environ, "TRITON_INTERPRET": "0", config.TILES_ENV: "dkv=64x128x8x3"}
    r = subprocess.run([sys.executable, "-c", _PINNED], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    got = [tuple(c) for c in json.loads(r.stdout.strip().splitlines()[-1])]
    assert got == [(64, 128, 8, 3)] + config._SPACES[("dq", "d128")]


def test_a_variant_outside_the_kernels_is_refused():
    with pytest.raises(ValueError, match="target='sm75'"):
        aot.Variant("fwd", "sm75", "bf16", 128, 1, 64, 64, 4, 3)
    with pytest.raises(ValueError, match="dtype='fp8'"):
        aot.Variant("fwd", "sm90", "fp8", 128, 1, 64, 64, 4, 3)
    with pytest.raises(ValueError, match="score='alibi'"):
        aot.Variant("fwd", "sm90", "bf16", 128, 1, 64, 64, 4, 3, score="alibi")


def test_the_kernels_build_with_the_scales_inductor_passes():
    """Inside ``torch.compile`` Inductor types the Python-float scales fp64 on CUDA; the kernels must still
    build (the first GPU check, 2026-11-26, found the online-softmax state promoted to fp64 and the build
    refused: "Loop-carried variable m_i has initial type fp32 but is re-assigned to fp64")."""
    vs = [aot.Variant(k, "sm90", "bf16", 64, 1, *config.tile_configs(k, 128, 128, config.row_class(64, "bf16"))[0],
                      scale_type="fp64") for k in aot.KERNELS]
    builds = aot.sweep(vs, jobs=2)
    failed = [f"{b.variant.label()}: {b.error}" for b in builds if not b.ok]
    assert not failed, "\n".join(failed)
    assert all(not b.spills for b in builds)
