"""Block-sparse attention kernels: block lists, eager reference op, Triton kernels (interpreted on CPU), compile.

Every numeric check is the 2x rule (docs/numerics.md) against an fp64 dense oracle (out, lse, dq, dk,
dv with a loss that flows through both out and lse, so dLSE is exercised). The Triton kernels
run here under ``TRITON_INTERPRET=1`` (tests/conftest.py sets it when there is no GPU) with
``ULTRAATTN_KERNELS=triton``; on a GPU machine the GPU tests run them compiled.
"""

from __future__ import annotations

import math

import pytest
import torch
from runtime_cases import LIB, Case, check_numerics, dense_mask, inputs, mask_mod_of, plan_mask
from torch.nn.attention.flex_attention import create_block_mask

import ultraattn.kernels as K
from ultraattn.kernels import config
from ultraattn.masks import generate_document, pattern_from_mask_mod

CUDA = torch.cuda.is_available()


def _run(case: Case, *, device: str = "cpu") -> dict:
    q, k, v, go, gl = (x.to(device) for x in inputs(case))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    mask = plan_mask(case)
    out, lse = K.block_sparse_attention(q, k, v, mask, return_lse=True, block_size=case.block)
    ((out.double() * go.double()).sum() + (lse.double() * gl.double()).sum()).backward()
    return {"out": out.detach().cpu(), "lse": lse.detach().cpu(), "dq": q.grad.cpu(), "dk": k.grad.cpu(),
            "dv": v.grad.cpu()}


@pytest.fixture
def triton_kernels(monkeypatch):
    if not CUDA and not config.interpret():
        pytest.skip("no GPU and TRITON_INTERPRET is not set (tests/conftest.py sets it)")
    if not config.HAS_TRITON:
        pytest.skip("triton is not installed")
    monkeypatch.setenv("ULTRAATTN_KERNELS", "triton")


def _lib(**kw) -> list[Case]:
    return [Case(mask=m, kwargs=a, **kw) for m, a in LIB]


# ----------------------------------------------------------------------------- block lists
@pytest.mark.parametrize("case", _lib(seqlen=200, heads=2, kv_heads=2, block=32), ids=lambda c: c.name)
def test_block_lists_reconstruct_the_dense_mask(case):
    lay = K.make_block_lists(plan_mask(case), q_len=case.seqlen, kv_len=case.seqlen, num_heads=case.heads,
                             mask_mod=mask_mod_of(case) if case.mask not in ("causal", "full", "random") else None,
                             block_size=case.block)
    want = dense_mask(case)[0]  # [H, S, S]
    nq, nk = lay.grid
    qb, kb = lay.q_block, lay.kv_block
    bits = K.unpack_bits(lay.bits, kb)
    for h in range(case.heads):
        u = int(lay.pattern_of[h])
        got = torch.zeros(nq * qb, nk * kb, dtype=torch.bool)
        for i in range(nq):
            for t in range(int(lay.full_cnt[u, i])):
                j = int(lay.full_idx[u, i, t])
                got[i * qb:(i + 1) * qb, j * kb:(j + 1) * kb] = True
            for t in range(int(lay.part_cnt[u, i])):
                j = int(lay.part_idx[u, i, t])
                got[i * qb:(i + 1) * qb, j * kb:(j + 1) * kb] = bits[int(lay.part_tile[u, i, t])]
        assert torch.equal(got[:case.seqlen, :case.seqlen], want[h]), case.name
        # the transposed lists name the same cells
        for j in range(nk):
            rows_f = lay.full_q_idx[u, j, :int(lay.full_q_cnt[u, j])].tolist()
            rows_p = lay.part_q_idx[u, j, :int(lay.part_q_cnt[u, j])].tolist()
            assert rows_f == [i for i in range(nq) if int(lay.kind[u, i, j]) == 2]
            assert rows_p == [i for i in range(nq) if int(lay.kind[u, i, j]) == 1]
            for t, i in enumerate(rows_p):
                assert int(lay.part_q_tile[u, j, t]) == int(lay.part_tile[u, i, lay.part_idx[u, i].tolist().index(j)])
    assert lay.attended_pairs() == int(want.sum())


