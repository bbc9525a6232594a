// Dense y = x W^T on the CPU for the one to four rows of a small decode batch, bf16 weights and inputs:
//
//     y[m, n] = sum_k x[m, k] * w[n, k]        x [M, K] bf16, w [N, K] bf16 (row n contiguous), M <= 4
//
// summed in fp32, written as bf16 (rounded to nearest even, as torch rounds) or fp32. At decode a dense layer
// reads its whole weight for a few rows, so the time is the weight's bytes plus the call; each weight row is read
// once, in order, and serves all M rows. The weight needs no packing: a row of W is what a dot product reads.
// Columns are split over the OpenMP threads in blocks of kCols; one thread runs a weight too small to pay for
// waking the others.
//
// A CPU with AVX-512 BF16 (the amx and avx512bf16 builds, kernels/cpu_isa.py) multiplies with bf16 dot products (vdpbf16ps: 32
// products a step, no conversion of either operand); the avx512 and avx2 builds widen the weight to fp32 in
// registers (a shift) and use fused multiply-adds, x widened once before the loop.
//
// Plain C++ (GCC/Clang vector extensions, AVX-512 BF16 intrinsics under #if) and OpenMP, no torch headers:
// moeserve/kernels/build.py compiles it on first use for the process's ISA, moeserve/kernels/cpu_skinny_gemm.py
// calls it through ctypes.

#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_bf16_dot.h"
#include "cpu_vec.h"

#ifdef __AVX512BF16__
#include <immintrin.h>
#endif

