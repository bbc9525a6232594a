// Routed experts of one MoE layer on the CPU, over rows already grouped by expert (a ContiguousLayout):
//
//     out[r] = W2_e · (silu(W1_e x_r) * (W3_e x_r))      for each valid row r of expert e's segment
//
// Built for the few rows per expert of a decode step, where a GEMM library pays its per-call cost once per expert
// and matrix: here one call does the whole layer. The weights come transposed, each expert's matrix with its
// output columns contiguous: w13t [E, H, 2I] (columns [gate | up]) and w2t [E, I, H]. A tile of R input rows by
// 8 * NV output columns keeps its R * NV accumulators in registers and walks down the weight rows, each step
// one broadcast input value per row and NV vector loads of weights: R * NV = 8 to 12 independent FMA chains
// whatever R is, so a lone row per expert runs about as fast as four, and no horizontal sums. Up to 6 rows a
// tile (12 chains, 8 loads per 12 FMAs: AVX2's 16 registers all used) read the weights a third fewer times than
// 4 did: at 16 rows per expert (a batch of 64 with top-4 of 16 experts) 15% faster on the 2-core AMD VM.
//
// bf16 with AVX-512 BF16 (the amx and avx512bf16 builds, kernels/cpu_isa.py): both GEMMs as bf16 dot products, or
// on AMX tiles in the amx build, x and the activation rounded to bf16, sums in fp32, over weights packed at load
// into the VNNI layout (see `packed` below).
//
// Plain C++ (GCC/Clang vector extensions, AMX intrinsics under #if) and OpenMP, no torch headers:
// moeserve/kernels/build.py compiles it on first use for the process's ISA, and moeserve/kernels/cpu_experts.py
// calls it through ctypes.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_vec.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define MOESERVE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif
#ifdef __AVX512BF16__
#include <immintrin.h>

#include "cpu_bf16_dot.h"
#endif

