/* Plain C ABI of the simsd CUDA kernels (no torch, no CUDA header).
 *
 * Shapes use the project vocabulary: B batch rows, Lq new tokens, Lmax cache capacity,
 * Hq / Hkv query / kv heads (Hq % Hkv == 0), D head_dim. Every tensor is addressed by a data
 * pointer plus element strides of its leading dims; the last dim is contiguous. Pointers to
 * fp16/bf16/fp32 data and every stride must be 16-byte aligned (8/8/4 elements), which is
 * what contiguous tensors with D in {64, 128} give.
 *
 * Every launcher enqueues its kernels on `stream` (a cudaStream_t) and returns SIMSD_OK, a
 * negative SIMSD_ERR_* for a bad argument, or a positive cudaError_t from the launch;
 * simsd_error_string() turns any of them into a message.
 */
#ifndef SIMSD_ATTENTION_H_
#define SIMSD_ATTENTION_H_

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum { SIMSD_F16 = 0, SIMSD_BF16 = 1, SIMSD_F32 = 2 } simsd_dtype;

enum {
  SIMSD_OK = 0,
  SIMSD_ERR_HEAD_DIM = -1,  /* D not in {64, 128} */
  SIMSD_ERR_DTYPE = -2,     /* dtype not in simsd_dtype */
  SIMSD_ERR_SHAPE = -3,     /* a size is negative, Hq % Hkv != 0, num_splits < 1, bad block_m / split_min_tiles */
  SIMSD_ERR_WORKSPACE = -4, /* num_splits > 1 without o_partial / lse_partial, or no q_rot / k_rot */
  SIMSD_ERR_MASK_MODE = -5, /* mask_mode not in 0..3 */
  SIMSD_ERR_ALIGN = -6      /* a pointer or stride breaks the 16-byte alignment */
};

/* Arguments of simsd_attention_fwd.
 *   q (B, Lq, Hq, D), k / v (B, Lq, Hkv, D): new tokens, q and k NOT rotated;
 *   k_cache / v_cache (num_pages, page_size, Hkv, D): page pools, keys stored rotated; row b's
 *   slot s lives at page block_table[b * block_table_stride + s / page_size], offset
 *   s % page_size (simsd_kernels/paging.py; a (B, Lmax, Hkv, D) cache is one page of Lmax per
 *   row, block_table [[0], ..., [B - 1]]); Lmax = max_pages * page_size is the capacity; row b
 *   reads [0, cache_seqlens[b]), the block-table entries of other slots are never read;
 *   cache_seqlens (B,) int32 on the device; labels (B, Lq, 3) int32 (kind, tau, grp);
 *   positions (B, Lq) int64 RoPE positions; out (B, Lq, Hq, D) in the input dtype.
 *   q_rot (B, Lq, Hq, D), k_rot (B, Lq, Hkv, D): contiguous workspaces in the input dtype, where
 *   the launcher writes the rotated new q and k once per token (the kernels read them; the
 *   attention door then writes k_rot to the cache with simsd_append_kv, rotate = 0).
 *   Split plan (simsd_kernels/split_plan.py; the rule is simsd::layout::split_range): the grid has
 *   num_splits CTAs along the keys; a row uses split_active(...) of them, each with at least
 *   split_min_tiles tiles of 64 keys (invariant != 0: cut from the cache length only, new tokens in
 *   the last active split). A row with more than one active split writes partial results to
 *   o_partial (num_splits, B, Lq, Hq, D) fp32 and lse_partial (num_splits, B, Lq, Hq) fp32
 *   (contiguous), merged into out. block_m: 16, 32 or 64 packed (token, q head) rows per CTA.
 *   A row that sees no key gets zeros. */
typedef struct {
  const void* q;
  const void* k;
  const void* v;
  const void* k_cache;
  const void* v_cache;
  const int32_t* cache_seqlens;
  const int32_t* block_table;  /* (B, max_pages) int32, row stride block_table_stride */
  const int32_t* labels;
  const int64_t* positions;
  void* out;
  float* o_partial;
  float* lse_partial;
  void* q_rot;
  void* k_rot;
  int64_t q_stride[3];       /* b, l, h */
  int64_t k_stride[3];
  int64_t v_stride[3];
  int64_t kc_stride[3];      /* k_cache page, slot in page, h */
  int64_t vc_stride[3];
  int64_t out_stride[3];
  int64_t labels_stride[2];  /* b, l (the 3 labels are contiguous) */
  int64_t positions_stride;  /* b (contiguous over l) */
  int64_t block_table_stride;
  int32_t B, Lq, Hq, Hkv, D, Lmax;
  int32_t page_size;
  int32_t num_splits;
  int32_t split_min_tiles;
  int32_t invariant;
  int32_t block_m;
  int32_t mask_mode;
  float rope_theta;
  float softmax_scale;
} simsd_attention_params;

/* Temporal-mask attention over a KV cache with RoPE fused (see simsd_kernels.api). */
int simsd_attention_fwd(const simsd_attention_params* p, simsd_dtype dtype, void* stream);

/* Keys per tile of the kernels (the split granularity): 64 for D in {64, 128}, else 0. */
int simsd_attention_block_n(int head_dim);

/* append_kv: for b < B, i < num_tokens: k_cache[b, cache_seqlens[b] + i] = rope(k[b, i]) at
 * positions[b, i] (rotate != 0) or k[b, i] as it is (rotate == 0: keys rotated already, e.g.
 * the k_rot of simsd_attention_fwd; positions unread) and v_cache[...] = v[b, i]. Slots >= Lmax
 * are skipped (not written). k / v (B, L, Hkv, D) in the cache dtype; caches: page pools read
 * through block_table as for simsd_attention_fwd (slot s of row b at its page and offset). */
typedef struct {
  const void* k;
  const void* v;
  const int64_t* positions;
  void* k_cache;
  void* v_cache;
  const int32_t* cache_seqlens;
  const int32_t* block_table;
  int64_t k_stride[3];
  int64_t v_stride[3];
  int64_t kc_stride[3];
  int64_t vc_stride[3];
  int64_t positions_stride;
  int64_t block_table_stride;
  int32_t B, num_tokens, Hkv, D, Lmax;
  int32_t page_size;
  int32_t rotate;
  float rope_theta;
} simsd_append_kv_params;

int simsd_append_kv(const simsd_append_kv_params* p, simsd_dtype dtype, void* stream);

/* out[b, i, j] = mask_allowed(mode, labels[b, i], labels[b, j]) as uint8, on the device;
 * labels (B, L, 3) int32 contiguous, out (B, L, L) uint8 contiguous. Used by the mirror test. */
int simsd_mask_table(const int32_t* labels, uint8_t* out, int32_t B, int32_t L, int32_t mask_mode,
                     void* stream);

/* Message for a code returned by the launchers (never NULL). */
const char* simsd_error_string(int code);

#ifdef __cplusplus
}
#endif

#endif /* SIMSD_ATTENTION_H_ */
