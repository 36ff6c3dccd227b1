"""Will a run fit? The memory of a whole run (weights, KV caches, verify workspaces; see
:mod:`simsd.engine.memory`) estimated from the settings and the prompts' lengths, before any
weight is loaded, and the largest settings that would fit when it does not."""
from __future__ import annotations

from dataclasses import dataclass

from ..decoding.choices import ParamError, opt
from ..engine.memory import Estimate, estimate, fmt_bytes, largest_fitting, shortfall, weight_bytes


@dataclass
class RunShape:
    """What the memory of a run depends on. ``models``: name -> ``(config, dtype, device,
    dense_attention)`` (``target``, and ``draft`` when a speculative mode runs); ``gamma``
    None = the block length."""
    models: dict
    prompt_lengths: list
    max_new_tokens: int
    block_length: int
    gamma: int | None
    batch_size: int
    modes: list


def capacity_of(prompt_lengths, max_new_tokens: int, block_length: int) -> int:
    """Cache tokens a row needs (as :func:`simsd.decoding.config.check_prompt` computes them)."""
    return max(-(-(p + max_new_tokens) // block_length) * block_length + block_length for p in prompt_lengths)


def run_estimate(shape: RunShape, **change) -> Estimate:
    """The bytes per device of a run with ``shape`` (fields replaced by ``change``)."""
    s = RunShape(**{**shape.__dict__, **change})
    block_length = s.block_length
    gamma = min(s.gamma or block_length, block_length)
    capacity = capacity_of(s.prompt_lengths, s.max_new_tokens, block_length)
    total = Estimate()
    for name, (config, dtype, device, _) in s.models.items():
        total.add(device, "weights", weight_bytes(config, dtype))
    for mode in s.modes:  # one engine per mode, side by side (simsd bench); one forward at a time
        names = ["target"] if mode == "vanilla" else ["target", "draft"]
        margin = (2 if mode == "vanilla" else gamma + 2) * block_length
        est = estimate({n: s.models[n] for n in names if n in s.models}, s.batch_size, capacity, margin,
                       with_weights=False)
        for device, parts in est.parts.items():
            have = total.parts[device]
            have["kv_caches"] += parts["kv_caches"]
            have["workspace"] = max(have["workspace"], parts["workspace"])
    return total


def check_run_memory(shape: RunShape) -> Estimate:
    """:class:`ParamError` (one line: the estimate, the free memory and the largest block length,
    gamma, batch size and max_tokens that would fit, each with the others unchanged) when the
    run does not fit a device; returns the estimate otherwise."""
    est = run_estimate(shape)
    short = shortfall(est)
    if short is None:
        return est
    device, _, free = short

    def fits(**change) -> bool:
        return shortfall(run_estimate(shape, **change)) is None

    hints = []
    gamma = shape.gamma or shape.block_length
    knobs = [("block_length", shape.block_length, lambda v: fits(block_length=v))]
    if any(m != "vanilla" for m in shape.modes):
        knobs.append(("gamma", gamma, lambda v: fits(gamma=v)))
    knobs += [("batch_size", shape.batch_size, lambda v: fits(batch_size=v)),
              ("max_tokens", shape.max_new_tokens, lambda v: fits(max_new_tokens=v))]
    for attr, value, ok in knobs:
        if value > 1:
            best = largest_fitting(ok, 1, value - 1)
            if best is not None:
                hints.append(f"{opt(attr)} {best}")
    hint = ("; it fits with " + " or ".join(hints) + (" (each alone)" if len(hints) > 1 else "")) if hints else \
        "; no smaller block length, gamma, batch size or max_tokens fits (a smaller model or dtype may)"
    raise ParamError("batch_size", f"this run needs {est.describe(device)} but {fmt_bytes(free)} are free{hint}")
