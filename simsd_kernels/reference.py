"""PyTorch references of the simsd attention ops (importable without Triton or CUDA).

* :func:`temporal_attention_torch`: the ``torch`` backend: per row, one SDPA call per group
  of query tokens that see the same keys (:mod:`simsd_kernels.mask_rule`), over exactly
  those keys, so a token's bits do not depend on the other tokens of the forward;
* :func:`temporal_attention_dense`: SDPA with a dense boolean mask (a shape-dependent baseline).
* :func:`temporal_attention_naive`: explicit softmax math in the input dtype (float64 in
  tests), the ground truth the kernels are compared with.
* :func:`append_kv_torch`: rotates the new keys and writes K/V into the cache.
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


def temporal_attention_torch(q, k, v, k_cache, v_cache, cache_seqlens, labels, positions,
                             mask_mode, rope_theta, softmax_scale):
    """SDPA over exactly the keys each query token may see; same contract as
    :func:`simsd_kernels.temporal_attention`.

    For every batch row, the query tokens that see the same keys (a bidirectional block, an
    exact-mode copy, a block-causal group, one paper-mode slot pattern) run as one SDPA call
    over those keys alone -- the row's visible cache prefix, then the visible new tokens in
    order -- without a mask, on freshly gathered (contiguous) tensors. A token's output thus
    depends only on its group's tokens and the keys it sees, never on the other tokens of the
    forward, on its batch neighbours or on padding: an exact-mode copy gets the same bits as a
    denoise forward of that state, in every dtype (docs/design.md §4.2; padding keys to a common
    length, or a dense mask over all new tokens, would change SDPA's blocking and hence the
    rounding). The grouping reads the labels and cache lengths on the host (this backend is
    not CUDA-graph safe).
    """
    B, Lq, Hq, D = q.shape
    groups = Hq // k.shape[2]
    qr = apply_rope(q, positions, rope_theta)
    kr = apply_rope(k, positions, rope_theta)
    lengths = cache_seqlens.tolist()
    visible = dense_new_token_mask(labels, mask_mode).cpu().tolist()
    out = torch.zeros_like(q)  # a token that sees nothing gets zeros
    for b in range(B):
        by_keys: dict = {}
        for i, row in enumerate(visible[b]):
            by_keys.setdefault(tuple(row), []).append(i)
        n = lengths[b]
        for row, members in by_keys.items():
            cols = [j for j, seen in enumerate(row) if seen]
            if n == 0 and not cols:
                continue
            pick = torch.tensor(members, device=q.device)
            take = torch.tensor(cols, dtype=torch.int64, device=q.device)
            keys = torch.cat([k_cache[b, :n], kr[b].index_select(0, take)])[None]
            vals = torch.cat([v_cache[b, :n], v[b].index_select(0, take)])[None]
            qg = qr[b].index_select(0, pick)[None]
            o = F.scaled_dot_product_attention(qg.transpose(1, 2), _expand_kv(keys, groups), _expand_kv(vals, groups),
                                               scale=softmax_scale).transpose(1, 2)
            out[b].index_copy_(0, pick, o[0])
    return out


def temporal_attention_dense(q, k, v, k_cache, v_cache, cache_seqlens, labels, positions,
                             mask_mode, rope_theta, softmax_scale):
    """SDPA with a dense boolean mask over the whole query and every new token, one call per
    distinct cache length (rows of equal length share it). Same results as
    :func:`temporal_attention_torch` up to rounding, but a token's bits depend on the shape of
    the forward (the other query tokens, the padding): kept as a baseline and for measuring
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


def append_kv_torch(k, v, positions, k_cache, v_cache, cache_seqlens, rope_theta, num_tokens):
    """Write rotated ``k[:, :num_tokens]`` and ``v[:, :num_tokens]`` at ``cache_seqlens[b] + i``."""
    if num_tokens == 0:
        return
    kr = apply_rope(k[:, :num_tokens], positions[:, :num_tokens], rope_theta)
    B = k.shape[0]
    rows = torch.arange(B, device=k.device)[:, None]
    cols = cache_seqlens.to(torch.int64)[:, None] + torch.arange(num_tokens, device=k.device)[None, :]
    k_cache[rows, cols] = kr.to(k_cache.dtype)
    v_cache[rows, cols] = v[:, :num_tokens].to(v_cache.dtype)
