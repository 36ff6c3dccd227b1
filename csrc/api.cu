// The C ABI entry points of simsd_attention.h: argument checks, dtype / head_dim dispatch,
// split-KV merge, the mask-table op of the mirror test, and error strings.
#include "common.cuh"
#include "launchers.cuh"
#include "mask_rule.cuh"
#include "tile_layout.cuh"

namespace simsd {
namespace {

bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15u) == 0; }

bool strides_aligned(const int64_t* s, int n, int64_t elems) {
  for (int i = 0; i < n; ++i)
    if (s[i] % elems) return false;
  return true;
}

int check_params(const simsd_attention_params& p, simsd_dtype dtype) {
  if (dtype != SIMSD_F16 && dtype != SIMSD_BF16 && dtype != SIMSD_F32) return SIMSD_ERR_DTYPE;
  if (p.D != 64 && p.D != 128) return SIMSD_ERR_HEAD_DIM;
  if (p.B < 0 || p.Lq < 0 || p.Lmax < 0 || p.page_size < 1 || p.block_table == nullptr || p.Hq <= 0 ||
      p.Hkv <= 0 || p.Hq % p.Hkv || p.num_splits < 1 || p.num_splits > 65535 || (int64_t)p.B * p.Hkv > 65535 || p.split_min_tiles < 1 ||
      (int64_t)p.B * p.Lq > 2147483647LL)
    return SIMSD_ERR_SHAPE;
  if (dtype != SIMSD_F32 && p.block_m != 16 && p.block_m != 32 && p.block_m != 64) return SIMSD_ERR_SHAPE;
  if (p.mask_mode < kBidirectional || p.mask_mode > kPaper) return SIMSD_ERR_MASK_MODE;
  if (p.num_splits > 1 && (p.o_partial == nullptr || p.lse_partial == nullptr)) return SIMSD_ERR_WORKSPACE;
  if (p.q_rot == nullptr || p.k_rot == nullptr) return SIMSD_ERR_WORKSPACE;
  if (dtype != SIMSD_F32) {  // the tensor-core kernel moves 16-byte vectors
    const void* ptrs[] = {p.q, p.k, p.v, p.k_cache, p.v_cache, p.out, p.q_rot, p.k_rot};
    for (const void* ptr : ptrs)
      if (!aligned16(ptr)) return SIMSD_ERR_ALIGN;
    const int64_t* strides[] = {p.q_stride, p.k_stride, p.v_stride, p.kc_stride, p.vc_stride, p.out_stride};
    for (const int64_t* s : strides)
      if (!strides_aligned(s, 3, 8)) return SIMSD_ERR_ALIGN;
  }
  return SIMSD_OK;
}

__global__ void mask_table_kernel(const int32_t* labels, uint8_t* out, int32_t B, int32_t L, int32_t mode) {
  const int64_t total = (int64_t)B * L * L;
  for (int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
       idx += (int64_t)gridDim.x * blockDim.x) {
    const int64_t j = idx % L, i = (idx / L) % L, b = idx / ((int64_t)L * L);
    const int32_t* q = labels + (b * L + i) * 3;
    const int32_t* k = labels + (b * L + j) * 3;
    out[idx] = mask_allowed(mode, q[0], q[1], q[2], k[0], k[1], k[2]) ? 1 : 0;
  }
}

}  // namespace
}  // namespace simsd

extern "C" int simsd_attention_block_n(int head_dim) {
  return head_dim == 64 || head_dim == 128 ? simsd::layout::kBlockN : 0;
}

extern "C" int simsd_attention_fwd(const simsd_attention_params* p, simsd_dtype dtype, void* stream) {
  SIMSD_RETURN_IF_ERROR(simsd::check_params(*p, dtype));
  if (p->B == 0 || p->Lq == 0) return SIMSD_OK;  // nothing to write
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  SIMSD_RETURN_IF_ERROR(simsd::launch_rope_qk(*p, dtype, s));  // RoPE once per token, every dtype
  switch (dtype) {
    case SIMSD_F16:
      SIMSD_RETURN_IF_ERROR(simsd::launch_attention_mma_f16(*p, s));
      break;
    case SIMSD_BF16:
      SIMSD_RETURN_IF_ERROR(simsd::launch_attention_mma_bf16(*p, s));
      break;
    default:
      SIMSD_RETURN_IF_ERROR(simsd::launch_attention_simple_f32(*p, s));
      break;
  }
  if (p->num_splits > 1) SIMSD_RETURN_IF_ERROR(simsd::launch_split_merge(*p, dtype, s));
  return SIMSD_OK;
}

extern "C" int simsd_mask_table(const int32_t* labels, uint8_t* out, int32_t B, int32_t L, int32_t mask_mode,
                                void* stream) {
  if (B < 0 || L < 0) return SIMSD_ERR_SHAPE;
  if (mask_mode < simsd::kBidirectional || mask_mode > simsd::kPaper) return SIMSD_ERR_MASK_MODE;
  const int64_t total = (int64_t)B * L * L;
  if (total == 0) return SIMSD_OK;
  const int threads = 256;
  const int64_t blocks = (total + threads - 1) / threads;
  simsd::mask_table_kernel<<<(unsigned)(blocks < 4096 ? blocks : 4096), threads, 0,
                             static_cast<cudaStream_t>(stream)>>>(labels, out, B, L, mask_mode);
  SIMSD_CHECK_LAUNCH();
  return SIMSD_OK;
}

extern "C" const char* simsd_error_string(int code) {
  switch (code) {
    case SIMSD_OK:
      return "no error";
    case SIMSD_ERR_HEAD_DIM:
      return "head_dim must be 64 or 128";
    case SIMSD_ERR_DTYPE:
      return "dtype must be float16, bfloat16 or float32";
    case SIMSD_ERR_SHAPE:
      return "bad sizes (negative size, Hq % Hkv != 0, num_splits < 1, split_min_tiles < 1, block_m not 16/32/64, "
             "or B * Hkv > 65535)";
    case SIMSD_ERR_WORKSPACE:
      return "num_splits > 1 needs the o_partial / lse_partial workspace, and every call the q_rot / k_rot workspace";
    case SIMSD_ERR_MASK_MODE:
      return "mask_mode must be 0 (bidirectional), 1 (block_causal), 2 (exact) or 3 (paper)";
    case SIMSD_ERR_ALIGN:
      return "fp16/bf16 tensors need 16-byte aligned data pointers and strides (multiples of 8 elements)";
    default:
      return code > 0 ? cudaGetErrorString(static_cast<cudaError_t>(code)) : "unknown simsd error";
  }
}
