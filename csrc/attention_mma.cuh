// Tensor-core (mma.sync m16n8k16, sm_80+) forward of the simsd temporal-mask attention for
// fp16 / bf16, FlashAttention-2 style.
//
// Grid (ceil(Lq * G / 64), B * Hkv, num_splits), 128 threads (4 warps), G = Hq / Hkv.
// One CTA owns 64 "rows" = (new token t, q head of kv head hkv) pairs, row m -> t = m / G,
// h = hkv * G + m % G, so all q heads sharing a kv head read each K/V tile once. Warp w owns
// rows [16 w, 16 w + 16). Per CTA:
//   1. rotate the Q tile (RoPE at positions[b, t], fp32 math) into shared memory, keep it in
//      registers as MMA A-fragments;
//   2. loop over 64-key tiles of the cache slice of this split, [split * chunk, ...) clipped
//      to cache_seqlens[b] read on the device: S = Q K^T, online softmax (fp32, base 2),
//      O += P V -- no mask work except the tail of the slice;
//   3. the last split also loops over the new tokens: k rotated on load, the mask evaluated
//      per element by simsd::mask_allowed from the labels;
//   4. write O / l to out (num_splits == 1) or O / l and log2-sum-exp to the fp32 workspace.
// Rows that see no key end with l == 0 and are written as zeros (lse = -inf).
// K/V tile rows past the valid range are zero-filled, so 0 * garbage never makes a NaN.
#pragma once

#include <math.h>

#include "common.cuh"
#include "mask_rule.cuh"

namespace simsd {

template <int D>
struct MmaTile {
  static_assert(D == 64 || D == 128, "head_dim must be 64 or 128");
  static constexpr int kBlockM = 64;
  static constexpr int kBlockN = 64;
  static constexpr int kWarps = 4;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kStride = D + 8;  // padded smem row (elements): conflict-free fragments
  static constexpr int kChunks = D / 16; // 8-element chunks in one half of a row
  static constexpr size_t smem_bytes =
      sizeof(uint16_t) * (size_t)(kBlockM + 2 * kBlockN) * kStride  // sQ, sK, sV
      + sizeof(int) * 3 * kBlockN                                    // key labels
      + sizeof(float) * (D / 2);                                     // inv_freq
};

template <typename T>
__device__ __forceinline__ uint32_t ld_smem32(const T* p) {
  return *reinterpret_cast<const uint32_t*>(p);
}

// Pack two 16-bit elements (lo in the low half) into one B-fragment register.
template <typename T>
__device__ __forceinline__ uint32_t pack_bits(T lo, T hi) {
  return (uint32_t)Dt<T>::bits(lo) | ((uint32_t)Dt<T>::bits(hi) << 16);
}

// Load kBlockN rows of a (., D) tile starting at row `first` (row stride `row_stride`
// elements) into smem (row stride kStride); rows >= nvalid are zero-filled. ROPE rotates each
// row at pos[first + r] in fp32 (new keys); otherwise the 16-byte chunks are copied as is.
template <typename T, int D, bool ROPE>
__device__ __forceinline__ void load_kv_rows(T* dst, const T* base, int64_t row_stride, int first,
                                             int nvalid, const int64_t* pos, const float* inv) {
  using Tile = MmaTile<D>;
  if constexpr (!ROPE) {
    constexpr int kVecs = D / 8;  // 16-byte chunks per row
    for (int u = threadIdx.x; u < Tile::kBlockN * kVecs; u += Tile::kThreads) {
      const int r = u / kVecs, c = (u % kVecs) * 8;
      uint4 val = make_uint4(0u, 0u, 0u, 0u);
      if (r < nvalid) val = *reinterpret_cast<const uint4*>(base + (int64_t)(first + r) * row_stride + c);
      *reinterpret_cast<uint4*>(dst + r * Tile::kStride + c) = val;
    }
  } else {
    for (int u = threadIdx.x; u < Tile::kBlockN * Tile::kChunks; u += Tile::kThreads) {
      const int r = u / Tile::kChunks, c = (u % Tile::kChunks) * 8;
      float x1[8], x2[8];
      if (r < nvalid) {
        const T* src = base + (int64_t)(first + r) * row_stride;
        load8(src + c, x1);
        load8(src + D / 2 + c, x2);
        rope8(x1, x2, static_cast<float>(pos[first + r]), inv + c);
      } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) x1[i] = x2[i] = 0.f;
      }
      store8(dst + r * Tile::kStride + c, x1);
      store8(dst + r * Tile::kStride + D / 2 + c, x2);
    }
  }
}

