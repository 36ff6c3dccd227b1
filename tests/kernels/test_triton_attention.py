"""The Triton temporal attention kernel against the float64 reference (interpreter on CPU).

Tolerance, flash-attention style: kernel error vs float64 <= 2x the torch backend's error at
the same dtype + a small floor. Outputs are NaN-poisoned so an unwritten tile fails.
"""
import pytest
import torch

pytest.importorskip("triton")

from simsd_kernels.mask_rule import MaskMode  # noqa: E402
from simsd_kernels.paging import identity_table  # noqa: E402
from simsd_kernels.reference import temporal_attention_naive  # noqa: E402
from tests.kernels.helpers import make_inputs, max_err, torch_attention  # noqa: E402
from triton_ops.ops import temporal_attention_fwd  # noqa: E402

THETA = 1e6
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FLOOR = {torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _run(args, mode, scale, num_splits=None):
    q = args[0]
    out = torch.full(q.shape, float("nan"), dtype=q.dtype, device=q.device)
    res = temporal_attention_fwd(*args, mode, THETA, scale, out=out, num_splits=num_splits,
                                 block_table=identity_table(args[0].shape[0], args[0].device))
    assert res is out
    assert not torch.isnan(out).any(), "unwritten or NaN output"
    return out


def _check(args, mode, num_splits=None, scale=None):
    args = [a.to(DEVICE) for a in args]
    q = args[0]
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    ref = temporal_attention_naive(*args, mode, THETA, scale)
    out = _run(args, mode, scale, num_splits)
    err = max_err(out, ref)
    torch_err = max_err(torch_attention(*args, mode, THETA, scale), ref)
    assert err <= 2 * torch_err + FLOOR[q.dtype], (err, torch_err)
    return err, out


# (B, Lq, Hq, Hkv, D, cache lengths, mode): odd lengths, Lq != Lk, GQA 1/2/3/4, empty caches
CASES = [
    (1, 1, 8, 2, 128, [129], MaskMode.PAPER),
    (2, 7, 4, 2, 64, [0, 63], MaskMode.EXACT),
    (3, 63, 2, 1, 64, [97, 0, 1], MaskMode.BLOCK_CAUSAL),
    (2, 97, 2, 2, 64, [7, 129], MaskMode.BIDIRECTIONAL),
    (2, 16, 8, 2, 128, [33, 0], MaskMode.PAPER),
    (1, 97, 4, 1, 64, [1], MaskMode.PAPER),
    (2, 9, 4, 1, 128, [0, 0], MaskMode.EXACT),
    (3, 5, 4, 4, 64, [63, 7, 0], MaskMode.BLOCK_CAUSAL),
    (1, 5, 6, 2, 64, [10], MaskMode.PAPER),  # GQA 3: any dividing ratio
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}-Lq{c[1]}-H{c[2]}:{c[3]}-D{c[4]}-"
                         f"c{'_'.join(map(str, c[5]))}-{c[6].name.lower()}")
def test_fp32_matches_float64_reference(case):
    B, Lq, Hq, Hkv, D, lens, mode = case
    err, _ = _check(make_inputs(1000 + 31 * Lq + sum(lens) + Hq, B, Lq, Hq, Hkv, D, lens), mode)
    assert err < 5e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode", [MaskMode.PAPER, MaskMode.EXACT])
def test_half_precision_within_torch_error(dtype, mode):
    args = make_inputs(11, 2, 13, 4, 2, 128, [70, 0], dtype=dtype)
    err, out = _check(args, mode)
    assert out.dtype == dtype
    assert err < 3e-2


@pytest.mark.parametrize("lens", [[129, 0, 1], [7, 97, 64]])
def test_split_kv_equals_no_split(lens):
    args = [a.to(DEVICE) for a in make_inputs(5, 3, 6, 4, 2, 64, lens, lmax=140)]
    scale = 64 ** -0.5
    ref = temporal_attention_naive(*args, MaskMode.PAPER, THETA, scale)
    one = _run(args, MaskMode.PAPER, scale, num_splits=1)
    for splits in (2, 5):  # 5 splits of a short cache: some splits are empty
        many = _run(args, MaskMode.PAPER, scale, num_splits=splits)
        assert max_err(many, one) < 2e-6
        assert max_err(many, ref) < 2e-5


