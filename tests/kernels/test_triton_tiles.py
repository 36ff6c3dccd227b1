"""The Triton kernels' query tiles and split plans under the interpreter (CPU), against float64.

Every query tile (16 / 32 / 64 packed rows) with several split plans (split count, least tiles per
split, the shape-invariant rule), every mask mode, fp32 and the half types; the automatic plan of
the backend (``simsd_kernels.split_plan``) when it splits; a batch whose rows need different split
counts; the RoPE pre-pass; and the shape-invariant mode's promise: a query token's output is the
same bits whatever other tokens and rows share the forward. Tolerance as in
test_triton_attention.py: kernel error <= 2x the torch backend's error + a dtype floor.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from simsd_kernels.mask_rule import MaskMode  # noqa: E402
from simsd_kernels.paging import identity_table  # noqa: E402
from simsd_kernels.reference import temporal_attention_naive  # noqa: E402
from simsd_kernels.rope import apply_rope  # noqa: E402
from simsd_kernels.split_plan import TRITON_FIGURES, active_splits, plan_for  # noqa: E402
from simsd_kernels.triton_backend import TritonAttention  # noqa: E402
from tests.kernels.helpers import door_attention, make_inputs, max_err, torch_attention  # noqa: E402
from triton_ops.ops import rope_qk_fwd, temporal_attention_fwd  # noqa: E402

THETA = 1e6
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FLOOR = {torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 1e-2}
# (num_splits, min_tiles, invariant)
PLANS = [(1, 1, False), (3, 1, False), (3, 1, True), (4, 2, True)]


def _check(args, mode, **plan):
    args = [a.to(DEVICE) for a in args]
    q = args[0]
    scale = q.shape[-1] ** -0.5
    out = torch.full(q.shape, float("nan"), dtype=q.dtype, device=q.device)
    res = temporal_attention_fwd(*args, mode, THETA, scale, out=out, **plan,
                                 block_table=identity_table(args[0].shape[0], args[0].device))
    assert res is out and not torch.isnan(out).any(), "unwritten or NaN output"
    ref = temporal_attention_naive(*[a.double() if a.is_floating_point() else a for a in args], mode, THETA, scale)
    err, torch_err = max_err(out, ref), max_err(torch_attention(*args, mode, THETA, scale), ref)
    assert err <= 2 * torch_err + FLOOR[q.dtype], (err, torch_err, plan)
    return out


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: f"s{p[0]}-min{p[1]}{'-inv' if p[2] else ''}")
@pytest.mark.parametrize("block_m", [16, 32, 64])
def test_every_tile_and_plan_fp32(block_m, plan):
    # 13 tokens x G 4 = 52 rows: 4 / 2 / 1 m-tiles; caches 0 / 70 / 130 keys (0 / 2 / 3 tiles)
    args = make_inputs(100 + block_m + 7 * plan[0], 3, 13, 4, 1, 64, [70, 0, 130], lmax=160)
    num_splits, min_tiles, invariant = plan
    mode = (MaskMode.PAPER, MaskMode.EXACT)[(block_m // 16 + num_splits) % 2]
    _check(args, mode, block_m=block_m, num_splits=num_splits, min_tiles=min_tiles, invariant=invariant)


@pytest.mark.parametrize("block_m,mode", [(16, MaskMode.BLOCK_CAUSAL), (32, MaskMode.BIDIRECTIONAL),
                                          (64, MaskMode.BLOCK_CAUSAL)])
def test_every_tile_other_modes_with_many_new_tiles(block_m, mode):
    """Lq 130 (three new-token tiles: the tile-skip path), a split plan that puts new tiles in
    several splits."""
    args = make_inputs(7 + block_m, 1, 130, 2, 1, 64, [65], lmax=80)
    labels = args[6]
    labels[..., 2] = (torch.arange(130) // 8).to(torch.int32)  # prefill blocks of 8: grp = token // 8
    _check(args, mode, block_m=block_m, num_splits=3, min_tiles=1)


@pytest.mark.parametrize("block_m,dtype", [(16, torch.bfloat16), (32, torch.float16), (64, torch.bfloat16)])
def test_half_precision_tiles(dtype, block_m):
    args = make_inputs(31 + block_m, 2, 9, 8, 2, 128, [100, 40], dtype=dtype, lmax=128)
    out = _check(args, MaskMode.PAPER, block_m=block_m, num_splits=2, min_tiles=1)
    assert out.dtype == dtype


def test_automatic_plan_splits_and_rows_with_one_split_skip_the_merge():
    """The backend's plan for a long capacity splits the keys; a row whose cache is short uses one
    split (written directly, the merge skips it) while its neighbour uses several."""
    args = [a.to(DEVICE) for a in make_inputs(5, 2, 4, 4, 1, 64, [3000, 40], lmax=4096)]
    q, k, v, k_cache = args[:4]
    plan = plan_for(q, k, k_cache, figures=TRITON_FIGURES)
    assert plan.num_splits > 1, plan
    scale = 0.125
    out = door_attention(TritonAttention, *args, MaskMode.EXACT, THETA, scale)
    ref = temporal_attention_naive(*[a.double() if a.is_floating_point() else a for a in args], MaskMode.EXACT,
                                   THETA, scale)
    assert not torch.isnan(out).any() and max_err(out, ref) < 5e-5


def test_rope_pre_pass_matches_the_reference_rotation():
    """RoPE once per token = the torch recipe (fp32 angles); exact identity at position 0."""
    gen = torch.Generator().manual_seed(3)
    q, k = torch.randn(2, 5, 4, 64, generator=gen), torch.randn(2, 5, 2, 64, generator=gen)
    pos = torch.randint(0, 2048, (2, 5), generator=gen)
    pos[0, 0] = 0
    q_rot, k_rot = rope_qk_fwd(q.to(DEVICE), k.to(DEVICE), pos.to(DEVICE), THETA)
    assert q_rot.is_contiguous() and k_rot.shape == k.shape
    for got, x in ((q_rot.cpu(), q), (k_rot.cpu(), k)):
        # fp32 angles: 1 ulp of inv_freq is ~1e-4 rad at position 2048
        assert max_err(got, apply_rope(x, pos, THETA)) < 3e-4 * x.abs().max().item()
        assert torch.equal(got[0, 0], x[0, 0])


@pytest.mark.bitwise
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shape_invariant_rows_are_bit_identical(dtype):
    """Exact mode: a denoise forward of one block (Lq 4, copy 0) and a verify forward of 20 copies
    (Lq 80) in a batch of 3 give the block's tokens the same bits with ``shape_invariant`` (under
    the interpreter; on a GPU it also takes the kernel's tile shapes, which this mode fixes).
    The cache length is one where counting the new tiles would give the two forwards different
    split counts (checked below with the speed rule), so a kernel that let Lq into the invariant
    cut would show here."""
    # G 1: the invariant plan (sized for 16 rows) splits this capacity; least tiles per split 4 (fp32), 6 (bf16)
    L, lmax, D = (860 if dtype == torch.float32 else 620), 1024, 64
    one = list(make_inputs(11, 1, 4, 1, 1, D, [L], dtype=dtype, lmax=lmax))
    big = list(make_inputs(12, 3, 80, 1, 1, D, [100, L, 200], dtype=dtype, lmax=lmax))
    for i in (0, 1, 2, 3, 4):  # q, k, v, k_cache, v_cache of row 1 := the single row
        if i < 3:
            big[i][1, :4] = one[i][0]
        else:
            big[i][1] = one[i][0]
    big[6][1, :, 2] = (torch.arange(80) // 4).to(torch.int32)  # copy c = tokens [4c, 4c + 4)
    one[6][0, :, 2] = 0
    big[7][1, :4] = one[7][0]
    one = [a.to(DEVICE) for a in one]
    big = [a.to(DEVICE) for a in big]
    scale = D ** -0.5
    a = door_attention(TritonAttention, *one, MaskMode.EXACT, THETA, scale, shape_invariant=True)
    b = door_attention(TritonAttention, *big, MaskMode.EXACT, THETA, scale, shape_invariant=True)
    pa = plan_for(one[0], one[1], one[3], figures=TRITON_FIGURES, invariant=True)
    pb = plan_for(big[0], big[1], big[3], figures=TRITON_FIGURES, invariant=True)
    assert pa == pb and pa.num_splits > 1  # the same plan, and it does split this cache
    assert active_splits(pa.num_splits, pa.min_tiles, False, L, 4) != active_splits(pa.num_splits, pa.min_tiles, False,
                                                                                    L, 80)
    assert torch.equal(a[0], b[1, :4])
    ref = temporal_attention_naive(*[x.double() if x.is_floating_point() else x for x in one], MaskMode.EXACT,
                                   THETA, scale)
    assert max_err(a, ref) <= FLOOR[dtype] + (2e-2 if dtype != torch.float32 else 5e-5)
