// Tensor-core (mma.sync m16n8k16, sm_80+) forward of the simsd temporal-mask attention for
// fp16 / bf16, FlashAttention-2 style with a cp.async pipeline and ldmatrix fragments.
//
// Grid (ceil(Lq * G / BLOCK_M), B * Hkv, num_splits), 128 threads = WM x WN warps, G = Hq / Hkv,
// BLOCK_M = 16 * WM in {16, 32, 64}. A CTA owns BLOCK_M "rows" = (new token t, q head) pairs of
// one kv head (row m -> t = m / G, h = hkv * G + m % G), so all q heads sharing a kv head read each
// K/V tile once. Warp (wm, wn) owns rows [16 wm, 16 wm + 16) and, of every 64-key tile, the keys
// [64 / WN * wn, ...): for a small M the warps are laid along the KV axis, each keeps its own
// online-softmax state, and the WN states are merged through shared memory at the end.
//
// Inputs are pre-rotated: q_rot / k_rot come from rope_qk (RoPE once per token, rope_qk.cu); the
// cache stores rotated keys. Per CTA:
//   1. tiles of this split (simsd::layout::split_range, from cache_seqlens[b] read on the device):
//      cache tiles, then new-token tiles; new-token tiles that no query row of the CTA may see
//      (block_causal / exact labels, layout::maybe_visible) are skipped -- exact, since a fully
//      masked tile leaves the softmax state bit for bit unchanged;
//   2. Q tile (cp.async, swizzled) -> A fragments by ldmatrix, kept in registers;
//   3. kStages-deep cp.async pipeline of K/V tiles in swizzled shared memory (zero-filled past the
//      valid rows, so NaN in unused cache slots never leaks); per tile: S = Q K^T (K by ldmatrix),
//      mask (the tail of the slice; labels for new tokens by simsd::mask_allowed), online softmax
//      in base 2 with fp32 statistics, O += P V (V by ldmatrix.trans, P from the S accumulators);
//   4. a row whose split is alone (layout::split_active == 1) writes O / l to out, otherwise the
//      split writes O / l and log2-sum-exp to the fp32 workspace for split_merge_kernel.
// Rows that see no key end with l == 0 and are written as zeros (lse = -inf).
#pragma once

#include <math.h>

#include <atomic>

#include "common.cuh"
#include "mask_rule.cuh"
#include "tile_layout.cuh"

