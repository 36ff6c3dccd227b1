"""PyTorch references of the simsd attention op (importable without Triton or CUDA).

* :func:`temporal_attention_dense`: SDPA with a dense boolean mask (a shape-dependent baseline).
* :func:`temporal_attention_naive`: explicit softmax math in the input dtype (float64 in
  tests), the ground truth the kernels are compared with.

The ``torch`` backend itself (SDPA over exactly the keys each token sees, the cache write) is
:mod:`simsd_kernels.torch_backend`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .mask_rule import dense_new_token_mask
from .rope import apply_rope


def full_mask(cache_seqlens, labels, mask_mode, cache_len: int):
    """Dense ``(B, Lq, cache_len + Lq)`` bool mask: visible cache prefix, then the rule."""
    B, Lq, _ = labels.shape
    cache_vis = torch.arange(cache_len, device=labels.device)[None, :] < cache_seqlens[:, None].to(torch.int64)
    cache_vis = cache_vis[:, None, :].expand(B, Lq, cache_len)
    return torch.cat([cache_vis, dense_new_token_mask(labels, mask_mode)], dim=-1)


def _inputs(q, k, v, k_cache, v_cache, cache_seqlens, labels, positions, mask_mode, rope_theta):
    qr = apply_rope(q, positions, rope_theta)
    kr = apply_rope(k, positions, rope_theta)
    used = int(cache_seqlens.max().item()) if cache_seqlens.numel() else 0
    keys = torch.cat([k_cache[:, :used], kr], dim=1)
    vals = torch.cat([v_cache[:, :used], v], dim=1)
    mask = full_mask(cache_seqlens, labels, mask_mode, used)
    return qr, keys, vals, mask


def _expand_kv(x, groups):
    # (B, L, Hkv, D) -> (B, Hq, L, D)
    return x.repeat_interleave(groups, dim=2).transpose(1, 2)


def temporal_attention_dense(q, k, v, k_cache, v_cache, cache_seqlens, labels, positions,
                             mask_mode, rope_theta, softmax_scale):
    """SDPA with a dense boolean mask over the whole query and every new token, one call per
    distinct cache length (rows of equal length share it). Same results as
    :class:`simsd_kernels.torch_backend.TorchAttention` (the torch backend) up to rounding, but a token's bits
    depend on the shape of the forward (the other query tokens, the padding): kept as a baseline and for measuring
    the cost of the grouped reference."""
    lengths = cache_seqlens.tolist()
    if len(set(lengths)) > 1:
        out = torch.empty_like(q)
        for n in sorted(set(lengths)):
            rows = [b for b, x in enumerate(lengths) if x == n]
            idx = torch.tensor(rows, device=q.device)
            pick = lambda t: t.index_select(0, idx)  # noqa: E731
            out[idx] = temporal_attention_dense(pick(q), pick(k), pick(v), pick(k_cache), pick(v_cache),
                                                pick(cache_seqlens), pick(labels), pick(positions), mask_mode,
                                                rope_theta, softmax_scale)
        return out
    qr, keys, vals, mask = _inputs(q, k, v, k_cache, v_cache, cache_seqlens, labels, positions,
                                   mask_mode, rope_theta)
    groups = q.shape[2] // k.shape[2]
    out = F.scaled_dot_product_attention(
        qr.transpose(1, 2), _expand_kv(keys, groups), _expand_kv(vals, groups),
        attn_mask=mask[:, None], scale=softmax_scale,
    ).transpose(1, 2)
    # a fully masked row is defined as zeros (SDPA would give NaN)
    any_visible = mask.any(dim=-1)[:, :, None, None]
    return torch.where(any_visible, out, torch.zeros((), dtype=out.dtype, device=out.device)).contiguous()


def temporal_attention_naive(q, k, v, k_cache, v_cache, cache_seqlens, labels, positions,
                             mask_mode, rope_theta, softmax_scale=None, compute_dtype=torch.float64):
    """Explicit softmax math in ``compute_dtype``; output in ``compute_dtype``."""
    cast = lambda t: t.to(compute_dtype)  # noqa: E731
    q, k, v, k_cache, v_cache = map(cast, (q, k, v, k_cache, v_cache))
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** -0.5
    qr, keys, vals, mask = _inputs(q, k, v, k_cache, v_cache, cache_seqlens, labels, positions,
                                   mask_mode, rope_theta)
    groups = q.shape[2] // k.shape[2]
    kx, vx = _expand_kv(keys, groups), _expand_kv(vals, groups)
    scores = torch.einsum("bqhd,bhkd->bhqk", qr, kx) * softmax_scale
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    m = scores.amax(dim=-1, keepdim=True).clamp_min(torch.finfo(compute_dtype).min)
    p = torch.exp(scores - m)
    denom = p.sum(dim=-1, keepdim=True)
    p = torch.where(denom > 0, p / denom.clamp_min(torch.finfo(compute_dtype).tiny), torch.zeros_like(p))
    return torch.einsum("bhqk,bhkd->bqhd", p, vx)