namespace {

using namespace moeserve_vec;

constexpr int kRows = 6;    // input rows per tile, at most
constexpr int kCols = 64;   // output columns per work item (and per on-stack gate/up block)
constexpr int kAhead = 16;   // weight rows prefetched ahead


inline float silu(float v) { return v / (1.0f + std::exp(-v)); }

// y[r, 8v + l] = sum_k x[r, k] * w[k, 8v + l] for R rows and NV vectors of columns; x rows ldx apart, w rows ldw.
template <int R, int NV, typename W>
inline void tile(const float* x, int64_t ldx, const W* w, int64_t ldw, int64_t K, float* y, int64_t ldy) {
  f32v acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = f32v{};
  for (int64_t k = 0; k < K; ++k) {
    const W* wk = w + k * ldw;
    // Rows of a transposed weight matrix are far apart (one page or more in large models), out of reach of the
    // hardware prefetcher, which stays inside a page: ask for the row kAhead steps down.
    for (int v = 0; v < NV; v += 64 / int(kLanes * sizeof(W))) __builtin_prefetch(wk + kAhead * ldw + v * kLanes);
    f32v wv[NV];
    for (int v = 0; v < NV; ++v) wv[v] = loadv(wk + v * kLanes);
    for (int r = 0; r < R; ++r) {
      const f32v xb = f32v{} + x[r * ldx + k];
      for (int v = 0; v < NV; ++v) acc[r][v] += xb * wv[v];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) storev(y + r * ldy + v * kLanes, acc[r][v]);
}

// The columns [0, n) of y = x · w for R rows: NV-vector tiles, then one vector at a time, then scalars.
template <int R, int NV, typename W>
inline void tiles(const float* x, int64_t ldx, const W* w, int64_t ldw, int64_t K, float* y, int64_t ldy,
                  int64_t n) {
  int64_t c = 0;
  for (; c + NV * kLanes <= n; c += NV * kLanes) tile<R, NV>(x, ldx, w + c, ldw, K, y + c, ldy);
  for (; c + kLanes <= n; c += kLanes) tile<R, 1>(x, ldx, w + c, ldw, K, y + c, ldy);
  for (; c < n; ++c)
    for (int r = 0; r < R; ++r) {
      float s = 0.0f;
      for (int64_t k = 0; k < K; ++k) s += x[r * ldx + k] * to_f32(w[k * ldw + c]);
      y[r * ldy + c] = s;
    }
}

// tiles for a run-time row count R in 1..kRows, with 8 accumulators (6 for R = 3) of 8 lanes; of 16 lanes
// (AVX-512's 32 registers) 8 to 16, a tile at most kCols wide.
template <typename W>
inline void matmul_rows(int R, const float* x, int64_t ldx, const W* w, int64_t ldw, int64_t K, float* y,
                        int64_t ldy, int64_t n) {
  if (kLanes == 16) {
    switch (R) {
      case 6: tiles<6, 2>(x, ldx, w, ldw, K, y, ldy, n); break;
      case 5: tiles<5, 2>(x, ldx, w, ldw, K, y, ldy, n); break;
      case 4: tiles<4, 4>(x, ldx, w, ldw, K, y, ldy, n); break;
      case 3: tiles<3, 4>(x, ldx, w, ldw, K, y, ldy, n); break;
      case 2: tiles<2, 4>(x, ldx, w, ldw, K, y, ldy, n); break;
      default: tiles<1, 4>(x, ldx, w, ldw, K, y, ldy, n); break;
    }
    return;
  }
  switch (R) {
    case 6: tiles<6, 2>(x, ldx, w, ldw, K, y, ldy, n); break;
    case 5: tiles<5, 2>(x, ldx, w, ldw, K, y, ldy, n); break;
    case 4: tiles<4, 3>(x, ldx, w, ldw, K, y, ldy, n); break;
    case 3: tiles<3, 4>(x, ldx, w, ldw, K, y, ldy, n); break;
    case 2: tiles<2, 4>(x, ldx, w, ldw, K, y, ldy, n); break;
    default: tiles<1, 8>(x, ldx, w, ldw, K, y, ldy, n); break;
  }
}

struct Item {
  int64_t expert, first, count, c0, c1;  // rows [first, first + count) of the layout; columns [c0, c1)
};

std::vector<Item> items(const int32_t* offsets, const int32_t* counts, int64_t E, int64_t cols,
                        int64_t width = kCols) {
  std::vector<Item> out;
  for (int64_t e = 0; e < E; ++e) {
    if (counts[e] <= 0) continue;
    for (int64_t c = 0; c < cols; c += width) out.push_back({e, offsets[e], counts[e], c, c + width < cols ? c + width : cols});
  }
  return out;
}

template <typename W>
void experts(const float* x, const W* w13t, const W* w2t, const int32_t* offsets, const int32_t* counts, int64_t E,
             int64_t H, int64_t I, float* act, float* out, int num_threads) {
  const std::vector<Item> up = items(offsets, counts, E, I);    // act[:, c0:c1] = silu(x W1^T) * (x W3^T)
  const std::vector<Item> down = items(offsets, counts, E, H);  // out[:, c0:c1] = act W2^T
  const int64_t n_up = static_cast<int64_t>(up.size()), n_down = static_cast<int64_t>(down.size());
  const int threads = threads_for(offsets[E] * 3 * H * I, num_threads);
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n_up; ++i) {
      const Item& it = up[i];
      const W* w = w13t + it.expert * H * 2 * I;
      const int64_t n = it.c1 - it.c0;
      float gate[kRows * kCols], upv[kRows * kCols];
      for (int64_t r0 = 0; r0 < it.count; r0 += kRows) {
        const int R = static_cast<int>(it.count - r0 < kRows ? it.count - r0 : kRows);
        const float* xr = x + (it.first + r0) * H;
        matmul_rows(R, xr, H, w + it.c0, 2 * I, H, gate, kCols, n);
        matmul_rows(R, xr, H, w + I + it.c0, 2 * I, H, upv, kCols, n);
        for (int r = 0; r < R; ++r) {
          float* a = act + (it.first + r0 + r) * I + it.c0;
          for (int64_t c = 0; c < n; ++c) a[c] = silu(gate[r * kCols + c]) * upv[r * kCols + c];
        }
      }
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n_down; ++i) {
      const Item& it = down[i];
      const W* w = w2t + it.expert * I * H;
      for (int64_t r0 = 0; r0 < it.count; r0 += kRows) {
        const int R = static_cast<int>(it.count - r0 < kRows ? it.count - r0 : kRows);
        const int64_t row = it.first + r0;
        matmul_rows(R, act + row * I, I, w + it.c0, H, I, out + row * H + it.c0, H, it.c1 - it.c0);
      }
    }
  }
}

