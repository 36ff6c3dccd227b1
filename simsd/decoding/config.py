"""Decoding configuration, prompt checks and results.

Semantics follow SDAR's reference decoding (docs/design.md §3): blocks aligned to absolute
position 0, block-causal prefill of the aligned prompt part, the unaligned prompt tail inside
the first decode block, a read-only cache while denoising, a commit forward per finished block.
"""
from __future__ import annotations

import dataclasses
import secrets
from dataclasses import dataclass, field

from ..config.fields import SETTINGS, StepSampling, check_threshold
from ..config.request import check_request
from ..config.speculative import SpecConfig
from ..config.vocabulary import ParamError, check_fields, opt
from .strategies import transfer_schedule


@dataclass
class DecodeConfig:
    """Decoding settings shared by every mode (declared in :data:`simsd.config.fields.SETTINGS`).

    ``steps`` defaults to ``block_length`` (one token per step for the schedule strategies).
    ``threshold`` is the confidence threshold of ``dynamic`` or the entropy bound of
    ``entropy`` (nats). ``logprobs``: the rows also report each generated token's
    log-probability and this many top ones (:mod:`simsd.decoding.logprobs`). Raises
    :class:`~simsd.config.vocabulary.ParamError` naming the field.
    """
    block_length: int = SETTINGS["block_length"].field(4)
    steps: int | None = SETTINGS["steps"].field(None)
    strategy: str = SETTINGS["strategy"].field("static")
    threshold: float | None = SETTINGS["threshold"].field(None)
    sampling: StepSampling = field(default_factory=StepSampling)
    max_new_tokens: int = SETTINGS["max_tokens"].field(128)
    seed: int = SETTINGS["seed"].field(0)
    fold_commit: bool = SETTINGS["fold_commit"].field(False)
    #: top log-probabilities per generated token (:mod:`simsd.decoding.logprobs`); None: none computed
    logprobs: int | None = None

    def __post_init__(self):
        check_fields(self)
        if self.steps is None:
            self.steps = self.block_length
        check_threshold(self.strategy, self.threshold)
        self.schedule = transfer_schedule(self.block_length, self.steps)

    def tokens_for_step(self, step: int) -> int:
        """Tokens the schedule asks for at 0-based ``step`` of a block (the last entry repeats)."""
        return self.schedule[min(step, len(self.schedule) - 1)]

    def revealing(self, k: int) -> "DecodeConfig":
        """A copy whose schedule asks for ``k`` tokens at every step (``k >= 1``): a schedule
        computed step by step from the MASK count, as the SimSD release's draft does
        (:class:`simsd.speculative.verifiers.ReleaseVerifier`)."""
        cfg = dataclasses.replace(self)
        cfg.schedule = [max(1, int(k))] * self.block_length
        return cfg


@dataclass
class GenerationResult:
    """``token_ids``: generated ids cut after the first stop id and at ``max_new_tokens``;
    ``logprobs``: with ``DecodeConfig.logprobs``, one entry per token of ``token_ids``
    (:meth:`simsd.decoding.logprobs.BlockLogprobs.read`), else None."""
    token_ids: list
    stats: dict
    text: str | None = None
    logprobs: list | None = None


@dataclass
class BatchResult:
    """``results[i]``: the :class:`GenerationResult` of prompt ``i``; ``stats``: ``batch_size,
    new_tokens, decode_seconds, tokens_per_second`` (all rows' tokens over the batch's decode
    time, prefill excluded) and ``batched_forwards`` per model."""
    results: list
    stats: dict


def finish(generated: list, stop_ids, max_new_tokens: int) -> list:
    """Cut ``generated`` after the first stop id (kept) and at ``max_new_tokens``."""
    out = []
    stops = set(stop_ids)
    for t in generated[:max_new_tokens]:
        out.append(t)
        if t in stops:
            break
    return out


