// One bf16 row's RMSNorm, optionally after the residual add, with kernels/rms_norm.py's reference roundings:
//
//     h = bf16(x + residual)                       (with a residual, r not null; written to h)
//     n = bf16(h * 1 / sqrt(mean(h^2) + eps))      (statistics in fp32)
//     y = bf16(weight * n)
//
// Shared by cpu_rms_norm.cpp and cpu_mla_rope_cache.cpp (the latent's norm before the cache write).

#pragma once

#include <cmath>
#include <cstdint>

#include "cpu_vec.h"

namespace moeserve_norm {

using namespace moeserve_vec;

inline void norm_row(const uint16_t* x, const uint16_t* r, const uint16_t* w, int64_t D, float eps, uint16_t* y,
              uint16_t* h) {
  const int64_t Dvec = D / kLanes * kLanes;
  const uint16_t* src = x;  // the rows normalized: x, or h = x + r
  f32v acc = f32v{};
  float ss = 0.0f;
  if (r != nullptr) {
    for (int64_t d = 0; d < Dvec; d += kLanes) {
      const f32v v = round_bf16(loadv(x + d) + loadv(r + d));
      storev(h + d, v);
      acc += v * v;
    }
    for (int64_t d = Dvec; d < D; ++d) {
      h[d] = to_bf16(to_f32(x[d]) + to_f32(r[d]));
      const float v = to_f32(h[d]);
      ss += v * v;
    }
    src = h;
  } else {
    for (int64_t d = 0; d < Dvec; d += kLanes) {
      const f32v v = loadv(x + d);
      acc += v * v;
    }
    for (int64_t d = Dvec; d < D; ++d) ss += to_f32(x[d]) * to_f32(x[d]);
  }
  for (int l = 0; l < kLanes; ++l) ss += acc[l];
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(D) + eps);
  for (int64_t d = 0; d < Dvec; d += kLanes) storev(y + d, loadv(w + d) * round_bf16(loadv(src + d) * inv));
  for (int64_t d = Dvec; d < D; ++d) y[d] = to_bf16(to_f32(w[d]) * to_f32(to_bf16(to_f32(src[d]) * inv)));
}

}  // namespace moeserve_norm
