// append_kv: write the new keys (RoPE-rotated here, or rotated already) and the new values into
// the KV cache.
//
// One thread per (b, i, kv head, pair index c < D/2): reads k[b, i, h, c] and k[..., c + D/2],
// writes the pair, rotated when p.rotate (else as it is: the attention door's k_rot), to
// slot cache_seqlens[b] + i of row b (its page and offset through the block table:
// page_offset) at head h, {c, c + D/2}, and copies the two v elements. Slots >= Lmax are skipped
// (documented in simsd_attention.h).
#include <math.h>

#include "common.cuh"

namespace simsd {
namespace {

template <typename T>
__global__ void append_kv_kernel(const simsd_append_kv_params p) {
  const int half = p.D / 2;
  const int64_t total = (int64_t)p.B * p.num_tokens * p.Hkv * half;
  for (int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
       idx += (int64_t)gridDim.x * blockDim.x) {
    const int c = (int)(idx % half);
    const int h = (int)((idx / half) % p.Hkv);
    const int i = (int)((idx / ((int64_t)half * p.Hkv)) % p.num_tokens);
    const int b = (int)(idx / ((int64_t)half * p.Hkv * p.num_tokens));
    const int64_t slot = (int64_t)p.cache_seqlens[b] + i;
    if (slot < 0 || slot >= p.Lmax) continue;

    const T* k = static_cast<const T*>(p.k) + b * p.k_stride[0] + i * p.k_stride[1] + h * p.k_stride[2];
    const T* v = static_cast<const T*>(p.v) + b * p.v_stride[0] + i * p.v_stride[1] + h * p.v_stride[2];
    const int32_t* bt = p.block_table + (int64_t)b * p.block_table_stride;
    T* kc = static_cast<T*>(p.k_cache) + page_offset(bt, slot, p.page_size, p.kc_stride[0], p.kc_stride[1]) +
            h * p.kc_stride[2];
    T* vc = static_cast<T*>(p.v_cache) + page_offset(bt, slot, p.page_size, p.vc_stride[0], p.vc_stride[1]) +
            h * p.vc_stride[2];

    if (p.rotate) {
      const float pos = static_cast<float>(p.positions[(int64_t)b * p.positions_stride + i]);
      float s, co;
      sincosf(pos * rope_inv_freq(c, p.D, p.rope_theta), &s, &co);
      float y1, y2;
      rope_rotate(Dt<T>::to_float(k[c]), Dt<T>::to_float(k[c + half]), co, s, y1, y2);
      kc[c] = Dt<T>::from_float(y1);
      kc[c + half] = Dt<T>::from_float(y2);
    } else {
      kc[c] = k[c];
      kc[c + half] = k[c + half];
    }
    vc[c] = v[c];
    vc[c + half] = v[c + half];
  }
}

template <typename T>
int launch(const simsd_append_kv_params& p, cudaStream_t stream) {
  const int64_t total = (int64_t)p.B * p.num_tokens * p.Hkv * (p.D / 2);
  if (total == 0) return SIMSD_OK;
  const int threads = 256;
  const int64_t blocks = (total + threads - 1) / threads;
  append_kv_kernel<T><<<(unsigned)(blocks < 65536 ? blocks : 65536), threads, 0, stream>>>(p);
  SIMSD_CHECK_LAUNCH();
  return SIMSD_OK;
}

}  // namespace
}  // namespace simsd

extern "C" int simsd_append_kv(const simsd_append_kv_params* p, simsd_dtype dtype, void* stream) {
  if (p->D <= 0 || p->D % 2) return SIMSD_ERR_HEAD_DIM;
  if (p->B < 0 || p->num_tokens < 0 || p->Hkv < 0 || p->Lmax < 0 || p->page_size < 1 ||
      p->block_table == nullptr)
    return SIMSD_ERR_SHAPE;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case SIMSD_F16:
      return simsd::launch<__half>(*p, s);
    case SIMSD_BF16:
      return simsd::launch<__nv_bfloat16>(*p, s);
    case SIMSD_F32:
      return simsd::launch<float>(*p, s);
    default:
      return SIMSD_ERR_DTYPE;
  }
}
