"""Checks of decoding options before anything is loaded: every value in its range, every
option used by the settings it belongs to (an option the run would ignore is an error).

The checks take any object with the option attributes (argparse's namespace, or a settings
object of the Python API) and a ``names`` mapping from attribute to the name errors should
show (``--max-new-tokens`` on the command line; the parameter name in an API). Errors are
:class:`UsageError` lines that name the option as given and its valid range.

Settings of the draft are its own: ``draft_strategy`` (default: the target's strategy) and
``draft_threshold`` (default: the target's ``threshold`` when both run the same strategy,
else the draft strategy's default), each checked against the draft strategy's range.
"""
from __future__ import annotations

import math

from ..decoding.choices import DEFAULT_THRESHOLD, MIN_TEMPERATURE, STRATEGIES, parse_strategy, threshold_range
from .errors import UsageError

#: manual_seed takes 64-bit values and the draft adds 2**20 + the prompt index: a signed 63-bit seed fits
SEED_MAX = 2 ** 63 - 1

#: attribute -> (kind, low, high, range text); high None = unbounded
RANGES = {
    "max_new_tokens": ("int", 1, None, "an integer >= 1"),
    "block_length": ("int", 1, None, "an integer >= 1"),
    "steps": ("int", 1, None, "an integer >= 1"),
    "gamma": ("int", 1, None, "an integer >= 1"),
    "temperature": ("float", 0.0, None, "a finite number >= 0 (0 = greedy)"),
    "top_k": ("int", 0, None, "an integer >= 0 (0 = off, 1 = greedy)"),
    "top_p": ("float", 0.0, 1.0, "a number in (0, 1]"),
    "seed": ("int", 0, SEED_MAX, f"an integer in [0, {SEED_MAX}]"),
    "limit": ("int", 1, None, "an integer >= 1"),
    "batch_size": ("int", 1, None, "an integer >= 1"),
    "tp": ("int", 1, None, "an integer >= 1"),
    "warmup": ("int", 0, None, "an integer >= 0"),
    "repeats": ("int", 1, None, "an integer >= 1"),
    "threads": ("int", 1, None, "an integer >= 1"),
}
SPEC_OPTIONS = ("draft", "draft_device", "gamma", "on_reject", "draft_strategy", "draft_threshold", "optimistic")


def option_name(attr: str, names: dict | None = None) -> str:
    """How errors name ``attr``: ``names[attr]``, else the command-line flag ``--attr-name``."""
    return (names or {}).get(attr, "--" + attr.replace("_", "-"))


def check_value(attr: str, value, names: dict | None = None) -> None:
    """``UsageError`` unless ``value`` lies in the range ``RANGES[attr]`` (None: not given, fine)."""
    if value is None or attr not in RANGES:
        return
    kind, lo, hi, text = RANGES[attr]
    name = option_name(attr, names)
    if kind == "float":
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        ok = ok and value >= lo and (hi is None or value <= hi) and not (attr == "top_p" and value == 0)
    else:
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= lo and (hi is None or value <= hi)
    if not ok:
        raise UsageError(f"{name} must be {text}, got {value}")


def check_threshold(strategy: str, value, attr: str = "threshold", names: dict | None = None) -> None:
    """``UsageError`` unless ``value`` (None: the strategy's default) is in ``strategy``'s range."""
    if value is None:
        return
    name = option_name(attr, names)
    lo, hi, text = threshold_range(strategy)
    if lo is None:
        raise UsageError(f"{name} applies to the dynamic and entropy strategies, not {strategy}")
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < lo or (hi is not None and value > hi):
        raise UsageError(f"{name} of the {strategy} strategy is {text}, got {value}")


def named_strategy(name: str, attr: str, names: dict | None = None) -> str:
    """:func:`parse_strategy` whose error names the option (``UsageError``)."""
    try:
        return parse_strategy(name)
    except ValueError as exc:
        raise UsageError(f"{option_name(attr, names)}: {exc}") from None


