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
// bf16 on AMX (the amx build, kernels/cpu_isa.py): both GEMMs on tiles, x and the activation rounded to bf16,
// sums in fp32, over weights packed at load into the tiles' VNNI layout (see `amx` below).
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
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
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
#pragma omp parallel num_threads(num_threads)
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
#pragma omp parallel for num_threads(num_threads) schedule(static)
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

#ifdef MOESERVE_AMX
// ---------------------------------------------------------------------------------------------------------------
// AMX: a tile is 16 rows of 64 bytes. C (fp32) is 16 rows x 16 columns; A (bf16) 16 rows x 32 of K; B (bf16)
// 16 rows of K pairs x 16 columns x the pair: B[k / 2][n][k % 2], the VNNI layout. The weights are packed at
// load (cpu_experts.pack) as column blocks of 16, each block's whole K contiguous: w13p [E, 2I / 16, H / 2, 16,
// 2] and w2p [E, H / 16, I / 2, 16, 2], so that a B tile is 16 consecutive 64-byte rows and a block streams.
// A work item keeps four C tiles (64 output columns; for gate/up, 32 of gate and the same 32 of up, so that
// SiLU·mul happens on the tiles' results) and walks K, loading each A tile once for the four products.
// Tiles: 0-3 C, 4 A, 5-6 B. Needs H and I multiples of 32 (cpu_experts.pack checks).
namespace amx {

constexpr int kTileRows = 16;
constexpr int kTileK = 32;   // bf16 along K in one A tile
constexpr int kBlock = 16;   // output columns of one C tile / packed block

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

void configure() {
  TileConfig c;
  for (int t = 0; t < 7; ++t) {
    c.rows[t] = kTileRows;
    c.colsb[t] = 64;
  }
  _tile_loadconfig(&c);
}

// n floats (a multiple of 16) -> bf16.
inline void row_to_bf16(const float* src, uint16_t* dst, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const __m256bh v = _mm512_cvtneps_pbh(_mm512_loadu_ps(src + i));
    std::memcpy(dst + i, &v, sizeof v);
  }
}

// c[16, 16 NB] (ldc floats) = a[16, K] (lda bf16 elements apart) · the NB packed column blocks b[j] ([K/2, 16, 2]).
template <int NB>
inline void matmul_tiles(const uint16_t* a, int64_t lda, const uint16_t* const* b, int64_t K, float* c, int64_t ldc) {
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

inline void matmul_blocks(int nb, const uint16_t* a, int64_t lda, const uint16_t* const* b, int64_t K, float* c,
                          int64_t ldc) {
  switch (nb) {
    case 4: matmul_tiles<4>(a, lda, b, K, c, ldc); break;
    case 3: matmul_tiles<3>(a, lda, b, K, c, ldc); break;
    case 2: matmul_tiles<2>(a, lda, b, K, c, ldc); break;
    default: matmul_tiles<1>(a, lda, b, K, c, ldc); break;
  }
}

// The experts over grouped bf16 rows xs [M + 16, H] (16 rows of slack: a tile reads 16 rows from a segment's
// start whatever its count; rows are independent, so the extra rows' results are dropped). act [M + 16, I]
// bf16 scratch; out [M, H] fp32, the valid rows of each segment.
void experts(const uint16_t* xs, const uint16_t* w13p, const uint16_t* w2p, const int32_t* offsets,
             const int32_t* counts, int64_t E, int64_t H, int64_t I, uint16_t* act, float* out, int num_threads) {
  const std::vector<Item> up = items(offsets, counts, E, I, 2 * kBlock);  // 32 columns of gate and of up
  const std::vector<Item> down = items(offsets, counts, E, H, 4 * kBlock);
  const int64_t n_up = static_cast<int64_t>(up.size()), n_down = static_cast<int64_t>(down.size());
  const int64_t block13 = H * kBlock, block2 = I * kBlock;  // elements of one packed column block
#pragma omp parallel num_threads(num_threads)
  {
    configure();
    alignas(64) float c[kTileRows * 4 * kBlock];
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n_up; ++i) {
      const Item& it = up[i];
      const uint16_t* w = w13p + it.expert * 2 * I * H;
      const int64_t j = it.c0 / kBlock;
      const uint16_t* b[4] = {w + j * block13, w + (j + 1) * block13, w + (I / kBlock + j) * block13,
                              w + (I / kBlock + j + 1) * block13};
      for (int64_t r0 = 0; r0 < it.count; r0 += kTileRows) {
        matmul_tiles<4>(xs + (it.first + r0) * H, H, b, H, c, 4 * kBlock);
        const int64_t R = it.count - r0 < kTileRows ? it.count - r0 : kTileRows;
        for (int64_t r = 0; r < R; ++r) {
          const float* g = c + r * 4 * kBlock;
          uint16_t* a = act + (it.first + r0 + r) * I + it.c0;
          for (int cc = 0; cc < 2 * kBlock; ++cc) a[cc] = to_bf16(silu(g[cc]) * g[2 * kBlock + cc]);
        }
      }
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n_down; ++i) {
      const Item& it = down[i];
      const uint16_t* w = w2p + it.expert * H * I;
      const int nb = static_cast<int>((it.c1 - it.c0) / kBlock);
      const uint16_t* b[4];
      for (int q = 0; q < nb; ++q) b[q] = w + (it.c0 / kBlock + q) * block2;
      for (int64_t r0 = 0; r0 < it.count; r0 += kTileRows) {
        matmul_blocks(nb, act + (it.first + r0) * I, I, b, I, c, 4 * kBlock);
        const int64_t R = it.count - r0 < kTileRows ? it.count - r0 : kTileRows;
        for (int64_t r = 0; r < R; ++r)
          std::memcpy(out + (it.first + r0 + r) * H + it.c0, c + r * 4 * kBlock, (it.c1 - it.c0) * sizeof(float));
      }
    }
    _tile_release();
  }
}

}  // namespace amx
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

