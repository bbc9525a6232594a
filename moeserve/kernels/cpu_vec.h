// Vectors of kLanes floats for moeserve's CPU kernels (GCC/Clang vector extensions): 16, one AVX-512 register, in
// the avx512 and amx builds (kernels/cpu_isa.py); else 8, one AVX2 register or two NEON registers. Loads from fp32
// and bfloat16 memory, stores to both (bfloat16 rounded to nearest even), scalar bfloat16 <-> float. Included by the kernels' .cpp files;
// moeserve/kernels/build.py rebuilds them when this file changes.

#pragma once

#include <cstdint>
#include <cstring>

namespace moeserve_vec {

#ifdef __AVX512F__
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif

typedef float f32v __attribute__((vector_size(4 * kLanes)));
typedef uint16_t u16v __attribute__((vector_size(2 * kLanes)));
typedef uint32_t u32v __attribute__((vector_size(4 * kLanes)));

inline f32v loadv(const float* p) {
  f32v v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline f32v loadv(const uint16_t* p) {  // bfloat16 -> float: the upper half of the fp32 bits
  u16v h;
  std::memcpy(&h, p, sizeof h);
  const u32v u = __builtin_convertvector(h, u32v) << 16;
  f32v v;
  std::memcpy(&v, &u, sizeof v);
  return v;
}
inline void storev(float* p, f32v v) { std::memcpy(p, &v, sizeof v); }
inline float to_f32(float v) { return v; }
inline float to_f32(uint16_t v) {
  const uint32_t u = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
inline uint16_t to_bf16(float f) {  // round to nearest even (as torch rounds; the kernels see no NaN)
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
inline uint16_t to_bf16(uint16_t v) { return v; }
inline f32v round_bf16(f32v v) {  // each lane rounded to bf16 (nearest even), kept as float
  u32v u;
  std::memcpy(&u, &v, sizeof u);
  u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  std::memcpy(&v, &u, sizeof v);
  return v;
}
inline void storev(uint16_t* p, f32v v) {  // float -> bfloat16 (nearest even)
  u32v u;
  v = round_bf16(v);
  std::memcpy(&u, &v, sizeof u);
  const u16v h = __builtin_convertvector(u >> 16, u16v);
  std::memcpy(p, &h, sizeof h);
}

// OpenMP threads worth waking for `work` multiply-adds (or like units): one per kMinWorkPerThread, at least one, at
// most num_threads. A parallel region costs microseconds to fork and join across many cores; a decode step's small
// calls (one row per expert, one request's attention) finish sooner on fewer threads.
constexpr int64_t kMinWorkPerThread = 1 << 18;
inline int threads_for(int64_t work, int num_threads) {
  const int64_t n = work / kMinWorkPerThread;
  return n < 1 ? 1 : (n < num_threads ? static_cast<int>(n) : num_threads);
}

}  // namespace moeserve_vec
