"""score_mods generated as Triton code (``ultraattn.kernels.score_codegen``), each against torch's own evaluation
of the same score_mod (FlexAttention's vmap over the four index dimensions): the score, its gradient, and the
gradients of buffers that want one, on one tile of scores in a small kernel under Triton's interpreter (or on a
GPU). The cases cover what the generator translates (attn-gym's score_mods, integer division and remainder
with negative operands, wrapped negative indices, clamps, powers, logic, constants built inside the score_mod)
and what it refuses, by name."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ultraattn.kernels import config
from ultraattn.kernels.score_codegen import MAX_BUFFERS, Unsupported, generate

B, H, M, N, Q0 = 2, 3, 16, 32, 5   # a tile of M queries (global positions Q0..) against N keys, per (b, h)


def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def tile(X, G, Y, DX, P0, P1, P2, P3, D0, D1, D2, D3, FN: tl.constexpr, BW: tl.constexpr, M: tl.constexpr,
             N: tl.constexpr, Q0: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        qi = tl.arange(0, M)[:, None] + Q0
        ki = tl.arange(0, N)[None, :]
        at = (b * tl.num_programs(1) + h) * M * N + (qi - Q0) * N + ki
        x = tl.load(X + at)
        keep = qi >= ki   # a causal tile: the masked scores' gradients must not reach the buffers
        tl.store(Y + at, FN(x, b, h, qi, ki, P0, P1, P2, P3))
        tl.store(DX + at, BW(tl.load(G + at), x, b, h, qi, ki, keep, P0, P1, P2, P3, D0, D1, D2, D3, True))

    return tile


def _torch(fn, x, dy, buffers, grads, dtype):
    """torch's (scores, d scores, buffer gradients) in ``dtype``, on the kept (causal) scores."""
    from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex
    from torch.nn.attention.flex_attention import _vmap_for_bhqkv

    xr = x.to(dtype).requires_grad_()
    bufs = [t.to(dtype).requires_grad_() if want else t for t, want in zip(buffers, grads)]
    with TransformGetItemToIndex():
        yr = _vmap_for_bhqkv(fn, prefix=(0,), suffix=(None,) * len(buffers))(
            xr, torch.arange(B), torch.arange(H), torch.arange(M) + Q0, torch.arange(N), *bufs)
    keep = (torch.arange(M)[:, None] + Q0) >= torch.arange(N)[None, :]
    got = torch.autograd.grad(yr, [xr, *(b for b, want in zip(bufs, grads) if want)], dy.to(dtype) * keep)
    return yr.detach(), got[0] * keep, list(got[1:])


def _run(fn, buffers, grads):
    """Generated, torch fp64 and torch fp32, each as (scores, d scores, buffer gradients) on the kept (causal)
    scores."""
    sk = generate(fn, buffers, grads)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(B, H, M, N, generator=g) * 4
    dy = torch.randn(B, H, M, N, generator=g)
    ptrs = [t.contiguous() for t in buffers] + list(sk.constants)
    spare = torch.zeros(1)
    dbufs = [torch.zeros(t.shape) if want else spare for t, want in zip(buffers, grads)]
    y, dx = torch.empty_like(x), torch.empty_like(x)
    _kernel()[(B, H)](x, dy, y, dx, *ptrs, *[spare] * (MAX_BUFFERS - len(ptrs)), *dbufs,
                      *[spare] * (MAX_BUFFERS - len(dbufs)), FN=sk.fwd, BW=sk.bwd, M=M, N=N, Q0=Q0)
    keep = (torch.arange(M)[:, None] + Q0) >= torch.arange(N)[None, :]
    return ((y, dx * keep, [d for d, want in zip(dbufs, grads) if want]),
            _torch(fn, x, dy, buffers, grads, torch.float64), _torch(fn, x, dy, buffers, grads, torch.float32))


def _policy(got: torch.Tensor, ref64: torch.Tensor, ref32: torch.Tensor) -> bool:
    """The numerics policy (docs/numerics.md): within 2x torch's fp32 error against fp64, plus 4 fp32 ulps of the
    tensor's scale."""
    err = float((got.double() - ref64).abs().max())
    base = float((ref32.double() - ref64).abs().max())
    return err <= 2 * base + 4 * torch.finfo(torch.float32).eps * max(1.0, float(ref64.abs().max()))


