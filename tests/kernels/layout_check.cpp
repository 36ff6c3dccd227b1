// Host emulation of the index maps of csrc/attention_mma.cuh (run by test_cuda_layout.py).
//
// The kernel's own functions from csrc/tile_layout.cuh (swizzle, ldmatrix lane addresses, split
// rule, tile-skip rule) run here against an independent model of the PTX instructions, written from
// the PTX ISA: ldmatrix .m8n8.x4(.trans).b16 (lane l addresses row l % 8 of matrix l / 8; lane l
// receives row l / 4, columns 2 (l % 4) + {0, 1} of each matrix, transposed with .trans) and the
// fragments of mma.m16n8k16.row.col (groupID = l / 4, tid = l % 4; A a0..a7, B b0..b3, C c0..c3).
// With small-integer tiles every product is exact, so the emulated warp's S = Q K^T and O = S V
// must equal the direct matrix products bit for bit, for every (head_dim, warps along M) the kernel
// instantiates. Also checked: cp.async / ldmatrix alignment and bank-conflict freedom, the
// pipeline's stage schedule, the tile-skip rule against the mask rule.
//
//   ./layout_check            run every check, print "ok" (exit 1 and the first failures otherwise)
//   ./layout_check splits     print the split rule on a grid of cases (compared with Python)
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "mask_rule.cuh"
#include "tile_layout.cuh"

using namespace simsd;
using namespace simsd::layout;

static int failures = 0;
#define CHECK(cond, ...)                      \
  do {                                        \
    if (!(cond)) {                            \
      if (failures++ < 20) {                  \
        std::fprintf(stderr, "FAIL: ");       \
        std::fprintf(stderr, __VA_ARGS__);    \
        std::fputc('\n', stderr);             \
      }                                       \
    }                                         \
  } while (0)

// A 32-bit register of two 16-bit elements (lo = element with the lower index), kept as values.
struct Reg {
  double lo = 0, hi = 0;
};
using Warp4 = Reg[32][4];

// ---- PTX model: ldmatrix.sync.aligned.m8n8.x4{.trans}.shared.b16 ------------------------------
// addr[l]: element offset (into `smem`) of the row lane l points at.
static void ldmatrix_x4(const std::vector<double>& smem, const int (&addr)[32], bool trans, Warp4& out) {
  for (int lane = 0; lane < 32; ++lane)
    for (int i = 0; i < 4; ++i) {
      const int r = lane / 4, c = 2 * (lane % 4);
      if (!trans) {
        out[lane][i].lo = smem[addr[8 * i + r] + c];
        out[lane][i].hi = smem[addr[8 * i + r] + c + 1];
      } else {  // element (r, c) of the loaded matrix is element (c, r) of the addressed rows
        out[lane][i].lo = smem[addr[8 * i + c] + r];
        out[lane][i].hi = smem[addr[8 * i + c + 1] + r];
      }
    }
}

// Alignment and bank conflicts of one ldmatrix.x4: each matrix's 8 row addresses are 16-byte
// aligned and fall in 8 distinct 16-byte bank groups (one wavefront per matrix).
static void check_ldsm_addresses(const int (&addr)[32], const char* what) {
  for (int i = 0; i < 4; ++i) {
    unsigned seen = 0;
    for (int r = 0; r < 8; ++r) {
      const int byte = addr[8 * i + r] * 2;
      CHECK(byte % 16 == 0, "%s: lane %d address %d not 16-byte aligned", what, 8 * i + r, byte);
      seen |= 1u << ((byte / 16) % 8);
    }
    CHECK(seen == 0xffu, "%s: matrix %d has a bank conflict (groups %02x)", what, i, seen);
  }
}

// ---- PTX model: mma.sync.aligned.m16n8k16.row.col.f32 (A 16x16, B 16x8, C/D 16x8) --------------
// Fragment coordinates (PTX ISA "Matrix Fragments for mma.m16n8k16 with floating point type").
static void a_coord(int lane, int i, int& row, int& col) {  // a0..a7
  const int g = lane >> 2, t = lane & 3;
  row = g + ((i >> 1) & 1) * 8;
  col = 2 * t + (i & 1) + (i >= 4 ? 8 : 0);
}
static void b_coord(int lane, int i, int& row, int& col) {  // b0..b3: row = k, col = n
  const int g = lane >> 2, t = lane & 3;
  row = 2 * t + (i & 1) + (i >= 2 ? 8 : 0);
  col = g;
}
static void c_coord(int lane, int i, int& row, int& col) {  // c0..c3
  const int g = lane >> 2, t = lane & 3;
  row = g + (i >= 2 ? 8 : 0);
  col = 2 * t + (i & 1);
}

