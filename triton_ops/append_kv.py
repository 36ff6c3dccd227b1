"""Triton kernel: write the new keys (RoPE-rotated here, or already rotated) and their values into
the KV cache.

One program per (batch row b, kv head, tile of ``BLOCK_T`` new tokens): token ``i < num_tokens``
goes to slot ``cache_seqlens[b] + i`` of the page pool, page ``BT[b, slot // page_size]`` at offset
``slot % page_size`` (``simsd_kernels.paging``; the contiguous cache is one page per row); with
``ROTATE`` the key is rotated (rotate-half, fp32
math) at its int64 position, without it (the attention door's write of the keys that
``rope_qk_kernel`` rotated) it is copied. Slots at or beyond the cache capacity ``Lmax`` are not
written (no out-of-bounds store; the caller owns capacity).
"""
import triton
import triton.language as tl

from .common import page_rows, rope_inv_freq, rope_rotate, round_to


@triton.jit(do_not_specialize=["page_size", "sbt"])
def append_kv_kernel(K, V, POS, KC, VC, SEQLENS, BT, num_tokens, Lmax, page_size,
                     skb, skt, skh, svb, svt, svh, spb, spt,
                     skcp, skct, skch, svcp, svct, svch, sbt, log2_theta_hi, log2_theta_lo,
                     HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr, ROTATE: tl.constexpr):
    HALF: tl.constexpr = HEAD_DIM // 2
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    t = tl.program_id(2) * BLOCK_T + tl.arange(0, BLOCK_T)
    slot = tl.load(SEQLENS + b) + t
    ok = (t < num_tokens) & (slot < Lmax)
    page, off = page_rows(BT + b * sbt, slot, page_size, ok)
    offs_h = tl.arange(0, HALF)
    offs_d = tl.arange(0, HEAD_DIM)

    k_ptr = K + b * skb + t[:, None] * skt + h * skh + offs_h[None, :]
    kc_ptr = KC + (page * skcp + off * skct)[:, None] + h * skch + offs_h[None, :]
    if ROTATE:
        k_lo = tl.load(k_ptr, mask=ok[:, None], other=0.0).to(tl.float32)
        k_hi = tl.load(k_ptr + HALF, mask=ok[:, None], other=0.0).to(tl.float32)
        pos = tl.load(POS + b * spb + t * spt, mask=ok, other=0).to(tl.float32)
        ang = pos[:, None] * rope_inv_freq(HALF, HEAD_DIM, log2_theta_hi, log2_theta_lo)[None, :]
        cos = tl.cos(ang)
        sin = tl.sin(ang)
        y1, y2 = rope_rotate(k_lo, k_hi, cos, sin)
        tl.store(kc_ptr, round_to(y1, KC.dtype.element_ty), mask=ok[:, None])
        tl.store(kc_ptr + HALF, round_to(y2, KC.dtype.element_ty), mask=ok[:, None])
    else:
        tl.store(kc_ptr, tl.load(k_ptr, mask=ok[:, None], other=0.0).to(KC.dtype.element_ty), mask=ok[:, None])
        tl.store(kc_ptr + HALF, tl.load(k_ptr + HALF, mask=ok[:, None], other=0.0).to(KC.dtype.element_ty),
                 mask=ok[:, None])

    v = tl.load(V + b * svb + t[:, None] * svt + h * svh + offs_d[None, :], mask=ok[:, None], other=0.0)
    tl.store(VC + (page * svcp + off * svct)[:, None] + h * svch + offs_d[None, :],
             v.to(VC.dtype.element_ty), mask=ok[:, None])
