"""The Triton fused-MoE kernels (triton_ops.fused_moe) against the torch path and float64, at every
tile height (``moe_block_m``: 16, 32, 64 rows); the sort by expert; the backend switch and
self-check of simsd_kernels.moe.

Device-agnostic: on a CUDA machine the kernels run compiled on ``cuda`` (bench/device_run.sh runs
this file in its ``fused-moe`` group), elsewhere under the interpreter on the CPU."""
import warnings

import pytest
import torch

import simsd_kernels.moe as moe
from simsd_kernels.backends import BackendCheckError, BackendCheckWarning
from simsd_kernels.selfcheck import ERR_FLOOR, CheckResult

pytest.importorskip("triton")
from triton_ops.ops import align_by_expert, fused_moe_fwd, moe_block_m  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                                 ids=["float32", "bfloat16", "float16"])


def case(T, H, I, E, K, dtype, seed=0, skew=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g, dtype=torch.float64)
    wgu = torch.randn(E, 2 * I, H, generator=g, dtype=torch.float64) * H ** -0.5
    wd = torch.randn(E, H, I, generator=g, dtype=torch.float64) * I ** -0.5
    logits = torch.randn(T, E, generator=g, dtype=torch.float64)
    if skew:
        logits[:, 0] += 6  # every token: expert 0 (several tiles of one expert)
    w, ids = torch.topk(torch.softmax(logits, -1).float(), K)
    on = lambda t: t.to(DEVICE)  # noqa: E731
    return (on(x.to(dtype)), on(wgu.to(dtype)), on(wd.to(dtype)), on(w), on(ids),
            (on(x), on(wgu), on(wd)))


@pytest.mark.parametrize("T,E,K,block_m", [(1, 4, 1, 16), (37, 8, 3, 16), (20, 128, 8, 16), (50, 4, 2, 32),
                                           (9, 3, 3, 64)])
def test_align_by_expert_tiles_every_pair_once_by_expert(T, E, K, block_m):
    ids = torch.stack([torch.randperm(E, generator=torch.Generator().manual_seed(t))[:K] for t in range(T)])
    pairs, expert_of_tile = (t.cpu() for t in align_by_expert(ids.to(DEVICE), E, block_m))
    P = T * K
    assert pairs.dtype == torch.int32 and expert_of_tile.dtype == torch.int32
    assert pairs.numel() == expert_of_tile.numel() * block_m
    real = pairs[pairs < P].tolist()
    assert sorted(real) == list(range(P))  # every pair once, no other id than the pad P
    assert set(pairs[pairs >= P].tolist()) <= {P}
    flat = ids.reshape(-1)
    for tile, e in enumerate(expert_of_tile.tolist()):
        chunk = pairs[tile * block_m:(tile + 1) * block_m]
        chunk = chunk[chunk < P]
        if e < 0:
            assert chunk.numel() == 0
            continue
        assert (flat[chunk.long()] == e).all()  # one expert per tile
        assert chunk.tolist() == sorted(chunk.tolist())  # in pair (token) order
    used = expert_of_tile[expert_of_tile >= 0].tolist()
    assert used == sorted(used) and set(used) == set(flat.tolist())


#: (tokens, hidden, width, experts, top-k) named by the tile height ``moe_block_m`` picks for them
SHAPES = {"bm16-one-token": (1, 64, 32, 4, 2), "bm16": (37, 96, 80, 8, 3), "bm16-128-experts": (24, 64, 48, 128, 8),
          "bm32": (64, 80, 48, 6, 2), "bm64": (100, 96, 40, 4, 2)}


@DTYPES
@pytest.mark.parametrize("name", list(SHAPES))
def test_triton_matches_torch_path_and_float64(dtype, name):
    T, H, I, E, K = SHAPES[name]
    assert moe_block_m(T * K, E) == int(name[2:4]), "the shape's name says its tile height"
    x, wgu, wd, w, ids, (x64, wgu64, wd64) = case(T, H, I, E, K, dtype, seed=T)
    ref = moe.fused_moe_torch(x64, wgu64, wd64, w, ids)
    got = fused_moe_fwd(x, wgu, wd, w, ids)
    torch_path = moe.fused_moe_torch(x, wgu, wd, w, ids)
    assert got.shape == (T, H) and got.dtype == dtype
    err = (got.double() - ref).abs().max().item()
    base = (torch_path.double() - ref).abs().max().item()
    assert err <= 2 * base + ERR_FLOOR[dtype], (err, base)
    if dtype == torch.float32:
        assert err < 1e-5