// D = A B + C over the warp; a[l][j] = {a_2j, a_2j+1}, b[l][j] = {b_2j, b_2j+1}, c[l][0..3].
static void mma(double (&c)[32][4], const Reg (&a)[32][4], const Reg (&b)[32][2]) {
  double A[16][16], B[16][8], C[16][8];
  int cover_a[16][16] = {}, cover_b[16][8] = {};
  for (int l = 0; l < 32; ++l) {
    for (int i = 0; i < 8; ++i) {
      int r, k;
      a_coord(l, i, r, k);
      A[r][k] = (i & 1) ? a[l][i / 2].hi : a[l][i / 2].lo;
      ++cover_a[r][k];
    }
    for (int i = 0; i < 4; ++i) {
      int k, n;
      b_coord(l, i, k, n);
      B[k][n] = (i & 1) ? b[l][i / 2].hi : b[l][i / 2].lo;
      ++cover_b[k][n];
    }
    for (int i = 0; i < 4; ++i) {
      int r, n;
      c_coord(l, i, r, n);
      C[r][n] = c[l][i];
    }
  }
  for (int r = 0; r < 16; ++r)
    for (int k = 0; k < 16; ++k) CHECK(cover_a[r][k] == 1, "A fragment covers (%d,%d) %d times", r, k, cover_a[r][k]);
  for (int k = 0; k < 16; ++k)
    for (int n = 0; n < 8; ++n) CHECK(cover_b[k][n] == 1, "B fragment covers (%d,%d) %d times", k, n, cover_b[k][n]);
  for (int l = 0; l < 32; ++l)
    for (int i = 0; i < 4; ++i) {
      int r, n;
      c_coord(l, i, r, n);
      double acc = C[r][n];
      for (int k = 0; k < 16; ++k) acc += A[r][k] * B[k][n];
      c[l][i] = acc;
    }
}

// ---- one tile through the kernel's index maps ---------------------------------------------------
static unsigned rng_state = 12345u;
static int small_int() {
  rng_state = rng_state * 1103515245u + 12345u;
  return (int)((rng_state >> 16) % 7) - 3;  // -3..3: every product and sum is exact
}

// load_tile_async / the Q load: chunk u = (r, c) of a (rows x D) tile goes to swz_offset(r, 8 c).
static std::vector<double> to_smem(const std::vector<double>& tile, int rows, int D) {
  const int chunks = D / 8;
  std::vector<double> smem(rows * D, -1e300);
  std::vector<int> written(rows * D, 0);
  for (int u = 0; u < rows * chunks; ++u) {
    const int r = u / chunks, c = u % chunks;
    const int dst = swz_offset(r, c * 8, chunks);
    CHECK(dst % 8 == 0, "cp.async destination %d not 16-byte aligned", dst);
    for (int e = 0; e < 8; ++e) {
      smem[dst + e] = tile[r * D + c * 8 + e];
      ++written[dst + e];
    }
  }
  for (int i = 0; i < rows * D; ++i) CHECK(written[i] == 1, "smem element %d written %d times", i, written[i]);
  return smem;
}

