"""Rotate-half rotary position embedding (RoPE), as in Qwen3 / SDAR.

``cos``/``sin`` are computed in float32 from ``inv_freq = theta ** (-arange(0, D, 2) / D)``
(the transformers Qwen3 recipe) and the rotation runs in the dtype of ``x``:
``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = [-x2, x1]``. :func:`rope_tables` folds
the sign into the sine (``[-sin, sin]``), so the rotation is ``x * cos + roll(x, D / 2) * sin``:
the same products and sums, bit for bit, in four ops instead of seven.
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


def rope_tables(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """``(cos, signed_sin)``, both ``(B, L, 1, head_dim)`` in ``dtype``: :func:`rope_cos_sin` with
    the first half of the sine negated, for :func:`rotate` (computed once per forward)."""
    cos, sin = rope_cos_sin(positions, head_dim, theta, dtype)
    half = head_dim // 2
    return cos, torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """``x (B, L, H, D)`` rotated with the tables of :func:`rope_tables`; a new tensor of x's dtype.
    Equals ``x * cos + rotate_half(x) * sin`` bit for bit (``-a * b == a * -b`` in IEEE arithmetic)."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin


def apply_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate ``x (B, L, H, D)`` at ``positions (B, L)``; returns a new tensor of x's dtype."""
    return rotate(x, *rope_tables(positions, x.shape[-1], theta, x.dtype))