def draft_settings(strategy: str, threshold, draft_strategy, draft_threshold) -> tuple[str, float | None]:
    """The draft's ``(strategy, threshold)``: its own when given; else the target's strategy, and
    the target's threshold only when the strategies are the same (a confidence threshold is
    not an entropy bound); None = the strategy's default."""
    d_strategy = parse_strategy(draft_strategy) if draft_strategy is not None else strategy
    if draft_threshold is not None:
        return d_strategy, draft_threshold
    return d_strategy, (threshold if d_strategy == strategy else None)


def same_device(a: str | None, b: str | None) -> bool:
    """Whether two device options name the same device (None: the default, cuda if available)."""
    import torch
    dev = lambda d: torch.device(d or ("cuda" if torch.cuda.is_available() else "cpu"))  # noqa: E731
    try:
        x, y = dev(a), dev(b)
    except RuntimeError:
        return a == b  # a bad name is reported by the device check
    if x.type != y.type:
        return False
    return x.type == "cpu" or (x.index or 0) == (y.index or 0)


def _given(args, attr: str) -> bool:
    return getattr(args, attr, None) is not None


def modes_of(args) -> list:
    """The decoding modes of a command (``--mode``, or bench's and eval's ``--modes``; eval also
    knows ``paper-release``, paper mode with ``paper_variant="release"``)."""
    command = getattr(args, "command", "generate")
    if command not in ("bench", "eval"):
        return [args.mode]
    if getattr(args, "mode", None) is not None:
        raise UsageError(f"simsd {command} takes --modes (comma-separated), not --mode")
    known = ("vanilla", "paper", "exact") + (("paper-release",) if command == "eval" else ())
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in known]
    if bad:
        raise UsageError(f"unknown mode(s) in --modes: {', '.join(bad)} (choose from {', '.join(known)})")
    if not modes:
        raise UsageError(f"--modes names no mode (choose from {', '.join(known)})")
    if len(set(modes)) != len(modes):
        raise UsageError(f"--modes names a mode twice: {args.modes}")
    return modes


