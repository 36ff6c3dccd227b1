"""Log-probabilities of generated tokens (``SamplingParams(logprobs=k)``; docs/serving.md "Log-probabilities").

**Definition.** A generated token's log-probability is the log-softmax, in float32, of the
target's logits at that token's position in the denoising step that revealed it, with the MASK
token excluded (a step never reveals MASK; :func:`~simsd.decoding.step.without_mask_token_`), at
temperature 1 and before top-k / top-p: vLLM v1's default ``logprobs_mode="raw_logprobs"``
(logprobs of the model's output before temperature, penalties and filtering), except that a
request with penalties (:mod:`simsd.decoding.penalties`) gets those of the penalised logits, the
ones its step keeps (vLLM's are before the penalties). The step that
revealed a token is vanilla decoding's step (:class:`~simsd.decoding.vanilla.VanillaRow`); exact
mode's verification copy of that state has the same logits (docs/design.md §4.1), so exact mode
reports vanilla's log-probabilities. Paper mode reports the target's verification distribution
at the token's M slot (the logits its acceptance test reads), for accepted draft tokens and the
target's own corrections alike.

``rank`` is vLLM's: the number of vocabulary entries whose log-probability is at least the
token's (1 for the most likely token; vLLM's ``batched_count_greater_than``). The ``k`` most
likely tokens come with their ranks 1..k.

Nothing here runs unless a request asks for log-probabilities: a block's :class:`BlockLogprobs`
exists only then, and its device tensors are read once, when the block is finished.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Logprob:
    """vLLM's ``Logprob``: ``logprob`` (natural log, float), ``rank`` (1-based vocabulary rank,
    see the module doc) and ``decoded_token`` (the token's text, None without a tokenizer)."""
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> tuple:
    """Per row of ``logits (N, V)`` (MASK excluded already, any float dtype) the log-probability
    of ``tokens (N,)`` int64: ``(logprob (N,) float32, rank (N,) int64, top_logprobs (N, k)
    float32, top_ids (N, k) int64)``, on the logits' device, no host read (module doc)."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(-1, tokens[:, None])
    rank = (lp >= chosen).sum(-1)
    top = lp.topk(k, dim=-1) if k else (lp[:, :0], tokens[:, None][:, :0])
    return chosen[:, 0], rank, top[0], top[1]


def packed(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> torch.Tensor:
    """:func:`token_logprobs` as one ``(N, 2 + 2k)`` float64 tensor (one host read for all;
    ids and ranks are exact in float64), read back by :func:`entries`."""
    lp, rank, top, ids = token_logprobs(logits, tokens, k)
    return torch.cat([lp[:, None].double(), rank[:, None].double(), top.double(), ids.double()], dim=1)


def entries(rows: list, k: int) -> list:
    """The host rows of :func:`packed` as entries ``(logprob, rank, [(token_id, logprob), ...] of
    the top k)``, one per token."""
    return [(r[0], int(r[1]), [(int(t), v) for v, t in zip(r[2:2 + k], r[2 + k:])]) for r in rows]


class BlockLogprobs:
    """The log-probabilities of one block's tokens as its steps reveal them, on the device: each
    :meth:`note` writes the positions it is given; :meth:`read` returns them on the host (one
    transfer) when the block is finished. ``k``: top log-probabilities per token; ``L``: the block
    length."""

    def __init__(self, k: int, L: int, device):
        self.k = k
        self.values = torch.zeros(L, 2 + 2 * k, dtype=torch.float64, device=device)

    def note(self, logits: torch.Tensor, tokens: torch.Tensor, where: torch.Tensor) -> None:
        """Record the positions ``where (L,)`` bool of a step: their tokens ``tokens (L,)`` were
        revealed from ``logits (L, V)`` (row ``i``: the logits of position ``i``; MASK excluded)."""
        self.values = torch.where(where[:, None], packed(logits, tokens, self.k), self.values)

    def read(self, first: int) -> list:
        """The :func:`entries` of positions ``first ..`` (the generated tokens), one host read."""
        return entries(self.values[first:].tolist(), self.k)


def as_vllm(token_id: int, entry: tuple, decode=None) -> dict:
    """vLLM's per-token dict ``{token_id: Logprob}`` of one entry of :meth:`BlockLogprobs.read`:
    the generated token first, then the top k (ranks 1..k) that are not it. ``decode(id) -> str``
    gives ``decoded_token`` (None: no text)."""
    lp, rank, top = entry
    text = (lambda t: None) if decode is None else decode
    out = {token_id: Logprob(lp, rank, text(token_id))}
    for r, (t, v) in enumerate(top, 1):
        if t not in out:
            out[t] = Logprob(v, r, text(t))
    return out