// Mirrors attend_tile<T, D, WM, *> (S = Q K^T, then O += S V; the softmax is elementwise and
// leaves the fragment maps alone) for every warp of a CTA with WM warps along M.
template <int D, int WM>
static void check_tile() {
  constexpr int WN = 4 / WM, BM = 16 * WM, KPW = kBlockN / WN, NT = KPW / 8, CH = D / 8;
  std::vector<double> q(BM * D), k(kBlockN * D), v(kBlockN * D);
  for (auto& x : q) x = small_int();
  for (auto& x : k) x = small_int();
  for (auto& x : v) x = small_int();
  const std::vector<double> sq = to_smem(q, BM, D), sk = to_smem(k, kBlockN, D), sv = to_smem(v, kBlockN, D);
  std::vector<double> s_ref(BM * kBlockN, 0), o_ref(BM * D, 0), o_sum(BM * D, 0);
  for (int m = 0; m < BM; ++m)
    for (int n = 0; n < kBlockN; ++n)
      for (int d = 0; d < D; ++d) s_ref[m * kBlockN + n] += q[m * D + d] * k[n * D + d];
  for (int m = 0; m < BM; ++m)
    for (int d = 0; d < D; ++d)
      for (int n = 0; n < kBlockN; ++n) o_ref[m * D + d] += s_ref[m * kBlockN + n] * v[n * D + d];

  for (int warp = 0; warp < 4; ++warp) {
    const int wm = warp / WN, wn = warp % WN, key0 = wn * KPW;
    // Q fragments
    Reg qf[D / 16][32][4];
    for (int ks = 0; ks < D / 16; ++ks) {
      int addr[32];
      for (int l = 0; l < 32; ++l) addr[l] = swz_offset(ldsm_a_row(l, wm * 16), ldsm_a_chunk(l, ks) * 8, CH);
      check_ldsm_addresses(addr, "Q");
      ldmatrix_x4(sq, addr, false, qf[ks]);
      for (int l = 0; l < 32; ++l)
        for (int i = 0; i < 8; ++i) {
          int r, c;
          a_coord(l, i, r, c);
          const double got = (i & 1) ? qf[ks][l][i / 2].hi : qf[ks][l][i / 2].lo;
          CHECK(got == q[(wm * 16 + r) * D + ks * 16 + c], "Q fragment D%d WM%d ks%d lane%d a%d", D, WM, ks, l, i);
        }
    }
    // S = Q K^T: ldmatrix of K rows, two k-steps per x4
    double s[NT][32][4] = {};
    for (int nt = 0; nt < NT; ++nt)
      for (int p = 0; p < D / 32; ++p) {
        int addr[32];
        for (int l = 0; l < 32; ++l) addr[l] = swz_offset(ldsm_k_row(l, key0 + nt * 8), ldsm_k_chunk(l, p) * 8, CH);
        check_ldsm_addresses(addr, "K");
        Warp4 kb;
        ldmatrix_x4(sk, addr, false, kb);
        Reg b01[32][2], b23[32][2];
        for (int l = 0; l < 32; ++l) {
          b01[l][0] = kb[l][0];
          b01[l][1] = kb[l][1];
          b23[l][0] = kb[l][2];
          b23[l][1] = kb[l][3];
        }
        mma(s[nt], qf[2 * p], b01);
        mma(s[nt], qf[2 * p + 1], b23);
      }
    for (int nt = 0; nt < NT; ++nt)
      for (int l = 0; l < 32; ++l)
        for (int i = 0; i < 4; ++i) {
          int r, c;
          c_coord(l, i, r, c);
          CHECK(s[nt][l][i] == s_ref[(wm * 16 + r) * kBlockN + key0 + nt * 8 + c], "S D%d WM%d warp%d nt%d lane%d c%d",
                D, WM, warp, nt, l, i);
        }
    // O = P V with P packed from the S accumulators as in the kernel, V by ldmatrix.trans
    double o[D / 8][32][4] = {};
    for (int kk = 0; kk < KPW / 16; ++kk) {
      Reg a[32][4];
      for (int l = 0; l < 32; ++l) {
        a[l][0] = {s[2 * kk][l][0], s[2 * kk][l][1]};
        a[l][1] = {s[2 * kk][l][2], s[2 * kk][l][3]};
        a[l][2] = {s[2 * kk + 1][l][0], s[2 * kk + 1][l][1]};
        a[l][3] = {s[2 * kk + 1][l][2], s[2 * kk + 1][l][3]};
      }
      for (int dt = 0; dt < D / 8; dt += 2) {
        int addr[32];
        for (int l = 0; l < 32; ++l) addr[l] = swz_offset(ldsm_v_row(l, key0 + kk * 16), ldsm_v_chunk(l, dt) * 8, CH);
        check_ldsm_addresses(addr, "V");
        Warp4 vb;
        ldmatrix_x4(sv, addr, true, vb);
        Reg b0[32][2], b1[32][2];
        for (int l = 0; l < 32; ++l) {
          b0[l][0] = vb[l][0];
          b0[l][1] = vb[l][1];
          b1[l][0] = vb[l][2];
          b1[l][1] = vb[l][3];
        }
        mma(o[dt], a, b0);
        mma(o[dt + 1], a, b1);
      }
    }
    // the epilogue writes o[dt][2 rh + j] to row g + 8 rh, column 8 dt + 2 t + j
    for (int dt = 0; dt < D / 8; ++dt)
      for (int l = 0; l < 32; ++l)
        for (int rh = 0; rh < 2; ++rh)
          for (int j = 0; j < 2; ++j) {
            const int row = wm * 16 + (l >> 2) + 8 * rh, col = dt * 8 + 2 * (l & 3) + j;
            double want = 0;
            for (int n = key0; n < key0 + KPW; ++n) want += s_ref[row * kBlockN + n] * v[n * D + col];
            CHECK(o[dt][l][2 * rh + j] == want, "O D%d WM%d warp%d dt%d lane%d", D, WM, warp, dt, l);
            o_sum[row * D + col] += o[dt][l][2 * rh + j];
          }
  }
  for (int i = 0; i < BM * D; ++i) CHECK(o_sum[i] == o_ref[i], "O merged over warps D%d WM%d at %d", D, WM, i);
}

