"""The decoding settings, each declared once (:data:`SETTINGS`, by field name), with the
remasking strategies (docs/design.md §3.5) and their thresholds, the smallest temperature that
still samples, and a denoising step's sampling (:class:`StepSampling`). The dataclasses of
decoding (:class:`~simsd.decoding.config.DecodeConfig`), speculative decoding
(:class:`~simsd.config.speculative.SpecConfig`), the engine and the requests
(:mod:`simsd.config.engine`, :mod:`simsd.config.request`) declare their fields with these.
Torch-free.
"""
from __future__ import annotations

from dataclasses import dataclass

from .vocabulary import MODES, SPECULATIVE, ParamError, Setting, check_fields, opt

STRATEGIES = ("sequential", "static", "dynamic", "entropy")
#: aliases used by SDAR's code
ALIASES = {"low_confidence_static": "static", "low_confidence_dynamic": "dynamic",
           "entropy_bounded": "entropy"}
DEFAULT_THRESHOLD = {"dynamic": 0.9, "entropy": 0.35}
#: paper mode as the paper describes it, or as the SimSD release's code runs it (docs/design.md §4.3)
PAPER_VARIANTS = ("described", "release")

#: temperatures below this act as greedy: the smallest normal float32 (``torch.finfo(torch.float32).tiny``),
#: too small to divide float32 logits by
MIN_TEMPERATURE = 2.0 ** -126

def threshold_range(strategy: str) -> tuple:
    """``(low, high, text)`` of a strategy's threshold: a confidence in ``[0, 1]`` (``dynamic``),
    an entropy bound in nats ``>= 0`` (``entropy``); ``(None, None, ...)`` for strategies without one."""
    if strategy == "dynamic":
        return 0.0, 1.0, "a confidence in [0, 1]"
    if strategy == "entropy":
        return 0.0, None, "an entropy bound in nats >= 0"
    return None, None, "not used"


def parse_strategy(value, name: str = "strategy") -> str:
    """The strategy's name (SDAR's aliases mapped); :class:`ParamError` naming the choices."""
    strategy = ALIASES.get(value, value) if isinstance(value, str) else value
    if strategy not in STRATEGIES:
        raise ParamError(name, f"{opt(name)}: unknown strategy {value!r} (choose from {', '.join(STRATEGIES)})")
    return strategy


def check_threshold(strategy: str, value, name: str = "threshold") -> None:
    """:class:`ParamError` unless ``value`` (None: the strategy's default) is in ``strategy``'s range."""
    if value is None:
        return
    lo, hi, text = threshold_range(strategy)
    if lo is None:
        raise ParamError(name, f"{opt(name)} applies to the dynamic and entropy strategies, not {strategy}")
    if not FINITE.ok(value) or value < lo or (hi is not None and value > hi):
        raise ParamError(name, f"{opt(name)} of the {strategy} strategy is {text}, got {value}")


def by_strategy(value, name: str):
    """A threshold as given: its range depends on the strategy, checked with it (:func:`check_threshold`)."""
    return value


def parse_width(value, name: str = "speculation_width"):
    """``speculation_width`` as kept: ``"auto"``, or an int >= 1 (a string of digits taken as one);
    :class:`ParamError` otherwise."""
    if value == "auto":
        return "auto"
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ParamError(name, f"{opt(name)} must be auto or an integer >= 1 (block copies per verify forward), "
                               f"got {value!r}")
    return value


