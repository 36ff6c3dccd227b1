"""Which masked positions a denoising step reveals (SDAR remasking strategies, DESIGN.md §3.5).

All functions take 1-D tensors over the block positions and return a bool tensor of the
positions to reveal; a step never reveals more positions than are still masked and always
reveals at least one while any is masked.
"""
from __future__ import annotations

import torch

STRATEGIES = ("sequential", "static", "dynamic", "entropy")
#: aliases used by SDAR's code
ALIASES = {"low_confidence_static": "static", "low_confidence_dynamic": "dynamic",
           "entropy_bounded": "entropy"}
DEFAULT_THRESHOLD = {"dynamic": 0.9, "entropy": 0.35}


def parse_strategy(name: str) -> str:
    name = ALIASES.get(name, name)
    if name not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r} (choose from {', '.join(STRATEGIES)})")
    return name


def transfer_schedule(block_length: int, steps: int) -> list[int]:
    """Tokens per step: ``block_length // steps``, the remainder added to the first steps.

    Raises:
        ValueError: ``steps`` outside ``[1, block_length]``.
    """
    if not 1 <= steps <= block_length:
        raise ValueError(f"steps must be in [1, block_length={block_length}], got {steps}")
    base, rem = divmod(block_length, steps)
    return [base + (1 if i < rem else 0) for i in range(steps)]


def _top(scores: torch.Tensor, masked: torch.Tensor, k: int, largest: bool) -> torch.Tensor:
    """The k masked positions with the largest (or smallest) score; ties go to the lower index."""
    fill = float("-inf") if largest else float("inf")
    s = scores.double().masked_fill(~masked, fill)
    order = torch.sort(s, descending=largest, stable=True).indices[:k]
    out = torch.zeros_like(masked)
    out[order] = True
    return out


def select_positions(strategy: str, masked: torch.Tensor, confidence: torch.Tensor,
                     entropy: torch.Tensor, k: int, threshold: float | None = None) -> torch.Tensor:
    """Positions to reveal in one step.

    Args:
        strategy: ``sequential | static | dynamic | entropy``.
        masked: ``(L,)`` bool, positions still MASK.
        confidence: ``(L,)`` probability of each position's sampled token.
        entropy: ``(L,)`` entropy (nats) of each position's distribution.
        k: tokens the schedule asks for in this step (clipped to the masked count).
        threshold: confidence threshold (``dynamic``, strict ``>``) or entropy bound
            (``entropy``); defaults from ``DEFAULT_THRESHOLD``.

    Returns:
        ``(L,)`` bool, a subset of ``masked`` with at least one position when any is masked.
    """
    n_masked = int(masked.sum())
    if n_masked == 0:
        return torch.zeros_like(masked)
    k = max(1, min(int(k), n_masked))
    if threshold is None:
        threshold = DEFAULT_THRESHOLD.get(strategy)
    if strategy == "sequential":
        idx = torch.nonzero(masked).flatten()[:k]
        out = torch.zeros_like(masked)
        out[idx] = True
        return out
    if strategy == "static":
        return _top(confidence, masked, k, largest=True)
    if strategy == "dynamic":
        above = masked & (confidence > threshold)
        if int(above.sum()) >= k:
            return above
        return _top(confidence, masked, k, largest=True)
    if strategy == "entropy":
        ent = entropy.double().masked_fill(~masked, float("inf"))
        order = torch.sort(ent, stable=True).indices[:n_masked]
        cum = torch.cumsum(ent[order], 0)
        n = max(1, int((cum <= threshold).sum()))
        out = torch.zeros_like(masked)
        out[order[:n]] = True
        return out
    raise ValueError(f"unknown strategy {strategy!r}")
