"""The split plan of both backends (:mod:`simsd_kernels.split_plan`), on the CPU.

The verify-shape table is the memory-bound part of issue 16's goal (SDAR-8B: 32 q / 8 kv heads,
SDAR-1.7B: 16 / 8, head_dim 128, bf16, an H100/H200 with 132 SMs): the SimSD query layouts with
``Lq * G <= 64`` (denoise / paper / exact at block length 4, denoise / paper at block length 8)
at batch 1 with a cache of 16k-32k and at batch >= 8 with a cache of 4k-32k. On each, with each
backend's residency, the plan must reach a wave efficiency >= 0.85 while its partial results
cost <= 10% of the K/V bytes.
"""
from __future__ import annotations

import itertools

import pytest

from simsd_kernels.split_plan import (
    BLOCK_N,
    CUDA_FIGURES,
    INVARIANT_BLOCK_M,
    MAX_PARTIAL_TRAFFIC,
    MIN_TILES,
    TARGET_WAVE_EFFICIENCY,
    TRITON_FIGURES,
    DeviceLimits,
    active_splits,
    ctas_per_sm,
    fixed_plan,
    min_tiles_for,
    partial_bytes_per_split,
    partial_traffic,
    plan_attention,
    residency,
    split_ranges,
    wave_efficiency,
)

H200 = DeviceLimits()
MODELS = {"8b": (32, 8), "1.7b": (16, 8)}
LAYOUTS = {"denoise4": 4, "paper4": 8, "exact4": 16, "denoise8": 8, "paper8": 16}  # Lq of each layout
REGIME = [(1, 16384), (1, 32768), (8, 4096), (8, 8192), (8, 16384), (8, 32768), (16, 4096), (16, 32768),
          (64, 4096)]
VERIFY_SHAPES = [(m, lay, b, L) for m in MODELS for lay in LAYOUTS for b, L in REGIME]
FIGURES = {"cuda": CUDA_FIGURES, "triton": TRITON_FIGURES}


def _plan(backend, model, q_len, batch, capacity, invariant=False, limits=H200):
    hq, hkv = MODELS[model]
    return plan_attention(batch=batch, q_len=q_len, num_q_heads=hq, num_kv_heads=hkv, head_dim=128,
                          cache_capacity=capacity, num_sms=limits.num_sms,
                          ctas_per_sm=residency(FIGURES[backend], 128, limits), invariant=invariant)


