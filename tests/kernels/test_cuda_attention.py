"""GPU tests of the ``cuda`` backend (simsd_kernels._C) against the float64 reference.

Tolerance (flash-attention style): the kernel's max error against the float64 naive reference
must stay within 2x the error of the PyTorch (SDPA) backend at the same dtype, plus a dtype
floor. Every case: batch of 3 rows with cache lengths 0, 37 and 150 in a 161-slot cache whose
unused slots hold NaN for the kernel (the references get zeros there), and an output
allocator poisoned with NaN (in the output's dtype). The Triton backend cross-checks one case
per mode and dtype only (each Triton specialisation compiles for seconds on the GPU). Skipped
without a GPU; skipped without the built extension unless SIMSD_REQUIRE_CUDA_EXT=1 (the device
script sets it).
"""
from __future__ import annotations

import pytest
import torch

from simsd_kernels import KIND_MASK, MaskMode, temporal_attention, temporal_attention_naive
from simsd_kernels.backends import get_backend
from tests.kernels.helpers import door_append_kv, door_attention, torch_append_kv, torch_attention

from .cuda_helpers import ERR_FLOOR, load_cuda_backend, make_inputs, max_err, nan_poison_beyond, poison_allocator

pytestmark = pytest.mark.gpu

CACHE_LENS = (0, 37, 150)
LMAX = 161
THETA = 1e6
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MODES = tuple(MaskMode)


@pytest.fixture(scope="module")
def cb():
    return load_cuda_backend()


def _run_case(cb, mode, Lq, groups, dtype, D, num_splits, seed, Hkv=2, cache_lens=CACHE_LENS, Lmax=LMAX,
              cross_check=False, args=None):
    B, Hq = len(cache_lens), Hkv * groups
    args = args if args is not None else make_inputs(B, Lq, Hq, Hkv, D, cache_lens, Lmax, dtype, "cuda", seed, mode)
    q, k, v, k_cache, v_cache, cache_seqlens, labels, positions = args
    scale = D ** -0.5
    f64 = [t.to(torch.float64) if t.is_floating_point() else t for t in args]
    ref = temporal_attention_naive(*f64, mode, THETA, scale)
    base = torch_attention(*args, mode, THETA, scale)

    kc_bad, vc_bad = nan_poison_beyond(k_cache, cache_lens), nan_poison_beyond(v_cache, cache_lens)
    splits = num_splits if num_splits else 32
    poison_allocator((B, Lq, Hq, D), dtype=dtype)
    poison_allocator((splits, B, Lq, Hq, D), (splits, B, Lq, Hq))
    out = door_attention(cb.CudaAttention, q, k, v, kc_bad, vc_bad, cache_seqlens, labels, positions, int(mode),
                         THETA, scale, num_splits=num_splits)
    torch.cuda.synchronize()

    assert out.shape == (B, Lq, Hq, D) and out.dtype == dtype
    assert torch.isfinite(out).all(), "NaN/inf in the output: unwritten tile or read past cache_seqlens"
    err, base_err = max_err(out, ref), max_err(base, ref)
    tol = 2 * base_err + ERR_FLOOR[dtype]
    assert err <= tol, f"cuda err {err:.3g} > tol {tol:.3g} (torch err {base_err:.3g})"

    if cross_check:
        triton = get_backend("triton")
        if triton is not None and triton.is_available(q.device)[0]:
            tri = door_attention(triton, q, k, v, k_cache, v_cache, cache_seqlens, labels, positions, mode, THETA,
                                 scale)
            assert max_err(out, tri) <= 2 * tol, "cuda and triton backends disagree"
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("groups", (1, 2, 4))
@pytest.mark.parametrize("Lq", (1, 7, 63, 97, 129))
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name.lower())
def test_matches_reference(cb, mode, Lq, groups, dtype):
    # the Triton cross-check on one case per (mode, dtype): 12 Triton compilations, not 180
    _run_case(cb, mode, Lq, groups, dtype, D=128, num_splits=1, seed=1000 + Lq * 10 + groups,
              cross_check=(Lq, groups) == (63, 2))


