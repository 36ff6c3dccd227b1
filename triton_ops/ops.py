"""Host launchers of the simsd Triton kernels (shape logic, workspaces, launch plan).

Arguments follow :func:`simsd_kernels.temporal_attention` (already validated there); shapes:
``q (B, Lq, Hq, D)``, ``k, v (B, Lq, Hkv, D)``, ``k_cache, v_cache (B, Lmax, Hkv, D)``,
``cache_seqlens (B,) int32``, ``labels (B, Lq, 3) int32``, ``positions (B, Lq) int64``; or the
caches as page pools ``(num_pages, page_size, Hkv, D)`` with ``block_table (B, max_pages) int32``
(``simsd_kernels.paging``; the capacity is then ``max_pages * page_size``). The table is always
given: the ``(B, Lmax, ...)`` caches are read through the one-page-per-row table
``simsd_kernels.paging.identity_table`` (this layer, below ``simsd_kernels``, builds none).
No host synchronisation: cache lengths are read by the kernels, and the launch plan (query tile,
split count, least tiles per split, invariant rule) comes from shapes only -- the caller
(``simsd_kernels.triton_backend``) computes it with ``simsd_kernels.split_plan`` -- so a launch can
be captured in a CUDA graph. ``cache_seqlens[b]`` is clamped to ``[0, Lmax]`` by the kernels.
No autotuning: one config per query tile (:data:`TILE_CONFIGS`), the same under the interpreter.
"""
from __future__ import annotations

import math
import re

import torch
import triton

from .append_kv import append_kv_kernel
from .attention import merge_splits_kernel, rope_qk_kernel, temporal_attn_fwd_kernel
from .fused_moe import moe_combine_kernel, moe_down_kernel, moe_gate_up_kernel

SUPPORTED_HEAD_DIMS = (64, 128)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
BLOCK_N = 64
BLOCK_MS = (16, 32, 64)
#: BLOCK_M -> (num_warps, num_stages), fp16/bf16: a small M streams more K/V per FLOP, so it keeps
#: four tiles in flight (and holds one program per SM at D 128, see
#: simsd_kernels.split_plan.TRITON_FIGURES); 64 rows need 8 warps to stay free of spills on sm_90
TILE_CONFIGS = {16: (4, 5), 32: (4, 5), 64: (8, 3)}
#: fp32 (a test path: ieee dots run on FMA units and are register-bound): 16 rows, 8 warps, 2 stages
FP32_CONFIG = (16, 8, 2)
#: the Triton in use; TILE_CONFIGS are free of register spills at sm_90 from 3.9 on. Before (3.6,
#: the H200 image's, compiled by .ci/triton_compile_check.sh) the D128 kernels spill with 32 rows
#: and 4 warps (16 bytes, GQA group 2) and with 64 rows at every launchable warp count (48-56
#: bytes): there a 32-row tile runs 8 warps and a 64-row tile runs as two 32-row programs
#: (:func:`tile_config`; rows are independent: the same math, the MMA shape may round dot products
#: otherwise, within the tolerance).
TRITON_VERSION = tuple(int(x) for x in re.findall(r"\d+", triton.__version__)[:2])
OLD_TRITON_D128 = TRITON_VERSION < (3, 9)
#: an explicit register cap: without it ptxas stops at 168 registers and spills for some groups
MAXNREG = 255
#: warps of the cache write (append_kv_kernel)
APPEND_WARPS = 4
#: True when ``TRITON_INTERPRET=1`` was set before the kernels were defined
INTERPRETED = type(temporal_attn_fwd_kernel).__name__ == "InterpretedFunction"


def _split_f64(x: float):
    """``x`` as an fp32 pair ``(hi, lo)`` with ``hi + lo == x`` to ~48 bits (kernel args are fp32)."""
    hi = float(torch.tensor(x, dtype=torch.float32))
    return hi, float(torch.tensor(x - hi, dtype=torch.float32))


def block_m_for(rows: int) -> int:
    """Tile of packed (token, q-head) rows: the next power of two in [16, 64]."""
    return min(64, max(16, triton.next_power_of_2(max(rows, 1))))


def tile_config(block_m: int, head_dim: int, fp32: bool) -> tuple:
    """``(block_m, num_warps, num_stages)`` launched for a plan's query tile ``block_m``."""
    if fp32 and not INTERPRETED:  # the row tile changes no result (rows are independent)
        return FP32_CONFIG
    if OLD_TRITON_D128 and head_dim == 128 and block_m >= 32:
        return 32, 8, TILE_CONFIGS[32][1]
    return (block_m, *TILE_CONFIGS[block_m])


