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
// Plain C++ (GCC/Clang vector extensions) and OpenMP, no torch headers: moeserve/kernels/build.py compiles it on
// first use for the host CPU, and moeserve/kernels/cpu_experts.py calls it through ctypes.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_vec.h"

namespace {

using namespace moeserve_vec;

constexpr int kRows = 6;    // input rows per tile, at most
constexpr int kCols = 64;   // output columns per work item (and per on-stack gate/up block)
constexpr int kAhead = 16;   // weight rows prefetched ahead


inline float silu(float v) { return v / (1.0f + std::exp(-v)); }

// y[r, 8v + l] = sum_k x[r, k] * w[k, 8v + l] for R rows and NV vectors of columns; x rows ldx apart, w rows ldw.
template <int R, int NV, typename W>
inline void tile(const float* x, int64_t ldx, const W* w, int64_t ldw, int64_t K, float* y, int64_t ldy) {
  f32x8 acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = f32x8{};
  for (int64_t k = 0; k < K; ++k) {
    const W* wk = w + k * ldw;
    // Rows of a transposed weight matrix are far apart (one page or more in large models), out of reach of the
    // hardware prefetcher, which stays inside a page: ask for the row kAhead steps down.
    for (int v = 0; v < NV; v += 64 / int(kLanes * sizeof(W))) __builtin_prefetch(wk + kAhead * ldw + v * kLanes);
    f32x8 wv[NV];
    for (int v = 0; v < NV; ++v) wv[v] = load8(wk + v * kLanes);
    for (int r = 0; r < R; ++r) {
      const f32x8 xb = f32x8{} + x[r * ldx + k];
      for (int v = 0; v < NV; ++v) acc[r][v] += xb * wv[v];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) store8(y + r * ldy + v * kLanes, acc[r][v]);
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

// tiles for a run-time row count R in 1..kRows, with 8 accumulators (6 for R = 3).
template <typename W>
inline void matmul_rows(int R, const float* x, int64_t ldx, const W* w, int64_t ldw, int64_t K, float* y,
                        int64_t ldy, int64_t n) {
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

std::vector<Item> items(const int32_t* offsets, const int32_t* counts, int64_t E, int64_t cols) {
  std::vector<Item> out;
  for (int64_t e = 0; e < E; ++e) {
    if (counts[e] <= 0) continue;
    for (int64_t c = 0; c < cols; c += kCols) out.push_back({e, offsets[e], counts[e], c, c + kCols < cols ? c + kCols : cols});
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

// One rank, every expert local: the (token, slot) pairs grouped by expert (token order kept inside an expert),
// the experts run on the grouped rows, and each token's k results summed with its top-k weights.
template <typename W>
int moe_local(const float* x, const int64_t* topk_ids, const float* topk_weights, int64_t T, int64_t k,
               const W* w13t, const W* w2t, int64_t E, int64_t H, int64_t I, float* scratch, float* out,
               int64_t* expert_counts, int num_threads) {
  const int64_t P = T * k;
  std::vector<int32_t> counts(E, 0), offsets(E + 1, 0);
  for (int64_t p = 0; p < P; ++p) {
    if (topk_ids[p] < 0 || topk_ids[p] >= E) return -1;
    ++counts[topk_ids[p]];
  }
  for (int64_t e = 0; e < E; ++e) {
    offsets[e + 1] = offsets[e] + counts[e];
    expert_counts[e] = counts[e];
  }
  std::vector<int64_t> row_of(P);
  std::vector<int32_t> next(offsets.begin(), offsets.end() - 1);
  for (int64_t p = 0; p < P; ++p) row_of[p] = next[topk_ids[p]]++;
  float* xs = scratch;           // [P, H] the grouped rows
  float* act = xs + P * H;       // [P, I]
  float* ys = act + P * I;       // [P, H] the experts' outputs
  for (int64_t p = 0; p < P; ++p) std::memcpy(xs + row_of[p] * H, x + (p / k) * H, H * sizeof(float));
  experts<W>(xs, w13t, w2t, offsets.data(), counts.data(), E, H, I, act, ys, num_threads);
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
  return 0;
}

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

}
