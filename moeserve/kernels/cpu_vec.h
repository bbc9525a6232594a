// Vectors of 8 floats for moeserve's CPU kernels (GCC/Clang vector extensions: one AVX2 register, two NEON
// registers): loads from fp32 and bfloat16 memory, stores, scalar bfloat16 -> float. Included by the kernels'
// .cpp files; moeserve/kernels/build.py rebuilds them when this file changes.

#pragma once

#include <cstdint>
#include <cstring>

namespace moeserve_vec {

constexpr int kLanes = 8;

typedef float f32x8 __attribute__((vector_size(32)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));

inline f32x8 load8(const float* p) {
  f32x8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline f32x8 load8(const uint16_t* p) {  // bfloat16 -> float: the upper half of the fp32 bits
  u16x8 h;
  std::memcpy(&h, p, sizeof h);
  const u32x8 u = __builtin_convertvector(h, u32x8) << 16;
  f32x8 v;
  std::memcpy(&v, &u, sizeof v);
  return v;
}
inline void store8(float* p, f32x8 v) { std::memcpy(p, &v, sizeof v); }
inline float to_f32(float v) { return v; }
inline float to_f32(uint16_t v) {
  const uint32_t u = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

}  // namespace moeserve_vec
