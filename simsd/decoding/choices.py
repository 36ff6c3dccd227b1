"""The decoding settings, each declared once with its checks, and the error they raise.

A :class:`Setting` carries a setting's type, valid values, help text and the decoding modes
that use it; a dataclass declares a field with it (:meth:`Setting.field`) and checks its
fields with :func:`check_fields` (one range check, one message form). The settings of
decoding (:class:`~simsd.decoding.config.DecodeConfig`, a step's :class:`SamplingParams`) and
of speculative decoding (:class:`~simsd.speculative.decoder.SpecConfig`) are declared here;
the entry points build the Python API, the server's requests and the command lines from the
same declarations (:mod:`simsd.entrypoints.settings`).

Every refusal is a :class:`ParamError`, a ``ValueError`` whose ``param`` names the setting.
Its message names settings through :func:`opt`, so that each surface shows its own spelling:
the field in the Python API and the server (``top_p``, ``rope_copy=False``), the option as
typed on the command line (``--top-p``, ``--no-rope-copy``).

Also here: the remasking strategies (docs/design.md §3.5) and their thresholds, and the
smallest temperature that still samples. Torch-free, so that the command line checks its
options before torch loads (a mistyped option costs a fraction of a second).
"""
from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass

STRATEGIES = ("sequential", "static", "dynamic", "entropy")
#: aliases used by SDAR's code
ALIASES = {"low_confidence_static": "static", "low_confidence_dynamic": "dynamic",
           "entropy_bounded": "entropy"}
DEFAULT_THRESHOLD = {"dynamic": 0.9, "entropy": 0.35}
MODES = ("vanilla", "paper", "exact")
SPECULATIVE = ("paper", "exact")
#: paper mode as the paper describes it, or as the SimSD release's code runs it (docs/design.md §4.3)
PAPER_VARIANTS = ("described", "release")

#: temperatures below this act as greedy: the smallest normal float32 (``torch.finfo(torch.float32).tiny``),
#: too small to divide float32 logits by
MIN_TEMPERATURE = 2.0 ** -126

_NAMED = re.compile("\x00(\\w+)(?:=([^\x00]*))?\x00")


def opt(name: str, value=None) -> str:
    """``name`` (a setting) as a message shows it on every surface; with ``value``: the setting
    at that value (``rope_copy=False`` in the API, ``--no-rope-copy`` on the command line)."""
    return f"\x00{name}\x00" if value is None else f"\x00{name}={value}\x00"


def field_name(name: str, value: str | None) -> str:
    """How the Python API and the server name a setting (:func:`opt`): its field."""
    return name if value is None else f"{name}={value}"


class ParamError(ValueError):
    """A setting out of its range or in a combination that is refused: ``param`` names the
    field as the API spells it (``max_tokens``, ``prompt``, ``temperature`` ...). The HTTP
    server answers 400 with it; the command line shows :meth:`render` with its options."""

    def __init__(self, param: str | None, message: str):
        self.param, self.template = param, message
        super().__init__(self.render())

    def render(self, name=field_name) -> str:
        """The message with each setting named by ``name(setting, value or None)``."""
        return _NAMED.sub(lambda m: name(m[1], m[2]), self.template)


def _number(x) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