FINITE = Setting(float, "")
_DRAFT = "the draft's own; default: "
#: the settings of decoding, by field name (a dataclass field: ``SETTINGS["steps"].field(None)``)
SETTINGS = {
    "mode": Setting(str, "vanilla: SDAR decoding with the target; paper: SimSD as published; exact: SimSD with "
                         "output identical to vanilla (greedy or sampled, same seed; see README)", choices=MODES),
    "temperature": Setting(float, "sampling temperature; 0 = greedy", low=0,
                           text="a finite number >= 0 (0 = greedy)"),
    "top_k": Setting(int, "keep the k most likely tokens; 0 = off, 1 = greedy (at any temperature)", low=0,
                     text="an integer >= 0 (0 = off, 1 = greedy)"),
    "top_p": Setting(float, "nucleus sampling mass; 1 = off", low=0, high=1, open_low=True),
    # vLLM's penalties, with vLLM's ranges (vllm/sampling_params.py); simsd.decoding.penalties applies them
    "presence_penalty": Setting(float, "subtracted from the logit of every token the output holds so far "
                                       "(vLLM's and OpenAI's presence_penalty); 0 = off", low=-2, high=2),
    "frequency_penalty": Setting(float, "subtracted from a token's logit once per time the output holds it so far "
                                        "(vLLM's and OpenAI's frequency_penalty); 0 = off", low=-2, high=2),
    "repetition_penalty": Setting(float, "divides the positive logits (multiplies the others) of every token of the "
                                         "prompt or the output so far (vLLM's repetition_penalty); 1 = off", low=0,
                                  open_low=True),
    "max_tokens": Setting(int, "most tokens generated per request (up to and including the stop token)", low=1),
    "seed": Setting(int, "seed of the request's sampling noise (sampling only; its randomness depends on it "
                         "alone)", low=0, high=2 ** 63 - 1),
    "block_length": Setting(int, "the block length (default: the checkpoint's block_size; 4 for model_type sdar "
                                 "without one; required for a qwen3 checkpoint without one)", low=1),
    "steps": Setting(int, "denoising steps per block, 1 to the block length (default: the block length)", low=1),
    "strategy": Setting(str, "remasking strategy: sequential | static | dynamic | entropy", parse=parse_strategy),
    "threshold": Setting(float, "confidence threshold (dynamic, in [0, 1], default 0.9) or entropy bound "
                                "(entropy, nats >= 0, default 0.35)", parse=by_strategy),
    "fold_commit": Setting(bool, "fold each block's commit forward into the next block's first forward"),
    "gamma": Setting(int, "draft steps verified per round, 1 to the block length (default: the block length)",
                     low=1, modes=SPECULATIVE),
    "on_reject": Setting(str, "after a partial acceptance: redraft the rest, or (the paper's fallback) finish with "
                              "vanilla target denoising when fewer than gamma positions remain",
                         choices=("redraft", "fallback"), modes=SPECULATIVE),
    "rope_copy": Setting(bool, "paper mode's RoPE copy (off: the ablation, mask slots at fresh positions after "
                               "the draft slots)", modes=("paper",)),
    "paper_variant": Setting(str, "paper mode as the paper describes it (described: acceptance in the draft's "
                                  "temporal order) or as the SimSD release's code runs it (release: position "
                                  "order, the rest re-drafted with a fresh schedule, no bonus token; no gamma, no "
                                  "fallback; docs/design.md §4.3)", choices=PAPER_VARIANTS, modes=("paper",)),
    "optimistic": Setting(bool, "draft the next round while the target verifies, roll back on rejection "
                                "(auto: when draft and target are on different devices)", modes=SPECULATIVE),
    "speculation_width": Setting(object, "the most block copies of an exact verify forward: with --draft self "
                                         "the proposal tree (its depth up to gamma, alternatives beside each "
                                         "proposed step), or auto: the tree with the most expected tokens per "
                                         "second, from the acceptance seen and what the engine's forwards cost on "
                                         "this device; with a draft model, N past gamma + 1 copies adds "
                                         "alternatives beside each drafted step (static and sequential draft "
                                         "strategies), auto: the draft's chain",
                                 parse=parse_width, modes=("exact",), text="auto or an integer >= 1"),
    "draft_strategy": Setting(str, _DRAFT + "the target's strategy", parse=parse_strategy, modes=SPECULATIVE),
    "draft_threshold": Setting(float, _DRAFT + "the target's threshold when the draft runs the target's "
                                      "strategy, else the draft strategy's default", modes=SPECULATIVE,
                               parse=by_strategy),
}


@dataclass(frozen=True)
class StepSampling:
    """A denoising step's sampling: ``temperature`` (finite, >= 0; 0 = greedy), ``top_k``
    (>= 0; 0 = off, 1 = greedy), ``top_p`` (in (0, 1]; 1 = off). A temperature below
    ``MIN_TEMPERATURE`` is greedy too. vLLM's penalties, applied to the logits before all of these
    (greedy decoding too; :mod:`simsd.decoding.penalties`): ``presence_penalty`` and
    ``frequency_penalty`` (in [-2, 2]; 0 = off) and ``repetition_penalty`` (finite, > 0; 1 = off),
    vLLM's ranges. Raises :class:`ParamError` naming the field and its range."""
    temperature: float = SETTINGS["temperature"].field(0.0)
    top_k: int = SETTINGS["top_k"].field(0)
    top_p: float = SETTINGS["top_p"].field(1.0)
    presence_penalty: float = SETTINGS["presence_penalty"].field(0.0)
    frequency_penalty: float = SETTINGS["frequency_penalty"].field(0.0)
    repetition_penalty: float = SETTINGS["repetition_penalty"].field(1.0)

    def __post_init__(self):
        check_fields(self)

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE or self.top_k == 1

    @property
    def penalized(self) -> bool:
        """Whether a penalty is on (any away from its neutral value): only then does a step count
        the tokens so far (nothing is computed for a request without penalties)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1
