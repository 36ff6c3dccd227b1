"""Triton kernels: temporal-mask attention of new tokens over a KV cache, RoPE fused.

FlashAttention-2 style forward. One program handles one (batch row b, kv head, tile of
``BLOCK_M`` packed query rows, KV split). The query rows of a program are the ``GROUP`` q-heads
of one kv head for consecutive new tokens (row ``r`` = token ``r // GROUP``, q-head
``hkv * GROUP + r % GROUP``), so every K/V tile is loaded once for the whole GQA group.

* Cache part: keys ``[lo, hi)`` of ``[0, cache_seqlens[b])`` (one split's share), no mask work
  except the bound of the last partial tile. Cache keys are stored rotated.
* New-token part (last split only): q and the new k are rotated here from int64 positions
  (rotate-half on the two halves of D, so no shuffle is needed: ``q.k = q_lo.k_lo + q_hi.k_hi``)
  and the mask is computed on the fly from int32 labels with the compile-time ``MASK_MODE``
  (``common.allowed``, a mirror of ``simsd_kernels.mask_rule.allowed``).
* Softmax in base 2 with fp32 statistics; a row that sees nothing writes zeros.
* ``NUM_SPLITS > 1``: each split writes a normalised partial output and its log2-sum-exp to a
  fp32 workspace; :func:`_merge_splits_kernel` combines them.
"""
import triton
import triton.language as tl

from .common import allowed, rope_inv_freq, to_dot, upcast


