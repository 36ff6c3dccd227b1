// The one torch-facing file: registers the simsd CUDA ops in the `simsd_cuda` namespace,
// checks arguments (TORCH_CHECK naming the argument), dispatches dtype / head_dim through the
// C ABI of simsd_attention.h and raises when a launcher returns an error.
//
//   torch.ops.simsd_cuda.attention(q, k, v, k_cache, v_cache, cache_seqlens, labels, positions,
//                                  mask_mode, rope_theta, softmax_scale, num_splits=1, block_m=64,
//                                  split_min_tiles=1, invariant=False, block_table=None) -> out
//   torch.ops.simsd_cuda.attention_with_kvcache(the same arguments) -> out   (the attention door:
//       the attention, then the k it rotated once and v of all Lq new tokens written to slots
//       cache_seqlens[b] + i below the capacity; writes the caches)
//   torch.ops.simsd_cuda.append_kv(k, v, positions, k_cache, v_cache, cache_seqlens,
//                                  rope_theta, num_tokens, block_table=None) -> ()   (writes the caches)
//   torch.ops.simsd_cuda.mask_table(labels, mask_mode) -> (B, L, L) bool   (CPU and CUDA)
//
// Shapes: q (B, Lq, Hq, D); k, v (B, Lq, Hkv, D); k_cache, v_cache (B, Lmax, Hkv, D), or page pools
// (num_pages, page_size, Hkv, D) with block_table (B, max_pages) int32 (simsd_kernels/paging.py;
// without one the (B, Lmax, ...) caches are read through the one-page-per-row table);
// cache_seqlens (B,) int32; labels (B, Lq, 3) int32; positions (B, Lq) int64; D in {64, 128};
// dtype float16 / bfloat16 (tensor cores) or float32 (plain path for tests).
// num_splits / block_m / split_min_tiles / invariant: the launch plan, chosen in Python by
// simsd_kernels/split_plan.py (simsd_kernels.cuda_backend.attention passes it); num_splits 0 is
// taken as 1. The per-row split rule runs on the device from cache_seqlens (graph-safe).
#include <Python.h>

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <tuple>

#include "mask_rule.cuh"
#include "simsd_attention.h"

