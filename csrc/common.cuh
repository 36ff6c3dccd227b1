// Device helpers shared by the simsd kernels: dtype traits, RoPE frequencies, the m16n8k16
// tensor-core MMA, cp.async / ldmatrix and the launch-error check. No torch header.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "simsd_attention.h"

namespace simsd {

constexpr float kLog2e = 1.4426950408889634f;

__host__ __device__ constexpr int ceil_div(int a, int b) { return (a + b - 1) / b; }

// ---- dtype traits: float <-> storage conversions (explicit intrinsics only, so the torch
// flags -D__CUDA_NO_HALF_CONVERSIONS__ etc. do not matter) -------------------------------
template <typename T> struct Dt;

template <> struct Dt<__half> {
  static __device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
  static __device__ __forceinline__ __half from_float(float x) { return __float2half_rn(x); }
  static __device__ __forceinline__ uint16_t bits(__half x) { return __half_as_ushort(x); }
  // two floats -> one 32-bit register, `lo` in the low half (the lower column of a fragment)
  static __device__ __forceinline__ uint32_t pack2(float lo, float hi) {
    __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
  }
};

template <> struct Dt<__nv_bfloat16> {
  static __device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
  static __device__ __forceinline__ __nv_bfloat16 from_float(float x) { return __float2bfloat16_rn(x); }
  static __device__ __forceinline__ uint16_t bits(__nv_bfloat16 x) { return __bfloat16_as_ushort(x); }
  static __device__ __forceinline__ uint32_t pack2(float lo, float hi) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
  }
};

template <> struct Dt<float> {
  static __device__ __forceinline__ float to_float(float x) { return x; }
  static __device__ __forceinline__ float from_float(float x) { return x; }
};

// ---- RoPE (rotate-half, as simsd_kernels/rope.py) ---------------------------------------
// inv_freq[i] = 1 / theta ** (2 i / D) in fp32, angle = float(pos) * inv_freq[i] in fp32
// (the transformers Qwen3 recipe). Needs accurate sincosf: never build with --use_fast_math.
__device__ __forceinline__ float rope_inv_freq(int i, int head_dim, float theta) {
  return 1.0f / powf(theta, static_cast<float>(2 * i) / static_cast<float>(head_dim));
}

// The rotate-half pair (x1 c - x2 s, x2 c + x1 s) in fp32 with its fused multiply-adds written
// out, so every kernel that rotates (rope_qk for the attention door, append_kv) rounds the same
// way: a plain expression leaves the contraction to the compiler, which may contract two kernels
// differently (the Triton door's and append_kv's fp32 keys differed so on the H200).
__device__ __forceinline__ void rope_rotate(float x1, float x2, float c, float s, float& y1, float& y2) {
  y1 = __fmaf_rn(x1, c, -__fmul_rn(x2, s));
  y2 = __fmaf_rn(x2, c, __fmul_rn(x1, s));
}

// ---- tensor-core MMA: D(16x8 f32) += A(16x16 row) * B(16x8 col), sm_80+ ------------------
// Fragment layout (PTX ISA, mma.m16n8k16, g = lane / 4, t = lane % 4):
//   A regs: {row g, k 2t..2t+1}, {row g+8, k 2t..}, {row g, k 2t+8..}, {row g+8, k 2t+8..}
//   B regs: {k 2t..2t+1, col g}, {k 2t+8..2t+9, col g}
//   C: c0,c1 = row g, cols 2t, 2t+1;  c2,c3 = row g+8, cols 2t, 2t+1
template <typename T> struct Mma;

template <> struct Mma<__half> {
  static __device__ __forceinline__ void run(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
    __trap();  // the extension is built for sm_80+ only
#endif
  }
};

template <> struct Mma<__nv_bfloat16> {
  static __device__ __forceinline__ void run(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
    __trap();
#endif
  }
};

// ---- asynchronous copies and matrix loads (sm_80+; PTX ISA "cp.async", "ldmatrix") ---------
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared without passing through registers (LDGSTS); `valid` false writes 16
// zero bytes and reads nothing (src-size 0), `gmem` must still be a mapped address.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const int src_size = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(smem)),
               "l"(__cvta_generic_to_global(gmem)), "r"(src_size)
               : "memory");
#else
  __trap();
#endif
}

__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

// Wait until at most N of this thread's committed cp.async groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

// ldmatrix.x4: lane l gives the shared address of row (l & 7) of 8x8 matrix (l >> 3); register i
// receives matrix i's fragment: row lane / 4, columns 2 (lane % 4) and 2 (lane % 4) + 1 (the lower
// column in the low half). .trans delivers the transpose (rows 2 (lane % 4) + {0, 1} at column
// lane / 4 of the 8 addressed rows).
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const void* smem) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(smem)));
#else
  __trap();
#endif
}

__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], const void* smem) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(smem)));
#else
  __trap();
#endif
}

// ---- launch checks -----------------------------------------------------------------------
// Return the launch error (a positive cudaError_t) from the enclosing launcher.
#define SIMSD_CHECK_LAUNCH()                              \
  do {                                                    \
    const cudaError_t simsd_err_ = cudaGetLastError();    \
    if (simsd_err_ != cudaSuccess) return (int)simsd_err_; \
  } while (0)

// Element offset of logical cache slot s of a row through its block-table row (simsd_kernels/paging.py):
// page bt_row[s / page_size] times the page stride, plus (s % page_size) times the slot stride.
__host__ __device__ __forceinline__ int64_t page_offset(const int32_t* bt_row, int64_t s, int page_size,
                                                        int64_t page_stride, int64_t slot_stride) {
  return (int64_t)bt_row[s / page_size] * page_stride + (s % page_size) * slot_stride;
}

#define SIMSD_RETURN_IF_ERROR(expr)                    \
  do {                                                 \
    const int simsd_rc_ = (expr);                      \
    if (simsd_rc_ != SIMSD_OK) return simsd_rc_;       \
  } while (0)

}  // namespace simsd
