"""The Triton ``append_kv`` kernel against the torch backend's cache write and a float64 rotation."""
import pytest
import torch

pytest.importorskip("triton")

from simsd_kernels.paging import identity_table  # noqa: E402
from simsd_kernels.rope import apply_rope  # noqa: E402
from tests.kernels.helpers import max_err, torch_append_kv  # noqa: E402
from triton_ops.ops import append_kv_fwd  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
THETA = 1e6


def _inputs(seed, B, L, Hkv, D, lens, lmax, dtype):
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(B, L, Hkv, D, generator=gen).to(dtype)
    v = torch.randn(B, L, Hkv, D, generator=gen).to(dtype)
    cache_seqlens = torch.tensor(lens, dtype=torch.int32)
    positions = cache_seqlens.to(torch.int64)[:, None] + torch.arange(L)[None] + 5
    k_cache = torch.full((B, lmax, Hkv, D), float("nan")).to(dtype)
    v_cache = torch.full((B, lmax, Hkv, D), float("nan")).to(dtype)
    return [t.to(DEVICE) for t in (k, v, positions, k_cache, v_cache, cache_seqlens)]


@pytest.mark.parametrize("num_tokens", [0, 1, 7, 19])
@pytest.mark.parametrize("D", [64, 128])
def test_append_kv_matches_torch_fp32(num_tokens, D):
    k, v, pos, kc, vc, lens = _inputs(num_tokens + D, 3, 19, 2, D, [0, 5, 40], 64, torch.float32)
    kc2, vc2 = kc.clone(), vc.clone()
    append_kv_fwd(k, v, pos, kc, vc, lens, THETA, num_tokens, block_table=identity_table(len(lens), kc.device))
    torch_append_kv(k, v, pos, kc2, vc2, lens, THETA, num_tokens)
    # the same slots are written (untouched ones stay NaN), values exactly, keys within fp32 error
    assert torch.equal(kc.isnan(), kc2.isnan()) and torch.equal(vc.isnan(), vc2.isnan())
    assert torch.equal(vc.nan_to_num(), vc2.nan_to_num())
    if num_tokens:
        rows = torch.arange(3, device=DEVICE)[:, None]
        cols = lens.long()[:, None] + torch.arange(num_tokens, device=DEVICE)[None]
        exact = apply_rope(k[:, :num_tokens].double(), pos[:, :num_tokens], THETA)
        err, torch_err = max_err(kc[rows, cols], exact), max_err(kc2[rows, cols], exact)
        assert err <= 2 * torch_err + 1e-6, (err, torch_err)


def test_append_kv_bf16_within_torch_error():
    k, v, pos, kc, vc, lens = _inputs(3, 2, 9, 2, 128, [1, 30], 48, torch.bfloat16)
    kc2 = kc.clone()
    append_kv_fwd(k, v, pos, kc, vc, lens, THETA, 9, block_table=identity_table(len(lens), kc.device))
    torch_append_kv(k, v, pos, kc2, vc.clone(), lens, THETA, 9)
    exact = apply_rope(k.double(), pos, THETA)
    rows = torch.arange(2, device=DEVICE)[:, None]
    cols = lens.long()[:, None] + torch.arange(9, device=DEVICE)[None]
    err, torch_err = max_err(kc[rows, cols], exact), max_err(kc2[rows, cols], exact)
    assert err <= 2 * torch_err + 1e-2, (err, torch_err)
    assert torch.equal(vc[rows, cols], v)


def test_append_kv_skips_slots_beyond_capacity():
    k, v, pos, kc, vc, lens = _inputs(4, 1, 8, 1, 64, [28], 32, torch.float32)
    append_kv_fwd(k, v, pos, kc, vc, lens, THETA, 8,  # slots 28..35, capacity 32
                  block_table=identity_table(len(lens), kc.device))
    assert not kc[0, 28:32].isnan().any()
    assert torch.equal(vc[0, 28:32], v[0, :4])