// One 64-key tile: S = Q K^T, mask, online softmax update, O += P V. Keys >= nvalid are
// masked; NEW also applies the label rule (qlab: this thread's 2 rows, sLab: the keys).
template <typename T, int D, bool NEW>
__device__ __forceinline__ void attend_tile(const uint32_t (&qf)[D / 16][4], const T* sK, const T* sV,
                                            const int* sLab, const int (&qlab)[2][3], int mode,
                                            int nvalid, float scale_log2, float (&o)[D / 8][4],
                                            float (&mrow)[2], float (&lrow)[2]) {
  using Tile = MmaTile<D>;
  constexpr int NT = Tile::kBlockN / 8;
  const int lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;

  float s[NT][4];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
    const T* krow = sK + (nt * 8 + g) * Tile::kStride + t4 * 2;
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks)
      Mma<T>::run(s[nt], qf[ks], ld_smem32(krow + ks * 16), ld_smem32(krow + ks * 16 + 8));
  }

#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int col = nt * 8 + t4 * 2 + (i & 1);
      bool ok = col < nvalid;
      if (NEW && ok) {
        const int* kl = sLab + 3 * col;
        const int rh = i >> 1;
        ok = mask_allowed(mode, qlab[rh][0], qlab[rh][1], qlab[rh][2], kl[0], kl[1], kl[2]);
      }
      s[nt][i] = ok ? s[nt][i] * scale_log2 : -INFINITY;
    }
  }

#pragma unroll
  for (int rh = 0; rh < 2; ++rh) {
    float mx = -INFINITY;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) mx = fmaxf(mx, fmaxf(s[nt][2 * rh], s[nt][2 * rh + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float m_new = fmaxf(mrow[rh], mx);
    const float m_use = m_new == -INFINITY ? 0.f : m_new;  // no (-inf) - (-inf)
    const float alpha = exp2f(mrow[rh] - m_use);
    mrow[rh] = m_new;
    float sum = 0.f;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      s[nt][2 * rh] = exp2f(s[nt][2 * rh] - m_use);
      s[nt][2 * rh + 1] = exp2f(s[nt][2 * rh + 1] - m_use);
      sum += s[nt][2 * rh] + s[nt][2 * rh + 1];
    }
    lrow[rh] = lrow[rh] * alpha + sum;  // per-thread partial; reduced over the quad at the end
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt) {
      o[dt][2 * rh] *= alpha;
      o[dt][2 * rh + 1] *= alpha;
    }
  }

  // The C layout of two adjacent 8-key S tiles is the A layout of a 16-key P tile.
#pragma unroll
  for (int kk = 0; kk < Tile::kBlockN / 16; ++kk) {
    const uint32_t a[4] = {Dt<T>::pack2(s[2 * kk][0], s[2 * kk][1]), Dt<T>::pack2(s[2 * kk][2], s[2 * kk][3]),
                           Dt<T>::pack2(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                           Dt<T>::pack2(s[2 * kk + 1][2], s[2 * kk + 1][3])};
    const T* vrow = sV + (kk * 16 + t4 * 2) * Tile::kStride + g;
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt) {
      const T* v0 = vrow + dt * 8;
      const uint32_t b0 = pack_bits(v0[0], v0[Tile::kStride]);
      const uint32_t b1 = pack_bits(v0[8 * Tile::kStride], v0[9 * Tile::kStride]);
      Mma<T>::run(o[dt], a, b0, b1);
    }
  }
}

