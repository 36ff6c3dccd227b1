"""One denoising step of a block (docs/design.md §3, items 2 and 4-6) and its batched form.

:func:`denoise_step` samples every position of a block (or a batch of blocks), picks the
positions to reveal by the remasking strategy and writes their tokens, on the logits' device
with no host read. Its sampling noise is keyed (:mod:`simsd.decoding.noise`): the step at
``(row seed, position, step in the block)`` sees the same noise wherever it is computed
(vanilla decoding, the draft, exact verification). :class:`Step` is the request form the batch engine
(:mod:`simsd.engine.batching`) carries with a forward: the engine hands all steps of one
forward to :meth:`Step.run_batch`, which applies them as one batched step per configuration.

A step computes only what its settings read: a greedy step no probabilities and no noise, the
entropy only for the ``entropy`` strategy, the confidence only for ``static`` and ``dynamic``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..engine.host_sync import to_device
from .config import DecodeConfig
from .noise import NoiseKey, step_noise
from .penalties import penalize_
from .sampling import sample
from .strategies import select_positions

_MASK_INDEX: dict = {}


def without_mask_token_(logits: torch.Tensor, mask_id: int) -> torch.Tensor:
    """``logits (..., V)`` with the MASK token made impossible (a step never "reveals" MASK),
    in place (the logits of a forward are read once); returns ``logits``."""
    key = (mask_id, logits.device)
    index = _MASK_INDEX.get(key)
    if index is None:
        index = _MASK_INDEX[key] = torch.tensor([mask_id], device=logits.device)
    return logits.index_fill_(-1, index, float("-inf"))


def tokens_to_reveal(cfg: DecodeConfig, step, device):
    """Tokens the schedule asks for at ``step`` (an int, or host ints, one per block): an int
    when they all ask the same, else a ``(C,)`` tensor on ``device`` (one copy)."""
    if isinstance(step, int):
        return cfg.tokens_for_step(step)
    ks = [cfg.tokens_for_step(int(s)) for s in step]
    return ks[0] if len(set(ks)) == 1 else to_device(ks, device)


def denoise_step(logits: torch.Tensor, block: torch.Tensor, mask_id: int, cfg: DecodeConfig, step,
                 noise: torch.Tensor | None = None, histories: list | None = None):
    """One denoising step on ``block (L,)`` from ``logits (L, V)``, or on a batch of blocks
    ``(C, L)`` from ``(C, L, V)`` with ``step`` an int or ``C`` host ints (their 0-based steps).

    The MASK token is excluded from sampling and, when ``cfg.sampling`` has penalties, they are
    applied (:func:`~simsd.decoding.penalties.penalize_`, each block state with its own
    :class:`~simsd.decoding.penalties.TokenHistory` of ``histories``, one per state): this is
    where a step's logits become its distribution, for vanilla decoding, the draft and exact
    verification alike (``logits`` are changed in place). ``noise``: the
    ``Exp(1)`` draws of the exponential race, ``(..., L, V)`` float32 on the logits' device
    (:func:`~simsd.decoding.noise.step_noise`); needed when sampling, unused when greedy. Runs on the logits' device
    without host reads. Returns ``(new_block, revealed bool, probs (..., L, V) or None)``:
    ``probs`` is the distribution each position's token was drawn from (None when greedy).

    Raises:
        ValueError: sampling without ``noise``.
    """
    if not cfg.sampling.greedy and not isinstance(noise, torch.Tensor):
        raise ValueError("a sampling step needs its noise tensor (simsd.decoding.noise.step_noise)")
    masked = block == mask_id
    logits = without_mask_token_(logits, mask_id)
    if cfg.sampling.penalized:
        if histories is None or any(h is None for h in histories):
            raise ValueError("a step with penalties needs the token history of each state")
        penalize_(logits.view(-1, *logits.shape[-2:]), block.view(-1, block.shape[-1]), histories, cfg.sampling)
    tokens, conf, ent, probs = sample(logits, cfg.sampling, noise, with_probs=False,
                                      with_entropy=cfg.strategy == "entropy",
                                      with_confidence=cfg.strategy in ("static", "dynamic"))
    revealed = select_positions(cfg.strategy, masked, conf, ent, tokens_to_reveal(cfg, step, logits.device),
                                cfg.threshold)
    return torch.where(revealed, tokens, block), revealed, probs


@dataclass
class Step:
    """A denoising step to apply to a request's logits (:func:`denoise_step`): the engine runs
    the steps of all rows of a forward that share ``cfg`` as one batched step, and sends the
    row ``(new_block, revealed, probs)`` instead of the logits. ``index``: the step within the
    block (0-based, from the block's first step); ``key``: the row's noise key for this block
    (:class:`~simsd.decoding.noise.NoiseKey`; needed when sampling). A row's noise depends on
    its key and step only, so a row decodes exactly as it would alone.

    ``block``: ``(L,)``, or ``(C, L)``: C states of the block at steps ``index .. index + C - 1``
    (exact verification's copies, one step each; their logits are the request's ``C * L``
    tokens and the results have a leading ``C``), or at the steps of ``index`` when it is a list
    of ``C`` ints (a proposal tree's copies, :mod:`simsd.speculative.tree`), with ``key`` one
    per state when it is a list. ``keep_logits``: the
    result also carries the step's logits (MASK made impossible) and its noise (None when
    greedy), ``(new_block, revealed, probs, logits, noise)``, for a row that proposes from them
    (self-speculation, :mod:`simsd.speculative.self_draft`; a draft step's alternatives,
    :mod:`simsd.speculative.spec_row`). ``history``: the row's
    :class:`~simsd.decoding.penalties.TokenHistory` before this block (needed when ``cfg.sampling``
    has penalties; None otherwise), or one per state when it is a list (a tree's copy of the next
    block counts the finished block)."""
    block: torch.Tensor
    index: int | list
    cfg: DecodeConfig
    mask_id: int
    key: NoiseKey | list | None = None
    keep_logits: bool = False
    history: object = None

    @property
    def states(self) -> int:
        """Block states the step covers (1 for an ``(L,)`` block)."""
        return 1 if self.block.dim() == 1 else self.block.shape[0]

    def indices(self) -> list:
        """The step in the block of each state the step covers."""
        return list(self.index) if isinstance(self.index, list) else [self.index + c for c in range(self.states)]

    def keys(self) -> list:
        """The noise key of each state the step covers (``key`` may be one per state: a tree's copy
        of the next block draws that block's noise)."""
        return list(self.key) if isinstance(self.key, list) else [self.key] * self.states

    def histories(self) -> list:
        """The token history of each state the step covers (as :meth:`keys`)."""
        return list(self.history) if isinstance(self.history, list) else [self.history] * self.states

    @staticmethod
    def run_batch(steps: list, logits: torch.Tensor) -> list:
        """Apply the steps to their logits: ``logits`` holds every step's states in order, as
        ``(N, L, V)`` or any shape that views as it (``N``: the steps' states; changed in place).
        Returns ``(new_block, revealed, probs)`` per step, in order. Steps with equal step
        settings (block length, schedule, strategy, threshold, sampling) and ``mask_id`` run as one
        batched :func:`denoise_step`; each row's noise depends on its own key only, so a row
        decodes exactly as it would alone."""
        sizes = [s.states for s in steps]
        L = steps[0].block.shape[-1]
        if logits.shape[:2] != (sum(sizes), L):
            logits = logits.reshape(sum(sizes), L, -1)
        first_state = [0]
        for n in sizes:
            first_state.append(first_state[-1] + n)
        groups: dict = {}
        for j, s in enumerate(steps):
            c = s.cfg  # the settings a step reads: requests with equal settings share one batched step
            key = (c.block_length, tuple(c.schedule), c.strategy, c.threshold, c.sampling, s.mask_id)
            groups.setdefault(key, []).append(j)
        out = [None] * len(steps)
        for rows in groups.values():
            first = steps[rows[0]]
            batch = logits
            if len(rows) < len(steps):
                index = [i for j in rows for i in range(first_state[j], first_state[j + 1])]
                batch = logits.index_select(0, to_device(index, logits.device))
            blocks = [steps[j].block for j in rows]
            blocks = torch.stack(blocks) if all(b.dim() == 1 for b in blocks) else \
                torch.cat([b.view(-1, L) for b in blocks])
            index = [i for j in rows for i in steps[j].indices()]
            noise = None
            if not first.cfg.sampling.greedy:
                keys = [k for j in rows for k in steps[j].keys()]
                if any(k is None for k in keys):
                    raise ValueError("a sampling Step needs its noise key")
                noise = step_noise(keys, index, L, batch.shape[2], batch.device)
            histories = None
            if first.cfg.sampling.penalized:
                histories = [h if h is None else h.to(batch.device) for j in rows for h in steps[j].histories()]
            new, revealed, probs = denoise_step(batch, blocks, first.mask_id, first.cfg, index, noise, histories)
            group = [steps[j] for j in rows]
            keep = any(s.keep_logits for s in group)
            kept = (batch, noise) if keep else (None, None)  # the logits masked in place by the step
            for j, result in zip(rows, _per_step(group, new, revealed, probs, *kept)):
                out[j] = result if steps[j].keep_logits else result[:3]
        return out


def _per_step(steps: list, *batched) -> list:
    """The batched results ``(N, ...)`` cut per step: ``(...)`` for an ``(L,)`` step, ``(C, ...)``
    for a chain of C states (one op per tensor)."""
    sizes = [s.states for s in steps]
    parts = []
    for x in batched:
        if x is None:
            parts.append([None] * len(steps))
        elif all(s.block.dim() == 1 for s in steps):
            parts.append(x.unbind(0))
        else:
            parts.append([p if s.block.dim() == 2 else p[0] for s, p in zip(steps, x.split(sizes))])
    return list(zip(*parts))
