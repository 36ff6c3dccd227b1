"""GPU tests of the CUDA kernel's query tiles, split plans and shape-invariant mode.

Every query tile (16 / 32 / 64 rows: 4, 2, 1 warps along M, the others along the keys) with
several split plans (split count, least tiles per split, the invariant rule) against the float64
reference, on caches holding NaN past each row's length and a NaN-poisoned allocator; the
automatic plan on a long cache; and bit-identical rows across Lq and batch in invariant mode.
Skipped without a GPU (the CPU checks of the same index maps are in test_cuda_layout.py).
"""
from __future__ import annotations

import pytest
import torch

from simsd_kernels import MaskMode, temporal_attention_naive
from tests.kernels.helpers import door_attention, torch_attention

from .cuda_helpers import ERR_FLOOR, load_cuda_backend, make_inputs, max_err, nan_poison_beyond, poison_allocator

pytestmark = pytest.mark.gpu
THETA = 1e6
PLANS = [(1, 1, False), (3, 1, False), (5, 2, True)]  # (num_splits, min_tiles, invariant)


@pytest.fixture(scope="module")
def cb():
    return load_cuda_backend()


def _reference(args, mode, scale):
    f64 = [t.double() if t.is_floating_point() else t for t in args]
    return temporal_attention_naive(*f64, mode, THETA, scale), torch_attention(*args, mode, THETA, scale)


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: f"s{p[0]}-min{p[1]}{'-inv' if p[2] else ''}")
@pytest.mark.parametrize("block_m", [16, 32, 64])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("mode", list(MaskMode), ids=lambda m: m.name.lower())
def test_tiles_and_plans(cb, mode, dtype, D, block_m, plan):
    lens = (0, 37, 300)
    args = make_inputs(3, 21, 8, 2, D, lens, 320, dtype, "cuda", 7 + block_m, mode)
    scale = D ** -0.5
    ref, base = _reference(args, mode, scale)
    q, k, v, kc, vc, seqlens, labels, positions = args
    num_splits, min_tiles, invariant = plan
    poison_allocator((3, 21, 8, D), (num_splits, 3, 21, 8, D), (num_splits, 3, 21, 8))
    out = cb.ops.attention(q, k, v, nan_poison_beyond(kc, lens), nan_poison_beyond(vc, lens), seqlens, labels,
                           positions, int(mode), THETA, scale, num_splits, block_m, min_tiles, invariant)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()
    tol = 2 * max_err(base, ref) + ERR_FLOOR[dtype]
    assert max_err(out, ref) <= tol


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=lambda d: str(d).split(".")[-1])
def test_automatic_plan_on_a_long_cache(cb, dtype):
    lens = (3000, 40, 4096)
    args = make_inputs(3, 8, 32, 8, 128, lens, 4096, dtype, "cuda", 5, MaskMode.PAPER)
    ref, base = _reference(args, MaskMode.PAPER, 128 ** -0.5)
    out = door_attention(cb.CudaAttention, *args, int(MaskMode.PAPER), THETA, 128 ** -0.5)
    assert max_err(out, ref) <= 2 * max_err(base, ref) + ERR_FLOOR[dtype]


def test_shape_invariant_rows_are_bit_identical(cb):
    """Exact mode: the tokens of one block get the same bits in a denoise forward (Lq 4) and in a
    verify forward of 20 copies (Lq 80, batch 3) with ``shape_invariant``."""
    dtype, D, L = torch.bfloat16, 128, 9000
    one = list(make_inputs(1, 4, 32, 8, D, (L,), 16384, dtype, "cuda", 11, MaskMode.EXACT))
    big = list(make_inputs(3, 80, 32, 8, D, (500, L, 16000), 16384, dtype, "cuda", 12, MaskMode.EXACT))
    for i in range(3):
        big[i][1, :4] = one[i][0]
    big[3][1], big[4][1] = one[3][0], one[4][0]
    big[6][1, :, 2] = (torch.arange(80, device="cuda") // 4).to(torch.int32)
    one[6][0, :, 2] = 0
    big[7][1, :4] = one[7][0]
    a = door_attention(cb.CudaAttention, *one, int(MaskMode.EXACT), THETA, D ** -0.5, shape_invariant=True)
    b = door_attention(cb.CudaAttention, *big, int(MaskMode.EXACT), THETA, D ** -0.5, shape_invariant=True)
    assert torch.equal(a[0], b[1, :4])
