// Internal launchers behind the C ABI (simsd_attention.h); each returns SIMSD_OK or an error
// code and checks its launches. Arguments are validated by simsd_attention_fwd.
#pragma once

#include <cuda_runtime.h>

#include "simsd_attention.h"

namespace simsd {

// RoPE of the new q and k into p.q_rot / p.k_rot (rope_qk.cu); fp16 / bf16 / fp32.
int launch_rope_qk(const simsd_attention_params& p, simsd_dtype dtype, cudaStream_t stream);

// Tensor-core forward (attention_mma.cuh) from p.q_rot / p.k_rot; D in {64, 128}, p.block_m in
// {16, 32, 64}.
int launch_attention_mma_f16(const simsd_attention_params& p, cudaStream_t stream);
int launch_attention_mma_bf16(const simsd_attention_params& p, cudaStream_t stream);

// Plain fp32 forward from p.q_rot / p.k_rot (one warp per row, no tensor cores; for tests against float64).
int launch_attention_simple_f32(const simsd_attention_params& p, cudaStream_t stream);

// LSE merge of the partial results of the rows that used more than one split into p.out.
int launch_split_merge(const simsd_attention_params& p, simsd_dtype dtype, cudaStream_t stream);

}  // namespace simsd
