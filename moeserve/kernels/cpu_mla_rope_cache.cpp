// MLA's per-layer latent write on the CPU, bf16 or float32, in one pass over each token (kernels/mla_rope_cache.py's
// reference computes it with six torch ops and two copies):
//
//     cache[loc[t]] = [rms_norm(c_kv[t]) | rotate(k_rope[t])]      (in place)
//     q_out[t, h]   = rotate(q_rope[t, h])
//
// rotate(x) = E(x * cos + partner(x) * sin) in fp32 (E the rows' type: bf16 rounds, float32 is exact), partner swapping a pair's members: neighbours (interleaved,
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

// y[j] = E(x[j] * cos[j] + x[partner(j)] * sin[j]) over R elements.
template <typename E>
__attribute__((optimize("fp-contract=off"))) void rotate(const E* x, const float* cos, const float* sin, int64_t R,
                                                           bool interleaved, E* y) {
  const int64_t half = R / 2;
  for (int64_t j = 0; j < R; ++j) {
    const int64_t p = interleaved ? (j ^ 1) : (j < half ? j + half : j - half);
    const float a = to_f32(x[j]) * cos[j];
    const float b = to_f32(x[p]) * sin[j];
    moeserve_norm::put(y + j, a + b);
  }
}

template <typename E>
void rope_cache(const E* q_rope, int64_t sqt, int64_t sqh, const E* c_kv, int64_t sc, const E* k_rope, int64_t sk,
                const E* norm_weight, float eps, const float* rope, int interleaved, E* cache, const int64_t* loc,
                int64_t T, int64_t H, int64_t r, int64_t R, E* q_out, int num_threads) {
  const int threads = T < kOneThreadTokens ? 1 : num_threads;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int64_t t = 0; t < T; ++t) {
    const float* cos = rope + t * 2 * R;
    const float* sin = cos + R;
    E* row = cache + loc[t] * (r + R);
    moeserve_norm::norm_row(c_kv + t * sc, nullptr, norm_weight, r, eps, row, nullptr);
    rotate(k_rope + t * sk, cos, sin, R, interleaved != 0, row + r);
    for (int64_t h = 0; h < H; ++h) rotate(q_rope + t * sqt + h * sqh, cos, sin, R, interleaved != 0,
                                           q_out + (t * H + h) * R);
  }
}

}  // namespace

extern "C" {

// q_rope [T, H, R] (tokens sqt, heads sqh apart, R contiguous); c_kv [T, r] and k_rope [T, R] (rows sc and sk
// apart); norm_weight [r]; rope [T, 2, R] fp32 contiguous; cache [N, r + R] contiguous; loc [T] int64 -> cache
// rows written, q_out [T, H, R] contiguous; all but rope and loc bf16 or all float32 by the entry point.
// num_threads: OpenMP threads.
void moeserve_mla_rope_cache_bf16(const uint16_t* q_rope, int64_t sqt, int64_t sqh, const uint16_t* c_kv, int64_t sc,
                                  const uint16_t* k_rope, int64_t sk, const uint16_t* norm_weight, float eps,
                                  const float* rope, int interleaved, uint16_t* cache, const int64_t* loc, int64_t T,
                                  int64_t H, int64_t r, int64_t R, uint16_t* q_out, int num_threads) {
  rope_cache(q_rope, sqt, sqh, c_kv, sc, k_rope, sk, norm_weight, eps, rope, interleaved, cache, loc, T, H, r, R, q_out,
             num_threads);
}

void moeserve_mla_rope_cache_f32(const float* q_rope, int64_t sqt, int64_t sqh, const float* c_kv, int64_t sc,
                                 const float* k_rope, int64_t sk, const float* norm_weight, float eps, const float* rope,
                                 int interleaved, float* cache, const int64_t* loc, int64_t T, int64_t H, int64_t r,
                                 int64_t R, float* q_out, int num_threads) {
  rope_cache(q_rope, sqt, sqh, c_kv, sc, k_rope, sk, norm_weight, eps, rope, interleaved, cache, loc, T, H, r, R, q_out,
             num_threads);
}

}