def _pages(k_cache, block_table):
    """``(block_table, page_size, capacity)`` of a launch."""
    # a pool of empty pages (capacity 0) is read and written nowhere: any page size >= 1 will do
    return block_table, max(1, k_cache.shape[1]), k_cache.shape[1] * block_table.shape[1]


def _check_backend_args(q):
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"triton backend: q dtype must be one of {SUPPORTED_DTYPES}, got {q.dtype}")
    if q.shape[-1] not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"triton backend: head_dim must be one of {SUPPORTED_HEAD_DIMS}, got {q.shape[-1]}")


def rope_qk_fwd(q, k, positions, rope_theta):
    """``(q_rot, k_rot)``: q and k rotated at ``positions`` (RoPE once per token), contiguous, in
    q's dtype; the same fp32 rotation the attention kernels used to apply on load."""
    B, Lq, Hq, D = q.shape
    Hkv = k.shape[2]
    q_rot = torch.empty((B, Lq, Hq, D), dtype=q.dtype, device=q.device)
    k_rot = torch.empty((B, Lq, Hkv, D), dtype=k.dtype, device=k.device)
    if B * Lq:
        rope_qk_kernel[(B * Lq,)](
            q, k, positions, q_rot, k_rot, q.stride(0), q.stride(1), q.stride(2),
            k.stride(0), k.stride(1), k.stride(2), positions.stride(0), positions.stride(1), Lq, Hq, Hkv,
            *_split_f64(math.log2(rope_theta)), HEAD_DIM=D, BLOCK_H=16, num_warps=4,
        )
    return q_rot, k_rot


def temporal_attention_fwd(q, k, v, k_cache, v_cache, cache_seqlens, labels, positions, mask_mode,
                           rope_theta, softmax_scale, *, out=None, num_splits=1, block_m=None, min_tiles=1,
                           invariant=False, block_table):
    """RoPE (:func:`rope_qk_fwd`) then :func:`attention_rotated_fwd`; returns ``out (B, Lq, Hq, D)``."""
    _check_backend_args(q)
    q_rot, k_rot = rope_qk_fwd(q, k, positions, rope_theta)
    return attention_rotated_fwd(q_rot, k_rot, v, k_cache, v_cache, cache_seqlens, labels, mask_mode, softmax_scale,
                                 out=out, num_splits=num_splits, block_m=block_m, min_tiles=min_tiles,
                                 invariant=invariant, block_table=block_table)


