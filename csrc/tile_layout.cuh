// Index maps of the tensor-core attention kernel, as plain host/device functions so that a host
// program (tests/kernels/layout_check.cpp) can run them against the PTX ISA definitions:
//
//  * the swizzled shared-memory layout of a (rows x D) 16-bit tile written by cp.async;
//  * the row / 16-byte chunk each lane hands to ldmatrix.x4 for the A operand (Q), the B operand of
//    S = Q K^T (K, no transpose) and the B operand of O += P V (V, .trans);
//  * the split-KV rule: which cache / new-token tiles a split of a row reads (mirror of
//    simsd_kernels/split_plan.py::split_ranges);
//  * the tile-skip rule: the new keys that may be visible to a set of query rows.
//
// Plain C++ when not compiled by nvcc (no CUDA header needed).
#pragma once

#if defined(__CUDACC__)
#define SIMSD_LAYOUT_FN __host__ __device__ __forceinline__
#else
#define SIMSD_LAYOUT_FN inline
#endif

namespace simsd {
namespace layout {

constexpr int kBlockN = 64;  // keys per tile (the split granularity)

// ---- swizzled tile: row r of a tile with kChunks 16-byte chunks per row (D / 8) --------------
// Chunk c of row r lives at chunk (c ^ (r & 7)) of that row. ldmatrix reads 8 rows at one logical
// chunk per phase; their physical chunks differ in the low 3 bits, i.e. they cover 8 distinct
// 16-byte bank groups (all 32 banks): conflict-free. kChunks must be a multiple of 8.
SIMSD_LAYOUT_FN int swz_chunk(int row, int chunk) { return chunk ^ (row & 7); }

// Element offset of (row, element e) in a swizzled tile with `chunks` chunks per row.
SIMSD_LAYOUT_FN int swz_offset(int row, int e, int chunks) {
  return row * chunks * 8 + swz_chunk(row, e >> 3) * 8 + (e & 7);
}

// ---- ldmatrix.x4 source rows: lane l addresses row (l & 7) of matrix (l >> 3) ----------------
// Each returns the tile (row, chunk) that lane `lane` must point at; the four 8x8 matrices are
// chosen so that the four destination registers are directly mma.m16n8k16 operands.

// A operand (Q rows [row0, row0 + 16), k-step ks = dims [16 ks, 16 ks + 16)):
// matrices (rows 0-7, chunk 2ks), (rows 8-15, chunk 2ks), (rows 0-7, chunk 2ks+1),
// (rows 8-15, chunk 2ks+1) -> a0..a3 of the A fragment.
SIMSD_LAYOUT_FN int ldsm_a_row(int lane, int row0) { return row0 + ((lane >> 3) & 1) * 8 + (lane & 7); }
SIMSD_LAYOUT_FN int ldsm_a_chunk(int lane, int ks) { return 2 * ks + (lane >> 4); }

// B operand of S = Q K^T from K rows (keys) [key0, key0 + 8), dims [32 p, 32 p + 32):
// matrices = chunks 4p, 4p+1, 4p+2, 4p+3 of those 8 keys -> {b0, b1} of k-step 2p, then of 2p+1.
SIMSD_LAYOUT_FN int ldsm_k_row(int lane, int key0) { return key0 + (lane & 7); }
SIMSD_LAYOUT_FN int ldsm_k_chunk(int lane, int p) { return 4 * p + (lane >> 3); }

// B operand of O += P V from V rows (keys) [key0, key0 + 16), dims [8 dt, 8 dt + 16) (dt even),
// loaded with .trans: matrices (keys 0-7, chunk dt), (keys 8-15, chunk dt), (keys 0-7, chunk dt+1),
// (keys 8-15, chunk dt+1) -> {b0, b1} of d-tile dt, then of d-tile dt + 1.
SIMSD_LAYOUT_FN int ldsm_v_row(int lane, int key0) { return key0 + ((lane >> 3) & 1) * 8 + (lane & 7); }
SIMSD_LAYOUT_FN int ldsm_v_chunk(int lane, int dt) { return dt + (lane >> 4); }

// ---- split-KV rule (mirror of split_plan.split_ranges) ----------------------------------------
struct TileRange {
  int cache_lo, cache_hi;  // cache tiles [lo, hi)
  int new_lo, new_hi;      // new-token tiles [lo, hi)
};

SIMSD_LAYOUT_FN int cdiv(int a, int b) { return (a + b - 1) / b; }

// Splits that get work for one row: the row's tiles cut so that each gets >= min_tiles.
SIMSD_LAYOUT_FN int split_active(int num_splits, int min_tiles, bool invariant, int cache_len, int q_len) {
  const int work = cdiv(cache_len > 0 ? cache_len : 0, kBlockN) + (invariant ? 0 : cdiv(q_len, kBlockN));
  int active = work / (min_tiles > 0 ? min_tiles : 1);
  if (active > num_splits) active = num_splits;
  return active < 1 ? 1 : active;
}

// Tiles of split z of a row. Not invariant: the cache tiles then the new-token tiles are cut
// evenly over the active splits. Invariant: only the cache tiles are cut (from the row's own
// length), every new tile goes to the last active split. Splits >= active get nothing.
SIMSD_LAYOUT_FN TileRange split_range(int z, int num_splits, int min_tiles, bool invariant, int cache_len,
                                      int q_len) {
  const int ct = cdiv(cache_len > 0 ? cache_len : 0, kBlockN);
  const int nt = cdiv(q_len, kBlockN);
  const int active = split_active(num_splits, min_tiles, invariant, cache_len, q_len);
  TileRange r = {0, 0, 0, 0};
  if (z >= active) return r;
  const int work = ct + (invariant ? 0 : nt);
  const long long lo = (long long)z * work / active, hi = (long long)(z + 1) * work / active;
  if (invariant) {
    r.cache_lo = (int)lo;
    r.cache_hi = (int)hi;
    if (z == active - 1) r.new_hi = nt;
  } else {
    r.cache_lo = lo < ct ? (int)lo : ct;
    r.cache_hi = hi < ct ? (int)hi : ct;
    r.new_lo = lo > ct ? (int)lo - ct : 0;
    r.new_hi = hi > ct ? (int)hi - ct : 0;
  }
  return r;
}

// ---- tile skipping: may new key (grp gk) be visible to some query with grp in [qmin, qmax]? ----
// Conservative (never false when a query of the range may see the key): block_causal needs
// gk <= some gq; exact needs the shared prefix (-1) or some gq in [gk, max(gk, tk)] (the key's
// copy or its descendants in a verification tree, tk the subtree's last group); paper and
// bidirectional keep every key (paper's known keys are seen by everyone). Mode values:
// mask_rule.cuh MaskMode.
SIMSD_LAYOUT_FN bool maybe_visible(int mode, int qmin, int qmax, int gk, int tk) {
  if (mode == 1) return gk <= qmax;
  if (mode == 2) return gk == -1 || (gk <= qmax && (gk > tk ? gk : tk) >= qmin);
  return true;
}

}  // namespace layout
}  // namespace simsd
