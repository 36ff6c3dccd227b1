"""Public op API of simsd: the attention door and its single-call forms.

* :func:`prepare_attention` / :class:`~simsd_kernels.metadata.AttentionMetadata` (the door, in
  :mod:`simsd_kernels.metadata`): one forward's metadata, then per layer ``meta.forward(q, k, v,
  k_cache, v_cache)``: RoPE once, the new K/V written to the cache, attention.
* :func:`temporal_attention`: one call of the door without the cache write (tests, benchmarks,
  the transformers adapter).
* :func:`append_kv`: the cache write alone, as the door's write (rotated k and v at
  ``cache_seqlens[b] + i``) of the first ``num_tokens`` tokens: :func:`prepare_append_kv
  <simsd_kernels.prepare.prepare_append_kv>` then :meth:`AttentionMetadata.append_kv
  <simsd_kernels.metadata.AttentionMetadata.append_kv>`.
"""
from __future__ import annotations

import torch

from .custom_ops import append_kv_op
from .metadata import capacity_of, validate_attention_args
from .prepare import prepare_append_kv, prepare_attention

__all__ = ["prepare_attention", "temporal_attention", "append_kv", "validate_attention_args"]


def temporal_attention(q, k, v, k_cache, v_cache, cache_seqlens, labels, positions, *,
                       mask_mode, rope_theta, softmax_scale=None, backend="auto", out=None,
                       shape_invariant=False, block_table=None):
    """Attention of new tokens over a KV cache and over themselves, with a label mask and RoPE.

    Shapes (B batch rows, Lq new tokens, Lmax cache capacity, Hq/Hkv heads, D head_dim):

    * ``q (B, Lq, Hq, D)``, ``k, v (B, Lq, Hkv, D)``: new tokens, **un-rotated** q and k;
    * ``k_cache, v_cache (B, Lmax, Hkv, D)``: cache, keys stored **rotated**; or page pools
      ``(num_pages, page_size, Hkv, D)`` read through ``block_table (B, max_pages) int32``
      (:mod:`simsd_kernels.paging`: row b's slot s at page ``block_table[b, s // page_size]``,
      offset ``s % page_size``; capacity ``Lmax = max_pages * page_size``);
    * ``cache_seqlens (B,) int32``: row ``b`` sees cache entries ``[0, cache_seqlens[b])``;
    * ``labels (B, Lq, 3) int32``: ``(kind, tau, grp)`` per new token, see
      :mod:`simsd_kernels.mask_rule`;
    * ``positions (B, Lq) int64``: RoPE position of each new token (the RoPE copy of the
      paper layout is simply equal positions for ``D_k`` and ``M_k``);
    * returns ``(B, Lq, Hq, D)`` in q's dtype (``out`` if given).

    Semantics: q and k are rotated (rotate-half, ``rope_theta``) at ``positions``; every new
    token sees the visible cache; new token i sees new token j where
    ``mask_rule.allowed(mask_mode, labels[i], labels[j])``; scale ``softmax_scale`` (default
    ``D ** -0.5``); a row that sees nothing is zeros. dtypes float16/bfloat16/float32
    (float64 on the torch backend). The cache is not written.

    ``shape_invariant``: the fused backends use the split plan whose query tile, split count and
    split boundaries depend only on the cache capacity, each row's cache length, the heads and the
    device -- never on Lq or B (:mod:`simsd_kernels.split_plan`), for verification that must give
    a query token the same bits whatever other tokens share the forward. The torch backend is
    invariant by construction.

    One call of the door: :func:`prepare_attention` then :meth:`AttentionMetadata.attend
    <simsd_kernels.metadata.AttentionMetadata.attend>` (under ``torch.compile`` the custom op
    ``simsd::temporal_attention``, :mod:`simsd_kernels.custom_ops`). The backend (``auto | cuda
    | triton | torch``) is resolved for the configuration
    (:func:`simsd_kernels.backends.resolve_backend`: shape-aware, and a compiled backend is
    self-checked against the torch reference the first time it meets a configuration; ``auto``
    falls back with a warning, an explicit name raises).

    Raises:
        ValueError: wrong dtype, device mismatch, shape, non-contiguous last dim, head_dim,
            GQA ratio, mask mode or backend (the message names the argument); an explicitly
            requested backend that does not support the shape or fails its self-check
            (:class:`simsd_kernels.backends.BackendCheckError`).
    """
    validate_attention_args(q, k, v, k_cache, v_cache, cache_seqlens, labels, positions, block_table)
    meta = prepare_attention(cache_seqlens, labels, positions, num_heads=q.shape[2], num_kv_heads=k.shape[2],
                             head_dim=q.shape[3], dtype=q.dtype, cache_capacity=capacity_of(k_cache, block_table),
                             mask_mode=mask_mode, rope_theta=rope_theta, softmax_scale=softmax_scale, backend=backend,
                             shape_invariant=shape_invariant, block_table=block_table)
    result = meta.attend(q, k, v, k_cache, v_cache)
    if out is not None:
        if out.shape != q.shape or out.dtype != q.dtype:
            raise ValueError(f"out must be {tuple(q.shape)} {q.dtype}, got {tuple(out.shape)} {out.dtype}")
        out.copy_(result)
        return out
    return result if result.is_contiguous() else result.contiguous()


def append_kv(k, v, positions, k_cache, v_cache, cache_seqlens, *, rope_theta, num_tokens=None,
              backend="auto", block_table=None):
    """Write the first ``num_tokens`` new tokens' K (rotated at ``positions``) and V into the cache.

    ``k, v (B, L, Hkv, D)``, ``positions (B, L) int64``, caches ``(B, Lmax, Hkv, D)``,
    ``cache_seqlens (B,) int32``: token i of row b goes to slot ``cache_seqlens[b] + i`` (slots
    ``>= Lmax`` are skipped); with ``block_table (B, max_pages) int32`` the caches are page pools
    ``(num_pages, page_size, Hkv, D)`` and the slot lands in its page (:mod:`simsd_kernels.paging`).
    ``cache_seqlens`` is not advanced (the caller owns it).
    ``num_tokens`` defaults to ``L``. One write of the door: the backend (``auto | cuda | triton
    | torch``) is resolved (and self-checked) for ``("append_kv", dtype, head_dim)`` and its door
    writes; under ``torch.compile`` it runs as ``simsd::append_kv``.

    Raises:
        ValueError: shapes/dtypes/devices do not fit (named), ``num_tokens`` outside ``[0, L]``, a
            backend that cannot run the write.
    """
    num_tokens = k.shape[1] if num_tokens is None else int(num_tokens)
    if torch.compiler.is_compiling():
        append_kv_op(k, v, positions, k_cache, v_cache, cache_seqlens, float(rope_theta), num_tokens, backend,
                     block_table)
        return
    door = prepare_append_kv(k, v, positions, k_cache, v_cache, cache_seqlens, rope_theta=rope_theta,
                             num_tokens=num_tokens, backend=backend, block_table=block_table)
    door.append_kv(k, v, k_cache, v_cache, num_tokens)
