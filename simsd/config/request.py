"""A request's settings (:class:`SamplingParams`, of the Python API, the server and the command
line's request options), each declared once with its :class:`~simsd.config.vocabulary.Setting`,
and :func:`check_request`: every rule of a request against the engine it runs on, one check that
the Python API, the server and the command line all reach. Torch-free.
"""
from __future__ import annotations

from dataclasses import dataclass

from .engine import ENGINE_SETTINGS
from .fields import SETTINGS, StepSampling, check_threshold
from .speculative import draft_settings
from .vllm_names import request_names
from .vocabulary import ParamError, Setting, check_fields

#: the largest seed (a signed 64-bit value; :mod:`simsd.decoding.noise` keys the noise with it)
SEED_MAX = SETTINGS["seed"].high
#: the most stop strings a request may give, and the most characters they may hold in all: the
#: text of every request is searched for its stop strings after each generated token, on the
#: thread that runs every request's rounds (OpenAI allows 4 strings, TGI 4 by default)
MAX_STOP_STRINGS, MAX_STOP_CHARS = 16, 1024


@request_names  # vLLM's and SGLang's names of the fields (simsd.config.vllm_names)
@dataclass(frozen=True)
class SamplingParams(StepSampling):
    """What one request asks for (vLLM's ``SamplingParams`` in shape; defaults: greedy, 128
    tokens). A step's sampling (``temperature``, ``top_k``, ``top_p``; it *is* a
    :class:`simsd.decoding.sampling.SamplingParams`, so it also fits
    ``DecodeConfig(sampling=...)``), the OpenAI-style request fields, and the SDAR decoding
    settings of the request (docs/design.md §3-4); see each field's help. ``seed`` None: a
    fresh one, reported in the output so the request can be replayed.

    The engine's settings (:class:`EngineArgs`) belong to the :class:`~simsd.entrypoints.api.LLM`:
    ``SamplingParams(block_length=8)`` is refused with a ``ParamError`` that says so.

    Raises:
        ParamError: a field of the wrong type or out of range, ``n`` other than 1, a threshold
            outside its strategy's range, an LLM setting (``param`` names it).
    """
    max_tokens: int = SETTINGS["max_tokens"].field(128)
    seed: int | None = SETTINGS["seed"].field(None)
    stop: tuple = Setting(str, "strings that end the generation (the text ends before the first one)", low=1,
                          many=True).field(())
    stop_token_ids: tuple = Setting(int, "ids that end the generation besides the checkpoint's own (kept in the "
                                         "output)", low=0, many=True).field(())
    ignore_eos: bool = Setting(bool, "do not stop at the checkpoint's stop ids (benchmarks)").field(False)
    steps: int | None = SETTINGS["steps"].field(None)
    strategy: str = SETTINGS["strategy"].field("static")
    threshold: float | None = SETTINGS["threshold"].field(None)
    gamma: int | None = SETTINGS["gamma"].field(None)
    draft_strategy: str | None = SETTINGS["draft_strategy"].field(None)
    draft_threshold: float | None = SETTINGS["draft_threshold"].field(None)
    n: int | None = Setting(int, "completions per request: simsd returns one (n=1; None = 1)", low=1).field(None)

    def __new__(cls, *args, **kwargs):
        # runs before the dataclass's __init__, which would refuse these with a bare TypeError
        for name in kwargs:
            if name in ENGINE_SETTINGS:
                raise ParamError(name, f"{name} is an LLM(...) setting, fixed when the engine is built, not a "
                                       f"request's: pass it to simsd.LLM(..., {name}=...)")
        return super().__new__(cls)

    def __post_init__(self):
        check_fields(self)
        if self.n not in (None, 1):
            raise ParamError("n", f"n={self.n}: simsd returns one completion per request (n=1); submit the prompt "
                                  f"{self.n} times with different seeds for more")
        object.__setattr__(self, "n", 1)
        check_threshold(self.strategy, self.threshold)
        draft_settings(self.strategy, self.threshold, self.draft_strategy, self.draft_threshold)


