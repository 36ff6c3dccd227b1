// Instantiations of the tensor-core forward for __nv_bfloat16 (head_dim 64 and 128, query tiles of 16 / 32 / 64 rows).
#include "attention_mma.cuh"
#include "launchers.cuh"

namespace simsd {

int launch_attention_mma_bf16(const simsd_attention_params& p, cudaStream_t stream) {
  switch (p.D) {
    case 64:
      return launch_attention_mma_m<__nv_bfloat16, 64>(p, stream);
    case 128:
      return launch_attention_mma_m<__nv_bfloat16, 128>(p, stream);
    default:
      return SIMSD_ERR_HEAD_DIM;
  }
}

}  // namespace simsd
