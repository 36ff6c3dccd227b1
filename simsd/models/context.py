"""The forward context: what every layer of one forward reads, built once per forward.

:meth:`SDARForCausalLM.forward <simsd.models.model.SDARForCausalLM.forward>` builds it from the
forward's inputs (the engine's one model call passes them, ``simsd.engine``); the layers take
``layer(x, ctx)`` and read it, so nothing is threaded through the layers argument by argument and
nothing per-forward is recomputed per layer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from simsd_kernels import AttentionMetadata

from .cache import KVCache


@dataclass(frozen=True)
class ForwardContext:
    """One forward of ``L`` new tokens in each of ``B`` rows.

    Attributes:
        positions: ``(B, L)`` int64 RoPE positions.
        labels: ``(B, L, 3)`` int32 ``(kind, tau, grp)`` mask labels.
        mask_mode: ``"bidirectional" | "block_causal" | "exact" | "paper"``.
        cache: the static cache; the forward reads its rows' ``[0, seqlens[b])``, writes the
            ``L`` new tokens' K/V behind them and advances row ``b`` by ``num_write[b]``.
        num_write: ``(B,)`` int32 on the device: the new tokens each row keeps.
        attention: the forward's attention metadata (:func:`simsd_kernels.prepare_attention`):
            the resolved backend, the RoPE tables for ``positions``, the backend's plan; every
            layer calls ``attention.forward`` on its own cache buffers.
        unit: the shape-invariant unit (block length) when the token-wise parts run per unit
            (:func:`per_unit`), else None.
    """
    positions: torch.Tensor
    labels: torch.Tensor
    mask_mode: str
    cache: KVCache
    num_write: torch.Tensor
    attention: AttentionMetadata
    unit: int | None

    @property
    def B(self) -> int:
        return self.positions.shape[0]

    @property
    def L(self) -> int:
        return self.positions.shape[1]


def per_unit(fn, ctx_or_unit, x: torch.Tensor, L: int | None = None):
    """``fn`` applied separately to each unit of ``unit`` consecutive tokens of each row of
    ``x (B * L, ...)`` (rows of ``L`` tokens; the last unit of a row may be shorter), each unit a
    fresh contiguous ``(U, ...)`` tensor; the results (a tensor or a tuple of tensors ``(U, ...)``)
    are concatenated back to ``(B * L, ...)``. A unit's result is then that of one fixed call on
    its own data, whatever else the forward holds (docs/design.md §4.2).

    ``ctx_or_unit``: a :class:`ForwardContext` (its ``unit`` and ``L``) or the unit (then ``L``)."""
    if isinstance(ctx_or_unit, ForwardContext):
        unit, L = ctx_or_unit.unit, ctx_or_unit.L
    else:
        unit = ctx_or_unit
    outs = [fn(x[r + s:r + min(s + unit, L)].clone()) for r in range(0, x.shape[0], L) for s in range(0, L, unit)]
    if isinstance(outs[0], tuple):
        return tuple(torch.cat(parts, 0) for parts in zip(*outs))
    return torch.cat(outs, 0)