def test_fully_masked_rows_are_zero():
    """Paper mode, empty cache, tokens with a kind outside 0-2 (padding): ``mask_rule.allowed``
    lets them see nothing, and nobody sees them. Their output must be exactly zero, the other
    rows unaffected by them; with split-KV too."""
    args = list(make_inputs(3, 2, 11, 4, 2, 64, [0, 5]))
    labels = args[6]
    pad = torch.zeros(2, 11, dtype=torch.bool)
    pad[:, 3] = True
    pad[0, 8:] = True
    labels[..., 0] = torch.where(pad, torch.full_like(labels[..., 0], 3), labels[..., 0])
    args = [a.to(DEVICE) for a in args]
    for splits in (1, 3):
        err, out = _check(args, MaskMode.PAPER, num_splits=splits)
        assert err < 5e-5
        assert torch.equal(out[0][pad[0]].cpu(), torch.zeros_like(out[0][pad[0]].cpu()))
        assert out[1][pad[1]].abs().sum() > 0  # row 1 has a cache: padding rows see it


def test_softmax_scale_is_used():
    args = make_inputs(21, 1, 5, 2, 1, 64, [9])
    err, _ = _check(args, MaskMode.BIDIRECTIONAL, scale=0.3)
    assert err < 5e-5


@pytest.mark.bitwise
def test_rope_copy_equal_positions_give_equal_rotation():
    """Paper layout's RoPE copy: D_k and M_k share a position; with identical q/k/v content and
    labels, their outputs are identical (rotation depends on the position only)."""
    args = list(make_inputs(8, 1, 6, 2, 2, 64, [4]))
    q, k, v, positions, labels = args[0], args[1], args[2], args[7], args[6]
    for t in (q, k, v):
        t[:, 3:] = t[:, :3]
    positions[:, 3:] = positions[:, :3]
    labels[:] = labels[:, :1]
    out = _run([a.to(DEVICE) for a in args], MaskMode.BIDIRECTIONAL, 0.125)
    assert torch.equal(out[:, 3:], out[:, :3])


def test_sliced_caches_use_their_strides():
    """Non-contiguous (head-sliced) caches: strides are taken from the tensors."""
    args = list(make_inputs(4, 2, 3, 2, 1, 64, [10, 2], lmax=12))
    gen = torch.Generator().manual_seed(40)
    wide_k = torch.randn(2, 12, 3, 64, generator=gen)
    wide_v = torch.randn(2, 12, 3, 64, generator=gen)
    args[3], args[4] = wide_k[:, :, 1:2], wide_v[:, :, 2:3]
    err, _ = _check(args, MaskMode.EXACT)
    assert err < 5e-5


@pytest.mark.gpu
@pytest.mark.parametrize("cache_len", [4096, 32760])
def test_automatic_split_on_long_caches_gpu(cache_len):
    """The automatic split-KV path compiled for the GPU: an SDAR-8B paper verify (Hq 32, Hkv 8,
    8 tokens, batch 1) over 4k-32k keys splits the cache (the split plan picks > 1) and stays
    within the float64 bound; positions run to ~32k (fp32 RoPE angles)."""
    from simsd_kernels.split_plan import TRITON_FIGURES, plan_for
    args = [a.to(DEVICE) for a in make_inputs(cache_len, 1, 8, 32, 8, 128, [cache_len], dtype=torch.bfloat16,
                                              lmax=cache_len + 8, max_pos=1)]
    assert int(args[7].max()) >= cache_len
    assert plan_for(args[0], args[1], args[3], figures=TRITON_FIGURES).num_splits > 1
    err, auto = _check(args, MaskMode.PAPER)
    one = _run(args, MaskMode.PAPER, 128 ** -0.5, num_splits=1)
    assert max_err(auto, one) <= FLOOR[torch.bfloat16]
