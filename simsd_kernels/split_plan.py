"""One split-KV plan for both attention backends (CUDA and Triton); pure Python (torch only to
read the device's properties in :func:`plan_for`).

Vocabulary: B batch rows, Lq new tokens, Hq / Hkv heads, ``G = Hq // Hkv``, D head_dim, Lmax the
cache capacity. A *tile* is ``BLOCK_N = 64`` keys. A *CTA* (a Triton program) owns one m-tile of
``block_m`` packed query rows (the ``Lq * G`` (token, q-head) pairs of one kv head), one batch row
and kv head, and one *split* of the key range; the grid is ``(m_tiles, B * Hkv, num_splits)``.

The plan is a function of shapes only, never of the device-side cache lengths, so a launch can be
captured in a CUDA graph. Each CTA derives its own keys from the real length of its row with
:func:`split_ranges` (mirrored by ``simsd::layout::split_range`` in ``csrc/tile_layout.cuh`` and by
the Triton kernel): surplus splits of a short row do nothing and the merge reads only the row's
active splits; a row with a single active split writes its output directly.

Choice (FlashAttention / FlashInfer style): for each candidate query tile (the natural one for
``Lq * G`` rows and the next smaller one) and each split count ``s``, the *wave efficiency* of the
grid ``n = m_tiles * B * Hkv * s`` on ``slots = SMs * CTAs/SM`` is ``w / ceil(w)`` with
``w = n / slots``; the partial results (fp32 O written and read back by the merge, plus the
log-sum-exp) must stay within :data:`MAX_PARTIAL_TRAFFIC` of the K/V bytes read, which sets the
least number of tiles per split. The plan estimates each option's time (:func:`estimated_time`)
and, among the options within :data:`TIME_SLACK` of the best, takes the largest tile and then the
smallest split count.

``invariant=True`` (shape-invariant numerics, for exact verification): the query tile is fixed at
:data:`INVARIANT_BLOCK_M` (the per-row reduction never depends on how many rows share a CTA), and
``num_splits`` / ``min_tiles`` depend only on the cache capacity, the head configuration, D, the
dtype width and the device -- never on Lq or B; the cache part is cut from the row's own length,
the new tokens go to the row's last active split, and the merge adds the splits in index order. So a
query token's result does not depend on the other tokens of the forward as far as the plan goes.
One thing the plan cannot fix: where the token's visible *new* keys sit inside a 64-key tile
(per-thread partial sums run over fixed columns); two forwards agree bit for bit when those keys
have the same tile offsets in both (e.g. a copy's block at the same offset modulo 64).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Mapping

BLOCK_N = 64
BLOCK_MS = (16, 32, 64)
#: an active split gets at least this many tiles (a CTA has fixed costs: Q load, pipeline fill)
MIN_TILES = 4
MAX_SPLITS = 128
#: the least wave efficiency the plan aims for (the verify-shape table test asserts it)
TARGET_WAVE_EFFICIENCY = 0.85
#: partial results (fp32 O written + read, lse) at most this fraction of the K/V bytes read
MAX_PARTIAL_TRAFFIC = 0.10
#: L2-to-SM over DRAM bandwidth (estimate): up to this many CTAs may share a K/V tile for free
L2_OVER_DRAM = 2.5
#: plans within this fraction of the best estimated time count as equal (larger tile, fewer splits win)
TIME_SLACK = 0.03
INVARIANT_BLOCK_M = 64
#: the invariant plan is sized for one batch row of this many new tokens (a 4x4 exact-mode verify)
INVARIANT_Q_LEN = 16


@dataclass(frozen=True)
class SplitPlan:
    """Launch plan of one attention call.

    ``block_m`` query rows per CTA; ``num_splits`` CTAs along the keys (grid z); ``min_tiles`` the
    least tiles an active split gets; ``invariant`` the shape-invariant rule (see the module doc).
    ``m_tiles, ctas, slots, wave_efficiency, partial_traffic``: what the plan expects at full
    capacity (every row at Lmax), for reports and tests.
    """
    block_m: int
    num_splits: int
    min_tiles: int
    invariant: bool = False
    m_tiles: int = 0
    ctas: int = 0
    slots: int = 0
    wave_efficiency: float = 0.0
    partial_traffic: float = 0.0


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def wave_efficiency(ctas: int, slots: int) -> float:
    """``w / ceil(w)`` with ``w = ctas / slots`` waves (1.0 = the last wave is full)."""
    if ctas <= 0 or slots <= 0:
        return 0.0
    waves = ctas / slots
    return waves / math.ceil(waves)


def natural_block_m(rows: int) -> int:
    """The smallest query tile in :data:`BLOCK_MS` that holds ``rows`` (64 beyond)."""
    for bm in BLOCK_MS:
        if rows <= bm:
            return bm
    return BLOCK_MS[-1]


def partial_bytes_per_split(rows_per_kv_head: int, head_dim: int) -> int:
    """Bytes of one split's partial result per kv head: fp32 O written and read, lse likewise."""
    return rows_per_kv_head * (head_dim * 4 + 4) * 2