def check_prompt_ids(prompt_ids, config, mask_id: int | None = None) -> None:
    """Validate prompt ids against a model: not empty, inside the vocabulary, and without the
    mask id (``mask_id``, else the config's ``mask_token_id``): a prompt never changes, and
    decoding would treat a MASK in it as a position to fill.

    Raises:
        ParamError: naming ``prompt``: empty, an id outside the vocabulary, the mask id (its
            position named).
    """
    if len(prompt_ids) == 0:
        raise ParamError("prompt", "the prompt is empty")
    bad = [t for t in prompt_ids if not 0 <= int(t) < config.vocab_size]
    if bad:
        raise ParamError("prompt", f"token id {bad[0]} is outside the vocabulary [0, {config.vocab_size})")
    mask = mask_id if mask_id is not None else config.mask_token_id
    ids = [int(t) for t in prompt_ids]
    if mask is not None and int(mask) in ids:
        at = ids.index(int(mask))
        raise ParamError("prompt", f"prompt token {at} is the mask id {int(mask)}; a prompt cannot contain the mask "
                                   f"token (decoding would overwrite it)")


def check_prompt(prompt_ids, config, max_new_tokens: int, block_length: int, mask_id: int | None = None,
                 max_model_len: int | None = None) -> int:
    """Validate prompt ids (:func:`check_prompt_ids`) and return the cache capacity (tokens) the
    generation needs: the prompt and ``max_new_tokens`` must fit the model's positions and, when
    given, an engine's ``max_model_len`` (positions per request, at most the model's).

    Raises:
        ParamError: see :func:`check_prompt_ids`; a prompt too long (``param`` ``prompt``), or too
            long with ``max_new_tokens`` (``param`` ``max_tokens``, including the rounding of
            the last block to a whole block); each surface names the setting as its user spells it.
    """
    check_prompt_ids(prompt_ids, config, mask_id)
    limit, what = config.max_position_embeddings, "the model's maximum length"
    if max_model_len is not None and max_model_len <= limit:
        limit, what = max_model_len, opt("max_model_len")
    P = len(prompt_ids)
    if P >= limit:
        raise ParamError("prompt", f"prompt of {P} tokens is longer than {what} {limit} - 1")
    if P + max_new_tokens > limit:
        raise ParamError("max_tokens", f"prompt ({P} tokens) + {opt('max_tokens')} ({max_new_tokens}) exceeds "
                                       f"{what} {limit}")
    total = -(-(P + max_new_tokens) // block_length) * block_length
    if total > config.max_position_embeddings:
        raise ParamError("max_tokens", f"prompt ({P} tokens) + {opt('max_tokens')} ({max_new_tokens}) rounded up "
                                       f"to whole blocks of {block_length} is {total} positions, past the model's "
                                       f"maximum length {config.max_position_embeddings}")
    return total + block_length


def resolve(params, config, vocab_size: int) -> tuple:
    """``(DecodeConfig, SpecConfig or None, seed)`` of a request to an engine of ``config`` (its
    ``block_length`` set) and a vocabulary of ``vocab_size``: the request's rules
    (:func:`simsd.config.request.check_request`), then the configurations the row programs take
    (``params``: a :class:`simsd.SamplingParams`, ``config``: an :class:`simsd.config.EngineArgs`).
    A request without ``gamma`` verifies ``max_gamma`` (else the block length) draft steps per
    round.

    Raises:
        ParamError: as :func:`~simsd.config.request.check_request`; ``steps`` above the block
            length.
    """
    check_request(params, config, vocab_size)
    seed = secrets.randbelow(2 ** 62) if params.seed is None else params.seed  # a fresh one is reported back
    cfg = DecodeConfig(block_length=config.block_length, steps=params.steps, strategy=params.strategy,
                       threshold=params.threshold,
                       sampling=StepSampling(params.temperature, params.top_k, params.top_p, params.presence_penalty,
                                             params.frequency_penalty, params.repetition_penalty),
                       max_new_tokens=params.max_tokens, seed=seed, fold_commit=config.fold_commit,
                       logprobs=params.logprobs)
    spec = None
    if config.mode != "vanilla":
        spec = SpecConfig(mode=config.mode, gamma=params.gamma or config.max_gamma, on_reject=config.on_reject,
                          rope_copy=config.rope_copy, draft_strategy=params.draft_strategy,
                          optimistic=config.optimistic, draft_threshold=params.draft_threshold,
                          paper_variant=config.paper_variant,
                          speculation_width=getattr(config, "speculation_width", "auto"))
    return cfg, spec, seed
