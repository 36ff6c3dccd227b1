"""Triton kernels: temporal-mask attention of new tokens over a KV cache.

FlashAttention-2 style forward. One program handles one (batch row b, kv head, tile of ``BLOCK_M``
packed query rows, KV split). The query rows of a program are the ``GROUP`` q-heads of one kv head
for consecutive new tokens (row ``r`` = token ``r // GROUP``, q-head ``hkv * GROUP + r % GROUP``),
so every K/V tile is loaded once for the whole GQA group; ``BLOCK_M`` is 16, 32 or 64.

* Inputs are pre-rotated: :func:`rope_qk_kernel` rotates the new q and k once per token (RoPE in
  fp32, rounded once to the input dtype); the cache stores rotated keys. No trigonometry here.
* Split plan (``simsd_kernels.split_plan``; the rule is :func:`_split_range`, mirrored by
  ``simsd::layout::split_range`` in CUDA): the split count, the least tiles per split and the
  invariant flag are runtime arguments, so one compiled variant serves every plan; each program
  derives its tiles from ``cache_seqlens[b]`` (graph-safe).
* The cache is a page pool read through the block table (``simsd_kernels.paging``): key ``n`` of
  row ``b`` is at page ``BT[b, n // page_size]``, offset ``n % page_size``. ``ONE_PAGE`` (a table of
  one page per row: the contiguous cache) looks the row's page up once, before the tile loop, and
  the tiles' addresses stay affine (Triton's pipeliner multi-buffers them as before paging; a
  page id loaded inside the loop stops that: 72 KB of shared memory instead of 137 KB at sm_90,
  D128); otherwise the page is looked up per key (as vLLM's Triton ``unified_attention``: a tile
  may straddle pages, the page size needs no relation to ``BLOCK_N``). The page ids of a partial
  tile's keys past the row are not loaded.
* Cache tiles need no mask work except the bound of the last partial tile. New-token tiles get the
  mask from int32 labels (``common.allowed``, a mirror of ``simsd_kernels.mask_rule.allowed``, the
  mode a runtime argument); a tile no query row of the program may see is skipped (exact: a fully
  masked tile leaves the softmax state unchanged).
* Softmax in base 2 with fp32 statistics; a row that sees nothing writes zeros.
* Tile products go through :func:`common.dot`: ``tl.dot`` when compiled, a fixed-order sum under
  the interpreter (so a row's bits there do not depend on its place in the tile or on the CPU).
* A row with a single active split writes its output; otherwise each split writes a normalised
  partial output and its log2-sum-exp to an fp32 workspace and :func:`merge_splits_kernel`
  combines the row's active splits in index order.
"""
import triton
import triton.language as tl

from .common import allowed, dot, page_rows, rope_inv_freq, rope_rotate, round_to, to_dot, upcast

# runtime scalars that must not be specialised (a value of 1 or a multiple of 16 would otherwise
# compile another variant): one variant per (dtype, head_dim, GQA group, BLOCK_M)
_RUNTIME = ["Lq", "Hq", "Lmax", "total_rows", "mask_mode", "num_splits", "min_tiles", "invariant", "page_size",
            "sbt"]


