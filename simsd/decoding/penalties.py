"""vLLM's presence, frequency and repetition penalties on a denoising step's logits.

The rule is vLLM's (``vllm/model_executor/layers/utils.py`` ``apply_penalties`` and
``vllm/_custom_ops.py`` ``apply_repetition_penalties_torch``; applied by ``vllm/v1/sample/sampler.py``
to the float32 logits before temperature, top-k and top-p, and before a greedy argmax), for a token
``t`` of logit ``x``, with ``c(t)`` the times the *output so far* holds ``t``:

* repetition (``r``): when ``t`` is in the prompt or the output so far, ``x * (1 / r)`` if
  ``x > 0``, else ``x * r`` (``r = 1``: off);
* frequency (``f``): ``x - f * c(t)``; presence (``p``): ``x - p * [c(t) > 0]`` (0: off; OpenAI's
  definition), in that order, all in float32.

The ranges are vLLM's (:class:`simsd.config.fields.StepSampling`): ``p`` and ``f`` in [-2, 2],
``r`` finite and > 0.

**The output so far of a block-diffusion step.** A denoising step acts on a block *state* (some
positions revealed, the rest MASK); the output so far at that step is the row's output tokens of
the earlier blocks plus the tokens revealed in that state (MASK positions and the prompt tail that
opens the first block are not output). So a step's penalty is a function of the state it
denoises, as its logits are: exact verification's copy of a state gets the penalty vanilla
decoding applies at that state, and exact mode stays vanilla's token for token
(:class:`~simsd.decoding.step.Step` carries each state's :class:`TokenHistory`). The prompt
(repetition only) is the whole prompt, its tail included.

Proposals drawn from logits kept from an earlier step (self-speculation's proposals, a draft
step's alternatives) use them as penalised for the state they were computed on: they are
proposals only, which exact verification accepts only as the target's own steps.

A request without penalties (``StepSampling.penalized`` False) builds no history and runs none
of this: no op and no host read are added to its steps.
"""
from __future__ import annotations

import torch

from ..engine.host_sync import to_device


class TokenHistory:
    """One row's tokens before a block, on one device (no host reads; immutable: the next block's
    is :meth:`after`).

    ``tokens``: ``(T,)`` int64, the output tokens of the earlier blocks (``mask_id`` in place of a
    prompt-tail position: not counted); ``prompt``: ``(P,)`` int64, the prompt's ids;
    ``output``: ``(L,)`` bool, the block positions that hold output (False: the prompt tail);
    ``mask_id``: the MASK id, where a position that holds no output is counted (its logit is
    ``-inf`` when the penalties apply, so its count changes nothing).
    """

    def __init__(self, tokens: torch.Tensor, prompt: torch.Tensor, output: torch.Tensor, mask_id: int):
        self.tokens, self.prompt, self.output, self.mask_id = tokens, prompt, output, mask_id
        self._on: dict = {}

    @classmethod
    def start(cls, prompt: list, first: int, block_length: int, mask_id: int, device) -> "TokenHistory":
        """The history of a request's first block: ``prompt`` (host ids) and no output; the block's
        first ``first`` positions hold the prompt tail. One host-to-device copy."""
        host = to_device(list(prompt) + [0] * first + [1] * (block_length - first), device)
        prompt_ids, output = host.split([len(prompt), block_length])
        return cls(host[:0], prompt_ids, output.bool(), mask_id)

    def after(self, block: torch.Tensor) -> "TokenHistory":
        """The history of the next block: this one with the finished ``block (L,)``'s output
        appended (on the block's device; no host read)."""
        h = self.to(block.device)
        tokens = torch.cat([h.tokens, torch.where(h.output, block, self.mask_id)])
        return TokenHistory(tokens, h.prompt, torch.ones_like(h.output), self.mask_id)

    def to(self, device) -> "TokenHistory":
        """This history on ``device`` (copied once per device)."""
        device = torch.device(device)
        if self.tokens.device == device:
            return self
        moved = self._on.get(device)
        if moved is None:
            moved = self._on[device] = TokenHistory(self.tokens.to(device), self.prompt.to(device),
                                                    self.output.to(device), self.mask_id)
        return moved


def penalize_(logits: torch.Tensor, states: torch.Tensor, histories: list, params) -> torch.Tensor:
    """Apply ``params``' penalties (a :class:`~simsd.config.fields.StepSampling`; vLLM's rule,
    module doc) to ``logits (N, P, V)`` float32 in place and return them: ``states (N, L)`` the
    block state each of the ``N`` groups of ``P`` logit rows was computed on, ``histories`` the
    :class:`TokenHistory` of each state (``N`` of them, on the logits' device; consecutive equal ones
    are counted together). The MASK logit must be ``-inf`` already
    (:func:`~simsd.decoding.step.without_mask_token_`). No host read."""
    N, V = states.shape[0], logits.shape[-1]
    counts = torch.zeros(N, V, dtype=torch.float32, device=logits.device)
    seen = None
    if params.repetition_penalty != 1:
        seen = torch.zeros(N, V, dtype=torch.bool, device=logits.device)
    a = 0
    while a < N:
        h, b = histories[a], a + 1
        while b < N and histories[b] is h:
            b += 1
        revealed = torch.where(h.output, states[a:b], h.mask_id)  # MASK positions count as MASK: nothing
        ids = torch.cat([h.tokens.expand(b - a, -1), revealed], dim=1)
        counts[a:b].scatter_add_(1, ids, torch.ones(ids.shape, dtype=torch.float32, device=ids.device))
        if seen is not None:
            seen[a:b].index_fill_(1, h.prompt, True)
        a = b
    output = (counts > 0)[:, None]
    counts = counts[:, None]
    if seen is not None:
        r = torch.where(seen[:, None] | output, float(params.repetition_penalty), 1.0)  # float32
        logits.mul_(torch.where(logits > 0, 1.0 / r, r))
    if params.frequency_penalty != 0:
        logits.sub_(params.frequency_penalty * counts)
    if params.presence_penalty != 0:
        logits.sub_(params.presence_penalty * output)
    return logits