def check_request(params: SamplingParams, config, vocab_size: int | None = None) -> list:
    """Every rule of a request ``params`` against an engine of ``config`` (an
    :class:`~simsd.config.engine.EngineArgs`; its ``block_length`` None before the checkpoint is
    read, which skips the rules that need it) and a vocabulary of ``vocab_size`` (None: not known
    yet): the Python API, the server and the command line all run it, so they refuse the same
    requests. Returns the notes on settings that will have no effect (the command line prints
    them; the API and the server take such requests as they are, OpenAI's leniency: clients send
    ``seed`` and ``top_p`` by habit).

    Raises:
        ParamError: a setting the engine's mode does not use (``gamma`` ... in vanilla mode),
            ``gamma`` above the block length or the engine's ``max_gamma``, a ``gamma`` with the
            release variant of paper mode, a stop id outside the vocabulary, more than
            :data:`MAX_STOP_STRINGS` stop strings or more than :data:`MAX_STOP_CHARS`
            characters of them, ``steps`` with the entropy strategy on every model (it would
            ignore them), ``on_reject="fallback"`` with ``gamma`` 1 (it never falls back).
    """
    from .fields import MIN_TEMPERATURE
    from .speculative import check_gamma, check_release, check_self_draft, is_self_draft
    from .vocabulary import MODES, check_modes, opt, settings_of
    if not isinstance(params, SamplingParams):
        raise ParamError("params", f"params must be simsd.SamplingParams, got {type(params).__name__}")
    check_modes({n: s for n, s in settings_of(params).items() if s.modes != MODES and getattr(params, n) is not None},
                [config.mode])
    speculative = config.mode != "vanilla"
    if speculative and is_self_draft(getattr(config, "draft", None)):
        check_self_draft(params)  # no draft strategy or threshold: there is no draft model
    if config.block_length is not None:
        check_gamma(params.gamma, config.block_length)
    check_release(config.paper_variant if config.mode == "paper" else "described", params.gamma, "redraft")
    if params.gamma is not None and config.max_gamma is not None and params.gamma > config.max_gamma:
        raise ParamError("gamma", f"{opt('gamma')} {params.gamma} exceeds this LLM's {opt('max_gamma')} "
                                  f"{config.max_gamma} (its caches hold the verify forwards of at most that many "
                                  f"draft steps)")
    check_stop(params.stop)
    bad = [t for t in params.stop_token_ids if vocab_size is not None and t >= vocab_size]
    if bad:
        raise ParamError("stop_token_ids", f"stop token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    d_strategy = draft_settings(params.strategy, None, params.draft_strategy, None)[0] if speculative else None
    if params.steps is not None and params.strategy == "entropy" and d_strategy in (None, "entropy"):
        raise ParamError("steps", f"{opt('steps')}: the entropy strategy picks how many tokens a step reveals by "
                                  f"its bound, it would ignore the step schedule")
    if speculative and config.on_reject == "fallback" and params.gamma == 1:
        raise ParamError("on_reject", f"{opt('on_reject', 'fallback')} with {opt('gamma', 1)} never falls back (it "
                                      f"finishes a block when fewer than gamma positions remain)")
    notes, temperature = [], params.temperature
    if temperature < MIN_TEMPERATURE:  # greedy: a sampling setting is ignored
        need = "> 0" if temperature == 0 else f">= {MIN_TEMPERATURE:.3g}"
        for name, off in (("top_k", params.top_k in (0, 1)), ("top_p", params.top_p == 1.0)):
            if not off:
                notes.append((name, f"{opt(name)} {getattr(params, name)} needs {opt('temperature')} {need} (with "
                                    f"{opt('temperature')} {temperature:g} decoding is greedy and {opt(name)} is "
                                    f"ignored)"))
    if params.greedy and params.seed is not None:
        tiny = 0 < temperature < MIN_TEMPERATURE
        why = f"{opt('temperature')} {temperature:g} < {MIN_TEMPERATURE:.3g}" if tiny else f"{opt('temperature')} 0"
        notes.append(("seed", f"{opt('seed')}: greedy decoding ({why} or {opt('top_k')} 1) draws nothing at random, "
                              f"the seed is ignored"))
    return notes


def check_stop(stop: tuple) -> None:
    """:class:`ParamError` naming ``stop`` when a request gives more than :data:`MAX_STOP_STRINGS`
    stop strings or more than :data:`MAX_STOP_CHARS` characters of them in all (the search for
    them after each generated token must stay small beside a round: other requests wait on it)."""
    from .vocabulary import opt
    if len(stop) > MAX_STOP_STRINGS:
        raise ParamError("stop", f"{opt('stop')}: at most {MAX_STOP_STRINGS} stop strings, got {len(stop)} (the text "
                                 f"is searched for each after every generated token)")
    chars = sum(len(s) for s in stop)
    if chars > MAX_STOP_CHARS:
        raise ParamError("stop", f"{opt('stop')}: the stop strings hold {chars} characters, at most {MAX_STOP_CHARS} "
                                 f"in all (the text is searched for each after every generated token)")