namespace simsd {

template <int D, int WM>
struct MmaCfg {
  static_assert(D == 64 || D == 128, "head_dim must be 64 or 128");
  static_assert(WM == 1 || WM == 2 || WM == 4, "1, 2 or 4 warps along M");
  static constexpr int kWarps = 4;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kWarpsM = WM;
  static constexpr int kWarpsN = kWarps / WM;
  static constexpr int kBlockM = 16 * WM;
  static constexpr int kBlockN = layout::kBlockN;
  static constexpr int kKeysPerWarp = kBlockN / kWarpsN;  // 64, 32, 16
  static constexpr int kNT = kKeysPerWarp / 8;            // 8-key S tiles per warp
  static constexpr int kChunks = D / 8;                   // 16-byte chunks per row
  // a small M reads more tiles per FLOP: one deeper pipeline, one CTA per SM (see csrc/README.md)
  static constexpr int kStages = WM == 4 ? 3 : 4;
  static constexpr int kTileElems = kBlockN * D;
  static constexpr int kStageElems = 2 * kTileElems;  // K then V
  static constexpr size_t smem_bytes = sizeof(uint16_t) * (size_t)kStages * kStageElems;
  // cross-warp merge (kWarpsN > 1), after the loop: O fragments + m + l per warp, in fp32
  static constexpr int kMergeFloats = (D / 8) * 4 * 32 + 4 * 32;
  static_assert(kBlockM * D <= kStageElems, "the Q tile lives in the last stage until the loop starts");
  static_assert(sizeof(float) * kWarps * kMergeFloats <= smem_bytes, "merge buffer fits the stages");
};

// kBlockN rows of a (., D) tile into swizzled smem: row r from base + (n0 + r) * row_stride;
// rows >= nvalid are zero-filled (cp.async src-size 0; the address stays that of row n0).
template <typename T, int D>
__device__ __forceinline__ void load_tile_async(T* dst, const T* base, int64_t row_stride, int n0, int nvalid) {
  constexpr int kChunks = D / 8;
  constexpr int kPerThread = layout::kBlockN * kChunks / 128;
#pragma unroll
  for (int k = 0; k < kPerThread; ++k) {
    const int u = threadIdx.x + k * 128;
    const int r = u / kChunks, c = u % kChunks;
    const bool ok = r < nvalid;
    const T* src = base + (int64_t)(n0 + (ok ? r : 0)) * row_stride + c * 8;
    cp_async16(dst + layout::swz_offset(r, c * 8, kChunks), src, ok);
  }
}

// The same from a page pool (simsd_kernels/paging.py): row r is logical slot n0 + r of the row
// whose block-table row is bt, at page bt[(n0 + r) / page_size], offset (n0 + r) % page_size (looked
// up per row: a tile may straddle pages); rows >= nvalid are zero-filled from slot n0's address.
template <typename T, int D>
__device__ __forceinline__ void load_page_tile_async(T* dst, const T* base, const int32_t* bt, int page_size,
                                                     int64_t page_stride, int64_t slot_stride, int n0, int nvalid) {
  constexpr int kChunks = D / 8;
  constexpr int kPerThread = layout::kBlockN * kChunks / 128;
#pragma unroll
  for (int k = 0; k < kPerThread; ++k) {
    const int u = threadIdx.x + k * 128;
    const int r = u / kChunks, c = u % kChunks;
    const bool ok = r < nvalid;
    const T* src = base + page_offset(bt, n0 + (ok ? r : 0), page_size, page_stride, slot_stride) + c * 8;
    cp_async16(dst + layout::swz_offset(r, c * 8, kChunks), src, ok);
  }
}

// One 64-key tile for this warp: S = Q K^T over its keys, mask, online softmax, O += P V.
// Keys >= nvalid are masked; NEW also applies the label rule (key labels read from global memory).
template <typename T, int D, int WM, bool NEW>
__device__ __forceinline__ void attend_tile(const uint32_t (&qf)[D / 16][4], const T* sK, const T* sV, int wn,
                                            int nvalid, const int* key_labels, int64_t key_label_stride,
                                            const int (&qlab)[2][3], int mode, float scale_log2,
                                            float (&o)[D / 8][4], float (&mrow)[2], float (&lrow)[2]) {
  using C = MmaCfg<D, WM>;
  constexpr int NT = C::kNT;
  const int lane = threadIdx.x & 31, t4 = lane & 3;
  const int key0 = wn * C::kKeysPerWarp;

  float s[NT][4];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
#pragma unroll
    for (int p = 0; p < D / 32; ++p) {
      uint32_t kb[4];
      ldsm_x4(kb, sK + layout::swz_offset(layout::ldsm_k_row(lane, key0 + nt * 8),
                                          layout::ldsm_k_chunk(lane, p) * 8, C::kChunks));
      Mma<T>::run(s[nt], qf[2 * p], kb[0], kb[1]);
      Mma<T>::run(s[nt], qf[2 * p + 1], kb[2], kb[3]);
    }
  }

