"""Per-request parameters of the Python API and the server, and their checks.

:class:`SamplingParams` is what one request asks for: the sampling fields of
:class:`simsd.decoding.sampling.SamplingParams` (it *is* one, so it also fits
``DecodeConfig(sampling=...)``), the OpenAI-style request fields (``max_tokens``, ``seed``,
``stop``, ``stop_token_ids``) and the SDAR decoding settings (``steps``, ``strategy``,
``threshold``, ``gamma``, ``draft_strategy``, ``draft_threshold``). Field checks run when it is
built; the checks
that need the model and mode run in :func:`resolve`, which also builds the
:class:`~simsd.decoding.config.DecodeConfig` and :class:`~simsd.speculative.decoder.SpecConfig`
of the request. Every error is a :class:`~simsd.entrypoints.errors.ParamError` naming the field.
"""
from __future__ import annotations

import math
import secrets
from dataclasses import dataclass

from ..decoding.config import DecodeConfig
from ..decoding.sampling import SamplingParams as StepSampling
from ..decoding.choices import parse_strategy
from ..speculative.decoder import SpecConfig
from .errors import ParamError, UsageError
from .options import check_threshold, draft_settings

#: seeds are integers in [0, MAX_SEED) (the draft's generator adds 2**20 to it)
MAX_SEED = 2 ** 63
#: settings of :class:`~simsd.entrypoints.api.LLM`, fixed when its engine is built: passed to
#: SamplingParams (a vLLM habit for some), they are refused by name, not with a bare TypeError
LLM_SETTINGS = ("mode", "device", "draft_device", "dtype", "batch_size", "max_model_len", "kv_cache_memory",
                "max_waiting", "block_length", "fold_commit", "on_reject", "rope_copy", "optimistic", "max_gamma",
                "paper_variant",
                "attention_backend", "cuda_graphs", "invariant", "tp", "threads", "scheduler_thread", "mask_token_id")


def _int(name, value, low=None, allow_none=False):
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise ParamError(name, f"{name} must be an integer, got {value!r}")
    if low is not None and value < low:
        raise ParamError(name, f"{name} must be >= {low}, got {value}")