def attention_rotated_fwd(q_rot, k_rot, v, k_cache, v_cache, cache_seqlens, labels, mask_mode, softmax_scale, *,
                          out=None, num_splits=1, block_m=None, min_tiles=1, invariant=False, block_table):
    """Run the fused kernels on already rotated ``q_rot``, ``k_rot`` (contiguous, as
    :func:`rope_qk_fwd` returns them); returns ``out (B, Lq, Hq, D)`` in q's dtype.

    Launch plan (``simsd_kernels.split_plan.SplitPlan`` fields): ``num_splits`` programs along the
    keys (None: 1), ``block_m`` packed query rows per program (default: the natural tile for ``Lq * G``),
    ``min_tiles`` least 64-key tiles per active split, ``invariant`` the shape-invariant split rule.
    ``out`` (optional) is written entirely. ``block_table``: the caches' page table (module doc).

    Raises:
        ValueError: dtype other than fp16/bf16/fp32, head_dim not 64/128, a bad plan.
    """
    _check_backend_args(q_rot)
    B, Lq, Hq, D = q_rot.shape
    Hkv = k_rot.shape[2]
    group = Hq // Hkv
    if out is None:
        out = torch.empty(q_rot.shape, dtype=q_rot.dtype, device=q_rot.device)
    if B == 0 or Lq == 0:
        return out
    rows = Lq * group
    num_splits = 1 if num_splits is None else num_splits
    block_m = block_m_for(rows) if block_m is None else int(block_m)
    if block_m not in BLOCK_MS or not 1 <= int(num_splits) <= 65535 or int(min_tiles) < 1:
        raise ValueError(f"triton backend: block_m must be in {BLOCK_MS}, num_splits in [1, 65535] and "
                         f"min_tiles >= 1, got {block_m}, {num_splits}, {min_tiles}")
    num_splits, min_tiles, invariant = int(num_splits), int(min_tiles), int(bool(invariant))
    total_rows = B * Lq * Hq
    if num_splits > 1:
        o_part = torch.empty((num_splits, total_rows, D), device=q_rot.device, dtype=torch.float32)
        lse_part = torch.empty((num_splits, total_rows), device=q_rot.device, dtype=torch.float32)
    else:  # never written (a single split writes out); any valid pointer will do
        o_part, lse_part = out, out
    fp32 = q_rot.dtype == torch.float32
    block_m, warps, stages = tile_config(block_m, D, fp32)
    block_table, page_size, capacity = _pages(k_cache, block_table)
    grid = (triton.cdiv(rows, block_m), B * Hkv, num_splits)
    temporal_attn_fwd_kernel[grid](
        q_rot, k_rot, v, k_cache, v_cache, cache_seqlens, labels, out, o_part, lse_part, block_table,
        q_rot.stride(0), q_rot.stride(1), q_rot.stride(2), k_rot.stride(0), k_rot.stride(1), k_rot.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_table.stride(0),
        labels.stride(0), labels.stride(1), out.stride(0), out.stride(1), out.stride(2),
        Lq, Hq, capacity, total_rows, softmax_scale * math.log2(math.e), int(mask_mode),
        num_splits, min_tiles, invariant, page_size,
        GROUP=group, HEAD_DIM=D, BLOCK_M=block_m, BLOCK_N=BLOCK_N, UPCAST=INTERPRETED,
        DOT_PREC="ieee" if (fp32 or INTERPRETED) else "tf32", ONE_PAGE=block_table.shape[1] == 1,
        num_warps=warps, num_stages=stages, maxnreg=MAXNREG,
    )
    if num_splits > 1:
        merge_splits_kernel[(total_rows,)](
            o_part, lse_part, out, cache_seqlens, Lq, Hq, capacity, total_rows,
            out.stride(0), out.stride(1), out.stride(2), num_splits, min_tiles, invariant,
            HEAD_DIM=D, BLOCK_N=BLOCK_N, num_warps=4 if D >= 128 else 2,
        )
    return out


def append_kv_fwd(k, v, positions, k_cache, v_cache, cache_seqlens, rope_theta, num_tokens, rotate=True, *,
                  block_table):
    """Write ``k[:, :num_tokens]`` (rotated at ``positions``; as it is without ``rotate``: keys
    that :func:`rope_qk_fwd` rotated) and ``v[:, :num_tokens]`` at ``cache_seqlens[b] + i``.

    Same contract as :func:`simsd_kernels.append_kv`: slots at or beyond the cache capacity are
    skipped instead of written out of bounds; the slot lands in its page of ``block_table``.
    """
    _check_backend_args(k)
    B, _, Hkv, D = k.shape
    if num_tokens == 0 or B == 0:
        return
    block_t = 16
    grid = (B, Hkv, triton.cdiv(num_tokens, block_t))
    # 4 warps: with its page lookup the D128 write spills 24 bytes at sm_90 in 2 (tests/kernels/sm90_compile.py)
    block_table, page_size, capacity = _pages(k_cache, block_table)
    append_kv_kernel[grid](
        k, v, positions, k_cache, v_cache, cache_seqlens, block_table, num_tokens, capacity, page_size,
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        positions.stride(0), positions.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_table.stride(0),
        *_split_f64(math.log2(rope_theta)),
        HEAD_DIM=D, BLOCK_T=block_t, ROTATE=bool(rotate), num_warps=APPEND_WARPS,
    )


#: fused MoE tiles: BLOCK_N channels per program; BLOCK_K of the reduction (fp32: half, register-bound)
MOE_BLOCK_N = 64
MOE_BLOCK_K = {True: 32, False: 64}
#: warps and pipeline stages of the grouped GEMMs (free of spills at sm_90 with MAXNREG: tests/kernels/sm90_compile.py)
MOE_WARPS, MOE_STAGES = 4, 2
MOE_BLOCK_H = 256


