"""The choices and ranges of decoding settings that need no tensors: the remasking strategies
(docs/design.md §3.5) and their thresholds, and the smallest temperature that still samples.

Torch-free, so that option checks (:mod:`simsd.entrypoints.options`) run before torch loads:
a mistyped option costs a fraction of a second instead of torch's import.
"""
from __future__ import annotations

STRATEGIES = ("sequential", "static", "dynamic", "entropy")
#: aliases used by SDAR's code
ALIASES = {"low_confidence_static": "static", "low_confidence_dynamic": "dynamic",
           "entropy_bounded": "entropy"}
DEFAULT_THRESHOLD = {"dynamic": 0.9, "entropy": 0.35}

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


def parse_strategy(name: str) -> str:
    """The strategy's name (SDAR's aliases mapped); ``ValueError`` naming the choices otherwise."""
    name = ALIASES.get(name, name)
    if name not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r} (choose from {', '.join(STRATEGIES)})")
    return name
