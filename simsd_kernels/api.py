"""Public op API of simsd: temporal-mask attention over a KV cache with RoPE fused."""
from __future__ import annotations

import torch

from .backends import OpConfig, resolve_backend
from .custom_ops import append_kv_op, temporal_attention_op
from .mask_rule import parse_mask_mode

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
SUPPORTED_HEAD_DIMS = (64, 128)


def _check(name, t, ndim, dtype=None):
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if dtype is not None and t.dtype not in (dtype if isinstance(dtype, tuple) else (dtype,)):
        raise ValueError(f"{name} must have dtype {dtype}, got {t.dtype}")
    if t.numel() and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dim, got strides {t.stride()}")


def validate_attention_args(q, k, v, k_cache, v_cache, cache_seqlens, labels, positions, head_dims=None):
    """Raise ``ValueError`` naming the argument when shapes, dtypes or devices do not fit."""
    _check("q", q, 4, _FLOAT_DTYPES)
    B, Lq, Hq, D = q.shape
    for name, t in (("k", k), ("v", v)):
        _check(name, t, 4, q.dtype)
        if t.shape[:2] != (B, Lq) or t.shape[3] != D:
            raise ValueError(f"{name} must be (B={B}, Lq={Lq}, Hkv, D={D}), got {tuple(t.shape)}")
    Hkv = k.shape[2]
    if v.shape[2] != Hkv:
        raise ValueError(f"k and v must have the same number of kv heads, got {k.shape[2]} and {v.shape[2]}")
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"GQA: Hq={Hq} must be a multiple of Hkv={Hkv}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        _check(name, t, 4, q.dtype)
        if t.shape[0] != B or t.shape[2:] != (Hkv, D):
            raise ValueError(f"{name} must be (B={B}, Lmax, Hkv={Hkv}, D={D}), got {tuple(t.shape)}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ")
    _check("cache_seqlens", cache_seqlens, 1, torch.int32)
    if cache_seqlens.shape[0] != B:
        raise ValueError(f"cache_seqlens must be (B={B},), got {tuple(cache_seqlens.shape)}")
    _check("labels", labels, 3, torch.int32)
    if labels.shape != (B, Lq, 3):
        raise ValueError(f"labels must be (B={B}, Lq={Lq}, 3), got {tuple(labels.shape)}")
    _check("positions", positions, 2, torch.int64)
    if positions.shape != (B, Lq):
        raise ValueError(f"positions must be (B={B}, Lq={Lq}), got {tuple(positions.shape)}")
    if head_dims is not None and D not in head_dims:
        raise ValueError(f"head_dim {D} is not supported by this backend (supported: {head_dims})")
    if D % 2:
        raise ValueError(f"head_dim must be even for rotate-half RoPE, got {D}")
    devices = {t.device for t in (q, k, v, k_cache, v_cache, cache_seqlens, labels, positions)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")


def _backend_name(backend, device, config: OpConfig) -> str:
    # eager: resolve now (cached; the first use of a configuration runs the backend's
    # self-check) so that a bad, unavailable or failing backend raises ValueError here; under
    # torch.compile the custom op resolves the name when it runs
    if torch.compiler.is_compiling():
        return backend
    return resolve_backend(backend, device, config).name


def temporal_attention(q, k, v, k_cache, v_cache, cache_seqlens, labels, positions, *,
                       mask_mode, rope_theta, softmax_scale=None, backend="auto", out=None,
                       shape_invariant=False):
    """Attention of new tokens over a KV cache and over themselves, with a label mask and RoPE.

    Shapes (B batch rows, Lq new tokens, Lmax cache capacity, Hq/Hkv heads, D head_dim):

    * ``q (B, Lq, Hq, D)``, ``k, v (B, Lq, Hkv, D)``: new tokens, **un-rotated** q and k;
    * ``k_cache, v_cache (B, Lmax, Hkv, D)``: cache, keys stored **rotated**;
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
    (float64 on the torch backend).

    ``shape_invariant``: the fused backends use the split plan whose query tile, split count and
    split boundaries depend only on the cache capacity, each row's cache length, the heads and the
    device -- never on Lq or B (:mod:`simsd_kernels.split_plan`), for verification that must give
    a query token the same bits whatever other tokens share the forward. The torch backend ignores it.

    Runs as the ``torch.library`` custom op ``simsd::temporal_attention`` (see
    :mod:`simsd_kernels.custom_ops`), so it works under ``torch.compile`` and CUDA graphs; the
    backend (``auto | cuda | triton | torch``) is resolved here in eager mode, inside the op
    when compiling (:func:`simsd_kernels.backends.resolve_backend`: shape-aware, and a compiled
    backend is self-checked against the torch reference the first time it meets a
    configuration; ``auto`` falls back with a warning, an explicit name raises).

    Raises:
        ValueError: wrong dtype, device mismatch, shape, non-contiguous last dim, head_dim,
            GQA ratio, mask mode or backend (the message names the argument); an explicitly
            requested backend that does not support the shape or fails its self-check
            (:class:`simsd_kernels.backends.BackendCheckError`).
    """
    mode = parse_mask_mode(mask_mode)
    validate_attention_args(q, k, v, k_cache, v_cache, cache_seqlens, labels, positions)
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** -0.5
    config = OpConfig("attention", q.dtype, q.shape[3], q.shape[2] // k.shape[2], int(mode))
    result = temporal_attention_op(q, k, v, k_cache, v_cache, cache_seqlens, labels, positions,
                                   int(mode), float(rope_theta), float(softmax_scale),
                                   _backend_name(backend, q.device, config), bool(shape_invariant))
    if out is not None:
        if out.shape != q.shape or out.dtype != q.dtype:
            raise ValueError(f"out must be {tuple(q.shape)} {q.dtype}, got {tuple(out.shape)} {out.dtype}")
        out.copy_(result)
        return out
    return result


def append_kv(k, v, positions, k_cache, v_cache, cache_seqlens, *, rope_theta, num_tokens=None,
              backend="auto"):
    """Write the first ``num_tokens`` new tokens' K (rotated at ``positions``) and V into the cache.

    ``k, v (B, L, Hkv, D)``, ``positions (B, L) int64``, caches ``(B, Lmax, Hkv, D)``,
    ``cache_seqlens (B,) int32``: token i of row b goes to slot ``cache_seqlens[b] + i``.
    ``cache_seqlens`` is not advanced (the caller owns it). ``num_tokens`` defaults to ``L``.

    Raises:
        ValueError: shapes/dtypes do not fit, or ``num_tokens`` outside ``[0, L]``.
    """
    B, L, Hkv, D = k.shape
    if num_tokens is None:
        num_tokens = L
    if not 0 <= num_tokens <= L:
        raise ValueError(f"num_tokens must be in [0, {L}], got {num_tokens}")
    if v.shape != k.shape or k_cache.shape[0] != B or k_cache.shape[2:] != (Hkv, D):
        raise ValueError(f"append_kv: k {tuple(k.shape)}, v {tuple(v.shape)}, k_cache {tuple(k_cache.shape)} do not "
                         f"fit")
    if positions.shape != (B, L):
        raise ValueError(f"positions must be (B={B}, L={L}), got {tuple(positions.shape)}")
    append_kv_op(k, v, positions, k_cache, v_cache, cache_seqlens, float(rope_theta), int(num_tokens),
                 _backend_name(backend, k.device, OpConfig("append_kv", k.dtype, D)))