// The (token, slot) pairs of topk_ids [T, k] grouped by expert, token order kept inside an expert: pair p goes to
// row row_of[p]; expert e's rows are offsets[e] .. offsets[e] + counts[e].
struct Grouping {
  std::vector<int32_t> counts, offsets;
  std::vector<int64_t> row_of;
};

bool group_pairs(const int64_t* topk_ids, int64_t P, int64_t E, int64_t* expert_counts, Grouping& g) {
  g.counts.assign(E, 0);
  g.offsets.assign(E + 1, 0);
  for (int64_t p = 0; p < P; ++p) {
    if (topk_ids[p] < 0 || topk_ids[p] >= E) return false;
    ++g.counts[topk_ids[p]];
  }
  for (int64_t e = 0; e < E; ++e) {
    g.offsets[e + 1] = g.offsets[e] + g.counts[e];
    expert_counts[e] = g.counts[e];
  }
  g.row_of.resize(P);
  std::vector<int32_t> next(g.offsets.begin(), g.offsets.end() - 1);
  for (int64_t p = 0; p < P; ++p) g.row_of[p] = next[topk_ids[p]]++;
  return true;
}

// out[t] = sum_j topk_weights[t, j] * ys[row_of[t * k + j]], summed in fp32.
void combine(const float* ys, const int64_t* row_of, const float* topk_weights, int64_t T, int64_t k, int64_t H,
             float* out, int num_threads) {
  const int threads = threads_for(T * k * H, num_threads);
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
  for (int64_t t = 0; t < T; ++t) {
    float* o = out + t * H;
    for (int64_t h = 0; h < H; ++h) o[h] = 0.0f;
    for (int64_t j = 0; j < k; ++j) {
      const float w = topk_weights[t * k + j];
      const float* y = ys + row_of[t * k + j] * H;
      for (int64_t h = 0; h < H; ++h) o[h] += w * y[h];
    }
  }
}

// One rank, every expert local: the pairs grouped by expert, the experts run on the grouped rows, and each
// token's k results summed with its top-k weights.
template <typename W>
int moe_local(const float* x, const int64_t* topk_ids, const float* topk_weights, int64_t T, int64_t k,
               const W* w13t, const W* w2t, int64_t E, int64_t H, int64_t I, float* scratch, float* out,
               int64_t* expert_counts, int num_threads) {
  const int64_t P = T * k;
  Grouping g;
  if (!group_pairs(topk_ids, P, E, expert_counts, g)) return -1;
  float* xs = scratch;           // [P, H] the grouped rows
  float* act = xs + P * H;       // [P, I]
  float* ys = act + P * I;       // [P, H] the experts' outputs
  for (int64_t p = 0; p < P; ++p) std::memcpy(xs + g.row_of[p] * H, x + (p / k) * H, H * sizeof(float));
  experts<W>(xs, w13t, w2t, g.offsets.data(), g.counts.data(), E, H, I, act, ys, num_threads);
  combine(ys, g.row_of.data(), topk_weights, T, k, H, out, num_threads);
  return 0;
}

#ifdef __AVX512BF16__
// ---------------------------------------------------------------------------------------------------------------
// bf16 over packed weights (the amx and avx512bf16 builds). The weights are packed at load (cpu_experts.pack) in
// the VNNI layout, as column blocks of 16, each block's whole K contiguous: w13p [E, 2I / 16, H / 2, 16, 2] and
// w2p [E, H / 16, I / 2, 16, 2] (B[k / 2][n][k % 2]): a block's step of two K is one 64-byte vector. x and the
// activation are rounded to bf16 (as torch's bf16 path rounds them), sums in fp32. A work item computes four blocks
// (64 output columns; for gate/up, 32 of gate and the same 32 of up, so that SiLU·mul happens on the results) for
// its expert's rows, a few rows at a time:
//   dot products (vdpbf16ps): per step of two K, each row's pair broadcast against the blocks' vectors, up to 6
//                             rows x 4 blocks of accumulators in registers;
//   AMX tiles (the amx build): 16 rows a tile, C 16 x 16 fp32, A 16 rows x 32 K, B a block's 32 K; for segments of
//                             at least `tile_from` rows left (the caller's choice: a tile computes 16 rows whatever
//                             the count, and each thread configures its tiles per call).
// Needs H and I multiples of 32 (cpu_experts.pack checks).
namespace packed {

constexpr int kBlock = moeserve_dot::kBlock;      // output columns of one packed block
constexpr int kSlackRows = 16;                     // rows past the last segment that a tile may read (and drops)
constexpr int kDotRows = moeserve_dot::kDotRows;  // rows of one dot-product pass, at most

// n floats (a multiple of 16) -> bf16.
inline void row_to_bf16(const float* src, uint16_t* dst, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const __m256bh v = _mm512_cvtneps_pbh(_mm512_loadu_ps(src + i));
    std::memcpy(dst + i, &v, sizeof v);
  }
}

