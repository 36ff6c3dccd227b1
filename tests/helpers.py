"""Shared test helpers: small random SDAR checkpoints (cached per session)."""
from __future__ import annotations

import functools
import tempfile
from pathlib import Path

from simsd.testing import make_random_checkpoint

_ROOT = Path(tempfile.mkdtemp(prefix="simsd-tests-"))


@functools.lru_cache(maxsize=None)
def random_checkpoint(name: str = "base", **kwargs) -> Path:
    """A random SDAR checkpoint directory, created once per test session per argument set."""
    path = _ROOT / (name + "-" + "-".join(f"{k}{v}" for k, v in sorted(kwargs.items())))
    if not (path / "config.json").exists():
        make_random_checkpoint(path, **kwargs)
    return path
