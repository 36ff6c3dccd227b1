"""The ``triton`` backend of the simsd attention ops (kernels in :mod:`triton_ops`).

Imported lazily by :mod:`simsd_kernels.backends`; importing it imports Triton and defines the
kernels (an ``ImportError`` makes the backend absent). :class:`TritonAttention` is the backend and
its door. Runs on CUDA devices, and on CPU only under the Triton interpreter (``TRITON_INTERPRET=1``
set before Triton is imported), which is how the tests exercise the kernels without a GPU. The
interpreter of Triton 3.6 and older fails under NumPy 2.4 and newer (:func:`interpreter_problem`);
the CPU is then refused with that reason.
"""
from __future__ import annotations

import os
import re
from contextlib import nullcontext

import torch

from triton_ops.ops import (
    INTERPRETED,
    SUPPORTED_DTYPES,
    SUPPORTED_HEAD_DIMS,
    append_kv_fwd,
    attention_rotated_fwd,
    rope_qk_fwd,
)

from .metadata import AttentionMetadata
from .split_plan import TRITON_FIGURES, plan_for_shape


def _major_minor(version: str) -> tuple:
    m = re.match(r"(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def interpreter_problem(triton_version: str | None = None, numpy_version: str | None = None) -> str:
    """Why Triton's interpreter cannot run the kernels with these versions (default: the installed
    ones), or ``""``. Triton <= 3.6's interpreter converts one-element arrays to Python ints with
    ``int(array)``, which NumPy >= 2.4 refuses (``TypeError: only 0-dimensional arrays can be
    converted to Python scalars``; triton-lang/triton#9171, fixed in 3.7). Measured here: Triton
    3.6.0 fails with NumPy 2.4.6 and runs with 2.3.5; Triton 3.7.0 and 3.9.0 run with 2.4.6. The
    compiled (GPU) path does not use the interpreter and is not affected."""
    if triton_version is None:
        import triton
        triton_version = triton.__version__
    if numpy_version is None:
        import numpy
        numpy_version = numpy.__version__
    if _major_minor(triton_version) < (3, 7) and _major_minor(numpy_version) >= (2, 4):
        return (f"Triton {triton_version}'s interpreter fails under NumPy {numpy_version} (NumPy >= 2.4 refuses its "
                f"int() of an array; fixed in Triton 3.7): install numpy<2.4 or triton>=3.7")
    return ""


def device_guard(device: torch.device):
    """``torch.cuda.device(device)`` for a CUDA tensor's device (Triton launches on the current
    device's stream and compiles for it: inputs on another GPU must switch to it first)."""
    return torch.cuda.device(device) if device.type == "cuda" else nullcontext()


class TritonAttention(AttentionMetadata):
    """The ``triton`` backend (kernels in :mod:`triton_ops`), and its door for one forward: the
    split plan once per forward (:mod:`simsd_kernels.split_plan`; ``num_splits`` > 0 forces that
    many splits); per layer RoPE once (``rope_qk_kernel``), the rotated k and v written as they are
    (``append_kv_kernel`` without ``ROTATE``), the attention kernels on the rotated q and k.
    Supports fp16/bf16/fp32 and head_dim 64/128 (the kernels' constexpr tiles:
    :data:`triton_ops.ops.SUPPORTED_DTYPES`, :data:`~triton_ops.ops.SUPPORTED_HEAD_DIMS`)."""

    name = "triton"
    dtypes, head_dims = SUPPORTED_DTYPES, SUPPORTED_HEAD_DIMS
    auto_devices = ("cuda",)
    plan_options = True
    fused = True

    @classmethod
    def is_available(cls, device) -> tuple:
        """``(ok, reason)``: CUDA device with Triton, or CPU under ``TRITON_INTERPRET=1`` (with a
        Triton and NumPy whose interpreter works: :func:`interpreter_problem`)."""
        device = torch.device(device)
        if device.type == "cuda":
            if INTERPRETED:
                return False, "Triton kernels were defined under TRITON_INTERPRET=1 (CPU only)"
            return True, ""
        if device.type == "cpu":
            if os.environ.get("TRITON_INTERPRET") == "1" and INTERPRETED:
                problem = interpreter_problem()
                return not problem, problem
            return False, "on CPU the Triton kernels need TRITON_INTERPRET=1 before triton is imported"
        return False, f"device type {device.type!r} is not supported by Triton here"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.plan = plan_for_shape(self.B, self.Lq, self.num_heads, self.num_kv_heads, self.head_dim,
                                   self.cache_capacity, torch.finfo(self.dtype).bits // 8, self.labels.device,
                                   figures=TRITON_FIGURES, num_splits=self.num_splits, invariant=self.shape_invariant)

    def forward(self, q, k, v, k_cache, v_cache, write: bool = True) -> torch.Tensor:
        self._check(q, k, v, k_cache, v_cache)
        plan = self.plan
        with device_guard(self.labels.device):
            q_rot, k_rot = rope_qk_fwd(q, k, self.positions, self.rope_theta)
            if write:
                append_kv_fwd(k_rot, v, self.positions, k_cache, v_cache, self.cache_seqlens, self.rope_theta, self.Lq,
                              rotate=False, block_table=self.block_table)
            return attention_rotated_fwd(q_rot, k_rot, v, k_cache, v_cache, self.cache_seqlens, self.labels,
                                         int(self.mask_mode), self.softmax_scale, num_splits=plan.num_splits,
                                         block_m=plan.block_m, min_tiles=plan.min_tiles, invariant=plan.invariant,
                                         block_table=self.block_table)

    def attend(self, q, k, v, k_cache, v_cache) -> torch.Tensor:
        return self.forward(q, k, v, k_cache, v_cache, write=False)

    def append_kv(self, k, v, k_cache, v_cache, num_tokens=None) -> None:
        n = self._check_write(k, v, k_cache, v_cache, num_tokens)
        with device_guard(k.device):
            append_kv_fwd(k, v, self.positions, k_cache, v_cache, self.cache_seqlens, self.rope_theta, n,
                          block_table=self.block_table)