using moeserve_dot::dot;

#ifdef MOESERVE_AMX
namespace amx {

constexpr int kTileRows = 16;
constexpr int kTileK = 32;  // bf16 along K in one A tile

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

bool enable() {  // Linux gives a process the tile state only when asked (ARCH_REQ_XCOMP_PERM, XTILEDATA)
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}

void configure() {  // tiles 0-3 C, 4 A, 5-6 B
  TileConfig c;
  for (int t = 0; t < 7; ++t) {
    c.rows[t] = kTileRows;
    c.colsb[t] = 64;
  }
  _tile_loadconfig(&c);
}

// c[16, 16 NB] (ldc floats) = a[16, K] · the NB packed blocks b[j]; each A tile loaded once for the NB products.
template <int NB>
inline void tile_blocks(const uint16_t* a, int64_t lda, const uint16_t* const* b, int64_t K, float* c, int64_t ldc) {
  _tile_zero(0);
  if (NB > 1) _tile_zero(1);
  if (NB > 2) _tile_zero(2);
  if (NB > 3) _tile_zero(3);
  for (int64_t k = 0; k < K; k += kTileK) {
    _tile_loadd(4, a + k, lda * 2);
    _tile_loadd(5, b[0] + k * kBlock, 64);
    _tile_dpbf16ps(0, 4, 5);
    if (NB > 1) {
      _tile_loadd(6, b[1] + k * kBlock, 64);
      _tile_dpbf16ps(1, 4, 6);
    }
    if (NB > 2) {
      _tile_loadd(5, b[2] + k * kBlock, 64);
      _tile_dpbf16ps(2, 4, 5);
    }
    if (NB > 3) {
      _tile_loadd(6, b[3] + k * kBlock, 64);
      _tile_dpbf16ps(3, 4, 6);
    }
  }
  _tile_stored(0, c, ldc * 4);
  if (NB > 1) _tile_stored(1, c + kBlock, ldc * 4);
  if (NB > 2) _tile_stored(2, c + 2 * kBlock, ldc * 4);
  if (NB > 3) _tile_stored(3, c + 3 * kBlock, ldc * 4);
}

inline void tiles(int nb, const uint16_t* a, int64_t lda, const uint16_t* const* b, int64_t K, float* c,
                  int64_t ldc) {
  switch (nb) {
    case 4: tile_blocks<4>(a, lda, b, K, c, ldc); break;
    case 3: tile_blocks<3>(a, lda, b, K, c, ldc); break;
    case 2: tile_blocks<2>(a, lda, b, K, c, ldc); break;
    default: tile_blocks<1>(a, lda, b, K, c, ldc); break;
  }
}

}  // namespace amx
#endif

// Rows [r0, r0 + step) of a segment of `count` rows: tiles (16 rows, the valid ones kept) where the build has them
// and at least tile_from rows are left, else dot products over up to kDotRows rows. Returns step.
inline int64_t product(int64_t count, int64_t r0, int64_t tile_from, int nb, const uint16_t* a, int64_t lda,
                       const uint16_t* const* b, int64_t K, float* c, int64_t ldc) {
  const int64_t left = count - r0;
#ifdef MOESERVE_AMX
  if (left >= tile_from) {
    amx::tiles(nb, a, lda, b, K, c, ldc);
    return left < amx::kTileRows ? left : amx::kTileRows;
  }
#else
  (void)tile_from;
#endif
  const int R = static_cast<int>(left < kDotRows ? left : kDotRows);
  dot(R, nb, a, lda, b, K, c, ldc);
  return R;
}

