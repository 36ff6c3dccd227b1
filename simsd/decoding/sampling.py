"""Token sampling for denoising steps: temperature, top-k, top-p, greedy.

Confidence is the probability of the chosen token under the temperature-scaled distribution
*before* top-k/top-p filtering (SDAR's evaluation code; docs/design.md §3.6). ``temperature == 0``
or ``top_k == 1`` is greedy (argmax); with ``temperature == 0`` the confidence uses temperature 1.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


def scaled_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Softmax of ``logits (..., V)`` at the sampling temperature (1 when greedy), float32."""
    t = params.temperature if params.temperature > 0 else 1.0
    return torch.softmax(logits.float() / t, dim=-1)


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution tokens are drawn from: temperature, then top-k, then top-p, renormalised.

    Greedy gives a one-hot at the argmax. Shape ``(..., V)`` float32.
    """
    if params.greedy:
        out = torch.zeros_like(logits, dtype=torch.float32)
        return out.scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    scores = logits.float() / params.temperature
    if params.top_k and params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
        cum = torch.softmax(sorted_scores, dim=-1).cumsum(-1)
        drop = cum - torch.softmax(sorted_scores, dim=-1) >= params.top_p  # keep the token that crosses p
        sorted_scores = sorted_scores.masked_fill(drop, float("-inf"))
        scores = torch.full_like(scores, float("-inf")).scatter(-1, order, sorted_scores)
    return torch.softmax(scores, dim=-1)


def exponential_noise(shape, device, generator: torch.Generator | None = None) -> torch.Tensor:
    """``Exp(1)`` draws (float32, on ``device`` with ``generator`` there) for :func:`draw`."""
    return torch.empty(shape, dtype=torch.float32, device=device).exponential_(generator=generator)


def draw(weights: torch.Tensor, generator: torch.Generator | None = None,
         noise: torch.Tensor | None = None) -> torch.Tensor:
    """One index per row of ``weights (..., V)`` (non-negative, not all zero), drawn with
    probability proportional to the weight, on the weights' device and without host reads:
    ``argmax(w / E)`` with ``E ~ Exp(1)`` i.i.d. (the exponential race; the index of the first
    of independent exponential clocks with rates ``w`` is distributed as ``w / sum(w)``).
    ``noise``: the ``E`` (:func:`exponential_noise`), else drawn from ``generator`` (on the
    weights' device). Returns int64 ``(...)``."""
    if noise is None:
        noise = exponential_noise(weights.shape, weights.device, generator)
    return (weights.float() / noise.clamp_min(torch.finfo(torch.float32).tiny)).argmax(-1)


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None,
           noise: torch.Tensor | None = None, with_probs: bool = True, with_entropy: bool = True):
    """Draw one token per row of ``logits (..., V)`` on their device (no host reads; the
    generator, or the precomputed ``noise`` of :func:`draw`, lives on that device).

    Returns ``(tokens (...) int64, confidence (...) float32, entropy (...) float32, probs (..., V))``
    where ``probs`` is the filtered distribution the token was drawn from (used by rejection
    sampling) and confidence/entropy come from the unfiltered temperature-scaled distribution.
    ``with_probs`` / ``with_entropy`` False: None in their place for greedy decoding (nothing
    to compute) and the entropy (only the ``entropy`` strategy reads it).
    """
    base = scaled_probs(logits, params)
    probs = None
    if params.greedy:
        tokens = logits.argmax(-1)
        if with_probs:
            probs = filtered_probs(logits, params)
    else:
        probs = filtered_probs(logits, params)
        tokens = draw(probs, generator, noise)
    confidence = base.gather(-1, tokens[..., None]).squeeze(-1)
    entropy = -(base * torch.log(base.clamp_min(1e-30))).sum(-1) if with_entropy else None
    return tokens, confidence, entropy, probs