namespace {

using namespace moeserve_vec;

constexpr int kMaxRows = 4;  // cpu_skinny_gemm.py's MAX_ROWS
constexpr int64_t kCols = 16;                 // columns per work item
constexpr int64_t kOneThreadElems = 1 << 16;  // below this many weight elements (128 KB), one thread

inline void put(float* y, int64_t i, float v) { y[i] = v; }
inline void put(uint16_t* y, int64_t i, float v) { y[i] = to_bf16(v); }

typedef float f32x8 __attribute__((vector_size(32)));
typedef float f32x4 __attribute__((vector_size(16)));

inline float hsum(f32v v) {  // halving: 16 -> 8 -> 4 lanes in vector adds, then 2 scalar levels
#ifdef __AVX512F__
  const f32x8 h = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                  __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
#else
  const f32x8 h = v;
#endif
  const f32x4 q = __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
  return (q[0] + q[2]) + (q[1] + q[3]);
}

// y[:M, n0:n0 + NC] from xf [M, K] fp32 (rows K apart) and w rows n0.. (bf16, ldw apart): M * NC vector
// accumulators.
template <int M, int NC, typename Y>
void cols_fma(const float* xf, const uint16_t* w, int64_t ldw, int64_t K, int64_t n0, Y* y, int64_t ldy) {
  const int64_t Kvec = K / kLanes * kLanes;
  const uint16_t* row[NC];
  for (int c = 0; c < NC; ++c) row[c] = w + (n0 + c) * ldw;
  f32v acc[M][NC];
  for (int m = 0; m < M; ++m)
    for (int c = 0; c < NC; ++c) acc[m][c] = f32v{};
  for (int64_t k = 0; k < Kvec; k += kLanes) {
    f32v wv[NC];
    for (int c = 0; c < NC; ++c) wv[c] = loadv(row[c] + k);
    for (int m = 0; m < M; ++m) {
      const f32v xv = loadv(xf + m * K + k);
      for (int c = 0; c < NC; ++c) acc[m][c] += xv * wv[c];
    }
  }
  for (int m = 0; m < M; ++m)
    for (int c = 0; c < NC; ++c) {
      float v = hsum(acc[m][c]);
      for (int64_t k = Kvec; k < K; ++k) v += xf[m * K + k] * to_f32(row[c][k]);
      put(y, m * ldy + n0 + c, v);
    }
}

#ifdef __AVX512BF16__
// The same from x in bf16 with bf16 dot products: 32 products of a row and a column a step; the K tail (K not a
// multiple of 32) is loaded masked, its missing lanes zero.
template <int M, int NC, typename Y>
void cols_dpbf16(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t ldw, int64_t K, int64_t n0, Y* y,
                 int64_t ldy) {
  const uint16_t* row[NC];
  for (int c = 0; c < NC; ++c) row[c] = w + (n0 + c) * ldw;
  __m512 acc[M][NC];
  for (int m = 0; m < M; ++m)
    for (int c = 0; c < NC; ++c) acc[m][c] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    const __mmask32 mask = K - k >= 32 ? ~__mmask32{0} : (__mmask32{1} << (K - k)) - 1;
    __m512bh wv[NC];
    for (int c = 0; c < NC; ++c) wv[c] = (__m512bh)_mm512_maskz_loadu_epi16(mask, row[c] + k);
    for (int m = 0; m < M; ++m) {
      const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + m * ldx + k);
      for (int c = 0; c < NC; ++c) acc[m][c] = _mm512_dpbf16_ps(acc[m][c], xv, wv[c]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int c = 0; c < NC; ++c) put(y, m * ldy + n0 + c, _mm512_reduce_add_ps(acc[m][c]));
}
#endif

// Columns [n0, n1) for M rows, NC at a time (fewer at the end): x rows ldx apart (bf16; xf: the same widened to
// fp32, rows K apart, in the builds without AVX-512 BF16), w rows ldw apart.
template <int M, typename Y>
void col_range(const uint16_t* x, int64_t ldx, const float* xf, const uint16_t* w, int64_t ldw, int64_t K,
               int64_t n0, int64_t n1, Y* y, int64_t ldy) {
#ifdef __AVX512BF16__
  (void)xf;
  constexpr int NC = 4;  // M * NC <= 16 accumulators of AVX-512's 32 registers
  int64_t n = n0;
  for (; n + NC <= n1; n += NC) cols_dpbf16<M, NC>(x, ldx, w, ldw, K, n, y, ldy);
  for (; n < n1; ++n) cols_dpbf16<M, 1>(x, ldx, w, ldw, K, n, y, ldy);
#else
  (void)x;
  (void)ldx;
  constexpr int NC = kLanes == 16 ? 4 : (M <= 2 ? 4 : 2);  // M * NC accumulators, room left for the loads
  int64_t n = n0;
  for (; n + NC <= n1; n += NC) cols_fma<M, NC>(xf, w, ldw, K, n, y, ldy);
  for (; n < n1; ++n) cols_fma<M, 1>(xf, w, ldw, K, n, y, ldy);
#endif
}

template <int M, typename Y>
void skinny(const uint16_t* x, const uint16_t* w, int64_t N, int64_t K, Y* y, int num_threads) {
  const float* xf = nullptr;
#ifndef __AVX512BF16__
  std::vector<float> widened(M * K);  // x in fp32, read once per column block
  for (int64_t i = 0; i < M * K; ++i) widened[i] = to_f32(x[i]);
  xf = widened.data();
#endif
  const int64_t items = (N + kCols - 1) / kCols;
  const int threads = N * K < kOneThreadElems ? 1 : num_threads;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int64_t i = 0; i < items; ++i) {
    const int64_t n0 = i * kCols, n1 = n0 + kCols < N ? n0 + kCols : N;
    col_range<M, Y>(x, K, xf, w, K, K, n0, n1, y, N);
  }
}

template <typename Y>
void dispatch(const uint16_t* x, const uint16_t* w, int64_t M, int64_t N, int64_t K, Y* y, int num_threads) {
  switch (M) {
    case 1: skinny<1, Y>(x, w, N, K, y, num_threads); break;
    case 2: skinny<2, Y>(x, w, N, K, y, num_threads); break;
    case 3: skinny<3, Y>(x, w, N, K, y, num_threads); break;
    case 4: skinny<4, Y>(x, w, N, K, y, num_threads); break;
    default: break;  // the caller checks 1 <= M <= kMaxRows
  }
}

// The batched form, MLA's absorbed decode (per head g, its query rows times W_UK[g] or W_UV[g]):
//
//     y[g, m, n] = sum_k x[g, m, k] * w[g, n, k]        any M, four rows at a time
//
// x: K contiguous, rows sxm and groups sxg apart; y: N contiguous, rows sym and groups syg apart; w either with K
// contiguous (rows swn apart: the dot products above) or with N contiguous (row k of w[g]^T swk apart: each output
// row a sum of weight rows scaled by x, fp32 fused multiply-adds in every build).