_S = 64
_REL = torch.randn(H, 2 * _S, generator=torch.Generator().manual_seed(1))
_SLOPES = torch.rand(H, generator=torch.Generator().manual_seed(2))
_DIST = torch.randint(0, 6, (B, _S, _S), generator=torch.Generator().manual_seed(3), dtype=torch.int32)
_SPATIAL = torch.randn(H, 6, generator=torch.Generator().manual_seed(4))


def _attn_gym(name):
    from attn_gym.mods import (
        generate_activation_score_mod,
        generate_alibi_bias,
        generate_sandwich_bias,
        generate_tanh_softcap,
    )

    return {"alibi": generate_alibi_bias(H), "softcap": generate_tanh_softcap(2),
            "softcap_approx": generate_tanh_softcap(2, approx=True), "sandwich": generate_sandwich_bias(H, _S, 16),
            "activation": generate_activation_score_mod(F.gelu, offset=1.0)}[name]


CASES = {
    # name: (score_mod, buffers, which want a gradient)
    **{n: (lambda s, b, h, q, k, n=n: _attn_gym(n)(s, b, h, q, k), [], ()) for n in
       ("alibi", "softcap", "softcap_approx", "sandwich", "activation")},
    "graphormer": (lambda s, b, h, q, k, sp, d: s + sp[h, d[b, q, k]], [_SPATIAL, _DIST], (True, False)),
    "relative table, negative offsets wrap": (lambda s, b, h, q, k, r: s + r[h, k - q] * 0.5, [_REL], (True,)),
    "per-head slope (reduced in the tile)": (lambda s, b, h, q, k, m: s - m[h] * (q - k).abs(), [_SLOPES], (True,)),
    "per-query bias": (lambda s, b, h, q, k, r: s * r[0, q], [_REL], (True,)),
    "integer arithmetic": (lambda s, b, h, q, k: s + ((k - q) // 3 + (k - 2 * q) % 5 + torch.remainder(q - k, -4)
                                                       + torch.div(k - q, 3, rounding_mode="trunc")).float(), [], ()),
    "logic and clamps": (lambda s, b, h, q, k: torch.where((q % 3 == 0) | ((k > 7) & ~(b == 1)), s.clamp(-2, 3) ** 2,
                                                           torch.sigmoid(-s).clamp(min=0.1)), [], ()),
    "tensor built inside": (lambda s, b, h, q, k: s + torch.tensor([0.5, -1.0, 2.0])[h] * torch.sqrt(
        (q - k).abs().float() + 1.0), [], ()),
}


@pytest.mark.parametrize("name", list(CASES))
def test_generated_score_mods_match_torch(name):
    if not (torch.cuda.is_available() or config.interpret()):
        pytest.skip("no GPU and TRITON_INTERPRET is not set (tests/conftest.py sets it)")
    fn, buffers, grads = CASES[name]
    (y, dx, dbufs), (y64, dx64, db64), (y32, dx32, db32) = _run(fn, buffers, grads)
    assert _policy(y, y64, y32), ("score", name)
    assert _policy(dx, dx64, dx32), ("d score", name)
    assert len(dbufs) == sum(grads)
    for n, (got, r64, r32) in enumerate(zip(dbufs, db64, db32, strict=True)):
        assert float(r64.abs().max()) > 0
        assert _policy(got, r64, r32), (f"buffer {n} gradient", name)


def test_what_is_not_generated_is_refused_by_name():
    rope = torch.randn(B, H, _S, 8)
    with pytest.raises(Unsupported, match=r"aten::index makes a \(8,\) tensor per score"):
        generate(lambda s, b, h, q, k, r: s + (r[b, h, q] * r[b, h, k]).sum(), [rope], (False,))
    with pytest.raises(Unsupported, match=f"at most {MAX_BUFFERS}"):
        generate(lambda s, b, h, q, k, *bs: s, [torch.zeros(2)] * (MAX_BUFFERS + 1), ())
    with pytest.raises(Unsupported, match="atan2"):
        generate(lambda s, b, h, q, k: torch.atan2(s, s + 1), [], ())