@dataclass(frozen=True)
class Setting:
    """One setting: ``kind`` (int, float, str, bool, or object: not checked here), the valid
    range (``low``/``high``, ``open_low``: ``low`` excluded; ``choices``), ``help`` (the
    command line's help and the API's doc), ``modes`` (the decoding modes that use it),
    ``unit`` (shown with the range), ``many`` (a value or a list of them, kept as a tuple),
    ``parse`` (``parse(value, name)`` -> the value to keep, or :class:`ParamError`) and ``text``
    (the valid values in words, when the range does not say it all)."""
    kind: type
    help: str
    low: float | None = None
    high: float | None = None
    open_low: bool = False
    choices: tuple = ()
    modes: tuple = MODES
    unit: str | None = None
    many: bool = False
    parse: object = None
    text: str | None = None

    def field(self, default, **kw):
        """A dataclass field of this setting with ``default``."""
        return dataclasses.field(default=default, metadata={"setting": self}, **kw)

    def valid(self, unit: str | None = None) -> str:
        """The valid values in words (``unit``: the surface's own, else :attr:`unit`)."""
        lo, hi = self.low, self.high
        if self.text is not None:
            text = self.text
        elif self.choices:
            text = f"one of {', '.join(self.choices)}"
        elif self.kind is str and self.low:
            text = "a non-empty string"
        elif self.kind is bool:
            text = "true or false"
        elif self.kind is int:
            text = ("an integer" + (f" in [{lo}, {hi}]" if hi is not None else f" >= {lo}" if lo is not None
                                    else ""))
        elif self.kind is float:
            if hi is not None:
                text = f"a number in {'(' if self.open_low else '['}{_number(lo)}, {_number(hi)}]"
            else:
                text = "a finite number" + (f" {'>' if self.open_low else '>='} {_number(lo)}" if lo is not None
                                            else "")
        else:
            text = f"a {self.kind.__name__}"
        unit = unit or self.unit
        return text + (f" ({unit})" if unit else "") + (", or a list of them" if self.many else "")

    def ok(self, value) -> bool:
        """Whether one value is of the kind and in the range."""
        if self.kind is int or self.kind is float:
            kinds = int if self.kind is int else (int, float)
            if isinstance(value, bool) or not isinstance(value, kinds) or not math.isfinite(value):
                return False
            lo, hi = self.low, self.high
            return ((lo is None or (value > lo if self.open_low else value >= lo))
                    and (hi is None or value <= hi))
        if self.kind in (bool, str):
            return (isinstance(value, self.kind) and (not self.choices or value in self.choices)
                    and (self.kind is bool or len(value) >= (self.low or 0)))
        return True

    def check(self, name: str, value, unit: str | None = None):
        """``value`` as kept (a tuple for :attr:`many`, :attr:`parse`'s result), or
        :class:`ParamError` naming ``name`` and the valid values."""
        if self.many and value is None:
            return ()
        values = (value,) if self.many and not isinstance(value, (list, tuple)) else value
        for v in (values if self.many else (value,)):
            if self.parse is None and not self.ok(v):
                raise ParamError(name, f"{opt(name)} must be {self.valid(unit)}, got {v!r}")
        if self.parse is not None:
            return self.parse(value, name)
        return tuple(values) if self.many else value


def settings_of(cls) -> dict:
    """``{field: Setting}`` of a dataclass (class or instance) declared with settings."""
    return {f.name: f.metadata["setting"] for f in dataclasses.fields(cls) if "setting" in f.metadata}


def check_fields(obj) -> None:
    """Check every field of the dataclass ``obj`` declared with a :class:`Setting` (None is
    allowed where the field's default is None) and keep the checked values."""
    for f in dataclasses.fields(obj):
        setting, value = f.metadata.get("setting"), getattr(obj, f.name)
        if setting is None or (value is None and f.default is None):
            continue
        kept = setting.check(f.name, value)
        if kept is not value:
            object.__setattr__(obj, f.name, kept)


def check_modes(given: dict, modes) -> None:
    """:class:`ParamError` naming the settings in ``given`` (``{name: Setting}``) that none of
    the run's decoding ``modes`` uses (an option the run would ignore is refused)."""
    unused = [n for n, s in given.items() if not set(s.modes) & set(modes)]
    if unused:
        variants = [n for n in unused if given[n].modes == ("paper",) and given[n].kind is not bool]
        if variants:
            raise ParamError(variants[0], f"{opt(variants[0])} is a variant of paper mode (the mode is "
                                          f"{', '.join(modes)})")
        ablations = [n for n in unused if given[n].modes == ("paper",)]
        if len(ablations) == len(unused):
            raise ParamError(unused[0], f"{', '.join(opt(n, False) for n in unused)} is an ablation of paper mode")
        unused = [n for n in unused if n not in ablations]
        raise ParamError(unused[0], f"{', '.join(opt(n) for n in unused)}: used by the paper and exact modes "
                                    f"only (the mode is vanilla)")