// 1 where this build has the AMX kernels below and the process got the tile state, else 0.
int moeserve_experts_amx_available() {
#ifdef MOESERVE_AMX
  return amx::enable() ? 1 : 0;
#else
  return 0;
#endif
}

#ifdef MOESERVE_AMX
// The bf16 AMX forms of the two entry points above: x fp32 (rounded to bf16 here); w13p [E, 2I / 16, H / 2, 16, 2]
// and w2p [E, H / 16, I / 2, 16, 2] bf16 (cpu_experts.pack); H and I multiples of 32. moeserve_experts_amx takes
// no act scratch; moeserve_moe_local_amx's scratch is [T * k * H] fp32.
void moeserve_experts_amx(const float* x, const uint16_t* w13p, const uint16_t* w2p, const int32_t* offsets,
                          const int32_t* counts, int64_t E, int64_t H, int64_t I, float* out, int num_threads) {
  const int64_t M = offsets[E];
  std::vector<uint16_t> xs((M + amx::kTileRows) * H, 0), act((M + amx::kTileRows) * I, 0);
  for (int64_t r = 0; r < M; ++r) amx::row_to_bf16(x + r * H, xs.data() + r * H, H);
  amx::experts(xs.data(), w13p, w2p, offsets, counts, E, H, I, act.data(), out, num_threads);
}

int moeserve_moe_local_amx(const float* x, const int64_t* topk_ids, const float* topk_weights, int64_t T, int64_t k,
                           const uint16_t* w13p, const uint16_t* w2p, int64_t E, int64_t H, int64_t I,
                           float* scratch, float* out, int64_t* expert_counts, int num_threads) {
  const int64_t P = T * k;
  Grouping g;
  if (!group_pairs(topk_ids, P, E, expert_counts, g)) return -1;
  std::vector<uint16_t> xs((P + amx::kTileRows) * H, 0), act((P + amx::kTileRows) * I, 0);
  for (int64_t p = 0; p < P; ++p) amx::row_to_bf16(x + (p / k) * H, xs.data() + g.row_of[p] * H, H);
  float* ys = scratch;  // [P, H] the experts' outputs
  amx::experts(xs.data(), w13p, w2p, g.offsets.data(), g.counts.data(), E, H, I, act.data(), ys, num_threads);
  combine(ys, g.row_of.data(), topk_weights, T, k, H, out, num_threads);
  return 0;
}
#endif

}
