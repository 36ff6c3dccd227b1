"""The ``cuda`` backend: the compiled extension ``simsd_kernels._C`` (sources in ``csrc/``).

Importing this module loads the extension, which registers ``torch.ops.simsd_cuda.*``; it
raises ``ImportError`` (with the reason) when the extension was not built, so
:func:`simsd_kernels.backends.get_backend` treats the backend as absent. Building it:
``pip install --no-build-isolation .`` with a CUDA build of torch and nvcc (``csrc/README.md``).

Ops (same semantics as :func:`simsd_kernels.temporal_attention`, shapes B, Lq, Lmax, Hq, Hkv, D):

* ``attention(q, k, v, k_cache, v_cache, cache_seqlens, labels, positions, mask_mode,
  rope_theta, softmax_scale, num_splits=0, shape_invariant=False) -> (B, Lq, Hq, D)``: fp16/bf16
  on tensor cores (sm_80+), fp32 on a plain path; head_dim 64/128; ``num_splits`` 0 = the launch
  plan of :mod:`simsd_kernels.split_plan`, n = n splits merged by log-sum-exp;
  ``shape_invariant`` = the plan that never depends on Lq or B (exact verification).
* ``attention_with_kvcache(the same arguments)``: the attention door
  (:mod:`simsd_kernels.metadata`): the same attention, then the k it rotated (once, for the
  attention) and v of all ``Lq`` new tokens written to slots ``cache_seqlens[b] + i`` (slots past
  the capacity are skipped); mutates ``k_cache``, ``v_cache``.
* ``append_kv(k, v, positions, k_cache, v_cache, cache_seqlens, rope_theta, num_tokens)``:
  rotated k and v of the first ``num_tokens`` new tokens to slots ``cache_seqlens[b] + i``
  (slots past the capacity are skipped).
* ``mask_table(labels (B, L, 3) int32, mask_mode) -> (B, L, L) bool``: the C++ mirror of
  :func:`simsd_kernels.mask_rule.allowed` (CPU and CUDA), for the mirror test.
"""
from __future__ import annotations

import functools
import json
import os
from contextlib import nullcontext

import torch

from . import split_plan
from .backends import Backend, supports_listed
from .metadata import AttentionMetadata

_HERE = os.path.dirname(os.path.abspath(__file__))
BUILD_INFO_PATH = os.path.join(_HERE, "_build_info.json")
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SUPPORTED_HEAD_DIMS = (64, 128)


@functools.lru_cache(maxsize=None)
def _read_build_info() -> dict:
    try:
        with open(BUILD_INFO_PATH) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def build_info() -> dict:
    """What setup.py recorded about the build (``{}`` when there is no record); read once per
    process (``_read_build_info.cache_clear()`` forgets it)."""
    return dict(_read_build_info())


try:
    from . import _C  # noqa: F401  (registers torch.ops.simsd_cuda)
except ImportError as exc:  # not built, or built against another torch
    raise ImportError(
        "simsd CUDA extension simsd_kernels._C is not available "
        f"({exc}); build it with a CUDA torch and nvcc: "
        "`pip install --no-build-isolation .` (see csrc/README.md)"
    ) from exc

ops = torch.ops.simsd_cuda


def is_available(device) -> tuple:
    """``(ok, reason)``: only CUDA devices whose arch the build covers (or can JIT from PTX)."""
    device = torch.device(device)
    if device.type != "cuda":
        return False, f"the cuda backend runs on CUDA devices only, got {device}"
    if not torch.cuda.is_available():
        return False, "torch.cuda.is_available() is False"
    major, minor = torch.cuda.get_device_capability(device)
    sm = 10 * major + minor
    info = build_info()
    archs = info.get("archs")
    if sm < 80:
        return False, f"sm_{sm} < sm_80 (the kernels use mma.sync bf16)"
    # a cubin runs on the same major arch with an equal or higher minor; PTX JITs forward
    if archs and not any(a // 10 == major and a <= sm for a in archs) and sm < info.get("ptx_arch", max(archs)):
        return False, f"built for sm {archs} (PTX {info.get('ptx_arch')}), device is sm_{sm}"
    return True, ""


def supports(dtype, head_dim) -> tuple:
    """``(ok, reason)``: fp16/bf16 (tensor cores) or fp32 (plain path), head_dim 64/128."""
    return supports_listed(dtype, head_dim, SUPPORTED_DTYPES, SUPPORTED_HEAD_DIMS)


def _guard(t):
    # the binding guards the launch too; this also makes the caching allocator and the current
    # stream those of the tensors' device for everything around it
    return torch.cuda.device(t.device) if t.device.type == "cuda" else nullcontext()


def _check_supported(name, t):
    if t.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"cuda backend: {name} dtype must be one of {SUPPORTED_DTYPES}, got {t.dtype} "
                         "(use backend='torch' for float64)")
    if t.shape[-1] not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"cuda backend: head_dim must be one of {SUPPORTED_HEAD_DIMS}, got {t.shape[-1]}")