def test_block_lists_kv_tail_is_never_full_and_heads_dedupe():
    lay = K.make_block_lists("full", q_len=100, kv_len=100, num_heads=3, block_size=32)
    assert lay.num_patterns == 1 and lay.pattern_of.tolist() == [0, 0, 0]
    assert (lay.kind[0, :, -1] == 1).all() and (lay.kind[0, :, :-1] == 2).all()
    # a mask_mod that differs per head inside blocks: heads get their own bit tiles
    lay = K.make_block_lists(lambda b, h, q, kv: (q - kv) % (h + 2) == 0, q_len=64, kv_len=64, num_heads=3,
                             block_size=32)
    assert lay.pattern_of.tolist() == [0, 1, 2]


def test_block_lists_errors_name_the_fix():
    pat = pattern_from_mask_mod(mask_mod_of(Case(mask="causal")), 128, 128, block_size=32)
    with pytest.raises(ValueError, match="mask_mod=..."):
        K.make_block_lists(pat)
    with pytest.raises(ValueError, match="power-of-two block size"):
        K.make_block_lists("causal", q_len=96, block_size=24)
    with pytest.raises(ValueError, match="batch=3"):
        doc = generate_document([[32, 32], [16, 48]])  # two batch entries with different blocks
        K.make_block_lists(pattern_from_mask_mod(doc, 64, 64, block_size=32, batch=2), batch=3, mask_mod=doc)


def _dense(lay) -> torch.Tensor:
    """bool [B, H, rows, keys] of block lists (blocks whole, padding included)."""
    nq, nk = lay.grid
    qb, kb = lay.q_block, lay.kv_block
    bits = K.unpack_bits(lay.bits, kb)
    out = torch.zeros(lay.batch * lay.num_heads, nq * qb, nk * kb, dtype=torch.bool)
    for bh in range(lay.batch * lay.num_heads):
        u = int(lay.pattern_of[bh])
        for i in range(nq):
            for t in range(int(lay.full_cnt[u, i])):
                j = int(lay.full_idx[u, i, t])
                out[bh, i * qb:(i + 1) * qb, j * kb:(j + 1) * kb] = True
            for t in range(int(lay.part_cnt[u, i])):
                j = int(lay.part_idx[u, i, t])
                out[bh, i * qb:(i + 1) * qb, j * kb:(j + 1) * kb] = bits[int(lay.part_tile[u, i, t])]
    return out.view(lay.batch, lay.num_heads, nq * qb, nk * kb)


