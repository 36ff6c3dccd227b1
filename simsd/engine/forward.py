"""The engine's one call of a model forward (docs/design.md §6).

Every forward the engine runs goes through :func:`model_forward`: the batched forwards of
:class:`~simsd.engine.batching.BatchEngine`, the prefill of a row, and the forwards a
:class:`~simsd.engine.graphs.GraphRunner` captures, replays' eager checks and runs eagerly
once graphs are off. How the engine calls a model is therefore written once.
"""
from __future__ import annotations

import torch


def model_forward(model, cache, ids: torch.Tensor, positions: torch.Tensor, labels: torch.Tensor, mask_mode: str,
                  num_write: torch.Tensor, want_logits: bool, unit: int):
    """One forward of ``model`` over ``cache`` (:meth:`simsd.models.model.SDARForCausalLM.forward`).

    Args:
        ids, positions: ``(B, L)`` int64; labels: ``(B, L, 3)`` int32 (``kind, tau, grp``).
        num_write: ``(B,)`` int32 on the model's device: row ``b`` keeps ``num_write[b]`` of the
            ``L`` tokens it writes into the cache (read-only forwards pass zeros); the cache
            needs ``L`` free slots past every row's length.
        want_logits: logits of all ``L`` tokens (float32 ``(B, L, V)``), else None.
        unit: the block length: the unit of the shape-invariant numerics (used with
            ``model.invariant``).
    """
    return model(ids, positions, labels, mask_mode, cache, num_write, slice(None) if want_logits else None,
                 unit=unit)
