"""Log-probabilities of a prompt's tokens (``SamplingParams(prompt_logprobs=k)``, a completion's
``echo`` with ``logprobs``; docs/serving.md "Log-probabilities").

**Definition** (block diffusion has no left-to-right factorisation of its own; this is the chain
rule under one reveal order, so the sum over a sequence is a proper log-probability of it).
Blocks are aligned to position 0 as in decoding (docs/design.md §3). Token ``i`` of block ``b`` is
scored with blocks ``0..b-1`` committed (their K/V in the cache, as decoding commits them) and,
inside block ``b``, positions ``< i`` revealed and positions ``>= i`` MASK: its log-probability is
the log-softmax (float32, MASK excluded, temperature 1: :mod:`simsd.decoding.logprobs`) of the
target's logits at ``i`` in that state -- the distribution a left-to-right (``sequential``)
denoising step would reveal it from. The first token of the sequence has none (None, as vLLM).

All states of a block are scored in one forward: one copy of the block per state (the ``exact``
mask: each copy sees the cache and itself; :func:`~simsd.decoding.layouts.exact_layout`'s
layout), read-only; the block's commit forward then writes its K/V. The pass runs on a scratch
cache of its own (the request's row is untouched: its decoding is the same with or without).
"""
from __future__ import annotations

import torch

from ..engine.host_sync import to_device
from .layouts import KNOWN, exact_layout
from .logprobs import entries, packed
from .step import without_mask_token_


def prompt_logprobs(model, ids: list, block_length: int, mask_id: int, k: int) -> list:
    """The log-probabilities of ``ids`` (a prompt, ``P`` host ints) under ``model`` (an
    :class:`~simsd.models.model.SDARForCausalLM`) with blocks of ``block_length`` (module doc):
    ``P`` entries, None for the first token, then ``(logprob, rank, [(token_id, logprob), ...] of
    the top k)`` (:func:`simsd.decoding.logprobs.entries`). ``ceil(P / L)``
    scoring forwards of ``n * L`` tokens (``n``: the block's prompt tokens) and a commit forward
    per full block but the last, one host read per block."""
    L, P = block_length, len(ids)
    dev = model.device
    cache = model.new_cache(1, -(-P // L) * L + L * L)  # the copies' writes land past the length
    cache.check_lengths = False
    out: list = [None]
    for b in range(0, P, L):
        block = list(ids[b:b + L])
        n = len(block)
        first = 1 if b == 0 else 0  # the sequence's first token has no log-probability
        if n > first:
            states = [block[:j] + [mask_id] * (L - j) for j in range(first, n)]
            C = len(states)
            copies, positions, labels = exact_layout(to_device(states, dev), b)
            logits = model(copies[None], to_device([positions], dev), to_device([labels], dev, torch.int32),
                           "exact", cache, 0, unit=L)[0].view(C, L, -1)
            at = to_device(list(range(first, n)), dev)
            rows = without_mask_token_(logits[torch.arange(C, device=dev), at], mask_id)  # state j scores position j
            out += entries(packed(rows, to_device(block[first:], dev), k).tolist(), k)
        if n == L and b + L < P:
            model(to_device([block], dev), to_device([list(range(b, b + L))], dev),
                  to_device([[KNOWN] * L], dev, torch.int32), "bidirectional", cache, L, None, unit=L)
    return out