template <typename T, int D>
__global__ void __launch_bounds__(MmaTile<D>::kThreads)
attention_mma_kernel(const simsd_attention_params p) {
  using Tile = MmaTile<D>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sK = sQ + Tile::kBlockM * Tile::kStride;
  T* sV = sK + Tile::kBlockN * Tile::kStride;
  int* sLab = reinterpret_cast<int*>(sV + Tile::kBlockN * Tile::kStride);
  float* sInv = reinterpret_cast<float*>(sLab + 3 * Tile::kBlockN);

  const int G = p.Hq / p.Hkv;
  const int rows_total = p.Lq * G;
  const int row0 = blockIdx.x * Tile::kBlockM;
  const int b = blockIdx.y / p.Hkv, hkv = blockIdx.y % p.Hkv;
  const int split = blockIdx.z;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
  const int64_t* pos = p.positions + (int64_t)b * p.positions_stride;

  for (int i = threadIdx.x; i < D / 2; i += Tile::kThreads) sInv[i] = rope_inv_freq(i, D, p.rope_theta);
  __syncthreads();

  // 1. Q tile, rotated.
  const T* q = static_cast<const T*>(p.q);
  for (int u = threadIdx.x; u < Tile::kBlockM * Tile::kChunks; u += Tile::kThreads) {
    const int r = u / Tile::kChunks, c = (u % Tile::kChunks) * 8, m = row0 + r;
    float x1[8], x2[8];
    if (m < rows_total) {
      const int t = m / G, h = hkv * G + m % G;
      const T* src = q + b * p.q_stride[0] + t * p.q_stride[1] + h * p.q_stride[2];
      load8(src + c, x1);
      load8(src + D / 2 + c, x2);
      rope8(x1, x2, static_cast<float>(pos[t]), sInv + c);
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) x1[i] = x2[i] = 0.f;
    }
    store8(sQ + r * Tile::kStride + c, x1);
    store8(sQ + r * Tile::kStride + D / 2 + c, x2);
  }
  __syncthreads();

  uint32_t qf[D / 16][4];
  {
    const T* qa = sQ + (warp * 16 + g) * Tile::kStride + t4 * 2;
    const T* qb = qa + 8 * Tile::kStride;
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      qf[ks][0] = ld_smem32(qa + ks * 16);
      qf[ks][1] = ld_smem32(qb + ks * 16);
      qf[ks][2] = ld_smem32(qa + ks * 16 + 8);
      qf[ks][3] = ld_smem32(qb + ks * 16 + 8);
    }
  }

  // labels of this thread's two rows (g and g + 8 of the warp's slab)
  int qlab[2][3];
#pragma unroll
  for (int rh = 0; rh < 2; ++rh) {
    const int m = row0 + warp * 16 + g + rh * 8;
    const int t = m < rows_total ? m / G : 0;
    const int* l = p.labels + (int64_t)b * p.labels_stride[0] + (int64_t)t * p.labels_stride[1];
    qlab[rh][0] = l[0];
    qlab[rh][1] = l[1];
    qlab[rh][2] = l[2];
  }

  float o[D / 8][4];