namespace {

using at::Tensor;

simsd_dtype to_simsd_dtype(const Tensor& t, const char* op) {
  switch (t.scalar_type()) {
    case at::kHalf:
      return SIMSD_F16;
    case at::kBFloat16:
      return SIMSD_BF16;
    case at::kFloat:
      return SIMSD_F32;
    default:
      break;
  }
  TORCH_CHECK(false, op, ": q must be float16, bfloat16 or float32, got ", t.scalar_type(),
              " (float64 runs on the torch backend)");
}

void check_tensor(const Tensor& t, const char* op, const char* name, int64_t ndim, at::ScalarType dtype,
                  const at::Device& device) {
  TORCH_CHECK(t.dim() == ndim, op, ": ", name, " must have ", ndim, " dims, got shape ", t.sizes());
  TORCH_CHECK(t.scalar_type() == dtype, op, ": ", name, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(t.device() == device, op, ": ", name, " is on ", t.device(), " but q/k is on ", device);
  TORCH_CHECK(t.numel() == 0 || t.stride(-1) == 1, op, ": ", name,
              " must be contiguous in its last dim, got strides ", t.strides());
}

void copy_strides(int64_t (&dst)[3], const Tensor& t) {
  for (int i = 0; i < 3; ++i) dst[i] = t.stride(i);
}

// The block table of a launch: the given (B, max_pages) int32 table (checked) or, without one, the
// one-page-per-row table of (B, Lmax, Hkv, D) caches (k_cache.size(0) must then be B).
Tensor page_table(const char* op, const std::optional<Tensor>& block_table, const Tensor& k_cache, int64_t B,
                  int64_t Hkv, int64_t D, const at::Device& dev) {
  if (!block_table.has_value()) {
    TORCH_CHECK(k_cache.size(0) == B && k_cache.size(2) == Hkv && k_cache.size(3) == D, op,
                ": k_cache must be (B=", B, ", Lmax, Hkv=", Hkv, ", D=", D, "), got ", k_cache.sizes());
    return at::arange(B, k_cache.options().dtype(at::kInt)).view({B, 1});
  }
  const Tensor& bt = *block_table;
  check_tensor(bt, op, "block_table", 2, at::kInt, dev);
  TORCH_CHECK(bt.size(0) == B && bt.size(1) >= 1, op, ": block_table must be (B=", B, ", max_pages >= 1), got ",
              bt.sizes());
  TORCH_CHECK(k_cache.size(1) >= 1 && k_cache.size(2) == Hkv && k_cache.size(3) == D, op,
              ": k_cache must be a page pool (num_pages, page_size >= 1, Hkv=", Hkv, ", D=", D, "), got ",
              k_cache.sizes());
  return bt;
}

void raise_on_error(int rc, const char* op) {
  TORCH_CHECK(rc == SIMSD_OK, op, ": ", simsd_error_string(rc));
}

// The attention launch of the attention and attention_with_kvcache ops: returns the output and
// the new keys rotated once (k_rot, contiguous (B, Lq, Hkv, D), in q's dtype).
std::tuple<Tensor, Tensor> launch_attention(const char* op, const Tensor& q, const Tensor& k, const Tensor& v,
                                            const Tensor& k_cache, const Tensor& v_cache,
                                            const Tensor& cache_seqlens_in, const Tensor& labels_in,
                                            const Tensor& positions_in, int64_t mask_mode, double rope_theta,
                                            double softmax_scale, int64_t num_splits, int64_t block_m,
                                            int64_t split_min_tiles, bool invariant,
                                            const std::optional<Tensor>& block_table_in) {
  TORCH_CHECK(q.is_cuda(), op, ": q must be a CUDA tensor, got ", q.device());
  const simsd_dtype dtype = to_simsd_dtype(q, op);
  const at::Device dev = q.device();
  check_tensor(q, op, "q", 4, q.scalar_type(), dev);
  check_tensor(k, op, "k", 4, q.scalar_type(), dev);
  check_tensor(v, op, "v", 4, q.scalar_type(), dev);
  check_tensor(k_cache, op, "k_cache", 4, q.scalar_type(), dev);
  check_tensor(v_cache, op, "v_cache", 4, q.scalar_type(), dev);
  check_tensor(cache_seqlens_in, op, "cache_seqlens", 1, at::kInt, dev);
  check_tensor(labels_in, op, "labels", 3, at::kInt, dev);
  check_tensor(positions_in, op, "positions", 2, at::kLong, dev);

  const int64_t B = q.size(0), Lq = q.size(1), Hq = q.size(2), D = q.size(3);
  const int64_t Hkv = k.size(2);
  TORCH_CHECK(D == 64 || D == 128, op, ": head_dim (q.size(3)) must be 64 or 128, got ", D);
  TORCH_CHECK(k.sizes() == at::IntArrayRef({B, Lq, Hkv, D}), op, ": k must be (B=", B, ", Lq=", Lq,
              ", Hkv, D=", D, "), got ", k.sizes());
  TORCH_CHECK(v.sizes() == k.sizes(), op, ": v must have k's shape ", k.sizes(), ", got ", v.sizes());
  TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0, op, ": GQA: Hq=", Hq, " must be a multiple of Hkv=", Hkv);
  const Tensor block_table = page_table(op, block_table_in, k_cache, B, Hkv, D, dev);
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes(), op, ": v_cache ", v_cache.sizes(), " must match k_cache ",
              k_cache.sizes());
  TORCH_CHECK(cache_seqlens_in.size(0) == B, op, ": cache_seqlens must be (B=", B, ",), got ",
              cache_seqlens_in.sizes());
  TORCH_CHECK(labels_in.sizes() == at::IntArrayRef({B, Lq, 3}), op, ": labels must be (B=", B, ", Lq=", Lq,
              ", 3), got ", labels_in.sizes());
  TORCH_CHECK(positions_in.sizes() == at::IntArrayRef({B, Lq}), op, ": positions must be (B=", B, ", Lq=", Lq,
              "), got ", positions_in.sizes());
  TORCH_CHECK(mask_mode >= 0 && mask_mode <= 3, op, ": mask_mode must be 0..3 (MaskMode), got ", mask_mode);
  TORCH_CHECK(num_splits >= 0 && num_splits <= 1024, op, ": num_splits must be in [0, 1024], got ", num_splits);
  TORCH_CHECK(block_m == 16 || block_m == 32 || block_m == 64, op, ": block_m must be 16, 32 or 64, got ", block_m);
  TORCH_CHECK(split_min_tiles >= 1, op, ": split_min_tiles must be >= 1, got ", split_min_tiles);
  TORCH_CHECK(B * Hkv <= 65535, op, ": B * Hkv must be <= 65535, got ", B * Hkv);

