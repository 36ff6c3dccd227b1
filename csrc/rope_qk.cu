// rope_qk: RoPE once per token. Rotates the new queries and keys of one attention call into
// contiguous workspaces (q_rot (B, Lq, Hq, D), k_rot (B, Lq, Hkv, D), input dtype) that the
// tensor-core kernel and the fp32 plain kernel read, so no CTA rotates anything (before, every
// split re-rotated its Q tile and every m-tile of the last split re-rotated all new keys), and
// that the attention door writes to the cache as they are (append_kv.cu without rotation).
//
// Block (D / 2, kHeadLanes) per token (b, t): thread x owns the pair (x, x + D / 2), computes
// sincos(pos * inv_freq[x]) once (fp32, precise: the transformers Qwen3 recipe, as
// rope_inv_freq / rope8 did inside the kernel before) and rotates that pair of every head
// y, y + kHeadLanes, ... of q and of k. The result is rounded once to the input dtype, which is
// what the kernel used to do when it staged the rotated tile in shared memory.
#include <math.h>

#include "common.cuh"
#include "launchers.cuh"

namespace simsd {
namespace {

constexpr int kHeadLanes = 4;

template <typename T>
__device__ __forceinline__ void rotate_pair(const T* src, T* dst, int x, int half, float c, float s) {
  float y1, y2;
  rope_rotate(Dt<T>::to_float(src[x]), Dt<T>::to_float(src[x + half]), c, s, y1, y2);
  dst[x] = Dt<T>::from_float(y1);
  dst[x + half] = Dt<T>::from_float(y2);
}

template <typename T>
__global__ void rope_qk_kernel(const simsd_attention_params p) {
  const int half = p.D / 2, x = threadIdx.x, y = threadIdx.y;
  const int b = blockIdx.x / p.Lq, t = blockIdx.x % p.Lq;
  const float pos = static_cast<float>(p.positions[(int64_t)b * p.positions_stride + t]);
  float s, c;
  sincosf(pos * rope_inv_freq(x, p.D, p.rope_theta), &s, &c);
  const T* q = static_cast<const T*>(p.q) + b * p.q_stride[0] + t * p.q_stride[1];
  const T* k = static_cast<const T*>(p.k) + b * p.k_stride[0] + t * p.k_stride[1];
  T* qr = static_cast<T*>(p.q_rot) + ((int64_t)b * p.Lq + t) * p.Hq * p.D;
  T* kr = static_cast<T*>(p.k_rot) + ((int64_t)b * p.Lq + t) * p.Hkv * p.D;
  for (int h = y; h < p.Hq; h += kHeadLanes) rotate_pair(q + h * p.q_stride[2], qr + h * p.D, x, half, c, s);
  for (int h = y; h < p.Hkv; h += kHeadLanes) rotate_pair(k + h * p.k_stride[2], kr + h * p.D, x, half, c, s);
}

template <typename T>
int launch(const simsd_attention_params& p, cudaStream_t stream) {
  const dim3 block(p.D / 2, kHeadLanes);
  rope_qk_kernel<T><<<(unsigned)((int64_t)p.B * p.Lq), block, 0, stream>>>(p);
  SIMSD_CHECK_LAUNCH();
  return SIMSD_OK;
}

}  // namespace

int launch_rope_qk(const simsd_attention_params& p, simsd_dtype dtype, cudaStream_t stream) {
  switch (dtype) {
    case SIMSD_F16:
      return launch<__half>(p, stream);
    case SIMSD_BF16:
      return launch<__nv_bfloat16>(p, stream);
    case SIMSD_F32:
      return launch<float>(p, stream);
    default:
      return SIMSD_ERR_DTYPE;
  }
}

}  // namespace simsd