def _number(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ParamError(name, f"{name} must be a finite number, got {value!r}")


@dataclass(frozen=True)
class SamplingParams(StepSampling):
    """What one request asks for (vLLM's ``SamplingParams`` in shape; defaults: greedy, 128 tokens).

    Sampling: ``temperature`` (0 = greedy), ``top_k`` (0 = off, 1 = greedy), ``top_p`` (1 = off);
    confidences follow SDAR's evaluation code (see :mod:`simsd.decoding.sampling`).

    Request: ``max_tokens`` (>= 1; generated tokens, the stop token included), ``seed`` (int in
    ``[0, 2**63)``; None: a fresh one, reported in the output so the request can be replayed;
    a request's randomness depends on its seed only), ``stop`` (strings: the text ends before
    the first one and generation stops), ``stop_token_ids`` (extra stop ids, kept in the
    output like the checkpoint's own), ``ignore_eos`` (do not stop on the checkpoint's stop
    ids; for benchmarks).

    ``n``: completions per request; simsd returns one (``n=1``, None = 1; other values are
    refused).

    Decoding (docs/design.md §3-4): ``steps`` (denoising steps per block, default the block length),
    ``strategy`` (``sequential | static | dynamic | entropy``), ``threshold`` (``dynamic``:
    confidence in [0, 1], default 0.9; ``entropy``: bound >= 0 nats, default 0.35), ``gamma``
    (draft steps verified per round, paper/exact only, default the block length), ``draft_strategy`` (default:
    ``strategy``), ``draft_threshold`` (in the draft strategy's range; default: ``threshold``
    when the draft runs the target's strategy, else the draft strategy's default).

    The block length and the other engine settings (``LLM_SETTINGS``) belong to the
    :class:`~simsd.entrypoints.api.LLM`: ``SamplingParams(block_length=8)`` is refused with a
    ``ParamError`` that says so.

    Raises:
        ParamError: a field of the wrong type or out of range, ``n`` other than 1, an LLM setting
            (``param`` names it).
    """
    max_tokens: int = 128
    seed: int | None = None
    stop: tuple = ()
    stop_token_ids: tuple = ()
    ignore_eos: bool = False
    steps: int | None = None
    strategy: str = "static"
    threshold: float | None = None
    gamma: int | None = None
    draft_strategy: str | None = None
    draft_threshold: float | None = None
    n: int | None = 1

    def __new__(cls, *args, **kwargs):
        # runs before the dataclass's __init__, which would refuse these with a bare TypeError
        for name in kwargs:
            if name in LLM_SETTINGS:
                raise ParamError(name, f"{name} is an LLM(...) setting, fixed when the engine is built, not a "
                                       f"request's: pass it to simsd.LLM(..., {name}=...)")
        return super().__new__(cls)

    def __post_init__(self):
        _number("temperature", self.temperature)
        if self.temperature < 0:
            raise ParamError("temperature", f"temperature must be >= 0, got {self.temperature}")
        _int("top_k", self.top_k, 0)
        _number("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ParamError("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        _int("max_tokens", self.max_tokens, 1)
        _int("seed", self.seed, 0, allow_none=True)
        if self.seed is not None and self.seed >= MAX_SEED:
            raise ParamError("seed", f"seed must be < 2**63, got {self.seed}")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if not all(isinstance(s, str) and s for s in stop):
            raise ParamError("stop", f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        object.__setattr__(self, "stop", stop)
        ids = tuple(self.stop_token_ids or ())
        for t in ids:
            _int("stop_token_ids", t, 0)
        object.__setattr__(self, "stop_token_ids", ids)
        if not isinstance(self.ignore_eos, bool):
            raise ParamError("ignore_eos", f"ignore_eos must be true or false, got {self.ignore_eos!r}")
        _int("n", self.n, 1, allow_none=True)
        if self.n not in (None, 1):
            raise ParamError("n", f"n={self.n}: simsd returns one completion per request (n=1); submit the prompt "
                                  f"{self.n} times with different seeds for more")
        object.__setattr__(self, "n", 1)
        _int("steps", self.steps, 1, allow_none=True)
        _int("gamma", self.gamma, 1, allow_none=True)
        for name in ("strategy", "draft_strategy"):
            value = getattr(self, name)
            if value is None and name == "draft_strategy":
                continue
            if not isinstance(value, str):
                raise ParamError(name, f"{name} must be a string, got {value!r}")
            try:
                object.__setattr__(self, name, parse_strategy(value))
            except ValueError as exc:
                raise ParamError(name, f"{name}: {exc}") from None
        d_strategy, _ = draft_settings(self.strategy, None, self.draft_strategy, None)
        for name, strategy in (("threshold", self.strategy), ("draft_threshold", d_strategy)):
            value = getattr(self, name)
            if value is not None:
                _number(name, value)
                try:  # the command line's check, with the field's name
                    check_threshold(strategy, value, name, {name: name})
                except UsageError as exc:
                    raise ParamError(name, str(exc)) from None


def fresh_seed() -> int:
    """A random seed for a request that gives none (reported back so it can be replayed)."""
    return secrets.randbelow(2 ** 62)


@dataclass(frozen=True)
class Settings:
    """The per-LLM settings a request is resolved against (fixed when the engine is built)."""
    mode: str
    block_length: int
    vocab_size: int
    fold_commit: bool = False
    on_reject: str = "redraft"
    rope_copy: bool = True
    optimistic: bool | None = None
    #: the most draft steps a request may verify per round (None: the block length)
    max_gamma: int | None = None
    #: paper mode as ``described`` in the paper or as the SimSD ``release`` runs it (SpecConfig)
    paper_variant: str = "described"


def resolve(params: SamplingParams, settings: Settings) -> tuple:
    """``(DecodeConfig, SpecConfig or None, seed)`` of a request: the checks that need the
    mode and the model, then the configurations the row programs take.

    Raises:
        ParamError: ``steps`` above the LLM's block length, ``gamma`` above it
            or above the LLM's ``max_gamma``, ``gamma`` / ``draft_strategy`` /
            ``draft_threshold`` in vanilla mode, a stop id outside the vocabulary. A request
            without ``gamma`` verifies ``max_gamma`` (else the block length) draft steps per round.
    """
    if not isinstance(params, SamplingParams):
        raise ParamError("params", f"params must be simsd.SamplingParams, got {type(params).__name__}")
    block_length = settings.block_length
    if params.steps is not None and params.steps > block_length:
        raise ParamError("steps", f"steps must be in [1, block_length={block_length}], got {params.steps}")
    vanilla = settings.mode == "vanilla"
    for name in ("gamma", "draft_strategy", "draft_threshold"):
        if vanilla and getattr(params, name) is not None:
            raise ParamError(name, f"{name} is used by the paper and exact modes only (this LLM runs vanilla)")
    if params.gamma is not None and params.gamma > block_length:
        raise ParamError("gamma", f"gamma {params.gamma} exceeds the block length {block_length} "
                                  f"(a block is finished in at most {block_length} steps)")
    if params.gamma is not None and settings.paper_variant == "release":
        raise ParamError("gamma", "gamma: the release variant of paper mode drafts the whole rest of the block every "
                                  "round (it verifies no fixed number of draft steps)")
    if params.gamma is not None and settings.max_gamma is not None and params.gamma > settings.max_gamma:
        raise ParamError("gamma", f"gamma {params.gamma} exceeds this LLM's max_gamma {settings.max_gamma} "
                                  f"(its caches hold the verify forwards of at most that many draft steps)")
    gamma = params.gamma if params.gamma is not None else settings.max_gamma
    bad = [t for t in params.stop_token_ids if t >= settings.vocab_size]
    if bad:
        raise ParamError("stop_token_ids", f"stop token id {bad[0]} is outside the vocabulary "
                                           f"[0, {settings.vocab_size})")
    seed = fresh_seed() if params.seed is None else params.seed
    cfg = DecodeConfig(block_length=block_length, steps=params.steps, strategy=params.strategy,
                       threshold=params.threshold, sampling=StepSampling(params.temperature, params.top_k, params.top_p),
                       max_new_tokens=params.max_tokens, seed=seed, fold_commit=settings.fold_commit)
    spec = None
    if not vanilla:
        spec = SpecConfig(mode=settings.mode, gamma=gamma, on_reject=settings.on_reject,
                          rope_copy=settings.rope_copy, draft_strategy=params.draft_strategy,
                          paper_variant=settings.paper_variant,
                          optimistic=settings.optimistic, draft_threshold=params.draft_threshold)
    return cfg, spec, seed
