// The verification mask rule as a host/device function.
//
// Mirrors simsd_kernels/mask_rule.py::allowed (the one definition); the op
// simsd_cuda::mask_table evaluates this function on the host (CPU tensors) and on the device
// (CUDA tensors) so a test can compare it with the Python rule over every label combination.
//
// Labels of a new token: kind (0 known, 1 draft D, 2 mask M), tau (1-based draft step,
// TAU_INF = 1 << 30 when never revealed; in exact mode the last copy of the token's subtree in a
// verification tree, 0 without descendants), grp (block id for block_causal, copy id for exact;
// -1 in exact mode = a shared prefix every token sees).
// Modes (MaskMode): 0 bidirectional, 1 block_causal, 2 exact, 3 paper.
//
//   query \ key | known | D_j            | M_j
//   ------------+-------+----------------+---------------
//   known       |  yes  |  no            |  no
//   D_i         |  yes  | tau_j <= tau_i | tau_j >  tau_i
//   M_i         |  yes  | tau_j <  tau_i | tau_j >= tau_i
//
// Plain C++ when not compiled by nvcc (no torch, no CUDA header needed).
#pragma once

#if defined(__CUDACC__)
#define SIMSD_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define SIMSD_HOST_DEVICE inline
#endif

namespace simsd {

enum MaskMode : int { kBidirectional = 0, kBlockCausal = 1, kExact = 2, kPaper = 3 };
enum TokenKind : int { kKnown = 0, kDraft = 1, kMask = 2 };
// exact mode: grp of the shared prefix that every copy sees (mask_rule.SHARED_GRP)
constexpr int kSharedGrp = -1;

// True where query token (kq, tq, gq) may attend new token (kk, tk, gk) under `mode`.
// An unknown mode allows nothing (the bindings reject it before any launch).
SIMSD_HOST_DEVICE bool mask_allowed(int mode, int kq, int tq, int gq, int kk, int tk, int gk) {
  switch (mode) {
    case kBidirectional:
      return true;
    case kBlockCausal:
      return gk <= gq;
    case kExact:  // the same copy, the shared prefix, or an ancestor copy (tk: its subtree's last group)
      return gk == gq || gk == kSharedGrp || (gk < gq && gq <= tk);
    case kPaper: {
      if (kk == kKnown) return kq == kKnown || kq == kDraft || kq == kMask;
      if (kq == kDraft) return (kk == kDraft && tk <= tq) || (kk == kMask && tk > tq);
      if (kq == kMask) return (kk == kDraft && tk < tq) || (kk == kMask && tk >= tq);
      return false;
    }
    default:
      return false;
  }
}

}  // namespace simsd
