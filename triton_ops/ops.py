"""Host launchers of the simsd Triton kernels (shape logic, block sizes, split-KV choice).

Arguments follow :func:`simsd_kernels.temporal_attention` (already validated there); shapes:
``q (B, Lq, Hq, D)``, ``k, v (B, Lq, Hkv, D)``, ``k_cache, v_cache (B, Lmax, Hkv, D)``,
``cache_seqlens (B,) int32``, ``labels (B, Lq, 3) int32``, ``positions (B, Lq) int64``.
No host synchronisation: cache lengths are read by the kernels, and the split count depends
only on shapes, so a launch can be captured in a CUDA graph. For the same reason
``cache_seqlens[b] <= Lmax`` is not checked (the caller owns it; the attention kernel reads
``cache_seqlens[b]`` keys, ``append_kv`` skips slots beyond ``Lmax``). No autotuning: one
heuristic config (BLOCK_N 64, 4 warps, 2 stages), the same under the interpreter.
"""
from __future__ import annotations

import functools
import math

import torch
import triton

from .append_kv import append_kv_kernel
from .attention import merge_splits_kernel, temporal_attn_fwd_kernel

SUPPORTED_HEAD_DIMS = (64, 128)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: True when ``TRITON_INTERPRET=1`` was set before the kernels were defined
INTERPRETED = type(temporal_attn_fwd_kernel).__name__ == "InterpretedFunction"
#: do not split the cache into pieces shorter than this (keys)
MIN_KEYS_PER_SPLIT = 256
MAX_SPLITS = 64


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _split_f64(x: float):
    """``x`` as an fp32 pair ``(hi, lo)`` with ``hi + lo == x`` to ~48 bits (kernel args are fp32)."""
    hi = float(torch.tensor(x, dtype=torch.float32))
    return hi, float(torch.tensor(x - hi, dtype=torch.float32))


def block_m_for(rows: int) -> int:
    """Tile of packed (token, q-head) rows: the next power of two in [16, 64]."""
    return min(64, max(16, triton.next_power_of_2(max(rows, 1))))


def auto_num_splits(device: torch.device, programs: int, cache_capacity: int) -> int:
    """Split the cache when ``programs`` (m-tiles x B x Hkv) cannot fill the GPU.

    Depends on shapes only (``cache_capacity`` = Lmax, not the device-side lengths).
    """
    if device.type != "cuda":
        return 1
    sms = _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    if programs >= sms:
        return 1
    by_len = max(1, cache_capacity // MIN_KEYS_PER_SPLIT)
    return max(1, min(triton.cdiv(2 * sms, programs), by_len, MAX_SPLITS))


def _check_backend_args(q):
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"triton backend: q dtype must be one of {SUPPORTED_DTYPES}, got {q.dtype}")
    if q.shape[-1] not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"triton backend: head_dim must be one of {SUPPORTED_HEAD_DIMS}, got {q.shape[-1]}")


def temporal_attention_fwd(q, k, v, k_cache, v_cache, cache_seqlens, labels, positions, mask_mode,
                           rope_theta, softmax_scale, *, out=None, num_splits=None, block_n=64):
    """Run the fused kernel; returns ``out (B, Lq, Hq, D)`` in q's dtype.

    ``num_splits`` None picks :func:`auto_num_splits`; ``out`` (optional) is written entirely.

    Raises:
        ValueError: dtype other than fp16/bf16/fp32, head_dim not 64/128, bad ``num_splits``.
    """
    _check_backend_args(q)
    B, Lq, Hq, D = q.shape
    Hkv = k.shape[2]
    group = Hq // Hkv
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if B == 0 or Lq == 0:
        return out
    rows = Lq * group
    block_m = block_m_for(rows)
    m_tiles = triton.cdiv(rows, block_m)
    if num_splits is None:
        num_splits = auto_num_splits(q.device, m_tiles * B * Hkv, k_cache.shape[1])
    if not 1 <= int(num_splits) <= 1024:
        raise ValueError(f"num_splits must be in [1, 1024], got {num_splits}")
    num_splits = int(num_splits)
    total_rows = B * Lq * Hq
    if num_splits > 1:
        o_part = torch.empty((num_splits, total_rows, D), device=q.device, dtype=torch.float32)
        lse_part = torch.empty((num_splits, total_rows), device=q.device, dtype=torch.float32)
    else:  # unused by the kernel (dead branch); any valid pointer will do
        o_part, lse_part = out, out
    fp32 = q.dtype == torch.float32
    grid = (m_tiles, B * Hkv, num_splits)
    temporal_attn_fwd_kernel[grid](
        q, k, v, k_cache, v_cache, cache_seqlens, labels, positions, out, o_part, lse_part,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        labels.stride(0), labels.stride(1), positions.stride(0), positions.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        Lq, Hq, total_rows, *_split_f64(math.log2(rope_theta)), softmax_scale * math.log2(math.e),
        GROUP=group, HEAD_DIM=D, MASK_MODE=int(mask_mode), NUM_SPLITS=num_splits,
        BLOCK_M=block_m, BLOCK_N=block_n, UPCAST=INTERPRETED,
        DOT_PREC="ieee" if (fp32 or INTERPRETED) else "tf32",
        num_warps=4, num_stages=2,
    )
    if num_splits > 1:
        merge_splits_kernel[(total_rows,)](
            o_part, lse_part, out, Lq, Hq, total_rows, out.stride(0), out.stride(1), out.stride(2),
            NUM_SPLITS=num_splits, BLOCK_S=max(2, triton.next_power_of_2(num_splits)), HEAD_DIM=D,
            num_warps=4 if D >= 128 else 2,
        )
    return out


def append_kv_fwd(k, v, positions, k_cache, v_cache, cache_seqlens, rope_theta, num_tokens):
    """Write rotated ``k[:, :num_tokens]`` and ``v[:, :num_tokens]`` at ``cache_seqlens[b] + i``.

    Same contract as :func:`simsd_kernels.reference.append_kv_torch`; slots at or beyond the
    cache capacity are skipped instead of written out of bounds.
    """
    _check_backend_args(k)
    B, _, Hkv, D = k.shape
    if num_tokens == 0 or B == 0:
        return
    block_t = 16
    grid = (B, Hkv, triton.cdiv(num_tokens, block_t))
    append_kv_kernel[grid](
        k, v, positions, k_cache, v_cache, cache_seqlens, num_tokens, k_cache.shape[1],
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        positions.stride(0), positions.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), *_split_f64(math.log2(rope_theta)),
        HEAD_DIM=D, BLOCK_T=block_t, num_warps=2,
    )