def check_options(args, modes, names: dict | None = None) -> None:
    """Check option values and combinations that need no checkpoint (see the module doc).

    ``modes``: the decoding modes the run uses. Raises :class:`UsageError`.
    """
    n = lambda attr: option_name(attr, names)  # noqa: E731
    for attr in RANGES:
        check_value(attr, getattr(args, attr, None), names)
    strategy = named_strategy(getattr(args, "strategy", None) or "static", "strategy", names)
    speculative = bool({"paper", "paper-release", "exact"} & set(modes))
    check_threshold(strategy, getattr(args, "threshold", None), "threshold", names)
    if not speculative:
        given = [n(a) for a in SPEC_OPTIONS if _given(args, a)]
        if given:
            raise UsageError(f"{', '.join(given)}: used by the paper and exact modes only (this run is vanilla)")
    d_strategy = strategy
    if speculative:
        d_given = getattr(args, "draft_strategy", None)
        d_strategy = strategy if d_given is None else named_strategy(d_given, "draft_strategy", names)
        check_threshold(d_strategy, getattr(args, "draft_threshold", None), "draft_threshold", names)
    # sampling: options that shape a sampling distribution need one
    temperature, top_k, top_p = args.temperature, args.top_k, args.top_p
    # a temperature too small to divide float32 logits by is greedy (simsd.decoding.sampling)
    need = "> 0" if temperature == 0 else f">= {MIN_TEMPERATURE:.3g}"
    if temperature < MIN_TEMPERATURE:
        for attr, value, off in (("top_k", top_k, top_k in (0, 1)), ("top_p", top_p, top_p == 1.0)):
            if not off:
                raise UsageError(f"{n(attr)} {value} needs {n('temperature')} {need} (with {n('temperature')} "
                                 f"{temperature:g} decoding is greedy and {attr.replace('_', '-')} would be ignored)")
    greedy = temperature < MIN_TEMPERATURE or top_k == 1
    if greedy and _given(args, "seed"):
        tiny = 0 < temperature < MIN_TEMPERATURE
        t_greedy = f"{n('temperature')} {temperature:g} < {MIN_TEMPERATURE:.3g}" if tiny else f"{n('temperature')} 0"
        raise UsageError(f"{n('seed')}: greedy decoding ({t_greedy} or {n('top_k')} 1) draws nothing at "
                         f"random, the seed would be ignored")
    if _given(args, "steps") and strategy == "entropy" and d_strategy == "entropy":
        raise UsageError(f"{n('steps')}: the entropy strategy picks how many tokens a step reveals by its bound, "
                         f"it would ignore the step schedule")
    if speculative and getattr(args, "on_reject", None) == "fallback" and getattr(args, "gamma", None) == 1:
        raise UsageError(f"{n('on_reject')} fallback with {n('gamma')} 1 never falls back (it finishes a block "
                         f"when fewer than gamma positions remain)")
    if getattr(args, "no_rope_copy", False) and not {"paper", "paper-release"} & set(modes):
        raise UsageError(f"{n('no_rope_copy')} is an ablation of paper mode")
    check_paper_variant(args, modes, names)
    if speculative and getattr(args, "fold_commit", False):
        optimistic = getattr(args, "optimistic", None)
        target_dev, draft_dev = getattr(args, "device", None), getattr(args, "draft_device", None)
        separate = draft_dev is not None and not same_device(draft_dev, target_dev)
        if optimistic == "on" or (optimistic in (None, "auto") and separate):
            why = (f"{n('optimistic')} on" if optimistic == "on"
                   else f"optimistic drafting, on by default with {n('draft_device')} {draft_dev} != {target_dev}")
            raise UsageError(f"{n('fold_commit')} is not combined with {why} (its rollback needs explicit draft "
                             f"commits); pass {n('optimistic')} off or drop {n('fold_commit')}")
    single = _given(args, "prompt") or _given(args, "prompt_ids")
    if single and _given(args, "limit"):
        raise UsageError(f"{n('limit')} applies to {n('prompts_file')} and {n('prompt_set')}, not to a single prompt")
    if single and getattr(args, "batch_size", 1) > 1:
        raise UsageError(f"{n('batch_size')} {args.batch_size} with a single prompt: batches need "
                         f"{n('prompts_file')} or {n('prompt_set')}")
    if getattr(args, "raw", False) and _given(args, "prompt_ids"):
        raise UsageError(f"{n('raw')} applies to text prompts; {n('prompt_ids')} bypass the tokenizer and its "
                         f"chat template")
    if getattr(args, "tp", 1) > 1:  # last: it loads torch (unless the device is the CPU)
        check_tp_devices(getattr(args, "device", None), args.tp, n("tp"))


def check_paper_variant(args, modes, names: dict | None = None) -> None:
    """``UsageError`` for ``paper_variant`` outside paper mode, and for the release variant
    (``paper_variant`` release, or eval's ``paper-release`` mode) with a ``gamma`` or
    ``on_reject`` fallback: it drafts the whole rest of the block every round."""
    n = lambda attr: option_name(attr, names)  # noqa: E731
    variant = getattr(args, "paper_variant", None)
    if variant is not None and not {"paper", "paper-release"} & set(modes):
        raise UsageError(f"{n('paper_variant')} is a variant of paper mode (this run: {', '.join(modes)})")
    if variant == "release" or "paper-release" in modes:
        named = f"{n('paper_variant')} release" if variant == "release" else "paper-release"
        for attr, bad in (("gamma", _given(args, "gamma")), ("on_reject", getattr(args, "on_reject", None) == "fallback")):
            if bad:
                raise UsageError(f"{n(attr)}: the release variant of paper mode ({named}) drafts the whole rest of "
                                 f"the block every round (no gamma, no fallback)")