  c10::cuda::CUDAGuard guard(dev);
  // small label tensors: make the layout the kernels assume (free when already contiguous)
  const Tensor cache_seqlens = cache_seqlens_in.contiguous();
  const Tensor labels = labels_in.contiguous();
  const Tensor positions = positions_in.contiguous();
  Tensor out = at::empty({B, Lq, Hq, D}, q.options());
  // RoPE once per token (rope_qk.cu), read by the kernels and written to the cache by the door
  Tensor q_rot = at::empty({B, Lq, Hq, D}, q.options());
  Tensor k_rot = at::empty({B, Lq, Hkv, D}, q.options());
  if (B == 0 || Lq == 0) return {out, k_rot};

  const int64_t splits = num_splits > 0 ? num_splits : 1;
  Tensor o_partial, lse_partial;
  if (splits > 1) {
    o_partial = at::empty({splits, B, Lq, Hq, D}, q.options().dtype(at::kFloat));
    lse_partial = at::empty({splits, B, Lq, Hq}, q.options().dtype(at::kFloat));
  }

  simsd_attention_params p{};
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.k_cache = k_cache.data_ptr();
  p.v_cache = v_cache.data_ptr();
  p.cache_seqlens = cache_seqlens.data_ptr<int32_t>();
  p.block_table = block_table.data_ptr<int32_t>();
  p.block_table_stride = block_table.stride(0);
  p.labels = labels.data_ptr<int32_t>();
  p.positions = positions.data_ptr<int64_t>();
  p.out = out.data_ptr();
  p.o_partial = splits > 1 ? o_partial.data_ptr<float>() : nullptr;
  p.lse_partial = splits > 1 ? lse_partial.data_ptr<float>() : nullptr;
  p.q_rot = q_rot.data_ptr();
  p.k_rot = k_rot.data_ptr();
  copy_strides(p.q_stride, q);
  copy_strides(p.k_stride, k);
  copy_strides(p.v_stride, v);
  copy_strides(p.kc_stride, k_cache);
  copy_strides(p.vc_stride, v_cache);
  copy_strides(p.out_stride, out);
  p.labels_stride[0] = labels.stride(0);
  p.labels_stride[1] = labels.stride(1);
  p.positions_stride = positions.stride(0);
  p.B = (int32_t)B;
  p.Lq = (int32_t)Lq;
  p.Hq = (int32_t)Hq;
  p.Hkv = (int32_t)Hkv;
  p.D = (int32_t)D;
  p.page_size = (int32_t)std::max<int64_t>(k_cache.size(1), 1);  // a pool of empty pages: read nowhere
  p.Lmax = (int32_t)(k_cache.size(1) * block_table.size(1));
  p.num_splits = (int32_t)splits;
  p.split_min_tiles = (int32_t)std::min<int64_t>(split_min_tiles, 1 << 30);
  p.invariant = invariant ? 1 : 0;
  p.block_m = (int32_t)block_m;
  p.mask_mode = (int32_t)mask_mode;
  p.rope_theta = (float)rope_theta;
  p.softmax_scale = (float)softmax_scale;
  const int rc = simsd_attention_fwd(&p, dtype, c10::cuda::getCurrentCUDAStream().stream());
  if (rc == SIMSD_ERR_ALIGN)
    TORCH_CHECK(false, op, ": ", simsd_error_string(rc), "; q ", q.strides(), ", k ", k.strides(), ", v ",
                v.strides(), ", k_cache ", k_cache.strides(), " (call .contiguous() on the offending tensor)");
  raise_on_error(rc, op);
  return {out, k_rot};
}

Tensor attention_cuda(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& k_cache,
                      const Tensor& v_cache, const Tensor& cache_seqlens, const Tensor& labels,
                      const Tensor& positions, int64_t mask_mode, double rope_theta, double softmax_scale,
                      int64_t num_splits, int64_t block_m, int64_t split_min_tiles, bool invariant,
                      const std::optional<Tensor>& block_table) {
  return std::get<0>(launch_attention("simsd_cuda::attention", q, k, v, k_cache, v_cache, cache_seqlens, labels,
                                      positions, mask_mode, rope_theta, softmax_scale, num_splits, block_m,
                                      split_min_tiles, invariant, block_table));
}