def at_most(name: str, value, high: int, what: str) -> None:
    """:class:`ParamError` unless ``1 <= value <= high`` (``what``: what ``high`` is)."""
    if value is not None and not 1 <= value <= high:
        raise ParamError(name, f"{opt(name)} must be in [1, {high}] ({what}), got {value}")


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


def draft_settings(strategy: str, threshold, draft_strategy, draft_threshold) -> tuple:
    """The draft's ``(strategy, threshold)``: its own when given; else the target's strategy, and
    the target's threshold only when the strategies are the same (a confidence threshold is
    not an entropy bound); None = the strategy's default. The draft threshold is checked
    against the draft strategy's range (:class:`ParamError`)."""
    d_strategy = parse_strategy(draft_strategy, "draft_strategy") if draft_strategy is not None else strategy
    check_threshold(d_strategy, draft_threshold, "draft_threshold")
    if draft_threshold is not None:
        return d_strategy, draft_threshold
    return d_strategy, (threshold if d_strategy == strategy else None)


def check_gamma(gamma: int | None, block_length: int) -> None:
    """:class:`ParamError` when ``gamma`` draft steps cannot fit a block of ``block_length``."""
    if gamma is not None and gamma > block_length:
        raise ParamError("gamma", f"{opt('gamma')} {gamma} exceeds the block length {block_length} (a block is "
                                  f"finished in at most {block_length} steps; valid: 1 to {block_length})")


def check_release(variant: str, gamma: int | None, on_reject: str, gamma_name: str = "gamma") -> None:
    """:class:`ParamError` for paper mode's release variant with a ``gamma`` (``gamma_name``: the
    setting that gave it) or ``on_reject`` fallback: it drafts the whole rest of the block every
    round."""
    if variant != "release" or (gamma is None and on_reject != "fallback"):
        return
    name = gamma_name if gamma is not None else "on_reject"
    raise ParamError(name, f"{opt(name)}: the release variant of paper mode ({opt('paper_variant', 'release')}) "
                           f"drafts the whole rest of the block every round (no gamma, no fallback)")


def check_fold_commit(fold_commit: bool, optimistic: bool | None, devices: str | None = None) -> None:
    """:class:`ParamError` for ``fold_commit`` with optimistic drafting: ``optimistic`` True, or
    None (auto) with the draft on another device than the target (``devices``: ``"draft !=
    target"``, None: the same device); optimistic rollback needs explicit draft commits."""
    if not fold_commit or optimistic is False or (optimistic is None and devices is None):
        return
    why = (opt("optimistic", True) if optimistic
           else f"optimistic drafting, on by default with {opt('draft_device')} {devices}")
    raise ParamError("fold_commit", f"{opt('fold_commit')} is not combined with {why} (its rollback needs "
                                    f"explicit draft commits); pass {opt('optimistic', False)} or drop "
                                    f"{opt('fold_commit')}")


def by_strategy(value, name: str):
    """A threshold as given: its range depends on the strategy, checked with it (:func:`check_threshold`)."""
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
    "draft_strategy": Setting(str, _DRAFT + "the target's strategy", parse=parse_strategy, modes=SPECULATIVE),
    "draft_threshold": Setting(float, _DRAFT + "the target's threshold when the draft runs the target's "
                                      "strategy, else the draft strategy's default", modes=SPECULATIVE,
                               parse=by_strategy),
}


@dataclass(frozen=True)
class SamplingParams:
    """A denoising step's sampling: ``temperature`` (finite, >= 0; 0 = greedy), ``top_k``
    (>= 0; 0 = off, 1 = greedy), ``top_p`` (in (0, 1]; 1 = off). A temperature below
    ``MIN_TEMPERATURE`` is greedy too. Raises :class:`ParamError` naming the field and its range."""
    temperature: float = SETTINGS["temperature"].field(0.0)
    top_k: int = SETTINGS["top_k"].field(0)
    top_p: float = SETTINGS["top_p"].field(1.0)

    def __post_init__(self):
        check_fields(self)

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE or self.top_k == 1
