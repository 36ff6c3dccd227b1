// Plain (no tensor core) fp32 forward and the split-KV LSE merge.
//
// attention_simple_kernel<D>: one warp per row (b, t, h), grid (ceil(B*Lq*Hq / 4), num_splits),
// 128 threads. Lane l owns elements d = l + 32 j (j < D / 32). q and the new keys are read from
// p.q_rot / p.k_rot, rotated once per token by rope_qk.cu. Keys are visited one at a time (dot
// product by warp shuffles, online softmax in base 2): the split's cache tiles, then its
// new-token tiles with the mask rule -- the tensor-core kernel's split rule (layout::split_range). Written for fp32 tests against float64, not for speed.
//
// split_merge_kernel<T, D>: one warp per row; rows whose cache needed one split only were
// written by that split and are skipped; otherwise out = sum_s 2^(lse_s - max) O_s / sum_s
// 2^(...) over the row's active splits in index order, zeros when every split saw nothing.
#include <math.h>

#include "common.cuh"
#include "launchers.cuh"
#include "mask_rule.cuh"
#include "tile_layout.cuh"

namespace simsd {

namespace {

constexpr int kWarpsPerBlock = 4;
constexpr int kBlockN = layout::kBlockN;  // split granularity, as the tensor-core kernel

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
}

template <int D>
__global__ void __launch_bounds__(kWarpsPerBlock * 32) attention_simple_kernel(const simsd_attention_params p) {
  constexpr int J = D / 32;
  const int lane = threadIdx.x & 31;
  const int64_t row = (int64_t)blockIdx.x * kWarpsPerBlock + (threadIdx.x >> 5);
  if (row >= (int64_t)p.B * p.Lq * p.Hq) return;
  const int h = (int)(row % p.Hq), t = (int)((row / p.Hq) % p.Lq), b = (int)(row / ((int64_t)p.Hq * p.Lq));
  const int hkv = h / (p.Hq / p.Hkv);
  const int split = blockIdx.y;
  const float scale_log2 = p.softmax_scale * kLog2e;

  const float* qp = static_cast<const float*>(p.q_rot) + (((int64_t)b * p.Lq + t) * p.Hq + h) * D;
  float q[J];
#pragma unroll
  for (int j = 0; j < J; ++j) q[j] = qp[lane + 32 * j];

  float m = -INFINITY, l = 0.f, o[J];
#pragma unroll
  for (int j = 0; j < J; ++j) o[j] = 0.f;

  auto visit = [&](const float* kp, const float* vp) {
    float k[J];
#pragma unroll
    for (int j = 0; j < J; ++j) k[j] = kp[lane + 32 * j];
    float dot = 0.f;
#pragma unroll
    for (int j = 0; j < J; ++j) dot += q[j] * k[j];
    const float s = warp_sum(dot) * scale_log2;
    const float m_new = fmaxf(m, s);
    const float alpha = exp2f(m - m_new), w = exp2f(s - m_new);
    l = l * alpha + w;
#pragma unroll
    for (int j = 0; j < J; ++j) o[j] = o[j] * alpha + w * vp[lane + 32 * j];
    m = m_new;
  };

  const int cache_len = min(max(p.cache_seqlens[b], 0), p.Lmax);
  const bool invariant = p.invariant != 0;
  const int active = layout::split_active(p.num_splits, p.split_min_tiles, invariant, cache_len, p.Lq);
  if (split >= active) return;  // the merge reads splits [0, active) only
  const layout::TileRange tr = layout::split_range(split, p.num_splits, p.split_min_tiles, invariant, cache_len, p.Lq);
  const float* kc = static_cast<const float*>(p.k_cache) + hkv * p.kc_stride[2];
  const float* vc = static_cast<const float*>(p.v_cache) + hkv * p.vc_stride[2];
  const int32_t* bt = p.block_table + (int64_t)b * p.block_table_stride;
  const int kend = min(cache_len, tr.cache_hi * kBlockN);
  for (int n = tr.cache_lo * kBlockN; n < kend; ++n)  // key n at its page (simsd_kernels/paging.py)
    visit(kc + page_offset(bt, n, p.page_size, p.kc_stride[0], p.kc_stride[1]),
          vc + page_offset(bt, n, p.page_size, p.vc_stride[0], p.vc_stride[1]));

  const int* lq = p.labels + (int64_t)b * p.labels_stride[0] + (int64_t)t * p.labels_stride[1];
  const float* kn = static_cast<const float*>(p.k_rot) + ((int64_t)b * p.Lq * p.Hkv + hkv) * D;
  const float* vn = static_cast<const float*>(p.v) + b * p.v_stride[0] + hkv * p.v_stride[2];
  const int nend = min(p.Lq, tr.new_hi * kBlockN);
  for (int n = tr.new_lo * kBlockN; n < nend; ++n) {
    const int* lk = p.labels + (int64_t)b * p.labels_stride[0] + (int64_t)n * p.labels_stride[1];
    if (!mask_allowed(p.mask_mode, lq[0], lq[1], lq[2], lk[0], lk[1], lk[2])) continue;
    visit(kn + (int64_t)n * p.Hkv * D, vn + n * p.v_stride[1]);
  }

  const float inv_l = l > 0.f ? 1.f / l : 0.f;  // a row that saw nothing -> zeros
  if (active == 1) {
    float* dst = static_cast<float*>(p.out) + b * p.out_stride[0] + t * p.out_stride[1] + h * p.out_stride[2];
#pragma unroll
    for (int j = 0; j < J; ++j) dst[lane + 32 * j] = o[j] * inv_l;
  } else {
    const int64_t prow = (int64_t)split * p.B * p.Lq * p.Hq + row;
#pragma unroll
    for (int j = 0; j < J; ++j) p.o_partial[prow * D + lane + 32 * j] = o[j] * inv_l;
    if (lane == 0) p.lse_partial[prow] = l > 0.f ? m + log2f(l) : -INFINITY;
  }
}

template <typename T, int D>
__global__ void __launch_bounds__(kWarpsPerBlock * 32) split_merge_kernel(const simsd_attention_params p) {
  constexpr int J = D / 32;
  const int lane = threadIdx.x & 31;
  const int64_t rows = (int64_t)p.B * p.Lq * p.Hq;
  const int64_t row = (int64_t)blockIdx.x * kWarpsPerBlock + (threadIdx.x >> 5);
  if (row >= rows) return;
  const int h = (int)(row % p.Hq), t = (int)((row / p.Hq) % p.Lq), b = (int)(row / ((int64_t)p.Hq * p.Lq));

  const int cache_len = min(max(p.cache_seqlens[b], 0), p.Lmax);
  const int active = layout::split_active(p.num_splits, p.split_min_tiles, p.invariant != 0, cache_len, p.Lq);
  if (active == 1) return;  // the only split wrote this row

  float lmax = -INFINITY;
  for (int s = 0; s < active; ++s) lmax = fmaxf(lmax, p.lse_partial[s * rows + row]);
  float acc[J], wsum = 0.f;
#pragma unroll
  for (int j = 0; j < J; ++j) acc[j] = 0.f;
  if (lmax != -INFINITY) {
    for (int s = 0; s < active; ++s) {
      const float w = exp2f(p.lse_partial[s * rows + row] - lmax);  // 0 for an empty split
      if (w == 0.f) continue;  // its partial O may be anything finite; skip it anyway
      wsum += w;
      const float* src = p.o_partial + (s * rows + row) * D;
#pragma unroll
      for (int j = 0; j < J; ++j) acc[j] += w * src[lane + 32 * j];
    }
  }
  const float inv = wsum > 0.f ? 1.f / wsum : 0.f;
  T* dst = static_cast<T*>(p.out) + b * p.out_stride[0] + t * p.out_stride[1] + h * p.out_stride[2];
#pragma unroll
  for (int j = 0; j < J; ++j) dst[lane + 32 * j] = Dt<T>::from_float(acc[j] * inv);
}

template <int D>
int launch_simple(const simsd_attention_params& p, cudaStream_t stream) {
  const int64_t rows = (int64_t)p.B * p.Lq * p.Hq;
  const dim3 grid((unsigned)((rows + kWarpsPerBlock - 1) / kWarpsPerBlock), p.num_splits);
  attention_simple_kernel<D><<<grid, kWarpsPerBlock * 32, 0, stream>>>(p);
  SIMSD_CHECK_LAUNCH();
  return SIMSD_OK;
}

template <typename T, int D>
int launch_merge(const simsd_attention_params& p, cudaStream_t stream) {
  const int64_t rows = (int64_t)p.B * p.Lq * p.Hq;
  const dim3 grid((unsigned)((rows + kWarpsPerBlock - 1) / kWarpsPerBlock));
  split_merge_kernel<T, D><<<grid, kWarpsPerBlock * 32, 0, stream>>>(p);
  SIMSD_CHECK_LAUNCH();
  return SIMSD_OK;
}

template <typename T>
int launch_merge_d(const simsd_attention_params& p, cudaStream_t stream) {
  if (p.D == 64) return launch_merge<T, 64>(p, stream);
  if (p.D == 128) return launch_merge<T, 128>(p, stream);
  return SIMSD_ERR_HEAD_DIM;
}

}  // namespace

int launch_attention_simple_f32(const simsd_attention_params& p, cudaStream_t stream) {
  if (p.D == 64) return launch_simple<64>(p, stream);
  if (p.D == 128) return launch_simple<128>(p, stream);
  return SIMSD_ERR_HEAD_DIM;
}

int launch_split_merge(const simsd_attention_params& p, simsd_dtype dtype, cudaStream_t stream) {
  switch (dtype) {
    case SIMSD_F16:
      return launch_merge_d<__half>(p, stream);
    case SIMSD_BF16:
      return launch_merge_d<__nv_bfloat16>(p, stream);
    case SIMSD_F32:
      return launch_merge_d<float>(p, stream);
    default:
      return SIMSD_ERR_DTYPE;
  }
}

}  // namespace simsd