// y[:M, n0:n1] = sum_k x[m, k] * wt[k, n] (wt rows ldk apart, N contiguous), kLanes * NV columns at a time.
template <int M, typename Y>
void rows_axpy(const uint16_t* x, int64_t ldx, const uint16_t* wt, int64_t ldk, int64_t K, int64_t n0, int64_t n1,
               Y* y, int64_t ldy) {
  constexpr int NV = 4;  // M * NV <= 16 accumulators
  int64_t n = n0;
  for (; n + NV * kLanes <= n1; n += NV * kLanes) {
    f32v acc[M][NV];
    for (int m = 0; m < M; ++m)
      for (int v = 0; v < NV; ++v) acc[m][v] = f32v{};
    for (int64_t k = 0; k < K; ++k) {
      f32v wv[NV];
      for (int v = 0; v < NV; ++v) wv[v] = loadv(wt + k * ldk + n + v * kLanes);
      for (int m = 0; m < M; ++m) {
        const float xs = to_f32(x[m * ldx + k]);
        for (int v = 0; v < NV; ++v) acc[m][v] += xs * wv[v];
      }
    }
    for (int m = 0; m < M; ++m)
      for (int v = 0; v < NV; ++v) storev(y + m * ldy + n + v * kLanes, acc[m][v]);
  }
  for (; n < n1; ++n)  // columns past the last whole block
    for (int m = 0; m < M; ++m) {
      float v = 0.0f;
      for (int64_t k = 0; k < K; ++k) v += to_f32(x[m * ldx + k]) * to_f32(wt[k * ldk + n]);
      put(y, m * ldy + n, v);
    }
}

// One group's M (<= kMaxRows) rows.
template <int M, typename Y>
void group_rows(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t swn, int64_t swk, int64_t N, int64_t K,
                Y* y, int64_t ldy) {
  if (swn == 1 && swk != 1) {
    rows_axpy<M, Y>(x, ldx, w, swk, K, 0, N, y, ldy);
    return;
  }
#ifdef __AVX512BF16__
  col_range<M, Y>(x, ldx, nullptr, w, swn, K, 0, N, y, ldy);
#else
  thread_local std::vector<float> widened;
  widened.resize(M * K);
  for (int m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) widened[m * K + k] = to_f32(x[m * ldx + k]);
  col_range<M, Y>(x, ldx, widened.data(), w, swn, K, 0, N, y, ldy);
#endif
}

template <typename Y>
void batched(const uint16_t* x, int64_t sxg, int64_t sxm, const uint16_t* w, int64_t swg, int64_t swn, int64_t swk,
             int64_t G, int64_t M, int64_t N, int64_t K, Y* y, int64_t syg, int64_t sym, int num_threads) {
  const int64_t chunks = (M + kMaxRows - 1) / kMaxRows, items = G * chunks;
  const int threads = G * N * K * chunks < kOneThreadElems ? 1 : num_threads;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int64_t i = 0; i < items; ++i) {
    const int64_t g = i / chunks, m0 = (i % chunks) * kMaxRows;
    const int rows = static_cast<int>(M - m0 < kMaxRows ? M - m0 : kMaxRows);
    const uint16_t* xg = x + g * sxg + m0 * sxm;
    const uint16_t* wg = w + g * swg;
    Y* yg = y + g * syg + m0 * sym;
    switch (rows) {
      case 1: group_rows<1, Y>(xg, sxm, wg, swn, swk, N, K, yg, sym); break;
      case 2: group_rows<2, Y>(xg, sxm, wg, swn, swk, N, K, yg, sym); break;
      case 3: group_rows<3, Y>(xg, sxm, wg, swn, swk, N, K, yg, sym); break;
      default: group_rows<4, Y>(xg, sxm, wg, swn, swk, N, K, yg, sym); break;
    }
  }
}

