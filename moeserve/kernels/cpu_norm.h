// One row's RMSNorm, optionally after the residual add, with kernels/rms_norm.py's reference roundings; T is the
// rows' type, bf16 (uint16_t) or float:
//
//     h = T(x + residual)                       (with a residual, r not null; written to h)
//     n = T(h * 1 / sqrt(mean(h^2) + eps))      (statistics in fp32)
//     y = T(weight * n)
//
// (in float every T() is the identity). Shared by cpu_rms_norm.cpp and cpu_mla_rope_cache.cpp (the latent's norm
// before the cache write).

#pragma once

#include <cmath>
#include <cstdint>

#include "cpu_vec.h"

namespace moeserve_norm {

using namespace moeserve_vec;

// The value a T holds of v: bf16's rounding, or v itself in float.
inline f32v held(f32v v, uint16_t) { return round_bf16(v); }
inline f32v held(f32v v, float) { return v; }
inline void put(uint16_t* p, float v) { *p = to_bf16(v); }
inline void put(float* p, float v) { *p = v; }

template <typename T>
struct Same {  // a parameter's type taken from the others (r and h may be nullptr)
  using type = T;
};

template <typename T>
inline void norm_row(const T* x, const typename Same<T>::type* r, const T* w, int64_t D, float eps, T* y,
                     typename Same<T>::type* h) {
  const int64_t Dvec = D / kLanes * kLanes;
  const T* src = x;  // the rows normalized: x, or h = x + r
  f32v acc = f32v{};
  float ss = 0.0f;
  if (r != nullptr) {
    for (int64_t d = 0; d < Dvec; d += kLanes) {
      const f32v v = held(loadv(x + d) + loadv(r + d), T{});
      storev(h + d, v);
      acc += v * v;
    }
    for (int64_t d = Dvec; d < D; ++d) {
      put(h + d, to_f32(x[d]) + to_f32(r[d]));
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
  for (int64_t d = 0; d < Dvec; d += kLanes) storev(y + d, loadv(w + d) * held(loadv(src + d) * inv, T{}));
  for (int64_t d = Dvec; d < D; ++d) {
    T n;
    put(&n, to_f32(src[d]) * inv);
    put(y + d, to_f32(w[d]) * to_f32(n));
  }
}

}  // namespace moeserve_norm
