"""Rotate-half rotary position embedding (RoPE), as in Qwen3 / SDAR.

``cos``/``sin`` are computed in float32 from ``inv_freq = theta ** (-arange(0, D, 2) / D)``
(the transformers Qwen3 recipe) and the rotation runs in the dtype of ``x``.
"""
from __future__ import annotations

import torch


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """``positions (B, L)`` int64 -> ``cos, sin`` of shape ``(B, L, 1, head_dim)`` in ``dtype``."""
    work = torch.float64 if dtype == torch.float64 else torch.float32
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.int64).to(work) / head_dim)
    )
    freqs = positions.to(work)[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype)[:, :, None, :], emb.sin().to(dtype)[:, :, None, :]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate ``x (B, L, H, D)`` at ``positions (B, L)``; returns a new tensor of x's dtype."""
    cos, sin = rope_cos_sin(positions, x.shape[-1], theta, x.dtype)
    return x * cos + rotate_half(x) * sin