def kv_bytes_per_tile(head_dim: int, elt_bytes: int) -> int:
    """K and V bytes of one tile of one kv head."""
    return 2 * BLOCK_N * head_dim * elt_bytes


def min_tiles_for(rows_per_kv_head: int, head_dim: int, elt_bytes: int,
                  max_traffic: float = MAX_PARTIAL_TRAFFIC) -> int:
    """Least tiles per active split so that partials stay within ``max_traffic`` of K/V bytes."""
    need = cdiv(partial_bytes_per_split(rows_per_kv_head, head_dim),
                int(max_traffic * kv_bytes_per_tile(head_dim, elt_bytes)))
    return max(MIN_TILES, need)


def partial_traffic(num_splits: int, rows_per_kv_head: int, head_dim: int, kv_tiles: int,
                    elt_bytes: int) -> float:
    """Partial bytes over K/V bytes for one (batch row, kv head) read as ``num_splits`` splits of
    ``kv_tiles`` tiles; 0 when a single split writes the output directly."""
    if num_splits <= 1 or kv_tiles <= 0:
        return 0.0
    return (num_splits * partial_bytes_per_split(rows_per_kv_head, head_dim)
            / (kv_tiles * kv_bytes_per_tile(head_dim, elt_bytes)))


def _check_shape(batch, q_len, num_q_heads, num_kv_heads, head_dim, cache_capacity, num_sms):
    if min(batch, q_len, cache_capacity) < 0 or num_kv_heads <= 0 or head_dim <= 0 or num_sms <= 0:
        raise ValueError(f"split plan: bad sizes batch={batch} q_len={q_len} heads={num_q_heads}/"
                         f"{num_kv_heads} head_dim={head_dim} cache_capacity={cache_capacity} sms={num_sms}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"split plan: num_q_heads={num_q_heads} is not a multiple of num_kv_heads={num_kv_heads}")


def plan_attention(*, batch: int, q_len: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
                   cache_capacity: int, num_sms: int, ctas_per_sm: Mapping[int, int], elt_bytes: int = 2,
                   invariant: bool = False) -> SplitPlan:
    """The launch plan of one call; pure function of its arguments (cached).

    ``ctas_per_sm`` maps each query tile (16/32/64) to the CTAs one SM holds (the backend's
    residency on the device: registers, shared memory). ``elt_bytes`` is the K/V element size.
    With ``invariant`` the result does not depend on ``batch`` or ``q_len``.

    Raises:
        ValueError: negative sizes, a GQA ratio that does not divide, a missing tile residency.
    """
    _check_shape(batch, q_len, num_q_heads, num_kv_heads, head_dim, cache_capacity, num_sms)
    res = tuple(sorted((int(k), int(v)) for k, v in ctas_per_sm.items()))
    if invariant:  # sized for one row of INVARIANT_Q_LEN tokens, whatever the call holds
        batch, q_len = 1, INVARIANT_Q_LEN
    return _plan(batch, q_len, num_q_heads // num_kv_heads, num_kv_heads, head_dim, cache_capacity, num_sms,
                 res, elt_bytes, invariant)


@functools.lru_cache(maxsize=4096)
def _plan(batch, q_len, group, num_kv_heads, head_dim, capacity, num_sms, res, elt_bytes, invariant):
    residency = dict(res)
    rows = q_len * group
    nat = INVARIANT_BLOCK_M if invariant else natural_block_m(rows)
    cands = [nat] if invariant or nat == BLOCK_MS[0] else [nat, nat // 2]
    cache_tiles = cdiv(capacity, BLOCK_N)
    work = cache_tiles + (0 if invariant else cdiv(q_len, BLOCK_N))
    min_tiles = min_tiles_for(rows, head_dim, elt_bytes)
    max_splits = max(1, min(MAX_SPLITS, work // min_tiles))
    options = []
    for bm in cands:
        if bm not in residency or residency[bm] < 1:
            raise ValueError(f"split plan: no residency (CTAs per SM) given for block_m={bm}")
        m_tiles = max(1, cdiv(rows, bm))
        slots = num_sms * residency[bm]
        for s in range(1, max_splits + 1):
            ctas = m_tiles * max(batch, 1) * num_kv_heads * s
            eff = wave_efficiency(ctas, slots)
            traffic = partial_traffic(s, rows, head_dim, work, elt_bytes)
            options.append((estimated_time(eff, traffic, m_tiles),
                            SplitPlan(bm, s, min_tiles, invariant, m_tiles, ctas, slots, eff, traffic)))
    best = min(t for t, _ in options)
    near = [p for t, p in options if t <= best * (1.0 + TIME_SLACK)]
    return min(near, key=lambda p: (-p.block_m, p.num_splits))


def estimated_time(eff: float, traffic: float, m_tiles: int) -> float:
    """Time of a memory-bound launch relative to reading the K/V once at full bandwidth.

    DRAM moves the K/V bytes once plus the partials (``traffic``); L2 serves each K/V tile to the
    ``m_tiles`` CTAs of a kv head (:data:`L2_OVER_DRAM` times the DRAM bandwidth, an estimate for
    H100/H200); the wave efficiency stretches whichever bound holds.
    """
    if eff <= 0:
        return math.inf
    return max(1.0 + traffic, m_tiles / L2_OVER_DRAM) / eff


def fixed_plan(num_splits: int, block_m: int = 64, invariant: bool = False) -> SplitPlan:
    """An explicit split count (tests, benchmarks): every split active down to one tile each."""
    if not 1 <= num_splits <= 65535 or block_m not in BLOCK_MS:
        raise ValueError(f"fixed split plan: num_splits must be in [1, 65535] and block_m in {BLOCK_MS}, "
                         f"got {num_splits}, {block_m}")
    return SplitPlan(block_m, num_splits, 1, invariant)


def active_splits(num_splits: int, min_tiles: int, invariant: bool, cache_len: int, q_len: int) -> int:
    """Splits that get work for one row (the device rule; ``simsd::split_active``)."""
    work = cdiv(max(cache_len, 0), BLOCK_N) + (0 if invariant else cdiv(q_len, BLOCK_N))
    return max(1, min(num_splits, work // max(min_tiles, 1)))


def split_ranges(num_splits: int, min_tiles: int, invariant: bool, cache_len: int, q_len: int):
    """Per split ``((cache_lo, cache_hi), (new_lo, new_hi))`` tile ranges of one row.

    The device rule (``simsd::split_range`` in ``csrc/tile_layout.cuh``, ``_split_range`` in
    ``triton_ops/attention.py``): ``work`` tiles (the cache's, plus the new tokens' unless
    ``invariant``) are cut evenly over ``active_splits`` splits, split ``z`` taking
    ``[z * work // active, (z + 1) * work // active)``; new tiles follow the cache tiles in that
    order (spread over the last splits). ``invariant``: only the cache is cut, and every new tile
    goes to the last active split. Splits ``>= active`` get empty ranges.
    """
    ct = cdiv(max(cache_len, 0), BLOCK_N)
    nt = cdiv(max(q_len, 0), BLOCK_N)
    active = active_splits(num_splits, min_tiles, invariant, cache_len, q_len)
    work = ct + (0 if invariant else nt)
    out = []
    for z in range(num_splits):
        if z >= active:
            out.append(((0, 0), (0, 0)))
            continue
        lo, hi = z * work // active, (z + 1) * work // active
        if invariant:
            out.append(((lo, hi), (0, nt) if z == active - 1 else (0, 0)))
        else:
            out.append(((min(lo, ct), min(hi, ct)), (max(lo, ct) - ct, max(hi, ct) - ct)))
    return out


@dataclass(frozen=True)
class DeviceLimits:
    """Per-SM limits that bound residency (defaults: H100 / H200, sm_90)."""
    num_sms: int = 132
    regs_per_sm: int = 65536
    smem_per_sm: int = 233472          # 228 KiB
    smem_reserved_per_cta: int = 1024  # the driver's per-CTA reservation (sm_80+)
    max_threads_per_sm: int = 2048
    max_ctas_per_sm: int = 32


def ctas_per_sm(regs_per_thread: int, threads: int, smem_bytes: int, limits: DeviceLimits = DeviceLimits()) -> int:
    """CTAs one SM holds (the occupancy calculator's rule): registers are allocated per warp in
    units of 256 within four SM sub-partitions, shared memory per CTA plus the reservation."""
    warps = cdiv(threads, 32)
    regs_per_warp = cdiv(max(regs_per_thread, 1) * 32, 256) * 256
    warps_by_regs = 4 * ((limits.regs_per_sm // 4) // regs_per_warp)
    by_regs = warps_by_regs // warps
    by_smem = limits.smem_per_sm // (smem_bytes + limits.smem_reserved_per_cta)
    by_threads = limits.max_threads_per_sm // threads
    return max(0, min(by_regs, by_smem, by_threads, limits.max_ctas_per_sm))


@dataclass(frozen=True)
class KernelFigures:
    """Static figures of one compiled kernel config on sm_90: registers per thread, shared memory
    per CTA (dynamic + static, bytes), threads per CTA."""
    regs: int
    smem: int
    threads: int


#: the CUDA tensor-core kernel (csrc/attention_mma.cuh) per (head_dim, block_m), fp16 and bf16 alike:
#: ``ptxas -v`` at sm_90 (nvcc 13.0), checked against every build by .ci/kernel_static_check.py
CUDA_FIGURES = {
    (128, 16): KernelFigures(234, 131200, 128), (128, 32): KernelFigures(234, 131200, 128),
    (128, 64): KernelFigures(246, 98432, 128),
    (64, 16): KernelFigures(140, 65664, 128), (64, 32): KernelFigures(146, 65664, 128),
    (64, 64): KernelFigures(164, 49280, 128),
}

#: the Triton kernel (triton_ops/attention.py, configs triton_ops.ops.TILE_CONFIGS) per
#: (head_dim, block_m), fp16 / bf16: the most registers ``ptxas -v`` reports over the GQA groups
#: compiled for sm_90 (Triton 3.9) and Triton's shared-memory size, checked by
#: tests/kernels/test_sm90_compile.py
TRITON_FIGURES = {
    (128, 16): KernelFigures(205, 137216, 128), (128, 32): KernelFigures(242, 143360, 128),
    (128, 64): KernelFigures(239, 114688, 256),
    (64, 16): KernelFigures(167, 69632, 128), (64, 32): KernelFigures(210, 73728, 128),
    (64, 64): KernelFigures(200, 57344, 256),
}


def residency(figures: Mapping, head_dim: int, limits: DeviceLimits = DeviceLimits()) -> dict:
    """``{block_m: CTAs per SM}`` of a backend's kernel configs for ``head_dim`` on ``limits``."""
    return {bm: ctas_per_sm(f.regs, f.threads, f.smem, limits)
            for (d, bm), f in figures.items() if d == head_dim}


def device_limits(props) -> DeviceLimits:
    """:class:`DeviceLimits` from a ``torch.cuda.get_device_properties`` object (fields missing
    from older torch builds keep their sm_90 defaults)."""
    base = DeviceLimits()
    return DeviceLimits(
        num_sms=int(props.multi_processor_count),
        regs_per_sm=int(getattr(props, "regs_per_multiprocessor", base.regs_per_sm)),
        smem_per_sm=int(getattr(props, "shared_memory_per_multiprocessor", base.smem_per_sm)),
        max_threads_per_sm=int(getattr(props, "max_threads_per_multi_processor", base.max_threads_per_sm)),
    )


@functools.lru_cache(maxsize=None)
def _cuda_limits(index: int) -> DeviceLimits:
    import torch
    return device_limits(torch.cuda.get_device_properties(index))


def limits_for(device) -> DeviceLimits:
    """The SM count and per-SM limits of a CUDA ``device`` (H100/H200 defaults elsewhere, e.g. the
    CPU under the Triton interpreter)."""
    if getattr(device, "type", None) != "cuda":
        return DeviceLimits()
    import torch
    return _cuda_limits(device.index if device.index is not None else torch.cuda.current_device())


def plan_for(q, k, k_cache, *, figures: Mapping, num_splits: int = 0, invariant: bool = False) -> SplitPlan:
    """The plan of one call ``q (B, Lq, Hq, D)``, ``k (B, Lq, Hkv, D)``, ``k_cache (B, Lmax, Hkv, D)``
    for a backend whose kernel configs have ``figures`` (:data:`CUDA_FIGURES`, :data:`TRITON_FIGURES`):
    :func:`plan_for_shape` of their sizes."""
    B, Lq, Hq, D = q.shape
    return plan_for_shape(B, Lq, Hq, k.shape[2], D, k_cache.shape[1], k_cache.element_size(), q.device,
                          figures=figures, num_splits=num_splits, invariant=invariant)


def plan_for_shape(batch: int, q_len: int, num_q_heads: int, num_kv_heads: int, head_dim: int, cache_capacity: int,
                   elt_bytes: int, device, *, figures: Mapping, num_splits: int = 0,
                   invariant: bool = False) -> SplitPlan:
    """The plan of one forward's attention on ``device`` (the attention door plans once per forward).

    ``num_splits`` > 0 forces that many splits (every split active down to one tile; the query
    tile stays the natural one, or :data:`INVARIANT_BLOCK_M` with ``invariant``).
    """
    if num_splits:
        bm = INVARIANT_BLOCK_M if invariant else natural_block_m(q_len * (num_q_heads // num_kv_heads))
        return fixed_plan(int(num_splits), bm, invariant)
    limits = limits_for(device)
    return plan_attention(batch=batch, q_len=q_len, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                          head_dim=head_dim, cache_capacity=cache_capacity, num_sms=limits.num_sms,
                          ctas_per_sm=residency(figures, head_dim, limits), elt_bytes=elt_bytes, invariant=invariant)
