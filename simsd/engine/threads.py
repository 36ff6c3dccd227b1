"""CPU intra-op threads for the forwards of small models.

torch uses every core for intra-op parallelism by default. A forward of a model as small as the
bundled tiny pair (a few million parameters) is too short to split: with more than one thread
it is not faster on an idle machine, and any other load on the cores makes it many times slower
(threads wait for each other at every operator). simsd therefore runs models below
``SMALL_MODEL_PARAMS`` parameters with one thread and larger ones with every core, unless told
otherwise: ``--threads N`` (or ``threads=N``) wins, then ``OMP_NUM_THREADS`` (read by torch at
start-up), then this rule. Measured on the bundled pair: docs/cli.md "CPU threads".
"""
from __future__ import annotations

import os

import torch

from .memory import parameter_count

#: models with fewer parameters (the largest of target and draft) run with one thread
SMALL_MODEL_PARAMS = 50_000_000


def default_threads(configs: list) -> int:
    """Intra-op threads for models with these configs when neither ``--threads`` nor
    ``OMP_NUM_THREADS`` says: 1 for small models, else every core torch sees."""
    largest = max((parameter_count(c) for c in configs), default=0)
    if largest < SMALL_MODEL_PARAMS:
        return 1
    return max(1, os.cpu_count() or 1)


def choose_threads(configs: list, requested: int | None = None) -> tuple[int, str]:
    """``(threads, why)``: ``requested`` if given, else ``OMP_NUM_THREADS``, else :func:`default_threads`."""
    if requested is not None:
        if requested < 1:
            raise ValueError(f"threads must be >= 1, got {requested}")
        return requested, "--threads"
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) >= 1:
        return int(env), "OMP_NUM_THREADS"
    return default_threads(configs), "model size"


def apply_threads(configs: list, requested: int | None = None) -> int:
    """Set torch's intra-op thread count (see :func:`choose_threads`); returns it."""
    n, _ = choose_threads(configs, requested)
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return n