@triton.jit
def _split_range(split, seqlen, Lq, num_splits, min_tiles, invariant, BLOCK_N: tl.constexpr):
    """``(active, cache_lo, cache_hi, new_lo, new_hi)`` tiles of ``split`` for one row."""
    ct = tl.cdiv(seqlen, BLOCK_N)
    nt = tl.cdiv(Lq, BLOCK_N)
    work = ct + nt * (1 - invariant)
    active = tl.maximum(1, tl.minimum(num_splits, work // min_tiles))
    lo = split * work // active
    hi = (split + 1) * work // active
    c_lo = tl.minimum(lo, ct)
    c_hi = tl.minimum(hi, ct)
    n_lo = tl.maximum(lo, ct) - ct
    n_hi = tl.maximum(hi, ct) - ct
    last = (split == active - 1).to(tl.int32)
    n_lo = n_lo * (1 - invariant)
    n_hi = n_hi * (1 - invariant) + nt * last * invariant
    return active, c_lo, c_hi, n_lo, n_hi


@triton.jit
def _online_softmax_step(acc, m_i, l_i, qk, v, ELT: tl.constexpr, UPCAST: tl.constexpr,
                         DOT_PREC: tl.constexpr):
    # qk: (BLOCK_M, BLOCK_N) scores in log2 units, -inf where not visible
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(qk - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + dot(to_dot(p, ELT, UPCAST), v, UPCAST, DOT_PREC)
    return acc, m_new, l_i


@triton.jit
def _cache_tile(acc, m_i, l_i, q, kc_base, vc_base, bt_row, page_size, skcp, skct, svcp, svct, start, hi, qk_scale,
                offs_n, offs_d, MASKED: tl.constexpr, ELT: tl.constexpr, UPCAST: tl.constexpr,
                DOT_PREC: tl.constexpr, ONE_PAGE: tl.constexpr):
    n = start + offs_n
    ok = n < hi
    if ONE_PAGE:  # the bases are at the row's one page already: affine addresses
        kt_ptr = kc_base + n[None, :] * skct + offs_d[:, None]  # (HEAD_DIM, BLOCK_N): K^T
        v_ptr = vc_base + n[:, None] * svct + offs_d[None, :]
    else:  # a page id per key
        page, off = page_rows(bt_row, n, page_size, ok)
        kt_ptr = kc_base + (page * skcp + off * skct)[None, :] + offs_d[:, None]
        v_ptr = vc_base + (page * svcp + off * svct)[:, None] + offs_d[None, :]
    if MASKED:
        kt = upcast(tl.load(kt_ptr, mask=ok[None, :], other=0.0), UPCAST)
        v = upcast(tl.load(v_ptr, mask=ok[:, None], other=0.0), UPCAST)
    else:
        kt = upcast(tl.load(kt_ptr), UPCAST)
        v = upcast(tl.load(v_ptr), UPCAST)
    qk = dot(q, kt, UPCAST, DOT_PREC) * qk_scale
    if MASKED:
        qk = tl.where(ok[None, :], qk, float("-inf"))
    return _online_softmax_step(acc, m_i, l_i, qk, v, ELT, UPCAST, DOT_PREC)


@triton.jit(do_not_specialize=_RUNTIME)
def temporal_attn_fwd_kernel(
    QR, KR, V, KC, VC, SEQLENS, LABELS, OUT, O_PART, LSE_PART, BT,
    sqb, sqt, sqh, skb, skt, skh, svb, svt, svh,
    skcp, skct, skch, svcp, svct, svch, sbt,
    slb, slt, sob, sot, soh,
    Lq, Hq, Lmax, total_rows, qk_scale, mask_mode, num_splits, min_tiles, invariant, page_size,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PREC: tl.constexpr, ONE_PAGE: tl.constexpr,
):
    ELT: tl.constexpr = KC.dtype.element_ty
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    split = tl.program_id(2)
    Hkv = Hq // GROUP
    b = (pid_bh // Hkv).to(tl.int64)
    hkv = pid_bh % Hkv

    seqlen = tl.minimum(tl.maximum(tl.load(SEQLENS + b), 0), Lmax)
    active, c_lo, c_hi, n_lo, n_hi = _split_range(split, seqlen, Lq, num_splits, min_tiles, invariant, BLOCK_N)
    if split < active:  # surplus splits of a short row do nothing: the merge reads [0, active)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < Lq * GROUP
        tok = rows // GROUP
        head = hkv * GROUP + rows % GROUP
        offs_d = tl.arange(0, HEAD_DIM)
        offs_n = tl.arange(0, BLOCK_N)

        q_ptr = QR + b * sqb + tok[:, None] * sqt + head[:, None] * sqh + offs_d[None, :]
        q = upcast(tl.load(q_ptr, mask=row_ok[:, None], other=0.0), UPCAST)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)

        # ---- cache tiles of this split, no mask work but the tail
        lo = c_lo * BLOCK_N
        hi = tl.minimum(c_hi * BLOCK_N, seqlen)
        hi_full = lo + (hi - lo) // BLOCK_N * BLOCK_N
        bt_row = BT + b * sbt
        kc_base = KC + hkv * skch
        vc_base = VC + hkv * svch
        if ONE_PAGE:  # the row's one page, looked up once (the loads stay affine: pipelined as before paging)
            row_page = tl.load(bt_row).to(tl.int64)
            kc_base += row_page * skcp
            vc_base += row_page * svcp
        for start in range(lo, hi_full, BLOCK_N):
            acc, m_i, l_i = _cache_tile(acc, m_i, l_i, q, kc_base, vc_base, bt_row, page_size, skcp, skct, svcp, svct,
                                        start, hi, qk_scale, offs_n, offs_d, False, ELT, UPCAST, DOT_PREC, ONE_PAGE)
        if hi_full < hi:
            acc, m_i, l_i = _cache_tile(acc, m_i, l_i, q, kc_base, vc_base, bt_row, page_size, skcp, skct, svcp, svct,
                                        hi_full, hi, qk_scale, offs_n, offs_d, True, ELT, UPCAST, DOT_PREC,
                                        ONE_PAGE)

        # ---- new-token tiles of this split: mask from labels, invisible tiles skipped
        lab_q = LABELS + b * slb + tok * slt
        kind_q = tl.load(lab_q, mask=row_ok, other=-1)[:, None]
        tau_q = tl.load(lab_q + 1, mask=row_ok, other=0)[:, None]
        grp_q = tl.load(lab_q + 2, mask=row_ok, other=0)[:, None]
        for jt in range(n_lo, n_hi):
            n = jt * BLOCK_N + offs_n
            ok = n < Lq
            lab_k = LABELS + b * slb + n * slt
            kind_k = tl.load(lab_k, mask=ok, other=-1)[None, :]
            tau_k = tl.load(lab_k + 1, mask=ok, other=0)[None, :]
            grp_k = tl.load(lab_k + 2, mask=ok, other=0)[None, :]
            vis = allowed(mask_mode, kind_q, tau_q, grp_q, kind_k, tau_k, grp_k) & ok[None, :]
            if tl.max(tl.max((vis & row_ok[:, None]).to(tl.int32), 1), 0) > 0:
                kt_ptr = KR + b * skb + n[None, :] * skt + hkv * skh + offs_d[:, None]
                kt = upcast(tl.load(kt_ptr, mask=ok[None, :], other=0.0), UPCAST)
                v_ptr = V + b * svb + n[:, None] * svt + hkv * svh + offs_d[None, :]
                v = upcast(tl.load(v_ptr, mask=ok[:, None], other=0.0), UPCAST)
                qk = dot(q, kt, UPCAST, DOT_PREC) * qk_scale
                qk = tl.where(vis, qk, float("-inf"))
                acc, m_i, l_i = _online_softmax_step(acc, m_i, l_i, qk, v, ELT, UPCAST, DOT_PREC)

        # ---- epilogue: a row that saw nothing has acc == 0 and l_i == 0 -> zeros
        o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        if active == 1:
            o_ptr = OUT + b * sob + tok[:, None] * sot + head[:, None] * soh + offs_d[None, :]
            tl.store(o_ptr, round_to(o, OUT.dtype.element_ty), mask=row_ok[:, None])
        else:
            row_id = ((b * Lq + tok) * Hq + head).to(tl.int64) + split * total_rows
            lse = tl.where(l_i > 0.0, m_i + tl.log2(tl.where(l_i > 0.0, l_i, 1.0)), float("-inf"))
            tl.store(O_PART + row_id[:, None] * HEAD_DIM + offs_d[None, :], o, mask=row_ok[:, None])
            tl.store(LSE_PART + row_id, lse, mask=row_ok)


@triton.jit(do_not_specialize=_RUNTIME)
def merge_splits_kernel(O_PART, LSE_PART, OUT, SEQLENS, Lq, Hq, Lmax, total_rows, sob, sot, soh,
                        num_splits, min_tiles, invariant, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program per output row ``(b, token, q-head)``: log-sum-exp merge of the row's active
    splits in index order (rows with a single active split were written by that split)."""
    row = tl.program_id(0).to(tl.int64)
    b = row // (Lq * Hq)
    tok = (row // Hq) % Lq
    h = row % Hq
    seqlen = tl.minimum(tl.maximum(tl.load(SEQLENS + b), 0), Lmax)
    active, c_lo, c_hi, n_lo, n_hi = _split_range(0, seqlen, Lq, num_splits, min_tiles, invariant, BLOCK_N)
    if active > 1:
        offs_d = tl.arange(0, HEAD_DIM)
        lse0 = tl.load(LSE_PART + row)
        m = lse0
        for s in range(1, active):
            m = tl.maximum(m, tl.load(LSE_PART + s * total_rows + row))
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        # every split < active wrote its rows (zeros and lse = -inf where it saw nothing)
        denom = tl.exp2(lse0 - m_safe)
        o = denom * tl.load(O_PART + row * HEAD_DIM + offs_d)
        for s in range(1, active):
            w = tl.exp2(tl.load(LSE_PART + s * total_rows + row) - m_safe)
            o = o + w * tl.load(O_PART + (s * total_rows + row) * HEAD_DIM + offs_d)
            denom = denom + w
        o = o / tl.where(denom > 0.0, denom, 1.0)
        tl.store(OUT + b * sob + tok * sot + h * soh + offs_d, round_to(o, OUT.dtype.element_ty))


@triton.jit
def rope_qk_kernel(Q, K, POS, QR, KR, sqb, sqt, sqh, skb, skt, skh, spb, spt, Lq, Hq, Hkv,
                   log2_theta_hi, log2_theta_lo, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr):
    """RoPE once per token: rotate q (all Hq heads) and k (all Hkv heads) of token ``(b, t)`` into
    the contiguous ``QR (B, Lq, Hq, D)`` / ``KR (B, Lq, Hkv, D)`` in the input dtype; cos/sin are
    computed once per (token, frequency), in fp32 from an fp64 ``inv_freq`` (``common.rope_inv_freq``)."""
    HALF: tl.constexpr = HEAD_DIM // 2
    pid = tl.program_id(0)
    b = (pid // Lq).to(tl.int64)
    t = pid % Lq
    offs = tl.arange(0, HALF)
    offs_h = tl.arange(0, BLOCK_H)
    ang = tl.load(POS + b * spb + t * spt).to(tl.float32) * rope_inv_freq(HALF, HEAD_DIM, log2_theta_hi, log2_theta_lo)
    cos = tl.cos(ang)[None, :]
    sin = tl.sin(ang)[None, :]
    for h0 in range(0, Hq, BLOCK_H):
        h = h0 + offs_h
        ok = (h < Hq)[:, None]
        src = Q + b * sqb + t * sqt + h[:, None] * sqh + offs[None, :]
        x1 = tl.load(src, mask=ok, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF, mask=ok, other=0.0).to(tl.float32)
        dst = QR + ((b * Lq + t) * Hq + h[:, None]) * HEAD_DIM + offs[None, :]
        y1, y2 = rope_rotate(x1, x2, cos, sin)
        tl.store(dst, round_to(y1, QR.dtype.element_ty), mask=ok)
        tl.store(dst + HALF, round_to(y2, QR.dtype.element_ty), mask=ok)
    for h0 in range(0, Hkv, BLOCK_H):
        h = h0 + offs_h
        ok = (h < Hkv)[:, None]
        src = K + b * skb + t * skt + h[:, None] * skh + offs[None, :]
        x1 = tl.load(src, mask=ok, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF, mask=ok, other=0.0).to(tl.float32)
        dst = KR + ((b * Lq + t) * Hkv + h[:, None]) * HEAD_DIM + offs[None, :]
        y1, y2 = rope_rotate(x1, x2, cos, sin)
        tl.store(dst, round_to(y1, KR.dtype.element_ty), mask=ok)
        tl.store(dst + HALF, round_to(y2, KR.dtype.element_ty), mask=ok)