// The experts over grouped bf16 rows xs [M + kSlackRows, H]; act [M + kSlackRows, I] bf16 scratch; out [M, H] fp32,
// the valid rows of each segment. tile_from: as `product`'s (the amx build; ignored by the others).
void experts(const uint16_t* xs, const uint16_t* w13p, const uint16_t* w2p, const int32_t* offsets,
             const int32_t* counts, int64_t E, int64_t H, int64_t I, uint16_t* act, float* out, int64_t tile_from,
             int num_threads) {
  const std::vector<Item> up = items(offsets, counts, E, I, 2 * kBlock);  // 32 columns of gate and of up
  const std::vector<Item> down = items(offsets, counts, E, H, 4 * kBlock);
  const int64_t n_up = static_cast<int64_t>(up.size()), n_down = static_cast<int64_t>(down.size());
  const int64_t block13 = H * kBlock, block2 = I * kBlock;  // elements of one packed column block
  constexpr int64_t kRowsMax = 16;  // rows of one product, at most (a tile's)
#ifdef MOESERVE_AMX
  int64_t most = 0;
  for (int64_t e = 0; e < E; ++e) most = counts[e] > most ? counts[e] : most;
  const bool tiles = most >= tile_from;  // threads configure tiles only where some segment runs on them
#endif
  int64_t M = 0;
  for (int64_t e = 0; e < E; ++e) M += counts[e] > 0 ? counts[e] : 0;
  const int threads = threads_for(M * 3 * H * I, num_threads);
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
#ifdef MOESERVE_AMX
    if (tiles) amx::configure();
#endif
    alignas(64) float c[kRowsMax * 4 * kBlock];
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n_up; ++i) {
      const Item& it = up[i];
      const uint16_t* w = w13p + it.expert * 2 * I * H;
      const int64_t j = it.c0 / kBlock;
      const uint16_t* b[4] = {w + j * block13, w + (j + 1) * block13, w + (I / kBlock + j) * block13,
                              w + (I / kBlock + j + 1) * block13};
      for (int64_t r0 = 0; r0 < it.count;) {
        const int64_t R = product(it.count, r0, tile_from, 4, xs + (it.first + r0) * H, H, b, H, c, 4 * kBlock);
        for (int64_t r = 0; r < R; ++r) {
          const float* g = c + r * 4 * kBlock;
          uint16_t* a = act + (it.first + r0 + r) * I + it.c0;
          for (int cc = 0; cc < 2 * kBlock; ++cc) a[cc] = to_bf16(silu(g[cc]) * g[2 * kBlock + cc]);
        }
        r0 += R;
      }
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n_down; ++i) {
      const Item& it = down[i];
      const uint16_t* w = w2p + it.expert * H * I;
      const int nb = static_cast<int>((it.c1 - it.c0) / kBlock);
      const uint16_t* b[4];
      for (int q = 0; q < nb; ++q) b[q] = w + (it.c0 / kBlock + q) * block2;
      for (int64_t r0 = 0; r0 < it.count;) {
        const int64_t R = product(it.count, r0, tile_from, nb, act + (it.first + r0) * I, I, b, I, c, 4 * kBlock);
        for (int64_t r = 0; r < R; ++r)
          std::memcpy(out + (it.first + r0 + r) * H + it.c0, c + r * 4 * kBlock, (it.c1 - it.c0) * sizeof(float));
        r0 += R;
      }
    }
#ifdef MOESERVE_AMX
    if (tiles) _tile_release();
#endif
  }
}

}  // namespace packed
#endif

}  // namespace

