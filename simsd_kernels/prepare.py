"""``prepare_attention``: one forward's inputs validated, the backend resolved, its door opened.

The door itself, :class:`~simsd_kernels.metadata.AttentionMetadata` and the backends' subclasses,
is :mod:`simsd_kernels.metadata` (which imports no backend, so the backends can build on it).
"""
from __future__ import annotations

import torch

from .backends import OpConfig, resolve_backend
from .mask_rule import parse_mask_mode
from .metadata import _FLOAT_DTYPES, AttentionMetadata, open_door, validate_forward_inputs


def prepare_attention(cache_seqlens, labels, positions, *, num_heads: int, num_kv_heads: int, head_dim: int,
                      dtype: torch.dtype, cache_capacity: int, mask_mode, rope_theta: float,
                      softmax_scale: float | None = None, backend: str = "auto",
                      shape_invariant: bool = False) -> AttentionMetadata:
    """Validate one forward's inputs, resolve the backend and let it plan the forward.

    Args:
        cache_seqlens: ``(B,)`` int32, row ``b`` holds ``[0, cache_seqlens[b])`` (on the device).
        labels: ``(B, Lq, 3)`` int32 ``(kind, tau, grp)`` of the new tokens
            (:mod:`simsd_kernels.mask_rule`).
        positions: ``(B, Lq)`` int64 RoPE positions of the new tokens.
        num_heads, num_kv_heads, head_dim, dtype: the q / kv heads (GQA), their size (even) and
            the float dtype of q, k, v and the caches.
        cache_capacity: ``Lmax``, the caches' second dim.
        mask_mode: ``bidirectional | block_causal | exact | paper`` (or the :class:`MaskMode`).
        rope_theta, softmax_scale: RoPE base; scale (default ``head_dim ** -0.5``).
        backend: ``auto | cuda | triton | torch`` (or a registered name), resolved here for the
            configuration (dtype, head_dim, GQA group, mask mode), self-check included.
        shape_invariant: the fused backends' split plan that never depends on Lq or B
            (:mod:`simsd_kernels.split_plan`); the torch backend is invariant by construction.

    Raises:
        ValueError: an input that does not fit (named), an unknown mask mode, a GQA ratio that
            does not divide, an odd head_dim, a backend that cannot run the configuration
            (:class:`~simsd_kernels.backends.BackendCheckError` for a failed self-check).
    """
    mode = parse_mask_mode(mask_mode)
    validate_forward_inputs(cache_seqlens, labels, positions)
    if dtype not in _FLOAT_DTYPES:
        raise ValueError(f"dtype must be one of {_FLOAT_DTYPES}, got {dtype}")
    if num_kv_heads <= 0 or num_heads % num_kv_heads:
        raise ValueError(f"GQA: Hq={num_heads} must be a multiple of Hkv={num_kv_heads}")
    if head_dim <= 0 or head_dim % 2:
        raise ValueError(f"head_dim must be even for rotate-half RoPE, got {head_dim}")
    scale = head_dim ** -0.5 if softmax_scale is None else float(softmax_scale)
    if torch.compiler.is_compiling():  # resolved inside the custom op when it runs
        impl = backend
    else:
        config = OpConfig("attention", dtype, head_dim, num_heads // num_kv_heads, int(mode))
        impl = resolve_backend(backend, labels.device, config)
    return open_door(impl, cache_seqlens, labels, positions, mode, float(rope_theta), scale, bool(shape_invariant),
                     num_heads, num_kv_heads, head_dim, dtype, int(cache_capacity))