@pytest.mark.parametrize("kb", [16, 64, 96])
def test_pack_unpack_roundtrip(kb):
    m = torch.rand(5, 16, kb) < 0.3
    m[:, 0, min(31, kb - 1)] = True  # bit 31 of a word is its sign bit
    packed = K.pack_bits(m)
    assert packed.dtype == torch.int32 and packed.shape == (5, 16, (kb + 31) // 32)
    assert torch.equal(K.unpack_bits(packed, kb), m)
    # the words' little-endian bytes hold bit c % 8 of byte c // 8 (the block lists' documented order)
    as_bytes = packed.contiguous().view(torch.uint8)[..., : kb // 8].to(torch.int32)
    assert torch.equal(((as_bytes[..., None] >> torch.arange(8)) & 1).reshape(5, 16, kb).bool(), m)


# ----------------------------------------------------------------------------- reference op (CPU path)
@pytest.mark.parametrize("case", _lib(seqlen=200, heads=4, kv_heads=2, batch=2, block=32), ids=lambda c: c.name)
def test_reference_op_matches_dense(case):
    assert not check_numerics(case, _run(case))


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_reference_op_low_precision(dtype):
    for mask, kw in (("causal", ()), ("document", (("lengths", (50, 90, 60)),))):
        case = Case(mask=mask, kwargs=kw, seqlen=200, heads=4, kv_heads=1, head_dim=32, dtype=dtype)
        assert not check_numerics(case, _run(case))


def test_reference_op_groups_the_heads_of_a_gqa_group():
    """The CPU op runs the query heads of a KV head as one matmul when they share a pattern and each head alone
    when they do not: a mask that differs between the heads of one group and between batch entries covers both."""
    case = Case(mask="head_mix", seqlen=200, heads=4, kv_heads=2, batch=2, block=32)
    lay = K.make_block_lists(mask_mod_of(case), q_len=200, kv_len=200, batch=2, num_heads=4, block_size=32)
    assert lay.pattern_of.view(2, 2, 2).tolist() == [[[0, 0], [0, 1]], [[1, 0], [0, 1]]]
    assert not check_numerics(case, _run(case))


# ----------------------------------------------------------------------------- Triton kernels
@pytest.mark.parametrize("case", _lib(seqlen=200, heads=4, kv_heads=2, batch=2, block=64), ids=lambda c: c.name)
def test_triton_matches_dense(case, triton_kernels):
    assert not check_numerics(case, _run(case, device="cuda" if CUDA else "cpu"))


@pytest.mark.parametrize(
    "case",
    [
        Case(mask="random", seqlen=256, heads=8, kv_heads=2, block=32, seed=3),  # GQA 4:1, 32-blocks
        Case(mask="random", seqlen=192, heads=8, kv_heads=1, block=64, seed=5),  # GQA 8:1
        Case(mask="causal", seqlen=130, heads=2, kv_heads=2, head_dim=80, block=64),  # odd head dim, 2-row tail
        Case(mask="document", kwargs=(("lengths", (64, 64, 64)),), seqlen=192, heads=2, kv_heads=2, head_dim=128,
             block=64),
        Case(mask="sliding_window", kwargs=(("window", 40),), seqlen=256, heads=2, kv_heads=2, dtype="bf16",
             block=128),
        Case(mask="causal", seqlen=256, heads=4, kv_heads=2, dtype="fp16", head_dim=64, block=128, batch=2),
        Case(mask="strided", kwargs=(("block", 32),), seqlen=256, heads=2, kv_heads=2, dtype="bf16", head_dim=80,
             block=64),
    ],
    ids=lambda c: f"{c.name}-D{c.head_dim}-blk{c.block}",
)
def test_triton_shapes_and_dtypes(case, triton_kernels):
    assert not check_numerics(case, _run(case, device="cuda" if CUDA else "cpu"))


def test_triton_empty_rows_give_zero_and_neg_inf(triton_kernels):
    """Rows that attend nowhere: output 0, LSE -inf, no NaN anywhere (also in the gradients)."""
    S = 128
    keep_rows = torch.arange(S) % 3 != 0

    def mm(b, h, q, kv):
        return keep_rows[q] & (kv <= q)

    dev = "cuda" if CUDA else "cpu"
    bm = create_block_mask(mm, None, None, S, S, device="cpu", BLOCK_SIZE=64)
    q, k, v = (torch.randn(1, 2, S, 32, device=dev, requires_grad=True) for _ in range(3))
    out, lse = K.block_sparse_attention(q, k, v, bm, return_lse=True)
    empty = ~keep_rows.to(dev)
    assert torch.equal(out[:, :, empty], torch.zeros_like(out[:, :, empty]))
    assert torch.isneginf(lse[:, :, empty]).all() and torch.isfinite(lse[:, :, ~empty]).all()
    out.sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert torch.equal(q.grad[:, :, empty], torch.zeros_like(q.grad[:, :, empty]))


def test_triton_backward_takes_global_lse_and_dlse(triton_kernels):
    """The distributed contract: bsa_bwd with an external (global) LSE and delta - dlse equals the
    gradient of the merged result. Split the keys in two tiles, merge, differentiate, compare."""
    torch.manual_seed(0)
    S, D = 128, 32
    dev = "cuda" if CUDA else "cpu"
    q, k, v = (torch.randn(1, 2, S, D, device=dev) for _ in range(3))
    go = torch.randn(1, 2, S, D, device=dev)
    gl = torch.randn(1, 2, S, device=dev)
    lay0 = K.make_block_lists(lambda b, h, qi, kv: (kv < 64) & (kv <= qi), q_len=S, kv_len=S, num_heads=2,
                              block_size=64, device=dev)
    lay1 = K.make_block_lists(lambda b, h, qi, kv: (kv >= 64) & (kv <= qi), q_len=S, kv_len=S, num_heads=2,
                              block_size=64, device=dev)
    o0, l0 = K.block_sparse_attention(q, k, v, lay0, return_lse=True)
    o1, l1 = K.block_sparse_attention(q, k, v, lay1, return_lse=True)
    lse = torch.logaddexp(l0, l1)
    out = o0 * torch.exp(l0 - lse)[..., None] + o1 * torch.exp(l1 - lse)[..., None]
    delta = (go * out).sum(-1)
    grads = [torch.ops.ultraattn.bsa_bwd(q, k, v, go, lse, delta, gl, *lt.bwd_tensors(), lt.q_block, lt.kv_block,
                                         1 / math.sqrt(D)) for lt in (lay0, lay1)]
    got = [a + b for a, b in zip(*grads)]
    q2, k2, v2 = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref_o = torch.nn.functional.scaled_dot_product_attention(q2, k2, v2, is_causal=True)
    s = (q2 @ k2.transpose(-1, -2)) / math.sqrt(D)
    ref_l = torch.logsumexp(s.masked_fill(~torch.ones(S, S, dtype=torch.bool, device=dev).tril(), -math.inf), -1)
    ((ref_o * go.double()).sum() + (ref_l * gl.double()).sum()).backward()
    for g, r in zip(got, (q2.grad, k2.grad, v2.grad)):
        assert (g.double() - r).abs().max() < 1e-4, (g.double() - r).abs().max()
    assert (out.double() - ref_o).abs().max() < 1e-5


# ----------------------------------------------------------------------------- ops, compile, errors
def test_op_is_in_the_compiled_graph_and_matches_eager():
    """torch.compile sees ultraattn::bsa_fwd (and its backward) as an op; Inductor's result equals eager."""
    S, H, D = 192, 4, 32
    bm = create_block_mask(mask_mod_of(Case(mask="sliding_window", kwargs=(("window", 40),))), None, None, S, S,
                           device="cpu", BLOCK_SIZE=64)
    lay = K.make_block_lists(bm, num_heads=H)
    graphs = []

    def spy(gm, example_inputs):
        graphs.append(gm.code)
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(gm, example_inputs)

    def f(q, k, v):
        out, lse = torch.ops.ultraattn.bsa_fwd(q, k, v, *lay.bwd_tensors(), lay.q_block, lay.kv_block, 0.2)
        return (out * 2).sum() + lse.sum()

    torch.manual_seed(0)
    args = [torch.randn(1, H, S, D, requires_grad=True) for _ in range(3)]
    args2 = [a.detach().clone().requires_grad_() for a in args]
    f(*args).backward()
    torch.compile(f, backend=spy, fullgraph=True)(*args2).backward()
    assert any("ultraattn.bsa_fwd" in g for g in graphs), graphs
    for a, b in zip(args, args2):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-5)


def test_bad_inputs_get_clear_errors(monkeypatch):
    q = torch.randn(1, 4, 64, 16)
    with pytest.raises(ValueError, match="not a multiple of num_kv_heads=3"):
        K.block_sparse_attention(q, torch.randn(1, 3, 64, 16), torch.randn(1, 3, 64, 16), "causal", block_size=32)
    with pytest.raises(TypeError, match="dtypes differ"):
        K.block_sparse_attention(q, q.half(), q, "causal", block_size=32)
    with pytest.raises(TypeError, match="float16, bfloat16 and float32"):
        K.block_sparse_attention(q.double(), q.double(), q.double(), "causal", block_size=32)
    with pytest.raises(ValueError, match="4-D"):
        K.block_sparse_attention(q[0], q, q, "causal", block_size=32)
    lay = K.make_block_lists("causal", q_len=64, num_heads=4, block_size=32)
    with pytest.raises(ValueError, match="built for q_len=64.*q_len=32"):
        K.block_sparse_attention(q[:, :, :32], q[:, :, :32], q[:, :, :32], lay)
    monkeypatch.setenv("ULTRAATTN_KERNELS", "fast")
    with pytest.raises(ValueError, match="ULTRAATTN_KERNELS='fast'"):
        K.block_sparse_attention(q, q, q, "causal", block_size=32)
    monkeypatch.setenv("ULTRAATTN_KERNELS", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        K.block_sparse_attention(q, q, q, "causal", block_size=32)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU: the compiled (non-interpreted) Triton kernels")
def test_gpu_compiled_kernels_inside_torch_compile():
    S, H, D = 1024, 8, 128
    bm = create_block_mask(lambda b, h, q, kv: kv <= q, None, None, S, S, device="cuda")
    q, k, v = (torch.randn(2, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))

    def f(q, k, v):
        return K.block_sparse_attention(q, k, v, bm)

    lay = K.get_block_lists(bm, q_len=S, kv_len=S, batch=2, num_heads=H, device=q.device)  # built outside compile
    out = torch.compile(lambda q, k, v: torch.ops.ultraattn.bsa_fwd(q, k, v, *lay.bwd_tensors(), 128, 128,
                                                                      D ** -0.5)[0])(q, k, v)
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    assert (out.float() - ref).abs().max() < 2e-2
    assert (f(q, k, v).float() - ref).abs().max() < 2e-2


def test_triton_non_contiguous_inputs(triton_kernels):
    """Head slices of bigger tensors (how the runtime passes a head group): strides are honoured, nothing
    is written out of bounds, results equal the contiguous ones."""
    dev = "cuda" if CUDA else "cpu"
    torch.manual_seed(0)
    big = [torch.randn(2, 8, 160, 32, device=dev) for _ in range(3)]
    sl = [x[:, 2:6] for x in big]
    args = [x.detach().requires_grad_() for x in sl]  # detach keeps the non-dense strides
    assert not args[0].is_contiguous()
    out, lse = K.block_sparse_attention(*args, "causal", return_lse=True, block_size=64)
    (out.square().sum() + lse.sum()).backward()
    ref = [x.detach().contiguous().requires_grad_() for x in sl]
    out2, lse2 = K.block_sparse_attention(*ref, "causal", return_lse=True, block_size=64)
    (out2.square().sum() + lse2.sum()).backward()
    torch.testing.assert_close(out, out2, rtol=0, atol=0)
    for a, b in zip(args, ref):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)


def test_every_kernel_parameter_is_passed_at_every_launch():
    """No kernel parameter has a default: Inductor (torch 2.11, Triton 3.6) built a launcher that wanted one argument
    more than the call gave when a launch left a defaulted constexpr out (the score_mod hooks, ``None``), so every
    launch passes every parameter (the GPU check's ``kernels_correct``, inside ``torch.compile``)."""
    import inspect

    from ultraattn.kernels import triton_kernels as tk

    for name, fn in tk._JIT.items():   # (a JITFunction on a GPU, an InterpretedFunction here: both wrap .fn)
        params = inspect.signature(fn.fn).parameters
        defaulted = [n for n, p in params.items() if p.default is not inspect.Parameter.empty]
        assert not defaulted, (name, defaulted)
        assert "SCORE" in params, name


def test_block_list_cache_keys_the_mask_mod_too():
    """``block_sparse_attention``'s block-list cache (``ops._BLOCK_LISTS``): one BlockPattern with PARTIAL blocks, read
    with two mask_mods, gives each mask_mod's own block lists (the bits of its PARTIAL cells), and the same pair again
    the cached one."""
    from ultraattn.kernels.ops import get_block_lists

    def stripes(b, h, q, k):   # every block PARTIAL
        return (q + k) % 3 != 0

    def other(b, h, q, k):     # the same blocks, other cells
        return (q + k) % 3 != 1

    pattern = pattern_from_mask_mod(stripes, 128, 128, block_size=32)
    kw = dict(q_len=128, kv_len=128, batch=1, num_heads=1, device=torch.device("cpu"), block_size=32)
    a = get_block_lists(pattern, mask_mod=stripes, **kw)
    b = get_block_lists(pattern, mask_mod=other, **kw)
    assert a is not b and not torch.equal(a.bits, b.bits)
    assert get_block_lists(pattern, mask_mod=other, **kw) is b