@triton.jit
def _online_softmax_step(acc, m_i, l_i, qk, v, ELT: tl.constexpr, UPCAST: tl.constexpr,
                         DOT_PREC: tl.constexpr):
    # qk: (BLOCK_M, BLOCK_N) scores in log2 units, -inf where not visible
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(qk - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(to_dot(p, ELT, UPCAST), v, input_precision=DOT_PREC)
    return acc, m_new, l_i


@triton.jit
def _cache_tile(acc, m_i, l_i, q_lo, q_hi, kc_base, vc_base, skct, svct, start, hi, qk_scale,
                offs_n, offs_h, offs_d, HALF: tl.constexpr, MASKED: tl.constexpr,
                ELT: tl.constexpr, UPCAST: tl.constexpr, DOT_PREC: tl.constexpr):
    n = start + offs_n
    kt_ptr = kc_base + n[None, :] * skct + offs_h[:, None]  # (HALF, BLOCK_N): K^T halves
    v_ptr = vc_base + n[:, None] * svct + offs_d[None, :]
    if MASKED:
        ok = n < hi
        kt_lo = upcast(tl.load(kt_ptr, mask=ok[None, :], other=0.0), UPCAST)
        kt_hi = upcast(tl.load(kt_ptr + HALF, mask=ok[None, :], other=0.0), UPCAST)
        v = upcast(tl.load(v_ptr, mask=ok[:, None], other=0.0), UPCAST)
    else:
        kt_lo = upcast(tl.load(kt_ptr), UPCAST)
        kt_hi = upcast(tl.load(kt_ptr + HALF), UPCAST)
        v = upcast(tl.load(v_ptr), UPCAST)
    qk = tl.dot(q_lo, kt_lo, input_precision=DOT_PREC)
    qk = tl.dot(q_hi, kt_hi, qk, input_precision=DOT_PREC) * qk_scale
    if MASKED:
        qk = tl.where(ok[None, :], qk, float("-inf"))
    return _online_softmax_step(acc, m_i, l_i, qk, v, ELT, UPCAST, DOT_PREC)


@triton.jit
def temporal_attn_fwd_kernel(
    Q, K, V, KC, VC, SEQLENS, LABELS, POS, OUT, O_PART, LSE_PART,
    sqb, sqt, sqh, skb, skt, skh, svb, svt, svh,
    skcb, skct, skch, svcb, svct, svch,
    slb, slt, spb, spt, sob, sot, soh,
    Lq, Hq, total_rows, log2_theta_hi, log2_theta_lo, qk_scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, MASK_MODE: tl.constexpr,
    NUM_SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PREC: tl.constexpr,
):
    HALF: tl.constexpr = HEAD_DIM // 2
    ELT: tl.constexpr = KC.dtype.element_ty
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    split = tl.program_id(2)
    Hkv = Hq // GROUP
    b = (pid_bh // Hkv).to(tl.int64)
    hkv = pid_bh % Hkv

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < Lq * GROUP
    tok = rows // GROUP
    head = hkv * GROUP + rows % GROUP
    offs_h = tl.arange(0, HALF)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    inv_freq = rope_inv_freq(HALF, HEAD_DIM, log2_theta_hi, log2_theta_lo)

    # q: load, rotate in fp32 at its positions, round to the input dtype for the dots
    q_ptr = Q + b * sqb + tok[:, None] * sqt + head[:, None] * sqh + offs_h[None, :]
    q_lo = tl.load(q_ptr, mask=row_ok[:, None], other=0.0).to(tl.float32)
    q_hi = tl.load(q_ptr + HALF, mask=row_ok[:, None], other=0.0).to(tl.float32)
    ang = tl.load(POS + b * spb + tok * spt, mask=row_ok, other=0).to(tl.float32)[:, None] * inv_freq[None, :]
    cos = tl.cos(ang)
    sin = tl.sin(ang)
    q_lo, q_hi = q_lo * cos - q_hi * sin, q_hi * cos + q_lo * sin
    q_lo = to_dot(q_lo, ELT, UPCAST)
    q_hi = to_dot(q_hi, ELT, UPCAST)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)

    # ---- cache: this split's share of [0, cache_seqlens[b]), no mask work
    seqlen = tl.load(SEQLENS + b)
    if NUM_SPLITS == 1:
        lo = 0
        hi = seqlen
    else:
        chunk = tl.cdiv(tl.cdiv(seqlen, NUM_SPLITS), BLOCK_N) * BLOCK_N
        lo = tl.minimum(split * chunk, seqlen)
        hi = tl.minimum(lo + chunk, seqlen)
    hi_full = lo + (hi - lo) // BLOCK_N * BLOCK_N
    kc_base = KC + b * skcb + hkv * skch
    vc_base = VC + b * svcb + hkv * svch
    for start in range(lo, hi_full, BLOCK_N):
        acc, m_i, l_i = _cache_tile(acc, m_i, l_i, q_lo, q_hi, kc_base, vc_base, skct, svct, start,
                                    hi, qk_scale, offs_n, offs_h, offs_d, HALF, False, ELT, UPCAST,
                                    DOT_PREC)
    if hi_full < hi:
        acc, m_i, l_i = _cache_tile(acc, m_i, l_i, q_lo, q_hi, kc_base, vc_base, skct, svct,
                                    hi_full, hi, qk_scale, offs_n, offs_h, offs_d, HALF, True, ELT,
                                    UPCAST, DOT_PREC)

    # ---- new tokens (last split): rotate k, mask from labels
    if split == NUM_SPLITS - 1:
        lab_q = LABELS + b * slb + tok * slt
        kind_q = tl.load(lab_q, mask=row_ok, other=-1)[:, None]
        tau_q = tl.load(lab_q + 1, mask=row_ok, other=0)[:, None]
        grp_q = tl.load(lab_q + 2, mask=row_ok, other=0)[:, None]
        for start in range(0, Lq, BLOCK_N):
            n = start + offs_n
            ok = n < Lq
            kt_ptr = K + b * skb + n[None, :] * skt + hkv * skh + offs_h[:, None]
            kt_lo = tl.load(kt_ptr, mask=ok[None, :], other=0.0).to(tl.float32)
            kt_hi = tl.load(kt_ptr + HALF, mask=ok[None, :], other=0.0).to(tl.float32)
            ang_k = inv_freq[:, None] * tl.load(POS + b * spb + n * spt, mask=ok, other=0).to(tl.float32)[None, :]
            cos_k = tl.cos(ang_k)
            sin_k = tl.sin(ang_k)
            kt_lo, kt_hi = kt_lo * cos_k - kt_hi * sin_k, kt_hi * cos_k + kt_lo * sin_k
            v_ptr = V + b * svb + n[:, None] * svt + hkv * svh + offs_d[None, :]
            v = upcast(tl.load(v_ptr, mask=ok[:, None], other=0.0), UPCAST)
            qk = tl.dot(q_lo, to_dot(kt_lo, ELT, UPCAST), input_precision=DOT_PREC)
            qk = tl.dot(q_hi, to_dot(kt_hi, ELT, UPCAST), qk, input_precision=DOT_PREC) * qk_scale
            lab_k = LABELS + b * slb + n * slt
            kind_k = tl.load(lab_k, mask=ok, other=-1)[None, :]
            tau_k = tl.load(lab_k + 1, mask=ok, other=0)[None, :]
            grp_k = tl.load(lab_k + 2, mask=ok, other=0)[None, :]
            vis = allowed(MASK_MODE, kind_q, tau_q, grp_q, kind_k, tau_k, grp_k) & ok[None, :]
            qk = tl.where(vis, qk, float("-inf"))
            acc, m_i, l_i = _online_softmax_step(acc, m_i, l_i, qk, v, ELT, UPCAST, DOT_PREC)

    # ---- epilogue: a row that saw nothing has acc == 0 and l_i == 0 -> zeros
    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    if NUM_SPLITS == 1:
        o_ptr = OUT + b * sob + tok[:, None] * sot + head[:, None] * soh + offs_d[None, :]
        tl.store(o_ptr, o.to(OUT.dtype.element_ty), mask=row_ok[:, None])
    else:
        row_id = ((b * Lq + tok) * Hq + head).to(tl.int64) + split * total_rows
        lse = tl.where(l_i > 0.0, m_i + tl.log2(tl.where(l_i > 0.0, l_i, 1.0)), float("-inf"))
        tl.store(O_PART + row_id[:, None] * HEAD_DIM + offs_d[None, :], o, mask=row_ok[:, None])
        tl.store(LSE_PART + row_id, lse, mask=row_ok)


@triton.jit
def merge_splits_kernel(O_PART, LSE_PART, OUT, Lq, Hq, total_rows, sob, sot, soh,
                        NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, HEAD_DIM: tl.constexpr):
    """One program per output row ``(b, token, q-head)``: log-sum-exp merge of the splits."""
    row = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, BLOCK_S)
    s_ok = s < NUM_SPLITS
    offs_d = tl.arange(0, HEAD_DIM)
    lse = tl.load(LSE_PART + s * total_rows + row, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))
    denom = tl.sum(w, 0)
    o = tl.load(O_PART + (s[:, None] * total_rows + row) * HEAD_DIM + offs_d[None, :],
                mask=s_ok[:, None], other=0.0)
    o = tl.sum(w[:, None] * o, 0) / tl.where(denom > 0.0, denom, 1.0)
    b = row // (Lq * Hq)
    tok = (row // Hq) % Lq
    h = row % Hq
    tl.store(OUT + b * sob + tok * sot + h * soh + offs_d, o.to(OUT.dtype.element_ty))