// The cache write of append_kv (rotate: RoPE at positions) and of the door (k rotated already).
void launch_append(const char* op, const Tensor& k, const Tensor& v, const Tensor& positions, const Tensor& k_cache,
                   const Tensor& v_cache, const Tensor& cache_seqlens, const Tensor& block_table, double rope_theta,
                   int64_t num_tokens, bool rotate) {
  simsd_append_kv_params p{};
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.positions = positions.data_ptr<int64_t>();
  p.k_cache = k_cache.data_ptr();
  p.v_cache = v_cache.data_ptr();
  p.cache_seqlens = cache_seqlens.data_ptr<int32_t>();
  p.block_table = block_table.data_ptr<int32_t>();
  p.block_table_stride = block_table.stride(0);
  copy_strides(p.k_stride, k);
  copy_strides(p.v_stride, v);
  copy_strides(p.kc_stride, k_cache);
  copy_strides(p.vc_stride, v_cache);
  p.positions_stride = positions.stride(0);
  p.B = (int32_t)k.size(0);
  p.num_tokens = (int32_t)num_tokens;
  p.Hkv = (int32_t)k.size(2);
  p.D = (int32_t)k.size(3);
  p.page_size = (int32_t)std::max<int64_t>(k_cache.size(1), 1);
  p.Lmax = (int32_t)(k_cache.size(1) * block_table.size(1));
  p.rotate = rotate ? 1 : 0;
  p.rope_theta = (float)rope_theta;
  raise_on_error(simsd_append_kv(&p, to_simsd_dtype(k, op), c10::cuda::getCurrentCUDAStream().stream()), op);
}

Tensor attention_with_kvcache_cuda(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& k_cache,
                                   const Tensor& v_cache, const Tensor& cache_seqlens, const Tensor& labels,
                                   const Tensor& positions, int64_t mask_mode, double rope_theta,
                                   double softmax_scale, int64_t num_splits, int64_t block_m, int64_t split_min_tiles,
                                   bool invariant, const std::optional<Tensor>& block_table_in) {
  const char* op = "simsd_cuda::attention_with_kvcache";
  auto res = launch_attention(op, q, k, v, k_cache, v_cache, cache_seqlens, labels, positions, mask_mode, rope_theta,
                              softmax_scale, num_splits, block_m, split_min_tiles, invariant, block_table_in);
  const Tensor& k_rot = std::get<1>(res);
  if (k_rot.numel() == 0) return std::get<0>(res);
  c10::cuda::CUDAGuard guard(q.device());
  // the attention read the cache below cache_seqlens only: the write of the slots behind it may follow
  const Tensor block_table = page_table(op, block_table_in, k_cache, q.size(0), k.size(2), q.size(3), q.device());
  launch_append(op, k_rot, v, positions.contiguous(), k_cache, v_cache, cache_seqlens.contiguous(), block_table,
                rope_theta, k_rot.size(1), /*rotate=*/false);
  return std::get<0>(res);
}

Tensor attention_meta(const Tensor& q, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                      const Tensor&, const Tensor&, int64_t, double, double, int64_t, int64_t, int64_t, bool,
                      const std::optional<Tensor>&) {
  return at::empty(q.sizes(), q.options());
}

void append_kv_cuda(const Tensor& k, const Tensor& v, const Tensor& positions_in, const Tensor& k_cache,
                    const Tensor& v_cache, const Tensor& cache_seqlens_in, double rope_theta, int64_t num_tokens,
                    const std::optional<Tensor>& block_table_in) {
  const char* op = "simsd_cuda::append_kv";
  TORCH_CHECK(k.is_cuda(), op, ": k must be a CUDA tensor, got ", k.device());
  to_simsd_dtype(k, op);
  const at::Device dev = k.device();
  check_tensor(k, op, "k", 4, k.scalar_type(), dev);
  check_tensor(v, op, "v", 4, k.scalar_type(), dev);
  check_tensor(k_cache, op, "k_cache", 4, k.scalar_type(), dev);
  check_tensor(v_cache, op, "v_cache", 4, k.scalar_type(), dev);
  check_tensor(positions_in, op, "positions", 2, at::kLong, dev);
  check_tensor(cache_seqlens_in, op, "cache_seqlens", 1, at::kInt, dev);
  const int64_t B = k.size(0), L = k.size(1), Hkv = k.size(2), D = k.size(3);
  TORCH_CHECK(D > 0 && D % 2 == 0, op, ": head_dim must be even, got ", D);
  TORCH_CHECK(v.sizes() == k.sizes(), op, ": v must have k's shape ", k.sizes(), ", got ", v.sizes());
  const Tensor block_table = page_table(op, block_table_in, k_cache, B, Hkv, D, dev);
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes(), op, ": v_cache ", v_cache.sizes(), " must match k_cache ",
              k_cache.sizes());
  TORCH_CHECK(positions_in.sizes() == at::IntArrayRef({B, L}), op, ": positions must be (B=", B, ", L=", L,
              "), got ", positions_in.sizes());
  TORCH_CHECK(cache_seqlens_in.size(0) == B, op, ": cache_seqlens must be (B=", B, ",), got ",
              cache_seqlens_in.sizes());
  TORCH_CHECK(num_tokens >= 0 && num_tokens <= L, op, ": num_tokens must be in [0, ", L, "], got ", num_tokens);

  c10::cuda::CUDAGuard guard(dev);
  launch_append(op, k, v, positions_in.contiguous(), k_cache, v_cache, cache_seqlens_in.contiguous(), block_table,
                rope_theta, num_tokens, /*rotate=*/true);
}

