"""A request's settings (:class:`SamplingParams`, of the Python API, the server and the command
line's request options), each declared once with its :class:`~simsd.config.vocabulary.Setting`,
and :func:`check_request`: every rule of a request against the engine it runs on, one check that
the Python API, the server and the command line all reach. Torch-free.
"""
from __future__ import annotations

import dataclasses
import hashlib
import secrets
from dataclasses import dataclass

from .engine import ENGINE_SETTINGS
from .fields import SETTINGS, StepSampling, check_threshold
from .speculative import draft_settings
from .vllm_names import request_names
from .vocabulary import ParamError, Rule, Setting, check_fields, check_rules, opt

#: the largest seed (a signed 64-bit value; :mod:`simsd.decoding.noise` keys the noise with it)
SEED_MAX = SETTINGS["seed"].high
#: the most stop strings a request may give, and the most characters they may hold in all: the
#: text of every request is searched for its stop strings after each generated token, on the
#: thread that runs every request's rounds (OpenAI allows 4 strings, TGI 4 by default)
MAX_STOP_STRINGS, MAX_STOP_CHARS = 16, 1024
#: the most top log-probabilities a request may ask for per token (vLLM's default ``max_logprobs``;
#: OpenAI's bound of chat ``top_logprobs``)
MAX_LOGPROBS = 20
#: the most completions one request may ask for (``n``): each is an engine request of its own, so
#: one request cannot fill the queue (OpenAI's limit is 128; vLLM has none)
MAX_N = 16


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
        ParamError: a field of the wrong type or out of range (``n`` above :data:`MAX_N`), a threshold
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
    n: int | None = Setting(int, f"completions per request (None = 1), at most {MAX_N}; choice i samples with "
                                 f"choice_seed(seed, i)", low=1, high=MAX_N).field(None)
    logprobs: int | None = Setting(int, f"return each generated token's log-probability and this many most likely "
                                        f"tokens' (vLLM's; None: none), at most {MAX_LOGPROBS}", low=0,
                                   high=MAX_LOGPROBS).field(None)
    prompt_logprobs: int | None = Setting(int, f"return each prompt token's log-probability and this many most "
                                               f"likely tokens' (vLLM's; None: none), at most {MAX_LOGPROBS}",
                                          low=0, high=MAX_LOGPROBS).field(None)

    def __new__(cls, *args, **kwargs):
        # runs before the dataclass's __init__, which would refuse these with a bare TypeError
        for name in kwargs:
            if name in ENGINE_SETTINGS:
                raise ParamError(name, f"{name} is an LLM(...) setting, fixed when the engine is built, not a "
                                       f"request's: pass it to simsd.LLM(..., {name}=...)")
        return super().__new__(cls)

    def __post_init__(self):
        check_fields(self)
        if self.n is None:
            object.__setattr__(self, "n", 1)
        check_threshold(self.strategy, self.threshold)
        draft_settings(self.strategy, self.threshold, self.draft_strategy, self.draft_threshold)


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice ``index`` of a request that samples with ``seed`` and asks for ``n > 1``
    completions: ``seed`` itself for choice 0 (so ``n=1`` is unchanged), else the first 63 bits
    of BLAKE2b (8-byte digest) of the text ``"simsd-choice:{seed}:{index}"``, a value in
    ``[0, SEED_MAX]``. A choice is an independent request of its own seed, so its tokens do not
    depend on the other choices or on anything else in flight: ``SamplingParams(n=1,
    seed=choice_seed(s, i))`` replays choice ``i``."""
    if index == 0:
        return seed
    digest = hashlib.blake2b(f"simsd-choice:{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


def split_choices(params: SamplingParams) -> list:
    """The ``params.n`` single-completion requests of ``params``: ``n=1`` and the seed of each
    choice (:func:`choice_seed`); a request without a seed gets a fresh one first (choice 0
    reports it). ``[params]`` for ``n=1``."""
    if params.n == 1:
        return [params]
    seed = secrets.randbelow(2 ** 62) if params.seed is None else params.seed
    return [dataclasses.replace(params, n=1, seed=choice_seed(seed, i)) for i in range(params.n)]


def _entropy_everywhere(s) -> bool:
    """Whether every model of the request runs the entropy strategy (the draft's own, if any)."""
    if s.strategy != "entropy":
        return False
    return s.mode == "vanilla" or draft_settings(s.strategy, None, s.draft_strategy, None)[0] == "entropy"


def _stop_chars(s) -> int:
    return sum(len(x) for x in s.stop)


#: The refused combinations of a request's settings with each other and with its engine's
#: (besides the speculative ones, :data:`~simsd.config.speculative.SPECULATIVE_RULES`), as
#: :class:`~simsd.config.vocabulary.Rule`. The stop strings are bounded (:data:`MAX_STOP_STRINGS`,
#: :data:`MAX_STOP_CHARS`) because the text of every request is searched for them after each
#: generated token, on the thread that runs every request's rounds: the search must stay small
#: beside a round.
REQUEST_RULES = (
    Rule("stop", lambda s: len(s.stop) > MAX_STOP_STRINGS,
         lambda s: f"{opt('stop')}: at most {MAX_STOP_STRINGS} stop strings, got {len(s.stop)} (the text is searched "
                   f"for each after every generated token)",
         ({}, {"stop": ["s"] * (MAX_STOP_STRINGS + 1)})),
    Rule("stop", lambda s: _stop_chars(s) > MAX_STOP_CHARS,
         lambda s: f"{opt('stop')}: the stop strings hold {_stop_chars(s)} characters, at most {MAX_STOP_CHARS} in "
                   f"all (the text is searched for each after every generated token)",
         ({}, {"stop": ["x" * MAX_STOP_CHARS, "y"]})),
    Rule("stop_token_ids", lambda s: s.vocab_size is not None and any(t >= s.vocab_size for t in s.stop_token_ids),
         lambda s: f"stop token id {next(t for t in s.stop_token_ids if t >= s.vocab_size)} is outside the "
                   f"vocabulary [0, {s.vocab_size})",
         ({}, {"stop_token_ids": [10 ** 9]})),
    Rule("steps", lambda s: s.steps is not None and _entropy_everywhere(s),
         lambda s: f"{opt('steps')}: the entropy strategy picks how many tokens a step reveals by its bound, it "
                   f"would ignore the step schedule",
         ({}, {"strategy": "entropy", "steps": 2})),
)


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
    from .speculative import SPECULATIVE_RULES
    from .vocabulary import MODES, check_modes, settings_of
    if not isinstance(params, SamplingParams):
        raise ParamError("params", f"params must be simsd.SamplingParams, got {type(params).__name__}")
    check_modes({n: s for n, s in settings_of(params).items() if s.modes != MODES and getattr(params, n) is not None},
                [config.mode])
    check_rules(SPECULATIVE_RULES + REQUEST_RULES, params, config, {"vocab_size": vocab_size})
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