extern "C" {

// x [M, H] fp32; w13t [E, H, 2I] and w2t [E, I, H] (each expert's matrices transposed, contiguous) fp32 or bf16
// by the entry point; offsets [E + 1] and counts [E] int32; act [M, I] fp32 scratch; out [M, H] fp32. Rows
// outside the valid rows of a segment are not written. num_threads: OpenMP threads (torch's intra-op count).
void moeserve_experts_f32(const float* x, const float* w13t, const float* w2t, const int32_t* offsets,
                          const int32_t* counts, int64_t E, int64_t H, int64_t I, float* act, float* out,
                          int num_threads) {
  experts<float>(x, w13t, w2t, offsets, counts, E, H, I, act, out, num_threads);
}

void moeserve_experts_bf16(const float* x, const uint16_t* w13t, const uint16_t* w2t, const int32_t* offsets,
                           const int32_t* counts, int64_t E, int64_t H, int64_t I, float* act, float* out,
                           int num_threads) {
  experts<uint16_t>(x, w13t, w2t, offsets, counts, E, H, I, act, out, num_threads);
}

// x [T, H] fp32; topk_ids [T, k] int64 in [0, E); topk_weights [T, k] fp32; weights as above; scratch
// [T * k * (2H + I)] fp32; out [T, H] fp32 = sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t]).
// expert_counts [E] int64: the pairs each expert computed. Returns 0, or -1 (nothing computed) if an expert id
// is outside [0, E).
int moeserve_moe_local_f32(const float* x, const int64_t* topk_ids, const float* topk_weights, int64_t T,
                           int64_t k, const float* w13t, const float* w2t, int64_t E, int64_t H, int64_t I,
                           float* scratch, float* out, int64_t* expert_counts, int num_threads) {
  return moe_local<float>(x, topk_ids, topk_weights, T, k, w13t, w2t, E, H, I, scratch, out, expert_counts,
                          num_threads);
}

int moeserve_moe_local_bf16(const float* x, const int64_t* topk_ids, const float* topk_weights, int64_t T,
                            int64_t k, const uint16_t* w13t, const uint16_t* w2t, int64_t E, int64_t H, int64_t I,
                            float* scratch, float* out, int64_t* expert_counts, int num_threads) {
  return moe_local<uint16_t>(x, topk_ids, topk_weights, T, k, w13t, w2t, E, H, I, scratch, out, expert_counts,
                             num_threads);
}

// 1 where this build has the packed-weight kernels below (the avx512bf16 build; the amx build where the process got
// the tile state), else 0.
int moeserve_experts_packed_available() {
#if defined(MOESERVE_AMX)
  return packed::amx::enable() ? 1 : 0;
#elif defined(__AVX512BF16__)
  return 1;
#else
  return 0;
#endif
}

// 1 where the packed-weight kernels can run segments on AMX tiles (the amx build), else 0.
int moeserve_experts_tiles() {
#ifdef MOESERVE_AMX
  return 1;
#else
  return 0;
#endif
}

#ifdef __AVX512BF16__
// The bf16 packed-weight forms of the two entry points above: x fp32 (rounded to bf16 here); w13p [E, 2I / 16, H / 2,
// 16, 2] and w2p [E, H / 16, I / 2, 16, 2] bf16 (cpu_experts.pack); H and I multiples of 32; tile_from: segments
// with at least this many rows left run on AMX tiles in the amx build. moeserve_experts_packed takes no act
// scratch; moeserve_moe_local_packed's scratch is [T * k * H] fp32.
void moeserve_experts_packed(const float* x, const uint16_t* w13p, const uint16_t* w2p, const int32_t* offsets,
                             const int32_t* counts, int64_t E, int64_t H, int64_t I, float* out, int64_t tile_from,
                             int num_threads) {
  const int64_t M = offsets[E];
  std::vector<uint16_t> xs((M + packed::kSlackRows) * H, 0), act((M + packed::kSlackRows) * I, 0);
  for (int64_t r = 0; r < M; ++r) packed::row_to_bf16(x + r * H, xs.data() + r * H, H);
  packed::experts(xs.data(), w13p, w2p, offsets, counts, E, H, I, act.data(), out, tile_from, num_threads);
}

int moeserve_moe_local_packed(const float* x, const int64_t* topk_ids, const float* topk_weights, int64_t T,
                              int64_t k, const uint16_t* w13p, const uint16_t* w2p, int64_t E, int64_t H, int64_t I,
                              float* scratch, float* out, int64_t* expert_counts, int64_t tile_from,
                              int num_threads) {
  const int64_t P = T * k;
  Grouping g;
  if (!group_pairs(topk_ids, P, E, expert_counts, g)) return -1;
  std::vector<uint16_t> xs((P + packed::kSlackRows) * H, 0), act((P + packed::kSlackRows) * I, 0);
  for (int64_t p = 0; p < P; ++p) packed::row_to_bf16(x + (p / k) * H, xs.data() + g.row_of[p] * H, H);
  float* ys = scratch;  // [P, H] the experts' outputs
  packed::experts(xs.data(), w13p, w2p, g.offsets.data(), g.counts.data(), E, H, I, act.data(), ys, tile_from,
                  num_threads);
  combine(ys, g.row_of.data(), topk_weights, T, k, H, out, num_threads);
  return 0;
}
#endif

}