#pragma unroll
  for (int dt = 0; dt < D / 8; ++dt) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.f;
  float mrow[2] = {-INFINITY, -INFINITY}, lrow[2] = {0.f, 0.f};
  const float scale_log2 = p.softmax_scale * kLog2e;

  // 2. the cache slice of this split (no mask work but the slice's tail)
  const int cache_len = min(max(p.cache_seqlens[b], 0), p.Lmax);
  const int chunk = ceil_div(ceil_div(cache_len, p.num_splits), Tile::kBlockN) * Tile::kBlockN;
  const int kbeg = split * chunk, kend = min(cache_len, kbeg + chunk);
  const T* kc = static_cast<const T*>(p.k_cache) + b * p.kc_stride[0] + hkv * p.kc_stride[2];
  const T* vc = static_cast<const T*>(p.v_cache) + b * p.vc_stride[0] + hkv * p.vc_stride[2];
  for (int n0 = kbeg; n0 < kend; n0 += Tile::kBlockN) {
    const int nvalid = min(Tile::kBlockN, kend - n0);
    __syncthreads();  // the previous tile is consumed
    load_kv_rows<T, D, false>(sK, kc, p.kc_stride[1], n0, nvalid, nullptr, nullptr);
    load_kv_rows<T, D, false>(sV, vc, p.vc_stride[1], n0, nvalid, nullptr, nullptr);
    __syncthreads();
    attend_tile<T, D, false>(qf, sK, sV, sLab, qlab, p.mask_mode, nvalid, scale_log2, o, mrow, lrow);
  }

  // 3. the new tokens (last split), mask from labels
  if (split == p.num_splits - 1) {
    const T* kn = static_cast<const T*>(p.k) + b * p.k_stride[0] + hkv * p.k_stride[2];
    const T* vn = static_cast<const T*>(p.v) + b * p.v_stride[0] + hkv * p.v_stride[2];
    for (int n0 = 0; n0 < p.Lq; n0 += Tile::kBlockN) {
      const int nvalid = min(Tile::kBlockN, p.Lq - n0);
      __syncthreads();
      load_kv_rows<T, D, true>(sK, kn, p.k_stride[1], n0, nvalid, pos, sInv);
      load_kv_rows<T, D, false>(sV, vn, p.v_stride[1], n0, nvalid, nullptr, nullptr);
      for (int j = threadIdx.x; j < Tile::kBlockN; j += Tile::kThreads) {
        const int* l = p.labels + (int64_t)b * p.labels_stride[0] + (int64_t)(n0 + j) * p.labels_stride[1];
        const bool in = j < nvalid;
        sLab[3 * j] = in ? l[0] : 0;
        sLab[3 * j + 1] = in ? l[1] : 0;
        sLab[3 * j + 2] = in ? l[2] : 0;
      }
      __syncthreads();
      attend_tile<T, D, true>(qf, sK, sV, sLab, qlab, p.mask_mode, nvalid, scale_log2, o, mrow, lrow);
    }
  }

  // 4. epilogue
#pragma unroll
  for (int rh = 0; rh < 2; ++rh) {
    float l = lrow[rh];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    const int m = row0 + warp * 16 + g + rh * 8;
    if (m >= rows_total) continue;
    const int t = m / G, h = hkv * G + m % G;
    const float inv_l = l > 0.f ? 1.f / l : 0.f;
    if (p.num_splits == 1) {
      T* dst = static_cast<T*>(p.out) + b * p.out_stride[0] + t * p.out_stride[1] + h * p.out_stride[2];
#pragma unroll
      for (int dt = 0; dt < D / 8; ++dt)
        *reinterpret_cast<uint32_t*>(dst + dt * 8 + t4 * 2) =
            Dt<T>::pack2(o[dt][2 * rh] * inv_l, o[dt][2 * rh + 1] * inv_l);
    } else {
      const int64_t row = (((int64_t)split * p.B + b) * p.Lq + t) * p.Hq + h;
      float* dst = p.o_partial + row * D;
#pragma unroll
      for (int dt = 0; dt < D / 8; ++dt)
        *reinterpret_cast<float2*>(dst + dt * 8 + t4 * 2) =
            make_float2(o[dt][2 * rh] * inv_l, o[dt][2 * rh + 1] * inv_l);
      if (t4 == 0) p.lse_partial[row] = l > 0.f ? mrow[rh] + log2f(l) : -INFINITY;
    }
  }
}

template <typename T, int D>
int launch_attention_mma(const simsd_attention_params& p, cudaStream_t stream) {
  using Tile = MmaTile<D>;
  const dim3 grid(ceil_div(p.Lq * (p.Hq / p.Hkv), Tile::kBlockM), p.B * p.Hkv, p.num_splits);
  const size_t smem = Tile::smem_bytes;
  if (smem > 48 * 1024) {
    const cudaError_t err = cudaFuncSetAttribute(attention_mma_kernel<T, D>,
                                                 cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (err != cudaSuccess) return (int)err;
  }
  attention_mma_kernel<T, D><<<grid, Tile::kThreads, smem, stream>>>(p);
  SIMSD_CHECK_LAUNCH();
  return SIMSD_OK;
}

}  // namespace simsd