@pytest.mark.parametrize("num_splits", (1, 2, 3, 0), ids=lambda s: f"splits{s or 'auto'}")
@pytest.mark.parametrize("D", (64, 128))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name.lower())
def test_head_dim_and_split_kv(cb, mode, dtype, D, num_splits):
    _run_case(cb, mode, 97, 2, dtype, D=D, num_splits=num_splits, seed=7 + D + num_splits)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_split_kv_equals_no_split(cb, dtype):
    """Splitting the cache changes only rounding: within the dtype floor of the unsplit result."""
    outs = [_run_case(cb, MaskMode.PAPER, 33, 4, dtype, 128, s, seed=5, cache_lens=(600, 1, 333), Lmax=640)
            for s in (1, 5)]
    assert max_err(outs[0], outs[1]) <= ERR_FLOOR[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("num_splits", (1, 3))
def test_fully_masked_rows_are_zero(cb, dtype, num_splits):
    """Rows that see nothing (empty cache, invalid kind under ``paper``) are zeros, never NaN."""
    mode = MaskMode.PAPER
    cache_lens = (0, 20)
    q, k, v, k_cache, v_cache, cache_seqlens, labels, positions = make_inputs(
        2, 9, 4, 2, 64, cache_lens, 64, dtype, "cuda", 3, mode)
    labels[:, ::2, 0] = 3  # no rule lets kind 3 see a new token, nor see it
    labels[:, 1::2, 0] = KIND_MASK
    out = door_attention(cb.CudaAttention, q, k, v, k_cache, v_cache, cache_seqlens, labels, positions, int(mode),
                         THETA, 0.125, num_splits=num_splits)
    ref = temporal_attention_naive(q.double(), k.double(), v.double(), k_cache.double(), v_cache.double(),
                                   cache_seqlens, labels, positions, mode, THETA, 0.125)
    assert torch.isfinite(out).all()
    assert (out[0, ::2] == 0).all(), "fully masked rows must be exact zeros"
    assert max_err(out, ref) <= 2 * ERR_FLOOR[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_public_api_routes_to_cuda(cb, dtype):
    args = make_inputs(3, 7, 4, 2, 128, CACHE_LENS, LMAX, dtype, "cuda", 11, MaskMode.EXACT)
    out = temporal_attention(*args, mask_mode="exact", rope_theta=THETA, backend="cuda")
    ref = torch_attention(*args, MaskMode.EXACT, THETA, 128 ** -0.5)
    assert max_err(out, ref) <= 4 * ERR_FLOOR[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("D", (64, 128))
def test_append_kv(cb, dtype, D):
    B, L, Hkv, Lmax = 3, 13, 2, 40
    cache_lens = [0, 5, 30]  # the last row overflows the capacity: slots >= Lmax are skipped
    gen = torch.Generator().manual_seed(D)
    k, v = (torch.randn(B, L, Hkv, D, generator=gen).to("cuda", dtype) for _ in range(2))
    k_cache, v_cache = (torch.randn(B, Lmax, Hkv, D, generator=gen).to("cuda", dtype) for _ in range(2))
    positions = (torch.tensor(cache_lens)[:, None] + torch.arange(L)).cuda()
    cache_seqlens = torch.tensor(cache_lens, dtype=torch.int32, device="cuda")
    num_tokens = 11
    kc, vc = k_cache.clone(), v_cache.clone()
    door_append_kv(cb.CudaAttention, k, v, positions, kc, vc, cache_seqlens, THETA, num_tokens)
    kr, vr = k_cache.clone().double(), v_cache.clone().double()
    for b, n in enumerate(cache_lens):  # reference on the rows' in-range slots, in float64
        m = min(num_tokens, Lmax - n)
        sub_k, sub_v = kr[b:b + 1].clone(), vr[b:b + 1].clone()
        torch_append_kv(k[b:b + 1, :m].double(), v[b:b + 1, :m].double(), positions[b:b + 1, :m], sub_k, sub_v,
                        cache_seqlens[b:b + 1], THETA, m)
        kr[b], vr[b] = sub_k[0], sub_v[0]
    torch.cuda.synchronize()
    assert torch.equal(vc, vr.to(dtype)), "v must be copied exactly"
    assert max_err(kc, kr) <= {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]
    untouched = torch.ones(B, Lmax, dtype=torch.bool)
    for b, n in enumerate(cache_lens):
        untouched[b, n:n + num_tokens] = False
    assert torch.equal(kc[untouched], k_cache[untouched]), "append_kv wrote outside its slots"


def test_rejects_bad_arguments(cb):
    """The door refuses a dtype outside the backend's supported set; the extension's own checks (the
    op called directly, one split of 64-row tiles) refuse mixed dtypes, a bad mask mode, misalignment."""
    args = list(make_inputs(1, 4, 2, 1, 64, (3,), 8, torch.float16, "cuda", 0, MaskMode.BIDIRECTIONAL))

    def raw(q, k, v, kc, vc, lens, labels, pos, mode):
        return cb.ops.attention(q, k, v, kc, vc, lens, labels, pos, mode, THETA, 0.125, 1, 64, 1, False)
    with pytest.raises(ValueError, match="dtype"):
        door_attention(cb.CudaAttention, *[a.double() if a.is_floating_point() else a for a in args], 0, THETA, 0.125)
    bad = list(args)
    bad[1] = bad[1].float()
    with pytest.raises(RuntimeError, match="k must be"):
        raw(*bad, 0)
    with pytest.raises(RuntimeError, match="mask_mode"):
        raw(*args, 7)
    odd = list(args)
    odd[0] = torch.zeros(1, 4, 2, 64 + 4, dtype=torch.float16, device="cuda")[..., 4:]  # 8-byte offset
    with pytest.raises(RuntimeError, match="16-byte"):
        raw(*odd, 0)
    assert cb.CudaAttention.is_available(torch.device("cpu"))[0] is False


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("cache_len", (4096, 16384, 32760))
def test_automatic_split_on_long_caches(cb, dtype, cache_len):
    """The heuristic split path (``num_splits=0``) of an SDAR-8B verify forward (Hq 32, Hkv 8,
    paper layout of 8 tokens, batch 1): 8 CTAs on a GPU of ~100+ SMs, so
    ``choose_num_splits`` picks many splits (min(2 * SMs / CTAs, Lmax / 128, 32)); positions
    run up to ~32k (RoPE angles in fp32). Against float64, and against the unsplit kernel."""
    Lmax = cache_len + 8
    args = make_inputs(1, 8, 32, 8, 128, (cache_len,), Lmax, dtype, "cuda", cache_len, MaskMode.PAPER)
    assert int(args[7].max()) >= cache_len
    auto = _run_case(cb, MaskMode.PAPER, 8, 4, dtype, 128, 0, seed=0, Hkv=8, cache_lens=(cache_len,), Lmax=Lmax,
                     args=args)
    one = _run_case(cb, MaskMode.PAPER, 8, 4, dtype, 128, 1, seed=0, Hkv=8, cache_lens=(cache_len,), Lmax=Lmax,
                    args=args)
    assert max_err(auto, one) <= ERR_FLOOR[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_hf_layout_strided_inputs(cb, dtype):
    """transformers hands ``(B, H, L, D)`` tensors; the adapter passes ``transpose(1, 2)`` views
    (last dim contiguous, other strides not) and the cache as a slice of ``[past | new]``: the
    kernel must read the strides, and give the result of the same values made contiguous."""
    B, Hq, Hkv, D, past, Lq = 2, 8, 2, 128, 70, 9
    gen = torch.Generator().manual_seed(4)
    query = torch.randn(B, Hq, Lq, D, generator=gen).to("cuda", dtype)
    key = torch.randn(B, Hkv, past + Lq, D, generator=gen).to("cuda", dtype)
    value = torch.randn(B, Hkv, past + Lq, D, generator=gen).to("cuda", dtype)
    q, k_all, v_all = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    labels = torch.zeros(B, Lq, 3, dtype=torch.int32, device="cuda")
    labels[..., 2] = torch.arange(Lq, dtype=torch.int32, device="cuda")
    rest = (torch.full((B,), past, dtype=torch.int32, device="cuda"), labels,
            torch.zeros(B, Lq, dtype=torch.int64, device="cuda"), int(MaskMode.BLOCK_CAUSAL), THETA, D ** -0.5)
    strided = (q, k_all[:, past:], v_all[:, past:], k_all[:, :past], v_all[:, :past])
    assert not any(t.is_contiguous() for t in strided)
    out = door_attention(cb.CudaAttention, *strided, *rest)
    dense = door_attention(cb.CudaAttention, *(t.contiguous() for t in strided), *rest)
    ref = temporal_attention_naive(*(t.double() for t in strided), *rest)
    assert torch.equal(out, dense), "strided and contiguous inputs of equal values must give equal outputs"
    assert max_err(out, ref) <= 2 * max_err(torch_attention(*strided, *rest), ref) + ERR_FLOOR[dtype]
