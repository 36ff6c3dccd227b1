"""One denoising step of a block (docs/design.md §3, items 2 and 4-6) and its batched form.

:func:`denoise_step` samples every position of a block (or a batch of blocks), picks the
positions to reveal by the remasking strategy and writes their tokens, on the logits' device
with no host read. Its sampling noise is keyed (:mod:`simsd.decoding.noise`): the step at
``(row seed, position, step in the block)`` sees the same noise wherever it is computed
(vanilla decoding, the draft, exact verification). :class:`Step` is the request form the batch engine
(:mod:`simsd.engine.batching`) carries with a forward: the engine hands all steps of one
forward to :meth:`Step.run_batch`, which applies them as one batched step per configuration.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..engine.host_sync import to_device
from .config import DecodeConfig
from .noise import NoiseKey, exponential
from .sampling import sample
from .strategies import select_positions


def without_mask_token(logits: torch.Tensor, mask_id: int) -> torch.Tensor:
    """``logits (..., V)`` with the MASK token made impossible (a step never "reveals" MASK)."""
    out = logits.clone()
    out[..., mask_id] = float("-inf")
    return out


def denoise_step(logits: torch.Tensor, block: torch.Tensor, mask_id: int, cfg: DecodeConfig, step,
                 noise: torch.Tensor | None = None):
    """One denoising step on ``block (L,)`` from ``logits (L, V)``, or on a batch of blocks
    ``(C, L)`` from ``(C, L, V)`` with ``step`` an int or a ``(C,)`` tensor of their 0-based steps.

    The MASK token is excluded from sampling. ``noise``: the ``Exp(1)`` draws of the exponential
    race, ``(..., L, V)`` float32 on the logits' device (:func:`step_noise`); needed when sampling,
    unused when greedy. Runs on the logits' device without host reads. Returns ``(new_block,
    revealed bool, probs (..., L, V) or None)``: ``probs`` is the distribution each position's
    token was drawn from (None when greedy).

    Raises:
        ValueError: sampling without ``noise``.
    """
    if not cfg.sampling.greedy and not isinstance(noise, torch.Tensor):
        raise ValueError("a sampling step needs its noise tensor (simsd.decoding.step.step_noise)")
    masked = block == mask_id
    logits = without_mask_token(logits, mask_id)
    tokens, conf, ent, probs = sample(logits, cfg.sampling, None, noise, with_probs=False,
                                      with_entropy=cfg.strategy == "entropy")
    revealed = select_positions(cfg.strategy, masked, conf, ent, cfg.tokens_for_step(step), cfg.threshold)
    return torch.where(revealed, tokens, block), revealed, probs


def step_noise(keys, steps, length: int, vocab: int, device) -> torch.Tensor:
    """The sampling noise of ``len(keys)`` blocks: ``(R, length, vocab)`` ``Exp(1)`` draws of
    :mod:`simsd.decoding.noise` keyed by each block's :class:`NoiseKey` and denoising step
    (``steps``: an int, R ints, or an ``(R,)`` tensor on ``device``)."""
    return exponential(keys, steps, length, vocab, device)


@dataclass
class Step:
    """A denoising step to apply to a request's logits (:func:`denoise_step`): the engine runs
    the steps of all rows of a forward that share ``cfg`` as one batched step, and sends the
    row ``(new_block, revealed, probs)`` instead of the logits. ``index``: the step within the
    block (0-based, from the block's first step); ``key``: the row's noise key for this block
    (:class:`~simsd.decoding.noise.NoiseKey`; needed when sampling). A row's noise depends on
    its key and step only, so a row decodes exactly as it would alone."""
    block: torch.Tensor
    index: int
    cfg: DecodeConfig
    mask_id: int
    key: NoiseKey | None = None

    @staticmethod
    def run_batch(steps: list, logits: list) -> list:
        """Apply ``steps[j]`` to ``logits[j] (L, V)``; returns ``(new_block, revealed, probs)``
        per step, in order. Steps with equal step settings (block length, steps, strategy, threshold,
        sampling) and ``mask_id`` run as one batched :func:`denoise_step`; each row's noise depends
        on its own key only, so a row decodes exactly as it would alone."""
        groups: dict = {}
        for j, s in enumerate(steps):
            c = s.cfg  # the settings a step reads: requests with equal settings share one batched step
            key = (c.block_length, c.steps, c.strategy, c.threshold, c.sampling, s.mask_id)
            groups.setdefault(key, []).append(j)
        out = [None] * len(steps)
        for rows in groups.values():
            first = steps[rows[0]]
            batch = torch.stack([logits[j] for j in rows])
            blocks = torch.stack([steps[j].block for j in rows])
            index = [steps[j].index for j in rows]
            step = index[0] if len(set(index)) == 1 else to_device(index, batch.device)
            noise = None
            if not first.cfg.sampling.greedy:
                if any(steps[j].key is None for j in rows):
                    raise ValueError("a sampling Step needs its noise key")
                noise = step_noise([steps[j].key for j in rows], index, batch.shape[1], batch.shape[2], batch.device)
            new, revealed, probs = denoise_step(batch, blocks, first.mask_id, first.cfg, step, noise)
            for k, j in enumerate(rows):
                out[j] = (new[k], revealed[k], None if probs is None else probs[k])
        return out