def attention(q, k, v, k_cache, v_cache, cache_seqlens, labels, positions, mask_mode, rope_theta,
              softmax_scale, num_splits: int = 0, shape_invariant: bool = False):
    """See :func:`simsd_kernels.temporal_attention`; ``num_splits`` 0 = the split plan, 1 = no split.

    Raises:
        ValueError: unsupported dtype or head_dim.
        RuntimeError: from the extension's argument checks or a failed launch.
    """
    _check_supported("q", q)
    plan = split_plan.plan_for(q, k, k_cache, figures=split_plan.CUDA_FIGURES, num_splits=int(num_splits),
                               invariant=bool(shape_invariant))
    with _guard(q):
        return ops.attention(q, k, v, k_cache, v_cache, cache_seqlens, labels, positions, int(mask_mode),
                             float(rope_theta), float(softmax_scale), plan.num_splits, plan.block_m, plan.min_tiles,
                             plan.invariant)


class CudaAttention(AttentionMetadata):
    """The door (:attr:`Backend.kvcache <simsd_kernels.backends.Backend>`): the split plan once per
    forward, then per layer one ``attention_with_kvcache`` launch (``attention`` without the write)."""

    def __init__(self, *args):
        super().__init__(*args)
        if self.dtype not in SUPPORTED_DTYPES or self.head_dim not in SUPPORTED_HEAD_DIMS:
            raise ValueError(f"cuda backend: dtype {self.dtype} / head_dim {self.head_dim} is not one of "
                             f"{SUPPORTED_DTYPES} / {SUPPORTED_HEAD_DIMS} (use backend='torch' for float64)")
        plan = split_plan.plan_for_shape(self.B, self.Lq, self.num_heads, self.num_kv_heads, self.head_dim,
                                         self.cache_capacity, torch.finfo(self.dtype).bits // 8, self.labels.device,
                                         figures=split_plan.CUDA_FIGURES, invariant=self.shape_invariant)
        self._rest = (self.cache_seqlens, self.labels, self.positions, int(self.mask_mode), float(self.rope_theta),
                      float(self.softmax_scale), plan.num_splits, plan.block_m, plan.min_tiles, plan.invariant)

    def forward(self, q, k, v, k_cache, v_cache) -> torch.Tensor:
        self._check(q, k, v, k_cache, v_cache)
        with _guard(q):
            return ops.attention_with_kvcache(q, k, v, k_cache, v_cache, *self._rest)

    def attend(self, q, k, v, k_cache, v_cache) -> torch.Tensor:
        self._check(q, k, v, k_cache, v_cache)
        with _guard(q):
            return ops.attention(q, k, v, k_cache, v_cache, *self._rest)


def append_kv(k, v, positions, k_cache, v_cache, cache_seqlens, rope_theta, num_tokens):
    """See :func:`simsd_kernels.append_kv`. Raises ValueError on an unsupported dtype."""
    if k.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"cuda backend: k dtype must be one of {SUPPORTED_DTYPES}, got {k.dtype}")
    with _guard(k):
        ops.append_kv(k, v, positions, k_cache, v_cache, cache_seqlens, float(rope_theta), int(num_tokens))


def mask_table(labels, mask_mode):
    """``(B, L, L)`` bool from the C++ mask rule (CPU or CUDA tensor ``labels (B, L, 3)`` int32)."""
    return ops.mask_table(labels, int(mask_mode))


def make_backend() -> Backend:
    """The :class:`~simsd_kernels.backends.Backend` for ``cuda`` (the import above already succeeded)."""
    return Backend("cuda", attention, append_kv, is_available, supports, plan_options=True, kvcache=CudaAttention)
