"""The attention backends by name, and the one chooser: ``auto | cuda | triton | torch``.

A backend is its door class, a subclass of :class:`~simsd_kernels.metadata.AttentionMetadata`
(:class:`~simsd_kernels.torch_backend.TorchAttention`, ``TritonAttention``, ``CudaAttention``): the
class declares its name, supported set, availability and the devices ``auto`` may choose it on.
``triton`` and ``cuda`` are imported on first use (they import their compilers);
:func:`register_backend` adds more (tests register deliberately wrong ones).
``SIMSD_ATTENTION_BACKEND`` overrides the ``auto`` choice (and then counts as an explicit request).

Trust (docs/design.md §5): a compiled backend proves itself before it is used. The first time a
backend would run a configuration :class:`OpConfig` ``(op, dtype, head_dim, GQA group,
mask_mode)`` on a device, :func:`simsd_kernels.selfcheck.run_check` opens its door on that device
and compares it with the torch reference on small cases of that configuration (a few ms, once per
process). The torch backend is the reference and is never checked.

* ``auto``: tries ``cuda``, then ``triton`` (on CUDA devices; the Triton interpreter on the CPU
  is a testing tool, never an automatic choice), then the ``torch`` reference. A backend that
  is not available, does not support the shape (dtype, head_dim: say 48 or 96) or fails its
  self-check is skipped; a failed check emits one :class:`BackendCheckWarning` naming the
  backend, the configuration and the error, and the configuration stays marked bad for the
  process.
* an explicit name (argument or environment variable) that is unknown, unavailable, does not
  support the shape or fails its check raises ``ValueError`` (:class:`BackendCheckError` for
  the check).
* ``SIMSD_TRUST_BACKENDS=1`` skips the checks.

Resolutions are cached per (request, device, configuration), so the eager per-call cost is a
dictionary lookup; availability per (backend, device) and self-check verdicts per (backend,
device, configuration).
"""
from __future__ import annotations

import importlib
import logging
import os
import warnings
from typing import NamedTuple

import torch

from .metadata import AttentionMetadata
from .torch_backend import TorchAttention

log = logging.getLogger("simsd_kernels")

#: the built-in names (:func:`backend_names` adds registered ones)
BACKEND_NAMES = ("auto", "cuda", "triton", "torch")
ENV_VAR = "SIMSD_ATTENTION_BACKEND"
TRUST_ENV_VAR = "SIMSD_TRUST_BACKENDS"


class BackendCheckError(ValueError):
    """An explicitly requested backend failed its self-check on this device and configuration."""


class BackendCheckWarning(RuntimeWarning):
    """``auto`` skipped a backend whose self-check failed (it falls back to the next one)."""


class OpConfig(NamedTuple):
    """What a self-check covers. ``op``: ``"attention"`` or ``"append_kv"``; ``group`` = Hq / Hkv
    and ``mask_mode`` (a :class:`~simsd_kernels.mask_rule.MaskMode` int) only for attention."""
    op: str
    dtype: torch.dtype
    head_dim: int
    group: int = 1
    mask_mode: int = 0

    def describe(self) -> str:
        from .mask_rule import MaskMode
        dt = str(self.dtype).replace("torch.", "")
        if self.op == "attention":
            return (f"attention {dt} head_dim={self.head_dim} group={self.group} "
                    f"mask_mode={MaskMode(self.mask_mode).name.lower()}")
        return f"{self.op} {dt} head_dim={self.head_dim}"


# name -> "module:class", imported on first use
_LAZY = {
    "cuda": "simsd_kernels.cuda_backend:CudaAttention",
    "triton": "simsd_kernels.triton_backend:TritonAttention",
}
_AUTO_ORDER = ["cuda", "triton"]  # then the torch reference
_CACHE: dict = {"torch": TorchAttention}  # name -> door class (None: failed to import)
_AVAILABLE: dict = {}   # (name, device) -> (ok, reason)
_VERDICTS: dict = {}    # (name, device, OpConfig) -> (ok, detail)
_RESOLVED: dict = {}    # (requested, env, trust, device, OpConfig | None) -> door class
_TOLD: set = set()      # the fallbacks warned or logged once


def reset() -> None:
    """Forget availability, self-check verdicts, resolutions and warnings (tests)."""
    for d in (_AVAILABLE, _VERDICTS, _RESOLVED):
        d.clear()
    _TOLD.clear()


def register_backend(backend: type, *, auto_rank: int | None = None) -> None:
    """Add (or replace) the door class ``backend`` (a subclass of
    :class:`~simsd_kernels.metadata.AttentionMetadata`) under ``backend.name``; ``auto_rank``: its
    index in the ``auto`` order (None: only reachable by name). Resets the caches.

    Raises:
        ValueError: not a door class, or the name ``auto`` or ``torch``.
    """
    if not (isinstance(backend, type) and issubclass(backend, AttentionMetadata)):
        raise ValueError(f"a backend is a subclass of AttentionMetadata, got {backend!r}")
    if backend.name in ("auto", "torch", ""):
        raise ValueError(f"cannot register a backend named {backend.name!r}")
    _CACHE[backend.name] = backend
    if backend.name in _AUTO_ORDER:
        _AUTO_ORDER.remove(backend.name)
    if auto_rank is not None:
        _AUTO_ORDER.insert(auto_rank, backend.name)
    reset()


def unregister_backend(name: str) -> None:
    """Remove a backend added by :func:`register_backend` (built-in lazy ones reload on use)."""
    _CACHE.pop(name, None)
    if name in _AUTO_ORDER and name not in _LAZY:
        _AUTO_ORDER.remove(name)
    reset()


