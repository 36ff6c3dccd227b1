"""FlexAttention ``mask_mod`` of the simsd mask rule (a mirror of :mod:`mask_rule`).

Key index ``k`` runs over ``[cache (cache_len) | new tokens (Lq)]``; cache keys are visible
to every query of row ``b`` below ``cache_seqlens[b]``, new keys follow
:func:`simsd_kernels.mask_rule.allowed` on the per-token labels.
"""
from __future__ import annotations

import torch

from .mask_rule import allowed, parse_mask_mode


def make_mask_mod(labels: torch.Tensor, cache_seqlens: torch.Tensor, cache_len: int, mask_mode):
    """``mask_mod(b, h, q_idx, kv_idx)`` for ``labels (B, Lq, 3)`` int32, ``cache_seqlens (B,)``.

    ``cache_len`` is the number of cache slots laid before the new tokens in the key sequence.
    """
    mode = parse_mask_mode(mask_mode)
    kind, tau, grp = labels[..., 0], labels[..., 1], labels[..., 2]
    Lq = labels.shape[1]

    def mask_mod(b, h, q_idx, kv_idx):
        in_cache = kv_idx < cache_len
        j = (kv_idx - cache_len).clamp(0, Lq - 1)
        new = allowed(mode, kind[b, q_idx], tau[b, q_idx], grp[b, q_idx], kind[b, j], tau[b, j], grp[b, j])
        return torch.where(in_cache, kv_idx < cache_seqlens[b], new)

    return mask_mod