def check_tp_devices(device, tp: int, name: str = "--tp") -> None:
    """Tensor parallelism on CUDA runs one rank per GPU (``cuda:<local rank>``, simsd.engine.tp):
    :class:`UsageError` when the ranks of this machine (``tp``, or torchrun's ``LOCAL_WORLD_SIZE``)
    outnumber the visible GPUs, before any rank starts or weights load. On the CPU the ranks are
    processes (gloo): any number. ``device``: the ``--device`` option (None: cuda if available)."""
    if device is not None and str(device).split(":")[0] != "cuda":
        return  # the CPU (check_device refuses other device types)
    import os

    import torch
    if device is None and not torch.cuda.is_available():
        return
    local = int(os.environ.get("LOCAL_WORLD_SIZE", tp))
    visible = torch.cuda.device_count()
    if local > visible:
        shown = os.environ.get("CUDA_VISIBLE_DEVICES")
        raise UsageError(f"{name} {tp}: {local} ranks on this machine need {local} GPUs (one rank per GPU), "
                         f"{visible} visible" + (f" (CUDA_VISIBLE_DEVICES={shown})" if shown is not None else ""))


def check_device(name: str, value):
    """``torch.device`` of a device option (``name`` as errors show it); :class:`UsageError` if
    it is not a device name, or names a device this machine does not have."""
    import torch
    try:
        dev = torch.device(value)
    except (RuntimeError, TypeError) as exc:
        raise UsageError(f"{name} {value!r} is not a device name (cpu, cuda, cuda:1, ...)") from exc
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"{name} {value}: no CUDA device is available (torch {torch.__version__})")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise UsageError(f"{name} {value}: only {torch.cuda.device_count()} CUDA device(s)")
    elif dev.type != "cpu":
        raise UsageError(f"{name} {value}: only cpu and cuda devices are supported")
    return dev


def check_engine_options(devices, cuda_graphs: bool, invariant: bool, names: dict | None = None) -> None:
    """Engine options this machine or build cannot honour: ``cuda_graphs`` needs every model's
    device (``devices``: names or ``torch.device``) to be a CUDA device, and is not combined with
    ``invariant`` (the graph runner does not run the per-unit path). Raises :class:`UsageError`."""
    n = lambda attr: option_name(attr, names)  # noqa: E731
    if not cuda_graphs:
        return
    import torch
    if invariant:
        raise UsageError(f"{n('invariant')} is not available with {n('cuda_graphs')} (the graph runner does not run "
                         f"the per-unit path)")
    devices = sorted({str(d) for d in devices})
    if any(torch.device(d).type != "cuda" for d in devices) or not torch.cuda.is_available():
        raise UsageError(f"{n('cuda_graphs')} needs CUDA devices, got {', '.join(devices)}")


def check_block_options(args, block_length: int, max_positions: int, names: dict | None = None) -> None:
    """Checks that need the block length (given or the checkpoint's) and the model's
    maximum length: ``block_length < max_positions``, ``steps`` and ``gamma`` in ``[1, block_length]``."""
    n = lambda attr: option_name(attr, names)  # noqa: E731
    if block_length >= max_positions:
        raise UsageError(f"{n('block_length')} {block_length} leaves no room in the model's maximum length "
                         f"{max_positions} (valid: 1 to {max_positions - 1})")
    steps = getattr(args, "steps", None)
    if steps is not None and steps > block_length:
        raise UsageError(f"{n('steps')} must be in [1, {block_length}] (the block length), got {steps}")
    gamma = getattr(args, "gamma", None)
    if gamma is not None and gamma > block_length:
        raise UsageError(f"{n('gamma')} {gamma} exceeds the block length {block_length} "
                         f"(a block is finished in at most {block_length} steps; valid: 1 to {block_length})")


__all__ = ["RANGES", "SEED_MAX", "check_options", "modes_of", "check_block_options", "check_device", "check_engine_options",
           "check_tp_devices", "check_threshold", "check_value", "draft_settings", "option_name", "DEFAULT_THRESHOLD", "STRATEGIES"]
