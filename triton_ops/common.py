"""Triton helpers shared by the simsd kernels: the mask-rule mirror, RoPE angles, rounding and the tile
dot.

:func:`allowed` mirrors :func:`simsd_kernels.mask_rule.allowed` operator for operator;
``tests/kernels/test_mask_mirror.py`` checks the two agree on every label combination.
"""
import os

import triton
import triton.language as tl

#: kernels defined under the Triton interpreter (``TRITON_INTERPRET=1`` before import)
INTERPRETER = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")

# mirrors simsd_kernels.mask_rule (kinds and MaskMode values)
KIND_KNOWN = tl.constexpr(0)
KIND_DRAFT = tl.constexpr(1)
KIND_MASK = tl.constexpr(2)
MODE_BIDIRECTIONAL = tl.constexpr(0)
MODE_BLOCK_CAUSAL = tl.constexpr(1)
MODE_EXACT = tl.constexpr(2)
MODE_PAPER = tl.constexpr(3)


@triton.jit
def allowed(mode, kind_q, tau_q, grp_q, kind_k, tau_k, grp_k):
    """True where a query (labels ``*_q``, column vectors) may attend a new key (row vectors).

    ``mode`` may be a runtime scalar (one compiled kernel for every mode; the branch is uniform
    across the program) or a constexpr.
    """
    if mode == MODE_BIDIRECTIONAL:
        res = (kind_q == kind_q) & (kind_k == kind_k)
    elif mode == MODE_BLOCK_CAUSAL:
        res = grp_k <= grp_q
    elif mode == MODE_EXACT:
        # -1: shared prefix (mask_rule.SHARED_GRP); grp_k < grp_q <= tau_k: an ancestor copy in a tree
        res = (grp_k == grp_q) | (grp_k == -1) | ((grp_k < grp_q) & (grp_q <= tau_k))
    else:
        k_known = kind_k == KIND_KNOWN
        k_draft = kind_k == KIND_DRAFT
        k_mask = kind_k == KIND_MASK
        q_draft = kind_q == KIND_DRAFT
        q_mask = kind_q == KIND_MASK
        from_draft = q_draft & (k_known | (k_draft & (tau_k <= tau_q)) | (k_mask & (tau_k > tau_q)))
        from_mask = q_mask & (k_known | (k_draft & (tau_k < tau_q)) | (k_mask & (tau_k >= tau_q)))
        from_known = (kind_q == KIND_KNOWN) & k_known
        res = from_known | from_draft | from_mask
    return res


@triton.jit
def rope_inv_freq(HALF: tl.constexpr, HEAD_DIM: tl.constexpr, log2_theta_hi, log2_theta_lo):
    """``(HALF,)`` fp32 ``1 / theta ** (arange(0, D, 2) / D)``, as :mod:`simsd_kernels.rope`.

    Evaluated in fp64 (``log2(theta)`` arrives as an fp32 hi/lo pair) and rounded once to fp32,
    so it matches the fp32 table of the reference to an ulp; a plain fp32 ``exp2`` would be
    ~10x less accurate and the error grows with the position.
    """
    log2_theta = tl.cast(log2_theta_hi, tl.float64) + tl.cast(log2_theta_lo, tl.float64)
    j2 = (tl.arange(0, HALF) * 2).to(tl.float64)
    return (1.0 / tl.exp2((j2 / HEAD_DIM) * log2_theta)).to(tl.float32)


@triton.jit
def rope_rotate(x1, x2, cos, sin):
    """The rotate-half pair ``(x1 cos - x2 sin, x2 cos + x1 sin)`` in fp32 with its fused
    multiply-adds written out, so every kernel that rotates (``rope_qk_kernel`` for the attention
    door, ``append_kv_kernel``) rounds the same way: a plain expression leaves the contraction to
    the compiler, and on the H200 the door's cached fp32 keys and ``append_kv``'s differed
    (bench/results/device_h200)."""
    return tl.fma(x1, cos, -(x2 * sin)), tl.fma(x2, cos, x1 * sin)


@triton.jit
def round_to(x, DTYPE: tl.constexpr):
    """fp32 ``x`` rounded to ``DTYPE``, to nearest even (the GPU's ``cvt.rn``).

    The interpreter's float32 -> bfloat16 cast truncates (it drops the low 16 bits: a bias of half
    a unit in the last place toward zero, which shrinks q, k, the softmax weights and the output
    alike and looks like a wrong softmax scale to the self-check); there the rounding is done first
    in integer arithmetic, so the cast that follows is exact. Compiled code is a plain cast.
    """
    if INTERPRETER:
        if DTYPE == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
            x = bits.to(tl.float32, bitcast=True)
    return x.to(DTYPE)


@triton.jit
def to_dot(x, ELT: tl.constexpr, UPCAST: tl.constexpr):
    """Round ``x`` to the input dtype ``ELT`` for ``tl.dot``; back to fp32 under the interpreter.

    The interpreter computes bf16/fp16 arithmetic on raw bits, so there the operands are kept in
    fp32 after the rounding (to nearest even, as on the GPU: :func:`round_to`).
    """
    x = round_to(x, ELT)
    if UPCAST:
        x = x.to(tl.float32)
    return x


@triton.jit
def upcast(x, UPCAST: tl.constexpr):
    """Under the interpreter, cast a freshly loaded dot operand to fp32 (no-op otherwise)."""
    if UPCAST:
        x = x.to(tl.float32)
    return x


@triton.jit
def dot(a, b, UPCAST: tl.constexpr, DOT_PREC: tl.constexpr):
    """``(M, K) @ (K, N)`` tile product with fp32 accumulation: ``tl.dot`` when compiled.

    Under the interpreter (``UPCAST``) it is the products ``a[m, k] * b[k, n]``, each rounded to
    fp32, summed over ``k`` in index order (``tl.sum`` over a middle axis: numpy adds the ``k``
    slices one after another), so an output element depends only on its own row and column and
    is the same bits on every CPU. ``tl.dot`` there would be ``np.matmul``, i.e. the BLAS, whose
    sgemm kernels may round a row differently by its place in the tile (OpenBLAS's Haswell kernel
    does, its SkylakeX kernel does not). A GPU's ``tl.dot`` sums in another order (these bits are
    not promised there; docs/exactness.md "What is tested"); ``tests/kernels/test_tile_dot.py`` checks
    the order.
    """
    if UPCAST:
        out = tl.sum(a[:, :, None] * b[None, :, :], 1)
    else:
        out = tl.dot(a, b, input_precision=DOT_PREC)
    return out


@triton.jit
def page_rows(bt_row, n, page_size, ok):
    """``(page, offset)`` int64 of logical cache slots ``n`` through one row of the block table
    (``bt_row``: a pointer to its first entry; ``simsd_kernels.paging``); the page ids where ``ok``
    is False are not loaded (0)."""
    page = tl.load(bt_row + n // page_size, mask=ok, other=0).to(tl.int64)
    return page, (n % page_size).to(tl.int64)
