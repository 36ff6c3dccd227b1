"""One backend chooser for the simsd attention ops: ``auto | cuda | triton | torch``.

``SIMSD_ATTENTION_BACKEND`` overrides the ``auto`` choice. Backends register themselves
lazily (``triton`` and ``cuda`` modules import their compilers only when first used); a
requested backend that is unavailable raises, an ``auto`` fallback is logged once.
"""
from __future__ import annotations

import importlib
import logging
import os
from dataclasses import dataclass
from typing import Callable

import torch

from .reference import append_kv_torch, temporal_attention_torch

log = logging.getLogger("simsd_kernels")

BACKEND_NAMES = ("auto", "cuda", "triton", "torch")
ENV_VAR = "SIMSD_ATTENTION_BACKEND"


@dataclass
class Backend:
    name: str
    attention: Callable
    append_kv: Callable
    #: ``is_available(device) -> (bool, reason)``
    is_available: Callable[[torch.device], tuple]


def _torch_backend() -> Backend:
    return Backend("torch", temporal_attention_torch, append_kv_torch, lambda device: (True, ""))


# name -> "module:factory"; each factory returns a Backend (imported on first use)
_LAZY = {
    "cuda": "simsd_kernels.cuda_backend:make_backend",
    "triton": "simsd_kernels.triton_backend:make_backend",
}
_CACHE: dict = {"torch": _torch_backend()}
_LOGGED: set = set()


def get_backend(name: str) -> Backend | None:
    """The Backend object for ``name`` or None when its module is missing or fails to import."""
    if name in _CACHE:
        return _CACHE[name]
    spec = _LAZY.get(name)
    backend = None
    if spec is not None:
        module, factory = spec.split(":")
        try:
            backend = getattr(importlib.import_module(module), factory)()
        except (ImportError, AttributeError, OSError, RuntimeError) as exc:
            log.debug("simsd backend %s unavailable: %s", name, exc)
            backend = None
    _CACHE[name] = backend
    return backend


def resolve_backend(requested: str, device: torch.device) -> Backend:
    """Return the backend to run on ``device``.

    Raises:
        ValueError: unknown name, or an explicitly requested backend that cannot run here.
    """
    if requested not in BACKEND_NAMES:
        raise ValueError(f"backend must be one of {BACKEND_NAMES}, got {requested!r}")
    if requested == "auto":
        env = os.environ.get(ENV_VAR, "").strip().lower()
        if env and env != "auto":
            if env not in BACKEND_NAMES:
                raise ValueError(f"{ENV_VAR} must be one of {BACKEND_NAMES}, got {env!r}")
            requested = env
    if requested != "auto":
        backend = get_backend(requested)
        if backend is None:
            raise ValueError(f"attention backend {requested!r} is not installed or failed to import")
        ok, why = backend.is_available(device)
        if not ok:
            raise ValueError(f"attention backend {requested!r} cannot run on {device}: {why}")
        return backend
    for name in ("cuda", "triton"):
        if device.type != "cuda":
            break  # on CPU the Triton interpreter is a testing tool, never an automatic choice
        backend = get_backend(name)
        if backend is not None and backend.is_available(device)[0]:
            return backend
    if device.type == "cuda" and "fallback" not in _LOGGED:
        _LOGGED.add("fallback")
        log.warning("simsd: no fused attention backend available on %s, using the torch reference", device)
    return _CACHE["torch"]
