// Instantiations of the tensor-core forward for __half (head_dim 64 and 128, query tiles of 16 / 32 / 64 rows).
#include "attention_mma.cuh"
#include "launchers.cuh"

namespace simsd {

int launch_attention_mma_f16(const simsd_attention_params& p, cudaStream_t stream) {
  switch (p.D) {
    case 64:
      return launch_attention_mma_m<__half, 64>(p, stream);
    case 128:
      return launch_attention_mma_m<__half, 128>(p, stream);
    default:
      return SIMSD_ERR_HEAD_DIM;
  }
}

}  // namespace simsd
