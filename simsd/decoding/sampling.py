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

import torch

from ..config.fields import MIN_TEMPERATURE, StepSampling  # noqa: F401  (declared torch-free there; re-exported)

_MAX_TEMPERATURE = torch.finfo(torch.float32).max


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


def scaled_probs(logits: torch.Tensor, params: StepSampling) -> torch.Tensor:
    """Softmax of ``logits (..., V)`` at the sampling temperature (1 when greedy), float32."""
    t = 1.0 if params.greedy else params.temperature
    return torch.softmax(scaled_scores(logits, t), dim=-1)


def filtered_probs(logits: torch.Tensor, params: StepSampling) -> torch.Tensor:
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


def draw(weights: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """One index per row of ``weights (..., V)`` (non-negative, not all zero), drawn with
    probability proportional to the weight, on the weights' device and without host reads:
    ``argmax(w / E)`` with ``E ~ Exp(1)`` i.i.d. (the exponential race; the index of the first
    of independent exponential clocks with rates ``w`` is distributed as ``w / sum(w)``).
    ``noise``: the ``E``, float32 ``(..., V)`` on the weights' device (keyed:
    :func:`simsd.decoding.noise.step_noise`). Returns int64 ``(...)``."""
    return (weights.float() / noise.clamp_min(torch.finfo(torch.float32).tiny)).argmax(-1)


def sample(logits: torch.Tensor, params: StepSampling, noise: torch.Tensor | None = None,
           with_probs: bool = True, with_entropy: bool = True, with_confidence: bool = True):
    """Draw one token per row of ``logits (..., V)`` on their device (no host reads; ``noise``:
    the ``Exp(1)`` draws of :func:`draw` on that device, needed when sampling, unused when greedy).

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
        tokens = draw(probs, noise)
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