  const bool tail = nvalid < C::kBlockN;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int col = key0 + nt * 8 + t4 * 2 + (i & 1);
      bool ok = !tail || col < nvalid;
      if (NEW && ok) {
        const int* kl = key_labels + (int64_t)col * key_label_stride;
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
  for (int kk = 0; kk < C::kKeysPerWarp / 16; ++kk) {
    const uint32_t a[4] = {Dt<T>::pack2(s[2 * kk][0], s[2 * kk][1]), Dt<T>::pack2(s[2 * kk][2], s[2 * kk][3]),
                           Dt<T>::pack2(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                           Dt<T>::pack2(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
    for (int dt = 0; dt < D / 8; dt += 2) {
      uint32_t vb[4];
      ldsm_x4_trans(vb, sV + layout::swz_offset(layout::ldsm_v_row(lane, key0 + kk * 16),
                                                layout::ldsm_v_chunk(lane, dt) * 8, C::kChunks));
      Mma<T>::run(o[dt], a, vb[0], vb[1]);
      Mma<T>::run(o[dt + 1], a, vb[2], vb[3]);
    }
  }
}

template <typename T, int D, int WM>
__global__ void __launch_bounds__(MmaCfg<D, WM>::kThreads)
attention_mma_kernel(const simsd_attention_params p) {
  using C = MmaCfg<D, WM>;
  constexpr int S = C::kStages;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* smem = reinterpret_cast<T*>(smem_raw);
  __shared__ int s_range[4];  // query grp min / max, visible new key min / max

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  const int wm = warp / C::kWarpsN, wn = warp % C::kWarpsN;
  const int G = p.Hq / p.Hkv;
  const int rows_total = p.Lq * G;
  const int row0 = blockIdx.x * C::kBlockM;
  const int b = blockIdx.y / p.Hkv, hkv = blockIdx.y % p.Hkv;
  const int z = blockIdx.z;
  const int cache_len = min(max(p.cache_seqlens[b], 0), p.Lmax);
  const bool invariant = p.invariant != 0;
  const int active = layout::split_active(p.num_splits, p.split_min_tiles, invariant, cache_len, p.Lq);
  if (z >= active) return;  // surplus split of a short row: the merge reads splits [0, active) only
  const layout::TileRange tr = layout::split_range(z, p.num_splits, p.split_min_tiles, invariant, cache_len, p.Lq);
  const int* lab_b = p.labels + (int64_t)b * p.labels_stride[0];

  // 1. new-token tiles that some query row of this CTA may see (block_causal / exact labels)
  int new_lo = tr.new_lo, new_hi = tr.new_hi;
  if (new_lo < new_hi && (p.mask_mode == kBlockCausal || p.mask_mode == kExact)) {
    if (tid == 0) {
      s_range[0] = INT_MAX;
      s_range[1] = INT_MIN;
      s_range[2] = INT_MAX;
      s_range[3] = -1;
    }
    __syncthreads();
    const int t_first = row0 / G, t_last = (min(row0 + C::kBlockM, rows_total) - 1) / G;
    for (int t = t_first + tid; t <= t_last; t += C::kThreads) {
      const int grp = lab_b[(int64_t)t * p.labels_stride[1] + 2];
      atomicMin(&s_range[0], grp);
      atomicMax(&s_range[1], grp);
    }
    __syncthreads();
    const int qmin = s_range[0], qmax = s_range[1];
    const int j_end = min(p.Lq, new_hi * C::kBlockN);
    for (int j = new_lo * C::kBlockN + tid; j < j_end; j += C::kThreads) {
      const int* lab_j = lab_b + (int64_t)j * p.labels_stride[1];
      if (layout::maybe_visible(p.mask_mode, qmin, qmax, lab_j[2], lab_j[1])) {
        atomicMin(&s_range[2], j);
        atomicMax(&s_range[3], j);
      }
    }
    __syncthreads();
    if (s_range[3] < 0) {
      new_hi = new_lo;  // nothing visible
    } else {
      new_lo = max(new_lo, s_range[2] / C::kBlockN);
      new_hi = min(new_hi, s_range[3] / C::kBlockN + 1);
    }
  }
  const int n_cache = tr.cache_hi - tr.cache_lo;
  const int n_tiles = n_cache + max(new_hi - new_lo, 0);

  const T* kc = static_cast<const T*>(p.k_cache) + hkv * p.kc_stride[2];
  const T* vc = static_cast<const T*>(p.v_cache) + hkv * p.vc_stride[2];
  const int32_t* bt = p.block_table + (int64_t)b * p.block_table_stride;
  const T* kn = static_cast<const T*>(p.k_rot) + ((int64_t)b * p.Lq * p.Hkv + hkv) * D;
  const T* vn = static_cast<const T*>(p.v) + b * p.v_stride[0] + hkv * p.v_stride[2];
  const int64_t kn_stride = (int64_t)p.Hkv * D;

  // tile i of this CTA -> stage i % S
  auto issue = [&](int i) {
    if (i < n_tiles) {
      T* sK = smem + (i % S) * C::kStageElems;
      if (i < n_cache) {
        const int n0 = (tr.cache_lo + i) * C::kBlockN;
        const int nvalid = min(C::kBlockN, cache_len - n0);
        load_page_tile_async<T, D>(sK, kc, bt, p.page_size, p.kc_stride[0], p.kc_stride[1], n0, nvalid);
        load_page_tile_async<T, D>(sK + C::kTileElems, vc, bt, p.page_size, p.vc_stride[0], p.vc_stride[1], n0,
                                   nvalid);
      } else {
        const int n0 = (new_lo + i - n_cache) * C::kBlockN;
        const int nvalid = min(C::kBlockN, p.Lq - n0);
        load_tile_async<T, D>(sK, kn, kn_stride, n0, nvalid);
        load_tile_async<T, D>(sK + C::kTileElems, vn, p.v_stride[1], n0, nvalid);
      }
    }
    cp_async_commit();  // possibly empty: keeps the group count uniform
  };

  // 2. Q tile into the last stage (free until the first loop iteration refills it)
  T* sQ = smem + (S - 1) * C::kStageElems;
  {
    const T* q = static_cast<const T*>(p.q_rot);
    for (int u = tid; u < C::kBlockM * C::kChunks; u += C::kThreads) {
      const int r = u / C::kChunks, c = u % C::kChunks, m = row0 + r;
      const bool ok = m < rows_total;
      const int mm = ok ? m : 0;
      const int t = mm / G, h = hkv * G + mm % G;
      const T* src = q + (((int64_t)b * p.Lq + t) * p.Hq + h) * D + c * 8;
      cp_async16(sQ + layout::swz_offset(r, c * 8, C::kChunks), src, ok);
    }
    cp_async_commit();
  }
#pragma unroll
  for (int i = 0; i < S - 1; ++i) issue(i);
  cp_async_wait<S - 1>();  // the Q group has landed
  __syncthreads();

  uint32_t qf[D / 16][4];
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks)
    ldsm_x4(qf[ks], sQ + layout::swz_offset(layout::ldsm_a_row(lane, wm * 16), layout::ldsm_a_chunk(lane, ks) * 8,
                                            C::kChunks));

  // labels of this thread's two rows (g and g + 8 of the warp's slab)
  int qlab[2][3];
#pragma unroll
  for (int rh = 0; rh < 2; ++rh) {
    const int m = row0 + wm * 16 + g + rh * 8;
    const int t = m < rows_total ? m / G : 0;
    const int* l = lab_b + (int64_t)t * p.labels_stride[1];
    qlab[rh][0] = l[0];
    qlab[rh][1] = l[1];
    qlab[rh][2] = l[2];
  }

  float o[D / 8][4];
#pragma unroll
  for (int dt = 0; dt < D / 8; ++dt) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.f;
  float mrow[2] = {-INFINITY, -INFINITY}, lrow[2] = {0.f, 0.f};
  const float scale_log2 = p.softmax_scale * kLog2e;

  // 3. the pipeline: wait for tile i, refill the stage freed by tile i - 1, compute tile i
  for (int i = 0; i < n_tiles; ++i) {
    cp_async_wait<S - 2>();
    __syncthreads();  // tile i visible to all; every warp is done with tile i - 1 (and with sQ)
    issue(i + S - 1);
    const T* sK = smem + (i % S) * C::kStageElems;
    const T* sV = sK + C::kTileElems;
    if (i < n_cache) {
      const int n0 = (tr.cache_lo + i) * C::kBlockN;
      attend_tile<T, D, WM, false>(qf, sK, sV, wn, min(C::kBlockN, cache_len - n0), nullptr, 0, qlab,
                                   p.mask_mode, scale_log2, o, mrow, lrow);
    } else {
      const int n0 = (new_lo + i - n_cache) * C::kBlockN;
      attend_tile<T, D, WM, true>(qf, sK, sV, wn, min(C::kBlockN, p.Lq - n0),
                                  lab_b + (int64_t)n0 * p.labels_stride[1], p.labels_stride[1], qlab, p.mask_mode,
                                  scale_log2, o, mrow, lrow);
    }
  }

  // 4. epilogue: quad sums of l, the WN warp states merged in warp order, then the output
#pragma unroll
  for (int rh = 0; rh < 2; ++rh) {
    lrow[rh] += __shfl_xor_sync(0xffffffffu, lrow[rh], 1);
    lrow[rh] += __shfl_xor_sync(0xffffffffu, lrow[rh], 2);
  }
  if constexpr (C::kWarpsN > 1) {
    cp_async_wait<0>();
    __syncthreads();  // the stages are free
    float* buf = reinterpret_cast<float*>(smem_raw) + warp * C::kMergeFloats;
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt)
#pragma unroll
      for (int j = 0; j < 4; ++j) buf[(dt * 4 + j) * 32 + lane] = o[dt][j];
#pragma unroll
    for (int rh = 0; rh < 2; ++rh) {
      buf[(D / 8) * 128 + rh * 32 + lane] = mrow[rh];
      buf[(D / 8) * 128 + 64 + rh * 32 + lane] = lrow[rh];
    }
    __syncthreads();
    if (wn != 0) return;
    const float* part = reinterpret_cast<const float*>(smem_raw) + wm * C::kWarpsN * C::kMergeFloats;
#pragma unroll
    for (int rh = 0; rh < 2; ++rh) {
      float mx = -INFINITY;
#pragma unroll
      for (int w = 0; w < C::kWarpsN; ++w) mx = fmaxf(mx, part[w * C::kMergeFloats + (D / 8) * 128 + rh * 32 + lane]);
      const float m_use = mx == -INFINITY ? 0.f : mx;
      float l = 0.f, scale[C::kWarpsN];
#pragma unroll
      for (int w = 0; w < C::kWarpsN; ++w) {
        const float* pw = part + w * C::kMergeFloats + (D / 8) * 128;
        scale[w] = exp2f(pw[rh * 32 + lane] - m_use);
        l += scale[w] * pw[64 + rh * 32 + lane];
      }
#pragma unroll
      for (int dt = 0; dt < D / 8; ++dt)
#pragma unroll
        for (int j = 2 * rh; j < 2 * rh + 2; ++j) {
          float acc = 0.f;
#pragma unroll
          for (int w = 0; w < C::kWarpsN; ++w) acc += scale[w] * part[w * C::kMergeFloats + (dt * 4 + j) * 32 + lane];
          o[dt][j] = acc;
        }
      mrow[rh] = mx;
      lrow[rh] = l;
    }
  }

#pragma unroll
  for (int rh = 0; rh < 2; ++rh) {
    const float l = lrow[rh];
    const int m = row0 + wm * 16 + g + rh * 8;
    if (m >= rows_total) continue;
    const int t = m / G, h = hkv * G + m % G;
    const float inv_l = l > 0.f ? 1.f / l : 0.f;
    if (active == 1) {
      T* dst = static_cast<T*>(p.out) + b * p.out_stride[0] + t * p.out_stride[1] + h * p.out_stride[2];
#pragma unroll
      for (int dt = 0; dt < D / 8; ++dt)
        *reinterpret_cast<uint32_t*>(dst + dt * 8 + t4 * 2) =
            Dt<T>::pack2(o[dt][2 * rh] * inv_l, o[dt][2 * rh + 1] * inv_l);
    } else {
      const int64_t row = (((int64_t)z * p.B + b) * p.Lq + t) * p.Hq + h;
      float* dst = p.o_partial + row * D;
#pragma unroll
      for (int dt = 0; dt < D / 8; ++dt)
        *reinterpret_cast<float2*>(dst + dt * 8 + t4 * 2) =
            make_float2(o[dt][2 * rh] * inv_l, o[dt][2 * rh + 1] * inv_l);
      if (t4 == 0) p.lse_partial[row] = l > 0.f ? mrow[rh] + log2f(l) : -INFINITY;
    }
  }
}

// cudaFuncSetAttribute once per kernel and device (not per launch), whatever the size: without
// the opt-in a launch may use 48 KiB of shared memory *static and dynamic together*, so a kernel
// whose dynamic part is exactly 48 KiB (D = 64, BLOCK_M = 64: 3 stages of 16 KiB) plus its static
// s_range failed every launch with cudaErrorInvalidValue on the H200 (bench/results/device_h200)
// when the opt-in was skipped for dynamic sizes <= 48 KiB.
template <typename Kernel>
int allow_dynamic_smem(Kernel kernel, size_t smem, std::atomic<unsigned long long>& done) {
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return (int)err;
  const unsigned long long bit = 1ull << (dev & 63);
  if (done.load(std::memory_order_acquire) & bit) return SIMSD_OK;
  err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
  if (err != cudaSuccess) return (int)err;
  done.fetch_or(bit, std::memory_order_release);
  return SIMSD_OK;
}

template <typename T, int D, int WM>
int launch_attention_mma(const simsd_attention_params& p, cudaStream_t stream) {
  using C = MmaCfg<D, WM>;
  static std::atomic<unsigned long long> smem_configured{0};
  SIMSD_RETURN_IF_ERROR(allow_dynamic_smem(attention_mma_kernel<T, D, WM>, C::smem_bytes, smem_configured));
  const dim3 grid(ceil_div(p.Lq * (p.Hq / p.Hkv), C::kBlockM), p.B * p.Hkv, p.num_splits);
  attention_mma_kernel<T, D, WM><<<grid, C::kThreads, C::smem_bytes, stream>>>(p);
  SIMSD_CHECK_LAUNCH();
  return SIMSD_OK;
}

template <typename T, int D>
int launch_attention_mma_m(const simsd_attention_params& p, cudaStream_t stream) {
  switch (p.block_m) {
    case 16:
      return launch_attention_mma<T, D, 1>(p, stream);
    case 32:
      return launch_attention_mma<T, D, 2>(p, stream);
    case 64:
      return launch_attention_mma<T, D, 4>(p, stream);
    default:
      return SIMSD_ERR_SHAPE;
  }
}

}  // namespace simsd