// ---- the cp.async pipeline's schedule (attention_mma_kernel step 2/3) ---------------------------
// Groups: Q, then one per issue() call. wait_group<N> = all but the newest N groups complete.
static void check_pipeline(int S) {
  for (int n_tiles = 0; n_tiles <= 12; ++n_tiles) {
    std::vector<int> group_tile;  // tile of each committed group (-1: Q, -2: empty)
    std::vector<int> stage_owner(S, -3);
    stage_owner[S - 1] = -1;  // Q lives in the last stage
    auto issue = [&](int i) {
      if (i < n_tiles) stage_owner[i % S] = i;
      group_tile.push_back(i < n_tiles ? i : -2);
    };
    group_tile.push_back(-1);
    for (int i = 0; i < S - 1; ++i) issue(i);
    // wait<S - 1>: the Q group (the oldest) is complete, Q is read from stage S - 1
    CHECK((int)group_tile.size() - (S - 1) >= 1, "Q group not waited for (S=%d)", S);
    CHECK(stage_owner[S - 1] == -1 || n_tiles == 0, "Q stage overwritten before its fragments are read (S=%d)", S);
    for (int i = 0; i < n_tiles; ++i) {
      const int complete = (int)group_tile.size() - (S - 2);  // groups [0, complete) have landed
      bool landed = false;
      for (int gi = 0; gi < complete; ++gi) landed |= group_tile[gi] == i;
      CHECK(landed, "tile %d read before its group completed (S=%d, n=%d)", i, S, n_tiles);
      // after the barrier: refill the stage of tile i - 1, never the one tile i is read from
      const int refill = (i + S - 1) % S;
      CHECK(refill != i % S, "stage %d refilled while tile %d is read from it", refill, i);
      issue(i + S - 1);
      CHECK(stage_owner[i % S] == i, "tile %d's stage was overwritten before use (S=%d, n=%d)", i, S, n_tiles);
    }
  }
}

// ---- tile skipping is conservative against the mask rule -----------------------------------------
static void check_maybe_visible() {
  // taus 0 and 1..4: exact mode's subtree ends (0: a copy without descendants)
  const int kinds[] = {0, 1, 2, 3}, taus[] = {0, 1, 2, 3, 4, 1 << 30}, grps[] = {-1, 0, 1, 2, 3, 4};
  for (int mode = 0; mode <= 3; ++mode)
    for (int qmin = -1; qmin <= 4; ++qmin)
      for (int qmax = qmin; qmax <= 4; ++qmax)
        for (int gq = qmin; gq <= qmax; ++gq)
          for (int kq : kinds)
            for (int tq : taus)
              for (int kk : kinds)
                for (int tk : taus)
                  for (int gk : grps)
                    if (mask_allowed(mode, kq, tq, gq, kk, tk, gk))
                      CHECK(maybe_visible(mode, qmin, qmax, gk, tk),
                            "mode %d: key grp %d (tau %d) visible to query grp %d but skipped for range [%d, %d]",
                            mode, gk, tk, gq, qmin, qmax);
}

static void print_splits() {
  const int lens[] = {0, 1, 63, 64, 65, 255, 256, 257, 1000, 4096, 4097, 16384, 32700};
  const int qlens[] = {1, 4, 16, 64, 65, 200};
  const int splits[] = {1, 2, 3, 7, 33};
  const int mins[] = {1, 4, 21};
  for (int len : lens)
    for (int ql : qlens)
      for (int ns : splits)
        for (int mt : mins)
          for (int inv = 0; inv < 2; ++inv)
            for (int z = 0; z < ns; ++z) {
              const TileRange r = split_range(z, ns, mt, inv != 0, len, ql);
              std::printf("%d %d %d %d %d %d %d %d %d %d %d\n", len, ql, ns, mt, inv, z,
                          split_active(ns, mt, inv != 0, len, ql), r.cache_lo, r.cache_hi, r.new_lo, r.new_hi);
            }
}

int main(int argc, char** argv) {
  if (argc > 1 && std::strcmp(argv[1], "splits") == 0) {
    print_splits();
    return 0;
  }
  check_tile<64, 1>();
  check_tile<64, 2>();
  check_tile<64, 4>();
  check_tile<128, 1>();
  check_tile<128, 2>();
  check_tile<128, 4>();
  check_pipeline(3);
  check_pipeline(4);
  check_maybe_visible();
  if (failures) {
    std::fprintf(stderr, "%d failures\n", failures);
    return 1;
  }
  std::printf("ok\n");
  return 0;
}