#ifdef __AVX512BF16__
// The packed form (the amx and avx512bf16 builds): y[g] = x[g] · W_g^T for g < G over the packed copies wp [G, N /
// 16, K / 2, 16, 2] (cpu_skinny_gemm.pack, G = 1, and pack_groups), any M: work items of up to kDotRows rows by 64
// columns, accumulators of 16 output columns each (cpu_bf16_dot.h), no horizontal sums; rounded to bf16 once.
// x rows sxm and groups sxg apart, y rows sym and groups syg apart, both with the last dimension contiguous.
void batched_packed_gemm(const uint16_t* x, int64_t sxg, int64_t sxm, const uint16_t* wp, int64_t G, int64_t M,
                         int64_t N, int64_t K, uint16_t* y, int64_t syg, int64_t sym, int num_threads) {
  constexpr int kBlock = moeserve_dot::kBlock, kRowsMax = moeserve_dot::kDotRows;
  const int64_t blocks = N / kBlock, col_items = (blocks + 3) / 4, row_items = (M + kRowsMax - 1) / kRowsMax;
  const int64_t per_group = row_items * col_items, n_items = G * per_group;
  const int threads = threads_for(G * M * N * K, num_threads);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int64_t i = 0; i < n_items; ++i) {
    const int64_t g = i / per_group, rest = i % per_group;
    const int64_t m0 = (rest / col_items) * kRowsMax, j0 = (rest % col_items) * 4;
    const int R = static_cast<int>(M - m0 < kRowsMax ? M - m0 : kRowsMax);
    const int nb = static_cast<int>(blocks - j0 < 4 ? blocks - j0 : 4);
    const uint16_t* b[4];
    for (int q = 0; q < nb; ++q) b[q] = wp + (g * blocks + j0 + q) * K * kBlock;
    alignas(64) float c[kRowsMax * 4 * kBlock];
    moeserve_dot::dot(R, nb, x + g * sxg + m0 * sxm, sxm, b, K, c, 4 * kBlock);
    for (int r = 0; r < R; ++r)
      for (int q = 0; q < nb; ++q)
        storev(y + g * syg + (m0 + r) * sym + (j0 + q) * kBlock, loadv(c + r * 4 * kBlock + q * kBlock));
  }
}
#endif

}  // namespace

extern "C" {

// 1 where this build multiplies with AVX-512 BF16 dot products, 0 where it widens to fp32.
int moeserve_skinny_dpbf16() {
#ifdef __AVX512BF16__
  return 1;
#else
  return 0;
#endif
}

// x [M, K] bf16 (rows K apart), w [N, K] bf16 contiguous, 1 <= M <= 4 -> y [M, N] contiguous, bf16 or fp32 by the
// entry point. num_threads: OpenMP threads (torch's intra-op count).
void moeserve_skinny_gemm_bf16(const uint16_t* x, const uint16_t* w, int64_t M, int64_t N, int64_t K, uint16_t* y,
                               int num_threads) {
  dispatch<uint16_t>(x, w, M, N, K, y, num_threads);
}

void moeserve_skinny_gemm_bf16_f32out(const uint16_t* x, const uint16_t* w, int64_t M, int64_t N, int64_t K, float* y,
                                      int num_threads) {
  dispatch<float>(x, w, M, N, K, y, num_threads);
}

// The batched form above: x [G, M, K], w [G, N, K] with K or N contiguous, y [G, M, N] bf16; strides in elements.
void moeserve_batched_skinny_gemm_bf16(const uint16_t* x, int64_t sxg, int64_t sxm, const uint16_t* w, int64_t swg,
                                       int64_t swn, int64_t swk, int64_t G, int64_t M, int64_t N, int64_t K,
                                       uint16_t* y, int64_t syg, int64_t sym, int num_threads) {
  batched<uint16_t>(x, sxg, sxm, w, swg, swn, swk, G, M, N, K, y, syg, sym, num_threads);
}

// x [G, M, K] bf16 times each group's packed W (wp [G, N / 16, K / 2, 16, 2] bf16: cpu_skinny_gemm.pack_groups; one
// group for a dense layer's packed copy) -> y [G, M, N] bf16; N a multiple of 16, K even; strides in elements.
// Returns 0, or -1 in a build without AVX-512 BF16 (nothing written).
int moeserve_batched_packed_gemm_bf16(const uint16_t* x, int64_t sxg, int64_t sxm, const uint16_t* wp, int64_t G,
                                      int64_t M, int64_t N, int64_t K, uint16_t* y, int64_t syg, int64_t sym,
                                      int num_threads) {
#ifdef __AVX512BF16__
  batched_packed_gemm(x, sxg, sxm, wp, G, M, N, K, y, syg, sym, num_threads);
  return 0;
#else
  (void)x, (void)sxg, (void)sxm, (void)wp, (void)G, (void)M, (void)N, (void)K, (void)y, (void)syg, (void)sym;
  (void)num_threads;
  return -1;
#endif
}

}
