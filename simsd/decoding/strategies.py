"""Which masked positions a denoising step reveals (SDAR remasking strategies, docs/design.md §3.5).

:func:`select_positions` takes tensors over the block positions (a leading batch of blocks is
allowed) and returns a bool tensor of the positions to reveal; a step never reveals more
positions than are still masked and always reveals at least one while any is masked. It runs
on the device without host reads, so a denoising step never waits for the GPU.
"""
from __future__ import annotations

import torch

from ..config.fields import DEFAULT_THRESHOLD, parse_strategy
from ..config.vocabulary import at_most


def transfer_schedule(block_length: int, steps: int) -> list[int]:
    """Tokens per step: ``block_length // steps``, the remainder added to the first steps.

    Raises:
        ParamError: ``steps`` outside ``[1, block_length]``.
    """
    at_most("steps", steps, block_length, "the block length")
    base, rem = divmod(block_length, steps)
    return [base + (1 if i < rem else 0) for i in range(steps)]


def stable_rank(scores: torch.Tensor, descending: bool) -> torch.Tensor:
    """Rank of each entry of ``scores (..., L)`` in a stable sort along the last dim (ties keep
    the lower index first): the inverse of the sorting permutation (its argsort)."""
    order = torch.sort(scores, dim=-1, descending=descending, stable=True).indices
    return order.argsort(dim=-1)


def select_positions(strategy: str, masked: torch.Tensor, confidence: torch.Tensor,
                     entropy: torch.Tensor, k, threshold: float | None = None) -> torch.Tensor:
    """Positions to reveal in one step, for one block or a batch of blocks, on the device and
    without reading anything on the host.

    Args:
        strategy: ``sequential | static | dynamic | entropy``.
        masked: ``(..., L)`` bool, positions still MASK.
        confidence: ``(..., L)`` probability of each position's sampled token.
        entropy: ``(..., L)`` entropy (nats) of each position's distribution.
        k: tokens the schedule asks for in this step: an int or a ``(...)`` int tensor per block
            (at least 1; a block reveals at most its masked positions).
        threshold: confidence threshold (``dynamic``, strict ``>``) or entropy bound
            (``entropy``); defaults from ``DEFAULT_THRESHOLD``.

    Returns:
        ``(..., L)`` bool, a subset of ``masked`` with at least one position per block that has
        a masked one. Ties go to the lower index (SDAR's ``topk`` on a stable order).

    Raises:
        ParamError: unknown strategy.
    """
    strategy = parse_strategy(strategy)
    if threshold is None:
        threshold = DEFAULT_THRESHOLD.get(strategy)
    # k above the masked count reveals every masked position (all of them rank first): no clip
    if isinstance(k, torch.Tensor):
        k = k.reshape(*masked.shape[:-1], 1).clamp_min(1)
    else:  # a host int: no host-to-device copy
        k = max(1, int(k))
    if strategy == "sequential":
        return masked & (masked.cumsum(-1) <= k)
    if strategy in ("static", "dynamic"):
        # masked positions rank before every unmasked one (-inf), by confidence, ties to the lower index
        top = masked & (stable_rank(confidence.masked_fill(~masked, float("-inf")), True) < k)
        if strategy == "static":
            return top
        above = masked & (confidence > threshold)
        return torch.where(above.sum(-1, keepdim=True) >= k, above, top)
    ent = entropy.double().masked_fill(~masked, float("inf"))
    ranked = torch.sort(ent, dim=-1, stable=True).values
    n = ((ranked.cumsum(-1) <= threshold).sum(-1, keepdim=True)).clamp_min(1)
    return masked & (stable_rank(ent, False) < n)
