"""The settings vocabulary: :class:`Setting` (a setting's type, valid values, help and the
decoding modes that use it), the one error every refusal raises (:class:`ParamError`), the
checks a dataclass of settings runs on its fields (:func:`check_fields`, :func:`check_modes`),
and the refused combinations of settings as data (:class:`Rule`, checked by :func:`check_rules`:
each rule is stated once, in the room of the settings it concerns, and every layer that holds
those settings runs the same table).

A :class:`ParamError`'s message names settings through :func:`opt`, so that each surface shows
its own spelling: the field in the Python API and the server (``top_p``, ``rope_copy=False``),
the option as typed on the command line (``--top-p``, ``--no-rope-copy``). Torch-free.
"""
from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Callable

MODES = ("vanilla", "paper", "exact")
SPECULATIVE = ("paper", "exact")

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

    def of(self, where: str) -> ParamError:
        """This refusal said of ``where`` (a prompt of several: ``prompt 2``, ``prompt p.jsonl:3``)."""
        return ParamError(self.param, f"{where}: {self.template}")

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
    if not unused:
        return
    variants = [n for n in unused if given[n].modes == ("paper",) and given[n].kind is not bool]
    ablations = [n for n in unused if given[n].modes == ("paper",) and n not in variants]
    if variants:
        name, text = variants[0], f"{opt(variants[0])} is a variant of paper mode (the mode is {', '.join(modes)})"
    elif len(ablations) == len(unused):
        name, text = unused[0], f"{', '.join(opt(n, False) for n in unused)} is an ablation of paper mode"
    else:
        unused = [n for n in unused if n not in ablations]
        name, text = unused[0], f"{', '.join(opt(n) for n in unused)}: used by the paper and exact modes only (the " \
                                f"mode is vanilla)"
    raise ParamError(name, text)


def at_most(name: str, value, high: int, what: str) -> None:
    """:class:`ParamError` unless ``1 <= value <= high`` (``what``: what ``high`` is)."""
    if value is not None and not 1 <= value <= high:
        raise ParamError(name, f"{opt(name)} must be in [1, {high}] ({what}), got {value}")


@dataclass(frozen=True)
class Rule:
    """One refused combination of settings. ``broken(s)``: whether the settings ``s`` (a
    :class:`Settings`) break it; ``param``: the setting the refusal names (or ``param(s)``);
    ``text(s)``: the message (settings named through :func:`opt`, so each surface shows its own
    spelling); ``example``: ``(engine, request)`` keywords of :class:`~simsd.config.EngineArgs`
    and :class:`~simsd.config.SamplingParams` (or the command line's options) that break it: the
    tests drive every rule's example through the surfaces that reach it."""
    param: object
    broken: Callable
    text: Callable
    example: tuple = ({}, {})

    def name(self, s) -> str:
        return self.param(s) if callable(self.param) else self.param


class Settings:
    """The settings a :class:`Rule` reads: attribute ``name`` of the first source that has it
    (sources: dataclasses of settings, namespaces or dicts, e.g. a request's
    :class:`~simsd.config.SamplingParams` before its engine's :class:`~simsd.config.EngineArgs`),
    None when no source has it (a rule on a setting that this layer does not hold does not
    fire)."""

    def __init__(self, *sources):
        self._sources = sources

    def __getattr__(self, name: str):
        for source in self._sources:
            if isinstance(source, dict):
                if name in source:
                    return source[name]
            elif hasattr(source, name):
                return getattr(source, name)
        return None


def check_rules(rules, *sources) -> None:
    """:class:`ParamError` for the first of ``rules`` (:class:`Rule`) that the settings of
    ``sources`` (as :class:`Settings` reads them) break."""
    s = Settings(*sources)
    for rule in rules:
        if rule.broken(s):
            raise ParamError(rule.name(s), rule.text(s))
