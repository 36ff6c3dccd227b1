"""The ``cuda`` backend: the compiled extension ``simsd_kernels._C`` (sources in ``csrc/``).

Importing this module loads the extension, which registers ``torch.ops.simsd_cuda.*``; it
raises ``ImportError`` (with the reason) when the extension was not built, so
:func:`simsd_kernels.backends.get_backend` treats the backend as absent. :class:`CudaAttention` is
the backend and its door. Building it:
``pip install --no-build-isolation .`` with a CUDA build of torch and nvcc (``csrc/README.md``).

Ops of the extension (same semantics as :func:`simsd_kernels.temporal_attention`, shapes B, Lq,
Lmax, Hq, Hkv, D; :class:`CudaAttention` launches them):

* ``attention(q, k, v, k_cache, v_cache, cache_seqlens, labels, positions, mask_mode,
  rope_theta, softmax_scale, num_splits, block_m, min_tiles, invariant) -> (B, Lq, Hq, D)``:
  fp16/bf16 on tensor cores (sm_80+), fp32 on a plain path; head_dim 64/128; the launch plan
  (:class:`~simsd_kernels.split_plan.SplitPlan`: ``num_splits`` splits merged by log-sum-exp,
  ``invariant`` the plan that never depends on Lq or B, for exact verification).
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
from .metadata import AttentionMetadata

_HERE = os.path.dirname(os.path.abspath(__file__))
BUILD_INFO_PATH = os.path.join(_HERE, "_build_info.json")


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


def _guard(t):
    # the binding guards the launch too; this also makes the caching allocator and the current
    # stream those of the tensors' device for everything around it
    return torch.cuda.device(t.device) if t.device.type == "cuda" else nullcontext()


class CudaAttention(AttentionMetadata):
    """The ``cuda`` backend (the compiled extension), and its door for one forward: the split plan
    once per forward (:mod:`simsd_kernels.split_plan`; ``num_splits`` > 0 forces that many
    splits), then per layer one ``attention_with_kvcache`` launch (:meth:`attend`: ``attention``
    without the write; :meth:`append_kv`: ``append_kv``), the caches read and written through the
    door's block table (:mod:`simsd_kernels.paging`). fp16/bf16 on tensor cores (sm_80+),
    fp32 on a plain path; head_dim 64/128."""

    name = "cuda"
    dtypes = (torch.float16, torch.bfloat16, torch.float32)
    head_dims = (64, 128)
    auto_devices = ("cuda",)
    plan_options = True
    fused = True

    @classmethod
    def is_available(cls, device) -> tuple:
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

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        plan = split_plan.plan_for_shape(self.B, self.Lq, self.num_heads, self.num_kv_heads, self.head_dim,
                                         self.cache_capacity, torch.finfo(self.dtype).bits // 8, self.labels.device,
                                         figures=split_plan.CUDA_FIGURES, num_splits=self.num_splits,
                                         invariant=self.shape_invariant)
        self._rest = (self.cache_seqlens, self.labels, self.positions, int(self.mask_mode), float(self.rope_theta),
                      float(self.softmax_scale), plan.num_splits, plan.block_m, plan.min_tiles, plan.invariant)

    def forward(self, q, k, v, k_cache, v_cache) -> torch.Tensor:
        self._check(q, k, v, k_cache, v_cache)
        with _guard(q):
            return ops.attention_with_kvcache(q, k, v, k_cache, v_cache, *self._rest, block_table=self.block_table)

    def attend(self, q, k, v, k_cache, v_cache) -> torch.Tensor:
        self._check(q, k, v, k_cache, v_cache)
        with _guard(q):
            return ops.attention(q, k, v, k_cache, v_cache, *self._rest, block_table=self.block_table)

    def append_kv(self, k, v, k_cache, v_cache, num_tokens=None) -> None:
        n = self._check_write(k, v, k_cache, v_cache, num_tokens)
        with _guard(k):
            ops.append_kv(k, v, self.positions, k_cache, v_cache, self.cache_seqlens, float(self.rope_theta), int(n),
                          block_table=self.block_table)


def mask_table(labels, mask_mode):
    """``(B, L, L)`` bool from the C++ mask rule (CPU or CUDA tensor ``labels (B, L, 3)`` int32)."""
    return ops.mask_table(labels, int(mask_mode))
