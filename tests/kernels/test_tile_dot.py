"""The interpreted tile dot (``triton_ops.common.dot``): the same bits on every CPU.

Under the interpreter ``tl.dot`` is ``np.matmul``, i.e. the BLAS, and OpenBLAS's Haswell sgemm
kernel (an AVX2 CPU's) rounds a row differently by its place in the tile, which broke the
copy == denoise equality of ``test_invariant_numerics.py::test_triton_interpreter`` on AVX2-only
CPUs. ``dot`` promises a defined order instead: each product rounded to fp32, summed over ``k``
in index order. The reference below is that order written out with element-wise fp32 numpy
operations, whose results IEEE 754 fixes on any CPU and vector width, so this test fails with a
BLAS-backed dot on every CPU (checked with ``tl.dot`` here: it differs on AVX-512 as well as on
the Haswell path), not only on the CPUs whose BLAS happens to depend on the row.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from triton_ops.common import dot  # noqa: E402
from triton_ops.ops import INTERPRETED  # noqa: E402

pytestmark = [pytest.mark.bitwise,
              pytest.mark.skipif(not INTERPRETED, reason="the interpreter's order (a GPU's tl.dot sums otherwise)")]


@triton.jit
def _dot_kernel(A, B, C, M: tl.constexpr, K: tl.constexpr, N: tl.constexpr):
    m, k, n = tl.arange(0, M), tl.arange(0, K), tl.arange(0, N)
    a = tl.load(A + m[:, None] * K + k[None, :])
    b = tl.load(B + k[:, None] * N + n[None, :])
    tl.store(C + m[:, None] * N + n[None, :], dot(a, b, True, "ieee"))


def tile_dot(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    c = torch.empty(a.shape[0], b.shape[1])
    _dot_kernel[(1,)](torch.from_numpy(a), torch.from_numpy(b), c, M=a.shape[0], K=a.shape[1], N=b.shape[1])
    return c.numpy()


def in_order(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``sum_k a[:, k] * b[k]``: fp32 products, added one ``k`` after another."""
    acc = a[:, 0, None] * b[0][None, :]
    for k in range(1, a.shape[1]):
        acc = acc + a[:, k, None] * b[k][None, :]
    return acc


# the kernel's two products: q (M, D) @ K^T (D, 64) and p (M, 64) @ V (64, D)
SHAPES = [(64, 64, 64), (16, 128, 64), (32, 64, 128), (64, 128, 64)]


@pytest.mark.parametrize("M,K,N", SHAPES)
def test_dot_sums_in_index_order(M, K, N):
    rng = np.random.default_rng(M + K + N)
    a = rng.standard_normal((M, K)).astype(np.float32)
    b = rng.standard_normal((K, N)).astype(np.float32)
    got = tile_dot(a, b)
    assert np.array_equal(got.view(np.int32), in_order(a, b).view(np.int32))


def test_a_rows_bits_do_not_depend_on_its_place_or_the_other_rows():
    """Row ``r`` of a 64-row tile equals the same row alone in row 0 of a 16-row tile (the
    property the verify forward's copies need: a copy's rows sit elsewhere in the tile)."""
    rng = np.random.default_rng(7)
    a = rng.standard_normal((64, 64)).astype(np.float32)
    b = rng.standard_normal((64, 64)).astype(np.float32)
    full = tile_dot(a, b)
    for r in range(64):
        alone = np.zeros((16, 64), np.float32)
        alone[0] = a[r]
        assert np.array_equal(tile_dot(alone, b)[0].view(np.int32), full[r].view(np.int32)), r
