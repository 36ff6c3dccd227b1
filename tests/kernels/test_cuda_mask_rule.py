"""The C++/CUDA mirror of the mask rule (csrc/mask_rule.cuh) equals mask_rule.allowed.

``torch.ops.simsd_cuda.mask_table`` evaluates the header's ``simsd::mask_allowed`` on the host
(CPU tensors: runs on the CPU CI machine whenever the extension is built) and on the device
(CUDA tensors, GPU only), over every combination of kind (including an invalid kind 3), tau
(0, 1, 2, 3, TAU_INF) and group (-1, 0, 1, 2, 2**30): tau 0 and group 2**30 are the engine's
padding labels (``simsd.engine.batching.PAD_LABEL``).
"""
from __future__ import annotations

import itertools

import pytest
import torch

from simsd_kernels import TAU_INF, MaskMode, dense_new_token_mask

from .cuda_helpers import load_cuda_backend


def all_label_combinations() -> torch.Tensor:
    """``(1, 100, 3)`` int32: one token per (kind, tau, grp) combination (grp -1: shared prefix;
    tau 0 and grp 2**30: padding)."""
    combos = list(itertools.product((0, 1, 2, 3), (0, 1, 2, 3, TAU_INF), (-1, 0, 1, 2, 1 << 30)))
    return torch.tensor(combos, dtype=torch.int32)[None]


@pytest.mark.parametrize("mode", tuple(MaskMode), ids=lambda m: m.name.lower())
def test_host_mirror_matches_python_rule(mode):
    cb = load_cuda_backend()
    labels = all_label_combinations()
    assert torch.equal(cb.mask_table(labels, mode), dense_new_token_mask(labels, mode))


@pytest.mark.gpu
@pytest.mark.parametrize("mode", tuple(MaskMode), ids=lambda m: m.name.lower())
def test_device_mirror_matches_python_rule(mode):
    cb = load_cuda_backend()
    labels = all_label_combinations()
    expected = dense_new_token_mask(labels, mode)
    assert torch.equal(cb.mask_table(labels.cuda(), mode).cpu(), expected)


def test_mask_table_rejects_bad_mode():
    cb = load_cuda_backend()
    with pytest.raises(RuntimeError, match="mask_mode"):
        cb.mask_table(all_label_combinations(), 9)