@pytest.mark.parametrize("backend", sorted(FIGURES))
def test_verify_shapes_reach_the_wave_target_within_the_traffic_budget(backend):
    bad = []
    for model, layout, batch, capacity in VERIFY_SHAPES:
        q_len = LAYOUTS[layout]
        p = _plan(backend, model, q_len, batch, capacity)
        hq, hkv = MODELS[model]
        rows = q_len * hq // hkv
        # recompute the claims from the plan itself
        ctas = -(-rows // p.block_m) * batch * hkv * p.num_splits
        slots = H200.num_sms * residency(FIGURES[backend], 128)[p.block_m]
        eff = wave_efficiency(ctas, slots)
        kv_tiles = -(-capacity // BLOCK_N) + -(-q_len // BLOCK_N)
        traffic = partial_traffic(p.num_splits, rows, 128, kv_tiles, 2)
        assert (ctas, eff) == (p.ctas, p.wave_efficiency)
        if eff < TARGET_WAVE_EFFICIENCY or traffic > MAX_PARTIAL_TRAFFIC:
            bad.append((model, layout, batch, capacity, p.block_m, p.num_splits, round(eff, 3), round(traffic, 3)))
    assert not bad, bad


def test_wave_efficiency_and_traffic_definitions():
    assert wave_efficiency(264, 264) == 1.0
    assert wave_efficiency(320, 264) == pytest.approx(320 / 528)  # 1.21 waves: 61%
    assert wave_efficiency(132, 264) == 0.5
    # the example: 32 splits of a 4k cache, paper layout of SDAR-8B (Lq*G = 32): ~50% extra
    assert partial_traffic(32, 32, 128, 64, 2) == pytest.approx(0.5, rel=0.02)
    assert partial_traffic(1, 32, 128, 64, 2) == 0.0
    mt = min_tiles_for(64, 128, 2)
    assert partial_traffic(1, 64, 128, 1, 2) == 0.0
    assert partial_bytes_per_split(64, 128) <= MAX_PARTIAL_TRAFFIC * mt * 2 * BLOCK_N * 128 * 2 \
        < partial_bytes_per_split(64, 128) * mt / (mt - 1)


def test_residency_rule():
    # 255 registers x 128 threads: two CTAs; 128 KiB of shared memory: one; 48 KiB: four
    assert ctas_per_sm(255, 128, 1024) == 2
    assert ctas_per_sm(128, 128, 131200) == 1
    assert ctas_per_sm(64, 128, 49152) == 4
    assert ctas_per_sm(32, 1024, 0) == 2  # threads bound
    assert residency(CUDA_FIGURES, 128) == {16: 1, 32: 1, 64: 2}
    assert all(v >= 1 for f in FIGURES.values() for d in (64, 128) for v in residency(f, d).values())


@pytest.mark.parametrize("capacity", [4096, 32768])
@pytest.mark.parametrize("q_len", [4, 16])
def test_every_row_length_keeps_partials_within_budget(capacity, q_len):
    """The grid is fixed by capacity; each row cuts its own length so that no active split holds
    fewer than min_tiles tiles: a 4k cache in a 32k buffer does not pay 32 splits of partials."""
    p = _plan("cuda", "8b", q_len, 1, capacity)
    rows = q_len * 4
    for length in range(0, capacity + 1, 61):
        active = active_splits(p.num_splits, p.min_tiles, False, length, q_len)
        kv_tiles = -(-length // BLOCK_N) + -(-q_len // BLOCK_N)
        assert partial_traffic(active, rows, 128, kv_tiles, 2) <= MAX_PARTIAL_TRAFFIC + 1e-9, (length, active)


@pytest.mark.parametrize("invariant", [False, True])
@pytest.mark.parametrize("num_splits,min_tiles", [(1, 1), (3, 1), (7, 4), (33, 6), (12, 21)])
def test_split_ranges_cover_every_tile_once_and_balance(num_splits, min_tiles, invariant):
    for length, q_len in itertools.product([0, 1, 63, 64, 65, 640, 4096, 4097, 30000], [1, 4, 64, 65, 200]):
        ranges = split_ranges(num_splits, min_tiles, invariant, length, q_len)
        active = active_splits(num_splits, min_tiles, invariant, length, q_len)
        assert len(ranges) == num_splits and 1 <= active <= num_splits
        ct, nt = -(-length // BLOCK_N), -(-q_len // BLOCK_N)
        cache = [t for (lo, hi), _ in ranges for t in range(lo, hi)]
        new = [t for _, (lo, hi) in ranges for t in range(lo, hi)]
        assert cache == list(range(ct)) and new == list(range(nt)), (length, q_len)
        assert all(r == ((0, 0), (0, 0)) for r in ranges[active:])  # surplus splits: nothing
        sizes = [c[1] - c[0] + (0 if invariant else n[1] - n[0]) for c, n in ranges[:active]]
        assert max(sizes) - min(sizes) <= 1  # balanced to one tile
        if active > 1:
            assert min(sizes) >= min_tiles
        if invariant:  # new tokens in the last active split only
            assert all(n == (0, 0) for _, n in ranges[:active - 1])


def test_new_tokens_are_spread_not_appended_to_the_last_split():
    """Speed mode: the last split does no more work than the others (the new tokens share it)."""
    ranges = split_ranges(8, 1, False, 4096, 64 * 6)  # 64 cache tiles + 6 new tiles over 8 splits
    work = [(c[1] - c[0]) + (n[1] - n[0]) for c, n in ranges]
    assert max(work) - min(work) <= 1 and sum(n[1] - n[0] for _, n in ranges) == 6
    assert sum(1 for _, n in ranges if n[1] > n[0]) >= 1


@pytest.mark.parametrize("backend", sorted(FIGURES))
def test_invariant_plan_ignores_lq_and_batch(backend):
    """Shape-invariant numerics (exact verification): for one cache capacity, a denoise forward
    (Lq = 4) and an exact-mode verify forward (Lq = 80, batch 3) get the same tile, split count,
    least tiles, and -- for every row length -- the same cache split boundaries."""
    for capacity in (512, 4096, 32768):
        plans = {(b, lq): _plan(backend, "8b", lq, b, capacity, invariant=True)
                 for b in (1, 3, 16) for lq in (4, 16, 80)}
        keys = {(p.block_m, p.num_splits, p.min_tiles, p.invariant) for p in plans.values()}
        assert len(keys) == 1, keys
        p = plans[(1, 4)]
        assert p.block_m == INVARIANT_BLOCK_M and p.invariant
        for length in (0, 1, 100, 1000, capacity // 2 + 7, capacity):
            short = split_ranges(p.num_splits, p.min_tiles, True, length, 4)
            long = split_ranges(p.num_splits, p.min_tiles, True, length, 80)
            assert [c for c, _ in short] == [c for c, _ in long], (capacity, length)
    # and the speed plan does depend on them (the point of having two modes)
    assert _plan(backend, "8b", 4, 1, 32768).block_m != _plan(backend, "8b", 16, 1, 32768).block_m


def test_fixed_plan_and_errors():
    p = fixed_plan(5, 32)
    assert (p.num_splits, p.block_m, p.min_tiles) == (5, 32, 1)
    with pytest.raises(ValueError, match="num_splits"):
        fixed_plan(0)
    with pytest.raises(ValueError, match="block_m"):
        fixed_plan(2, 48)
    with pytest.raises(ValueError, match="multiple"):
        plan_attention(batch=1, q_len=4, num_q_heads=6, num_kv_heads=4, head_dim=128, cache_capacity=64,
                       num_sms=132, ctas_per_sm={16: 1, 32: 1, 64: 1})
    with pytest.raises(ValueError, match="residency"):
        plan_attention(batch=1, q_len=4, num_q_heads=8, num_kv_heads=2, head_dim=128, cache_capacity=64,
                       num_sms=132, ctas_per_sm={64: 1})
    with pytest.raises(ValueError, match="bad sizes"):
        plan_attention(batch=-1, q_len=4, num_q_heads=8, num_kv_heads=2, head_dim=128, cache_capacity=64,
                       num_sms=132, ctas_per_sm={16: 1, 32: 1, 64: 1})


def test_plan_for_other_devices_and_short_caches():
    """Fewer SMs or a tiny cache: still a valid plan (at least one split, each active split with
    at least MIN_TILES tiles unless there is only one)."""
    small = DeviceLimits(num_sms=16)
    for capacity in (0, 64, 300, 5000):
        p = _plan("cuda", "1.7b", 8, 2, capacity, limits=small)
        assert p.num_splits >= 1 and p.min_tiles >= MIN_TILES
        assert p.num_splits == 1 or p.num_splits * p.min_tiles <= -(-capacity // BLOCK_N) + 1
