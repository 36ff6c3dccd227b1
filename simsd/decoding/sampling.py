"""Token sampling for denoising steps: temperature, top-k, top-p, greedy.

Confidence is the probability of the chosen token under the temperature-scaled distribution
*before* top-k/top-p filtering (SDAR's evaluation code; docs/design.md §3.6). Greedy (argmax) is
``temperature == 0``, ``top_k == 1`` at any temperature, or a temperature below
``MIN_TEMPERATURE`` (too small to divide float32 logits by); a greedy run is the same whatever
its temperature: its confidences use temperature 1. Every accepted setting gives finite
distributions: small temperatures divide the logits minus their maximum (so nothing overflows),
huge ones are capped at the largest float32 (the distribution is then uniform).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .choices import MIN_TEMPERATURE  # temperatures below it (the smallest normal float32) act as greedy

_MAX_TEMPERATURE = torch.finfo(torch.float32).max


@dataclass(frozen=True)
class SamplingParams:
    """``temperature`` >= 0 (finite; 0 = greedy), ``top_k`` >= 0 (0 = off, 1 = greedy),
    ``top_p`` in (0, 1] (1 = off). Raises ``ValueError`` naming the parameter and its range."""
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k}")
        if not (isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE or self.top_k == 1


def scaled_scores(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``logits (..., V) / temperature`` in float32 without overflow: below temperature 1 the
    row maximum is subtracted first (softmax is unchanged by it); a huge temperature is capped.
    At temperature 1 the logits themselves (dividing by 1 changes no bit)."""
    x = logits.float()
    if temperature == 1.0:
        return x
    if temperature < 1.0:
        return (x - x.amax(-1, keepdim=True)) / temperature
    return x / min(temperature, _MAX_TEMPERATURE)


def scaled_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Softmax of ``logits (..., V)`` at the sampling temperature (1 when greedy), float32."""
    t = 1.0 if params.greedy else params.temperature
    return torch.softmax(scaled_scores(logits, t), dim=-1)


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution tokens are drawn from: temperature, then top-k, then top-p, renormalised.

    Greedy gives a one-hot at the argmax. Shape ``(..., V)`` float32.
    """
    if params.greedy:
        out = torch.zeros_like(logits, dtype=torch.float32)
        return out.scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    scores = scaled_scores(logits, params.temperature)
    if params.top_k and params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=True, stable=True)  # ties: same order in any batch
        cum = torch.softmax(sorted_scores, dim=-1).cumsum(-1)
        drop = cum - torch.softmax(sorted_scores, dim=-1) >= params.top_p  # keep the token that crosses p
        drop[..., 0] = False  # and always the most likely one (a top_p below float32's range rounds to 0)
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
           noise: torch.Tensor | None = None, with_probs: bool = True, with_entropy: bool = True,
           with_confidence: bool = True):
    """Draw one token per row of ``logits (..., V)`` on their device (no host reads; the
    generator, or the precomputed ``noise`` of :func:`draw`, lives on that device).

    Returns ``(tokens (...) int64, confidence (...) float32, entropy (...) float32, probs (..., V))``
    where ``probs`` is the filtered distribution the token was drawn from (used by rejection
    sampling) and confidence/entropy come from the unfiltered temperature-scaled distribution.
    ``with_probs`` / ``with_entropy`` / ``with_confidence`` False: None in their place for
    greedy decoding (nothing to compute), the entropy (only the ``entropy`` strategy reads it)
    and the confidence (the ``sequential`` and ``entropy`` strategies do not read it).
    """
    probs = None
    if params.greedy:
        tokens = logits.argmax(-1)
        if with_probs:
            probs = filtered_probs(logits, params)
    else:
        probs = filtered_probs(logits, params)
        tokens = draw(probs, generator, noise)
    base = scaled_probs(logits, params) if with_confidence or with_entropy else None
    confidence = None
    if with_confidence and params.greedy:
        # the argmax's probability is the largest one: softmax is exp(x - max) / sum, exactly
        # 1 / sum at the argmax and at most that elsewhere (the same value as a gather)
        confidence = base.amax(-1)
    elif with_confidence:
        confidence = base.gather(-1, tokens[..., None]).squeeze(-1)
    entropy = -(base * torch.log(base.clamp_min(1e-30))).sum(-1) if with_entropy else None
    return tokens, confidence, entropy, probs
