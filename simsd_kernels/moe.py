"""The expert computation of a mixture-of-experts layer (Qwen3-MoE / SDAR-MoE): every token's
top-k experts, each a SwiGLU MLP, and their weighted sum.

``fused_moe(x, w_gate_up, w_down, topk_weights, topk_ids)`` computes, for every token ``t``::

    out[t] = sum_j topk_weights[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])),  e = topk_ids[t, j]

with ``gate_e`` the first ``I`` rows of ``w_gate_up[e]``, ``up_e`` the last ``I`` (transformers'
``Qwen3MoeExperts`` layout). Numerics of the torch path (the reference and the CPU path): the
expert products in the dtype of ``x``; the weighted sum in float32 (float64 for float64 inputs),
slot ``j = 0`` first, then one cast to the dtype of ``x``. A token's result depends only on its
own row and the rows that share its experts in the call (the matrix products' rounding may
depend on the number of rows); the model's shape-invariant mode runs each unit of tokens in its
own call (:func:`simsd.models.model.per_unit`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def check_moe_args(x, w_gate_up, w_down, topk_weights, topk_ids) -> None:
    """Raise ``ValueError`` naming the tensor whose shape, dtype or device does not fit."""
    if x.dim() != 2:
        raise ValueError(f"fused_moe: x must be (T, H), got shape {tuple(x.shape)}")
    T, H = x.shape
    if w_gate_up.dim() != 3 or w_gate_up.shape[2] != H or w_gate_up.shape[1] % 2:
        raise ValueError(f"fused_moe: w_gate_up must be (E, 2I, H={H}), got shape {tuple(w_gate_up.shape)}")
    E, I2 = w_gate_up.shape[:2]
    if tuple(w_down.shape) != (E, H, I2 // 2):
        raise ValueError(f"fused_moe: w_down must be (E={E}, H={H}, I={I2 // 2}), got shape {tuple(w_down.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != T or tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise ValueError(f"fused_moe: topk_ids and topk_weights must both be (T={T}, k), got "
                         f"{tuple(topk_ids.shape)} and {tuple(topk_weights.shape)}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"fused_moe: topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if w_gate_up.dtype != x.dtype or w_down.dtype != x.dtype:
        raise ValueError(f"fused_moe: weights ({w_gate_up.dtype}, {w_down.dtype}) must have the dtype of x ({x.dtype})")
    devices = {t.device for t in (x, w_gate_up, w_down, topk_weights, topk_ids)}
    if len(devices) > 1:
        raise ValueError(f"fused_moe: tensors on several devices: {sorted(map(str, devices))}")


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 for float64 inputs, float32 otherwise (the weighted sum)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def fused_moe_torch(x, w_gate_up, w_down, topk_weights, topk_ids) -> torch.Tensor:
    """The torch path of :func:`fused_moe` (module doc): the (token, slot) pairs sorted by expert,
    one SwiGLU per expert that holds any, the weighted sum over the slots; ``(T, H)`` in x's dtype."""
    T, H = x.shape
    K = topk_ids.shape[1]
    I = w_down.shape[2]
    flat = topk_ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w_gate_up.shape[0]).tolist()
    y = x.new_empty(T * K, H)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        slots = order[start:start + n]
        start += n
        gate, up = F.linear(x[slots // K], w_gate_up[e]).split(I, dim=-1)
        y[slots] = F.linear(F.silu(gate) * up, w_down[e])
    acc = accumulation_dtype(x.dtype)
    y = y.view(T, K, H).to(acc)
    w = topk_weights.to(acc)
    out = y[:, 0] * w[:, :1]
    for j in range(1, K):
        out = out + y[:, j] * w[:, j:j + 1]
    return out.to(x.dtype)


def fused_moe(x, w_gate_up, w_down, topk_weights, topk_ids, *, backend: str = "auto") -> torch.Tensor:
    """Weighted top-k SwiGLU experts (module doc).

    Args:
        x: ``(T, H)`` float16 / bfloat16 / float32 / float64 hidden states.
        w_gate_up: ``(E, 2I, H)`` gate rows then up rows of every expert, x's dtype.
        w_down: ``(E, H, I)`` x's dtype.
        topk_weights: ``(T, k)`` routing weights (any float dtype; float32 in the model).
        topk_ids: ``(T, k)`` int32 / int64 expert ids in ``[0, E)``.
        backend: ``auto | torch``.

    Returns:
        ``(T, H)`` in x's dtype.

    Raises:
        ValueError: shapes, dtypes or devices that do not fit (named), an unknown backend.
    """
    check_moe_args(x, w_gate_up, w_down, topk_weights, topk_ids)
    if backend not in ("auto", "torch"):
        raise ValueError(f"fused_moe: backend must be auto or torch, got {backend!r}")
    return fused_moe_torch(x, w_gate_up, w_down, topk_weights, topk_ids)