void append_kv_meta(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, double,
                    int64_t, const std::optional<Tensor>&) {}

Tensor check_mask_labels(const Tensor& labels, int64_t mask_mode, const char* op) {
  TORCH_CHECK(labels.dim() == 3 && labels.size(2) == 3, op, ": labels must be (B, L, 3), got ", labels.sizes());
  TORCH_CHECK(labels.scalar_type() == at::kInt, op, ": labels must be int32, got ", labels.scalar_type());
  TORCH_CHECK(mask_mode >= 0 && mask_mode <= 3, op, ": mask_mode must be 0..3 (MaskMode), got ", mask_mode);
  return labels.contiguous();
}

Tensor mask_table_cpu(const Tensor& labels_in, int64_t mask_mode) {
  const Tensor labels = check_mask_labels(labels_in, mask_mode, "simsd_cuda::mask_table");
  const int64_t B = labels.size(0), L = labels.size(1);
  Tensor out = at::empty({B, L, L}, labels.options().dtype(at::kBool));
  const int32_t* lab = labels.data_ptr<int32_t>();
  bool* o = out.data_ptr<bool>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < L; ++i)
      for (int64_t j = 0; j < L; ++j) {
        const int32_t* q = lab + (b * L + i) * 3;
        const int32_t* k = lab + (b * L + j) * 3;
        o[(b * L + i) * L + j] = simsd::mask_allowed((int)mask_mode, q[0], q[1], q[2], k[0], k[1], k[2]);
      }
  return out;
}

Tensor mask_table_cuda(const Tensor& labels_in, int64_t mask_mode) {
  const char* op = "simsd_cuda::mask_table";
  const Tensor labels = check_mask_labels(labels_in, mask_mode, op);
  c10::cuda::CUDAGuard guard(labels.device());
  const int64_t B = labels.size(0), L = labels.size(1);
  Tensor out = at::empty({B, L, L}, labels.options().dtype(at::kByte));
  raise_on_error(simsd_mask_table(labels.data_ptr<int32_t>(), out.data_ptr<uint8_t>(), (int32_t)B, (int32_t)L,
                                  (int32_t)mask_mode, c10::cuda::getCurrentCUDAStream().stream()),
                 op);
  return out.to(at::kBool);
}

}  // namespace

TORCH_LIBRARY(simsd_cuda, m) {
  m.def(
      "attention(Tensor q, Tensor k, Tensor v, Tensor k_cache, Tensor v_cache, Tensor cache_seqlens, "
      "Tensor labels, Tensor positions, int mask_mode, float rope_theta, float softmax_scale, "
      "int num_splits=1, int block_m=64, int split_min_tiles=1, bool invariant=False, Tensor? block_table=None) "
      "-> Tensor");
  m.def(
      "attention_with_kvcache(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, "
      "Tensor cache_seqlens, Tensor labels, Tensor positions, int mask_mode, float rope_theta, float softmax_scale, "
      "int num_splits=1, int block_m=64, int split_min_tiles=1, bool invariant=False, Tensor? block_table=None) "
      "-> Tensor");
  m.def(
      "append_kv(Tensor k, Tensor v, Tensor positions, Tensor(a!) k_cache, Tensor(b!) v_cache, "
      "Tensor cache_seqlens, float rope_theta, int num_tokens, Tensor? block_table=None) -> ()");
  m.def("mask_table(Tensor labels, int mask_mode) -> Tensor");
}

TORCH_LIBRARY_IMPL(simsd_cuda, CUDA, m) {
  m.impl("attention", &attention_cuda);
  m.impl("attention_with_kvcache", &attention_with_kvcache_cuda);
  m.impl("append_kv", &append_kv_cuda);
  m.impl("mask_table", &mask_table_cuda);
}

TORCH_LIBRARY_IMPL(simsd_cuda, CPU, m) { m.impl("mask_table", &mask_table_cpu); }

TORCH_LIBRARY_IMPL(simsd_cuda, Meta, m) {
  m.impl("attention", &attention_meta);
  m.impl("attention_with_kvcache", &attention_meta);
  m.impl("append_kv", &append_kv_meta);
}

// `import simsd_kernels._C` loads this library, which registers the ops above.
extern "C" PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", "simsd CUDA ops (torch.ops.simsd_cuda)", -1,
                                          nullptr};
  return PyModule_Create(&module_def);
}
