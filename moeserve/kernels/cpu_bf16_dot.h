// bf16 products over weights packed in the VNNI layout with AVX-512 BF16 dot products (vdpbf16ps), for the builds
// that have them (amx, avx512bf16; kernels/cpu_isa.py). A packed block is 16 output columns with its whole K:
// [K / 2, 16, 2] bf16 (B[k / 2][n][k % 2]), so a step of two K is one 64-byte vector; a row's pair of x is
// broadcast against it. No horizontal sums: each accumulator holds 16 output columns. Shared by cpu_experts.cpp
// (the experts' packed weights) and cpu_skinny_gemm.cpp (the dense layers' packed copies).

#pragma once

#ifdef __AVX512BF16__
#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace moeserve_dot {

constexpr int kBlock = 16;   // output columns of one packed block
constexpr int kDotRows = 6;  // rows of one pass, at most: 6 x 4 accumulators + 4 weight vectors + 1 broadcast

// c[R, 16 NB] (ldc floats) = a[R, K] (rows lda bf16 elements apart) · the NB packed blocks b[j] ([K / 2, 16, 2]).
template <int R, int NB>
inline void dot_blocks(const uint16_t* a, int64_t lda, const uint16_t* const* b, int64_t K, float* c, int64_t ldc) {
  __m512 acc[R][NB];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t k2 = 0; k2 < K / 2; ++k2) {
    __m512bh wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(b[j] + k2 * 2 * kBlock);
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, a + r * lda + 2 * k2, sizeof pair);
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
      for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xv, wv[j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NB; ++j) _mm512_storeu_ps(c + r * ldc + j * kBlock, acc[r][j]);
}

template <int NB>
inline void dot_rows(int R, const uint16_t* a, int64_t lda, const uint16_t* const* b, int64_t K, float* c,
                     int64_t ldc) {
  switch (R) {
    case 6: dot_blocks<6, NB>(a, lda, b, K, c, ldc); break;
    case 5: dot_blocks<5, NB>(a, lda, b, K, c, ldc); break;
    case 4: dot_blocks<4, NB>(a, lda, b, K, c, ldc); break;
    case 3: dot_blocks<3, NB>(a, lda, b, K, c, ldc); break;
    case 2: dot_blocks<2, NB>(a, lda, b, K, c, ldc); break;
    default: dot_blocks<1, NB>(a, lda, b, K, c, ldc); break;
  }
}

inline void dot(int R, int nb, const uint16_t* a, int64_t lda, const uint16_t* const* b, int64_t K, float* c,
                int64_t ldc) {
  switch (nb) {
    case 4: dot_rows<4>(R, a, lda, b, K, c, ldc); break;
    case 3: dot_rows<3>(R, a, lda, b, K, c, ldc); break;
    case 2: dot_rows<2>(R, a, lda, b, K, c, ldc); break;
    default: dot_rows<1>(R, a, lda, b, K, c, ldc); break;
  }
}

}  // namespace moeserve_dot
#endif  // __AVX512BF16__
