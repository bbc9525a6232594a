// MLA's per-layer latent write on the CPU, bf16, in one pass over each token (kernels/mla_rope_cache.py's
// reference computes it with six torch ops and two copies):
//
//     cache[loc[t]] = [rms_norm(c_kv[t]) | rotate(k_rope[t])]      (in place)
//     q_out[t, h]   = rotate(q_rope[t, h])
//
// rotate(x) = bf16(x * cos + partner(x) * sin) in fp32, partner swapping a pair's members: neighbours (interleaved,
// DeepSeek-V3) or the two halves (V2); rope [T, 2, R] fp32 holds each token's cos and signed sin laid out like x.
// The products and the sum are rounded apart, as torch's three ops round them (no fused multiply-add here), and the
// norm rounds as cpu_norm.h's; so the cache rows and q_out are the reference's bits.
//
// Plain C++ and OpenMP, no torch headers: moeserve/kernels/build.py compiles it on first use for the process's
// ISA, moeserve/kernels/cpu_mla_rope_cache.py calls it through ctypes.

#include <cstdint>

#include "cpu_norm.h"
#include "cpu_vec.h"

namespace {

using namespace moeserve_vec;

constexpr int64_t kOneThreadTokens = 64;  // fewer tokens than this: one thread

// y[j] = bf16(x[j] * cos[j] + x[partner(j)] * sin[j]) over R elements.
__attribute__((optimize("fp-contract=off"))) void rotate(const uint16_t* x, const float* cos, const float* sin,
                                                           int64_t R, bool interleaved, uint16_t* y) {
  const int64_t half = R / 2;
  for (int64_t j = 0; j < R; ++j) {
    const int64_t p = interleaved ? (j ^ 1) : (j < half ? j + half : j - half);
    const float a = to_f32(x[j]) * cos[j];
    const float b = to_f32(x[p]) * sin[j];
    y[j] = to_bf16(a + b);
  }
}

}  // namespace

extern "C" {

// q_rope [T, H, R] bf16 (tokens sqt, heads sqh apart, R contiguous); c_kv [T, r] and k_rope [T, R] bf16 (rows
// sc and sk apart); norm_weight [r] bf16; rope [T, 2, R] fp32 contiguous; cache [N, r + R] bf16 contiguous;
// loc [T] int64 -> cache rows written, q_out [T, H, R] bf16 contiguous. num_threads: OpenMP threads.
void moeserve_mla_rope_cache_bf16(const uint16_t* q_rope, int64_t sqt, int64_t sqh, const uint16_t* c_kv, int64_t sc,
                                  const uint16_t* k_rope, int64_t sk, const uint16_t* norm_weight, float eps,
                                  const float* rope, int interleaved, uint16_t* cache, const int64_t* loc, int64_t T,
                                  int64_t H, int64_t r, int64_t R, uint16_t* q_out, int num_threads) {
  const int threads = T < kOneThreadTokens ? 1 : num_threads;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int64_t t = 0; t < T; ++t) {
    const float* cos = rope + t * 2 * R;
    const float* sin = cos + R;
    uint16_t* row = cache + loc[t] * (r + R);
    moeserve_norm::norm_row(c_kv + t * sc, nullptr, norm_weight, r, eps, row, nullptr);
    rotate(k_rope + t * sk, cos, sin, R, interleaved != 0, row + r);
    for (int64_t h = 0; h < H; ++h) rotate(q_rope + t * sqt + h * sqh, cos, sin, R, interleaved != 0,
                                           q_out + (t * H + h) * R);
  }
}

}
