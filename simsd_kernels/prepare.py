"""Opening a door: one forward's (or one cache write's) inputs validated, the backend resolved, its
door opened.

* :func:`prepare_attention`: the door of one forward (:class:`~simsd_kernels.metadata.AttentionMetadata`).
* :func:`prepare_append_kv`: the door of one cache write (:func:`simsd_kernels.append_kv`).

The door classes are the backends (:mod:`simsd_kernels.metadata` and the backends' modules);
:mod:`simsd_kernels.backends` resolves a name to one.
"""
from __future__ import annotations

from functools import partial

import torch

from .backends import OpConfig, resolve_backend
from .mask_rule import parse_mask_mode
from .metadata import _FLOAT_DTYPES, AttentionMetadata, TracedAttention, validate_append_args, validate_forward_inputs


def prepare_attention(cache_seqlens, labels, positions, *, num_heads: int, num_kv_heads: int, head_dim: int,
                      dtype: torch.dtype, cache_capacity: int, mask_mode, rope_theta: float,
                      softmax_scale: float | None = None, backend: str = "auto",
                      shape_invariant: bool = False, block_table=None) -> AttentionMetadata:
    """Validate one forward's inputs, resolve the backend and open its door (which plans the forward).

    Args:
        cache_seqlens: ``(B,)`` int32, row ``b`` holds ``[0, cache_seqlens[b])`` (on the device).
        labels: ``(B, Lq, 3)`` int32 ``(kind, tau, grp)`` of the new tokens
            (:mod:`simsd_kernels.mask_rule`).
        positions: ``(B, Lq)`` int64 RoPE positions of the new tokens.
        num_heads, num_kv_heads, head_dim, dtype: the q / kv heads (GQA), their size (even) and
            the float dtype of q, k, v and the caches.
        cache_capacity: ``Lmax``, the logical slots of a row: the caches' second dim, or with a
            ``block_table`` ``max_pages * page_size``.
        mask_mode: ``bidirectional | block_causal | exact | paper`` (or the :class:`MaskMode`).
        rope_theta, softmax_scale: RoPE base; scale (default ``head_dim ** -0.5``).
        backend: ``auto | cuda | triton | torch`` (or a registered name), resolved here for the
            configuration (dtype, head_dim, GQA group, mask mode), self-check included.
        shape_invariant: the fused backends' split plan that never depends on Lq or B
            (:mod:`simsd_kernels.split_plan`); the torch backend is invariant by construction.
        block_table: ``(B, max_pages) int32`` page table of page-pool caches ``(num_pages,
            page_size, Hkv, D)`` (:mod:`simsd_kernels.paging`); None: caches ``(B, Lmax, Hkv, D)``,
            one page per row. The plan does not depend on it (only on the capacity).

    Raises:
        ValueError: an input that does not fit (named; a ``block_table`` that is not ``(B,
            max_pages)`` int32 or whose pages do not divide the capacity), an unknown mask mode, a GQA ratio that
            does not divide, an odd head_dim, a backend that cannot run the configuration
            (:class:`~simsd_kernels.backends.BackendCheckError` for a failed self-check).

    Returns:
        the resolved backend's door (an instance of its :class:`AttentionMetadata` subclass;
        :class:`~simsd_kernels.metadata.TracedAttention` while ``torch.compile`` traces).
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
    if torch.compiler.is_compiling():  # resolved inside the custom ops when they run
        door = partial(TracedAttention, backend)
    else:
        door = resolve_backend(backend, labels.device, OpConfig("attention", dtype, head_dim, num_heads // num_kv_heads,
                                                                 int(mode)))
    return door(cache_seqlens, labels, positions, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                dtype=dtype, cache_capacity=int(cache_capacity), mask_mode=mode, rope_theta=float(rope_theta),
                softmax_scale=scale, shape_invariant=bool(shape_invariant), block_table=block_table)

def prepare_append_kv(k, v, positions, k_cache, v_cache, cache_seqlens, *, rope_theta: float, num_tokens: int,
                      backend: str = "auto", block_table=None) -> AttentionMetadata:
    """Validate one cache write's inputs (shapes as :func:`simsd_kernels.append_kv`), resolve the
    backend for ``("append_kv", dtype, head_dim)`` (self-check included) and open its door for the
    write (:meth:`~simsd_kernels.metadata.AttentionMetadata.open_write`; then ``door.append_kv(k,
    v, k_cache, v_cache, num_tokens)``).

    Raises:
        ValueError: an input that does not fit (named), ``num_tokens`` outside ``[0, L]``, a backend
            that cannot run the write (:class:`~simsd_kernels.backends.BackendCheckError` for a
            failed self-check).
    """
    validate_append_args(k, v, positions, k_cache, v_cache, cache_seqlens, num_tokens, block_table)
    impl = resolve_backend(backend, k.device, OpConfig("append_kv", k.dtype, k.shape[3]))
    return impl.open_write(k, k_cache, cache_seqlens, positions, rope_theta=rope_theta, block_table=block_table)