def test_several_tiles_of_one_expert():
    x, wgu, wd, w, ids, (x64, wgu64, wd64) = case(70, 64, 32, 4, 2, torch.float32, skew=True)
    assert moe_block_m(140, 4) == 64 and int((ids == 0).sum()) > 64
    torch.testing.assert_close(fused_moe_fwd(x, wgu, wd, w, ids), moe.fused_moe_torch(x, wgu, wd, w, ids).float(),
                               rtol=0, atol=1e-5)


def test_a_tokens_result_does_not_depend_on_the_other_tokens():
    """Each output row is its own tile row's products (no atomics, no cross-row sums): a token gives
    the same bits alone, in a batch, and with the batch reordered."""
    x, wgu, wd, w, ids, _ = case(29, 64, 48, 8, 2, torch.bfloat16, seed=5)
    full = fused_moe_fwd(x, wgu, wd, w, ids)
    for t in (0, 13, 28):
        alone = fused_moe_fwd(x[t:t + 1], wgu, wd, w[t:t + 1], ids[t:t + 1])
        assert torch.equal(alone[0], full[t])
    perm = torch.randperm(29, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    assert torch.equal(fused_moe_fwd(x[perm], wgu, wd, w[perm], ids[perm]), full[perm])


def test_no_tokens():
    x, wgu, wd, w, ids, _ = case(3, 64, 32, 4, 2, torch.float32)
    assert fused_moe_fwd(x[:0], wgu, wd, w[:0], ids[:0]).shape == (0, 64)


def test_self_check_cases_cover_every_tile_height():
    """The kernels choose 16-, 32- or 64-row tiles (64: prefill and batched decode, the only wgmma
    variant): the self-check runs each, with an expert over two tiles and rows past 16 and 32 filled."""
    heights = {}
    for n, (T, H, I, E, K) in enumerate(moe.CHECK_CASES):
        (_, _, _), _, ids = moe._case("cpu", torch.float32, T, H, I, E, K, seed=n)
        bm = moe_block_m(T * K, E)
        counts = torch.bincount(ids.reshape(-1), minlength=E)
        heights[bm] = max(heights.get(bm, 0), int(counts.max()))
        assert counts[0] > bm and counts[-1] == 0, (n, bm, counts.tolist())
        if bm > 16:  # besides expert 0, tiles whose rows past the half are filled
            assert ((counts[1:] % bm > bm // 2) | (counts[1:] > bm)).any(), (n, bm, counts.tolist())
    assert set(heights) == {16, 32, 64}, heights


def _rows_past_16_lost(x, wgu, wd, w, ids):
    """A kernel that drops tile rows past 16 (the pairs an expert holds past the first 16 of each
    tile): those tokens' outputs are whatever the buffers held (NaN here). Same as the right kernel at
    16-row tiles."""
    out = moe.fused_moe_torch(x, wgu, wd, w, ids)
    bm = moe_block_m(ids.numel(), wgu.shape[0])
    flat = ids.reshape(-1)
    rank = torch.empty_like(flat)  # a pair's place among its expert's pairs, in pair order
    for e in flat.unique():
        where = (flat == e).nonzero().flatten()
        rank[where] = torch.arange(where.numel(), device=flat.device)
    lost = (rank % bm >= 16).view(ids.shape).any(1)
    return out.masked_fill(lost[:, None], float("nan"))


@DTYPES
def test_self_check_passes_the_kernels_and_fails_wrong_ones(dtype):
    res = moe.check_fused_moe(moe.fused_moe_triton, DEVICE, dtype)
    print(dtype, res)
    assert res.ok, res

    def scaled(x, wgu, wd, w, ids):  # a 1% error in every output
        return moe.fused_moe_torch(x, wgu, wd, w, ids) * 1.01

    def unweighted(x, wgu, wd, w, ids):  # the routing weights ignored
        return moe.fused_moe_torch(x, wgu, wd, torch.ones_like(w) / w.shape[1], ids)

    def swapped(x, wgu, wd, w, ids):  # gate and up rows exchanged
        I = wd.shape[2]
        return moe.fused_moe_torch(x, torch.cat([wgu[:, I:], wgu[:, :I]], 1), wd, w, ids)

    for wrong in (scaled, unweighted, swapped):
        res = moe.check_fused_moe(wrong, DEVICE, dtype)
        assert not res.ok and "max error" in res.detail, (wrong.__name__, res)
    res = moe.check_fused_moe(_rows_past_16_lost, DEVICE, dtype)  # right at 16 rows: the 32-row case fails it
    assert not res.ok and res.detail.startswith("case 2") and "non-finite" in res.detail, res

    def raises(*args):
        raise RuntimeError("boom")
    assert moe.check_fused_moe(raises, DEVICE, dtype).detail == "RuntimeError: boom"


def test_backend_choice(monkeypatch):
    monkeypatch.setenv("SIMSD_TRUST_BACKENDS", "1")  # the self-check would call the kernels too
    monkeypatch.setattr(moe, "_RESOLVED", {})
    calls = []
    monkeypatch.setattr(moe, "fused_moe_triton", lambda *a: calls.append("triton") or moe.fused_moe_torch(*a))
    x, wgu, wd, w, ids, _ = case(5, 64, 32, 4, 2, torch.float32)
    cpu = [t.cpu() for t in (x, wgu, wd, w, ids)]
    moe.fused_moe(*cpu)  # auto on the CPU: torch (the interpreter is never automatic)
    assert calls == []
    moe.fused_moe(x, wgu, wd, w, ids, backend="triton")  # explicit: compiled on a GPU, the interpreter on the CPU
    assert calls == ["triton"]
    if DEVICE == "cuda":  # auto on a CUDA device (its check trusted here): triton
        moe.fused_moe(x, wgu, wd, w, ids)
        assert calls == ["triton", "triton"]
    with pytest.raises(ValueError, match="backend must be one of"):
        moe.fused_moe(x, wgu, wd, w, ids, backend="cuda")


def test_auto_trusts_triton_on_cuda_only_after_its_check(monkeypatch):
    """``auto`` on a CUDA device: triton once the check passed; a failed check warns once and
    falls back to torch; an explicit ``triton`` then raises (checked without a GPU: availability and
    the verdict are replaced)."""
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(moe, "triton_availability", lambda device: (True, ""))
    monkeypatch.setattr(moe, "_VERDICTS", {})
    monkeypatch.setattr(moe, "_WARNED", set())
    monkeypatch.setattr(moe, "_RESOLVED", {})
    checked = []

    def verdict(ok):
        def check(run, device, dtype):
            checked.append((device, dtype))
            return CheckResult(ok, 0.5, 0.1, "case 0: max error 0.5 (tol 0.1)")
        return check

    monkeypatch.setattr(moe, "check_fused_moe", verdict(True))
    assert moe.resolve_moe_backend("auto", cuda, torch.bfloat16) == "triton"
    assert moe.resolve_moe_backend("auto", cuda, torch.bfloat16) == "triton"
    assert checked == [(cuda, torch.bfloat16)]  # once per device and dtype
    monkeypatch.setattr(moe, "check_fused_moe", verdict(False))
    moe._RESOLVED.clear()  # the cached choices (a lookup per call) hold the passed verdict
    with pytest.warns(BackendCheckWarning, match="max error 0.5"):
        assert moe.resolve_moe_backend("auto", cuda, torch.float16) == "torch"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert moe.resolve_moe_backend("auto", cuda, torch.float16) == "torch"  # warned once
    with pytest.raises(BackendCheckError, match="failed its self-check"):
        moe.resolve_moe_backend("triton", cuda, torch.float16)
    monkeypatch.setenv("SIMSD_TRUST_BACKENDS", "1")
    assert moe.resolve_moe_backend("auto", cuda, torch.float16) == "triton"
    monkeypatch.setattr(moe, "triton_availability", lambda device: (False, "no triton"))
    moe._RESOLVED.clear()
    with pytest.raises(ValueError, match="cannot run on cuda:0: no triton"):
        moe.resolve_moe_backend("triton", cuda, torch.float16)


def test_moe_block_with_the_triton_backend():
    from simsd.models.config import ModelConfig
    from simsd.models.moe import SparseMoeBlock
    from simsd.testing import config_dict, moe_config_dict, random_state_dict
    cfg = moe_config_dict(config_dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, mask_token_id=96))
    pre = "model.layers.0.mlp."
    block = SparseMoeBlock(ModelConfig.from_dict(cfg))
    block.load_state_dict({k[len(pre):]: v for k, v in random_state_dict(cfg).items() if k.startswith(pre)})
    block.to(DEVICE)
    x = torch.randn(2, 9, 64, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    with torch.no_grad():
        block.backend = "torch"
        want = block(x)
        block.backend = "triton"
        got = block(x)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