def moe_block_m(num_pairs: int, num_experts: int) -> int:
    """Rows of a fused-MoE tile: the next power of two in [16, 64] of the mean pairs per expert."""
    return min(64, max(16, triton.next_power_of_2(max(1, -(-num_pairs // num_experts)))))


def align_by_expert(topk_ids, num_experts: int, block_m: int):
    """The (token, slot) pairs ``p = t * k + j`` sorted by expert into tiles of ``block_m`` pairs of
    one expert (torch ops on the ids' device, no host synchronisation).

    Returns ``(sorted_pairs (tiles * block_m,) int32, expert_of_tile (tiles,) int32)``: an expert's
    pairs in token order, its last tile padded with ``T * k``; tiles past the last expert's are
    ``-1`` (the kernels return at once). ``tiles`` is the bound ``cdiv(P + min(E, P) * (block_m - 1),
    block_m)`` for ``P = T * k`` pairs, known from the shapes alone.
    """
    flat = topk_ids.reshape(-1).to(torch.int64)
    P, dev = flat.numel(), flat.device
    order = torch.argsort(flat, stable=True)
    # not torch.bincount: on CUDA it reads the largest id back to size its output (a host sync)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    first_sorted = torch.cumsum(counts, 0) - counts
    experts = flat[order]
    dest = (ends - padded)[experts] + torch.arange(P, device=dev) - first_sorted[experts]
    tiles = triton.cdiv(P + min(num_experts, P) * (block_m - 1), block_m)
    sorted_pairs = torch.full((tiles * block_m,), P, dtype=torch.int32, device=dev)
    sorted_pairs[dest] = order.to(torch.int32)
    tile_start = torch.arange(tiles, device=dev) * block_m
    expert_of_tile = torch.searchsorted(ends, tile_start, right=True)
    expert_of_tile = torch.where(expert_of_tile < num_experts, expert_of_tile, -1).to(torch.int32)
    return sorted_pairs, expert_of_tile


def fused_moe_fwd(x, w_gate_up, w_down, topk_weights, topk_ids):
    """The experts of :func:`simsd_kernels.moe.fused_moe` (arguments checked there): sort by expert,
    grouped gate/up GEMM with SiLU-and-mul, grouped down GEMM times the routing weight, combine
    (triton_ops.fused_moe). ``(T, H)`` in x's dtype."""
    T, H = x.shape
    E, I = w_down.shape[0], w_down.shape[2]
    K = topk_ids.shape[1]
    out = torch.empty_like(x)
    if T == 0:
        return out
    x, w_gate_up, w_down = x.contiguous(), w_gate_up.contiguous(), w_down.contiguous()
    P = T * K
    block_m = moe_block_m(P, E)
    sorted_pairs, expert_of_tile = align_by_expert(topk_ids, E, block_m)
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    fp32 = x.dtype == torch.float32
    block_k = MOE_BLOCK_K[fp32]
    prec = "ieee" if (fp32 or INTERPRETED) else "tf32"
    act = torch.empty(P, I, dtype=x.dtype, device=x.device)
    y = torch.empty(P, H, dtype=torch.float32, device=x.device)
    tiles = expert_of_tile.shape[0]
    moe_gate_up_kernel[(tiles, triton.cdiv(I, MOE_BLOCK_N))](
        x, w_gate_up, sorted_pairs, expert_of_tile, act, P, K, H, I,
        x.stride(0), w_gate_up.stride(0), w_gate_up.stride(1), act.stride(0),
        BLOCK_M=block_m, BLOCK_N=MOE_BLOCK_N, BLOCK_K=block_k, UPCAST=INTERPRETED, DOT_PREC=prec,
        num_warps=MOE_WARPS, num_stages=MOE_STAGES, maxnreg=MAXNREG)
    moe_down_kernel[(tiles, triton.cdiv(H, MOE_BLOCK_N))](
        act, w_down, sorted_pairs, expert_of_tile, weights, y, P, H, I,
        act.stride(0), w_down.stride(0), w_down.stride(1), y.stride(0),
        BLOCK_M=block_m, BLOCK_N=MOE_BLOCK_N, BLOCK_K=block_k, UPCAST=INTERPRETED, DOT_PREC=prec,
        num_warps=MOE_WARPS, num_stages=MOE_STAGES, maxnreg=MAXNREG)
    moe_combine_kernel[(T, triton.cdiv(H, MOE_BLOCK_H))](
        y, out, H, y.stride(0), out.stride(0), TOP_K=K, BLOCK_H=MOE_BLOCK_H, num_warps=4)
    return out
