"""Triton kernels of the mixture-of-experts experts (``simsd_kernels.moe.fused_moe``).

The (token, slot) pairs are sorted by expert on the host side (:func:`align_by_expert`, torch
ops, no host synchronisation) into tiles of ``BLOCK_M`` pairs of one expert each (a tile's tail
is padded with the id ``T * k``, which loads nothing and stores nothing). Then three kernels, no
Python loop over the experts:

* :func:`moe_gate_up_kernel`: per (tile, ``BLOCK_N`` channels): the gate and up products of the
  tile's tokens with its expert's ``w_gate_up`` rows (fp32 accumulators), ``silu(gate) * up``,
  stored per pair: ``act (T * k, I)`` in the input dtype;
* :func:`moe_down_kernel`: per (tile, ``BLOCK_N`` outputs): ``act @ w_down[e].T`` times the pair's
  routing weight, stored in float32 per pair: ``y (T * k, H)``;
* :func:`moe_combine_kernel`: per (token, ``BLOCK_H`` outputs): the sum of the token's ``k`` rows
  of ``y`` in slot order, in float32, rounded once to the output dtype.

No atomics: a token's result does not depend on which other tokens share the call (each output
element is one tile row's own dot products), and the same inputs give the same bits. ``DOT_PREC``:
``ieee`` for float32 inputs (no TF32 rounding), ``tf32`` otherwise (unused by fp16 / bf16 dots);
``UPCAST`` (the interpreter): operands in fp32 and :func:`triton_ops.common.dot`'s ordered sum.
"""
import triton
import triton.language as tl

from .common import dot, round_to, upcast


@triton.jit
def _tile(SORTED, tile, num_pairs, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, N):
    """The tile's pairs ``(BLOCK_M,)`` (int64), which of them are real, this program's ``BLOCK_N``
    output offsets and which of them lie below ``N``."""
    pairs = tl.load(SORTED + tile * BLOCK_M + tl.arange(0, BLOCK_M))
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return pairs.to(tl.int64), pairs < num_pairs, offs_n, offs_n < N


@triton.jit
def moe_gate_up_kernel(X, W, SORTED, EXPERT_OF_TILE, ACT, num_pairs, top_k, H, I,
                       sxt, swe, swn, sat,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
                       DOT_PREC: tl.constexpr):
    tile = tl.program_id(0)
    e = tl.load(EXPERT_OF_TILE + tile)
    if e < 0:
        return
    pairs, ok_m, offs_n, ok_n = _tile(SORTED, tile, num_pairs, BLOCK_M, BLOCK_N, I)
    tokens = pairs // top_k
    offs_k = tl.arange(0, BLOCK_K)
    w_base = W + e.to(tl.int64) * swe
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        ok_k = k0 + offs_k < H
        x = upcast(tl.load(X + tokens[:, None] * sxt + (k0 + offs_k)[None, :], mask=ok_m[:, None] & ok_k[None, :],
                           other=0.0), UPCAST)
        wg = upcast(tl.load(w_base + offs_n[None, :] * swn + (k0 + offs_k)[:, None],
                            mask=ok_n[None, :] & ok_k[:, None], other=0.0), UPCAST)
        wu = upcast(tl.load(w_base + (I + offs_n)[None, :] * swn + (k0 + offs_k)[:, None],
                            mask=ok_n[None, :] & ok_k[:, None], other=0.0), UPCAST)
        gate += dot(x, wg, UPCAST, DOT_PREC)
        up += dot(x, wu, UPCAST, DOT_PREC)
    act = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(ACT + pairs[:, None] * sat + offs_n[None, :], round_to(act, ACT.dtype.element_ty),
             mask=ok_m[:, None] & ok_n[None, :])


@triton.jit
def moe_down_kernel(ACT, W, SORTED, EXPERT_OF_TILE, TOPK_W, Y, num_pairs, H, I,
                    sat, swe, swn, syt,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
                    DOT_PREC: tl.constexpr):
    tile = tl.program_id(0)
    e = tl.load(EXPERT_OF_TILE + tile)
    if e < 0:
        return
    rows, ok_m, offs_n, ok_n = _tile(SORTED, tile, num_pairs, BLOCK_M, BLOCK_N, H)
    offs_k = tl.arange(0, BLOCK_K)
    w_base = W + e.to(tl.int64) * swe
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        ok_k = k0 + offs_k < I
        a = upcast(tl.load(ACT + rows[:, None] * sat + (k0 + offs_k)[None, :], mask=ok_m[:, None] & ok_k[None, :],
                           other=0.0), UPCAST)
        w = upcast(tl.load(w_base + offs_n[None, :] * swn + (k0 + offs_k)[:, None],
                           mask=ok_n[None, :] & ok_k[:, None], other=0.0), UPCAST)
        acc += dot(a, w, UPCAST, DOT_PREC)
    # the expert output is rounded to the input dtype (as the torch path's product), then weighted in fp32
    acc = round_to(acc, ACT.dtype.element_ty).to(tl.float32)
    weight = tl.load(TOPK_W + rows, mask=ok_m, other=0.0).to(tl.float32)
    tl.store(Y + rows[:, None] * syt + offs_n[None, :], acc * weight[:, None], mask=ok_m[:, None] & ok_n[None, :])


@triton.jit
def moe_combine_kernel(Y, OUT, H, syt, sot, TOP_K: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = offs < H
    acc = tl.load(Y + (t * TOP_K) * syt + offs, mask=ok, other=0.0)
    for j in tl.static_range(1, TOP_K):
        acc += tl.load(Y + (t * TOP_K + j) * syt + offs, mask=ok, other=0.0)
    tl.store(OUT + t * sot + offs, round_to(acc, OUT.dtype.element_ty), mask=ok)