def backend_names() -> tuple:
    """Every name :func:`resolve_backend` accepts."""
    extra = tuple(n for n in _CACHE if n not in BACKEND_NAMES)
    return BACKEND_NAMES + extra


def get_backend(name: str) -> type | None:
    """The door class of backend ``name``, or None when its module is missing or fails to import."""
    if name in _CACHE:
        return _CACHE[name]
    spec = _LAZY.get(name)
    backend = None
    if spec is not None:
        module, cls = spec.split(":")
        try:
            backend = getattr(importlib.import_module(module), cls)
        except (ImportError, AttributeError, OSError, RuntimeError) as exc:
            log.debug("simsd backend %s unavailable: %s", name, exc)
            backend = None
    _CACHE[name] = backend
    return backend


def availability(name: str, device: torch.device) -> tuple:
    """``(ok, reason)`` for backend ``name`` on ``device`` (cached per process)."""
    key = (name, device)
    hit = _AVAILABLE.get(key)
    if hit is None:
        backend = get_backend(name)
        hit = (False, "not installed or failed to import") if backend is None else backend.is_available(device)
        _AVAILABLE[key] = hit
    return hit


def trusted() -> bool:
    """True when ``SIMSD_TRUST_BACKENDS=1`` switches the self-checks off."""
    return os.environ.get(TRUST_ENV_VAR, "").strip() == "1"


def verdict(backend: type, device: torch.device, config: OpConfig) -> tuple:
    """``(ok, detail)`` of ``backend``'s self-check for ``config`` on ``device`` (run once; the
    torch reference is not checked).

    Raises:
        RuntimeError: the check has not run yet and the current CUDA stream is capturing a
            graph (run the op once eagerly before capturing).
    """
    if backend is TorchAttention or trusted():
        return True, "not checked"
    key = (backend.name, device, config)
    hit = _VERDICTS.get(key)
    if hit is not None:
        return hit
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"simsd: backend {backend.name!r} has not been checked for {config.describe()} on "
                           f"{device}; run the op once before capturing a CUDA graph")
    from .selfcheck import run_check
    result = run_check(backend, device, config)
    hit = _VERDICTS[key] = (result.ok, result.detail)
    return hit


def _requested_name(requested: str) -> str:
    names = backend_names()
    if requested not in names:
        raise ValueError(f"backend must be one of {names}, got {requested!r}")
    if requested == "auto":
        env = os.environ.get(ENV_VAR, "").strip().lower()
        if env and env != "auto":
            if env not in names:
                raise ValueError(f"{ENV_VAR} must be one of {names}, got {env!r}")
            return env
    return requested


def _explicit(name: str, device: torch.device, config: OpConfig | None) -> type:
    backend = get_backend(name)
    if backend is None:
        raise ValueError(f"attention backend {name!r} is not installed or failed to import")
    ok, why = availability(name, device)
    if not ok:
        raise ValueError(f"attention backend {name!r} cannot run on {device}: {why}")
    if config is not None:
        ok, why = backend.supports(config.dtype, config.head_dim)
        if not ok:
            raise ValueError(f"attention backend {name!r} does not support {config.describe()}: {why}")
        ok, detail = verdict(backend, device, config)
        if not ok:
            raise BackendCheckError(f"attention backend {name!r} failed its self-check on {device} for "
                                    f"{config.describe()}: {detail} (SIMSD_TRUST_BACKENDS=1 skips the check)")
    return backend


def _auto(device: torch.device, config: OpConfig | None) -> type:
    skipped = []
    for name in list(_AUTO_ORDER):
        backend = get_backend(name)
        if backend is None or device.type not in backend.auto_devices:
            continue
        ok, why = availability(name, device)
        if ok and config is not None:
            ok, why = backend.supports(config.dtype, config.head_dim)
            if ok:
                ok, why = verdict(backend, device, config)
                if not ok and (name, device, config) not in _TOLD:
                    _TOLD.add((name, device, config))
                    warnings.warn(f"simsd: attention backend {name!r} failed its self-check on {device} for "
                                  f"{config.describe()}: {why}; using the next backend", BackendCheckWarning,
                                  stacklevel=4)
        if ok:
            return backend
        skipped.append(f"{name}: {why}")
    if device.type == "cuda":
        what = config.describe() if config is not None else "these inputs"
        if (device, config) not in _TOLD:
            _TOLD.add((device, config))
            log.warning("simsd: no fused attention backend for %s on %s (%s), using the torch reference",
                        what, device, "; ".join(skipped) or "none registered")
    return TorchAttention


def resolve_backend(requested: str, device: torch.device, config: OpConfig | None = None) -> type:
    """The backend (its door class) to run on ``device``: ``requested`` (``auto`` or a name of
    :func:`backend_names`) resolved.

    ``config`` (the op, dtype, head_dim, GQA group and mask mode at hand) makes the choice
    shape-aware and self-checked, see the module docstring; without it only availability is
    considered. Cached: repeated calls cost a dictionary lookup.

    Raises:
        ValueError: unknown name, or an explicitly requested backend that cannot run here or
            does not support ``config``.
        BackendCheckError: an explicitly requested backend failed its self-check.
    """
    if not isinstance(device, torch.device):
        device = torch.device(device)
    if requested != "auto":  # an explicit name resolves the same whatever the environment once it passed
        key = (requested, device, config)
        hit = _RESOLVED.get(key)
        if hit is None:
            hit = _RESOLVED[key] = _explicit(_requested_name(requested), device, config)
        return hit
    environ = os.environ
    key = (requested, environ.get(ENV_VAR), environ.get(TRUST_ENV_VAR), device, config)
    hit = _RESOLVED.get(key)
    if hit is None:
        name = _requested_name(requested)
        hit = _RESOLVED[key] = _auto(device, config) if name == "auto" else _explicit(name, device, config)
    return hit
