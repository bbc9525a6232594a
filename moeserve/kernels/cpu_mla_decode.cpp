// MLA decode attention on the CPU, in the weight-absorbed form, straight over the paged latent cache:
//
//     s[h, t] = scale * q[b, h] · cache[slot_t]            (the key: the whole latent row [c_kv | k_rope])
//     o[b, h] = sum_t softmax_t(s[h, :]) * cache[slot_t][:Dv]   (the value: its c_kv part)
//
// for t over request b's slots kv_indices[kv_indptr[b] .. kv_indptr[b + 1]). The rows are read where they lie in
// the pool: no gathered [B, L, D] copy, no padding to the longest request and no mask. All heads of a request
// share one latent row (multi-query), so a row is loaded once for every head: the score pass keeps one
// accumulator per head and reads each row once; the value pass reads the row again (a request's rows stay in
// L2: 2.3 KB each for DeepSeek's 576-wide latent) and adds it, times each head's probability, to the heads'
// outputs, which stay in L1 ([h, Dv] floats, 8 KB for 4 heads of 512).
//
// A bf16 cache on a CPU with AVX-512 BF16 (the amx and avx512bf16 builds, kernels/cpu_isa.py) scores with bf16 dot products
// (vdpbf16ps: 32 products a step, no conversion of the row), q rounded to bf16 as torch's bf16 path has it.
//
// Plain C++ (GCC/Clang vector extensions, AVX-512 BF16 intrinsics under #if) and OpenMP, no torch headers:
// moeserve/kernels/build.py compiles it on first use for the process's ISA, moeserve/kernels/cpu_mla_decode.py
// calls it through ctypes.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_vec.h"

#ifdef __AVX512BF16__
#include <immintrin.h>
#endif

namespace {

using namespace moeserve_vec;

constexpr int kMaxHeads = 8;  // heads scored together per work item (more are split into several items)

inline float hsum(f32v v) {
  float s = 0.0f;
  for (int l = 0; l < kLanes; ++l) s += v[l];
  return s;
}

template <typename C>
constexpr int64_t kLineElemsOf = 64 / sizeof(C);

// s[j * lds + t] = scale * q_j · row_t for NH heads (q rows ldq apart), D wide; NT rows at a time, so that
// each vector of q loaded serves NT rows and each vector of a row NH heads.
template <int NH, int NT, typename Q, typename C>
void scores(const Q* q, int64_t ldq, const C* cache, const int64_t* idx, int64_t L, int64_t D, float scale,
            float* s, int64_t lds) {
  const int64_t Dvec = D / kLanes * kLanes;
  int64_t t = 0;
  for (; t + NT <= L; t += NT) {
    const C* row[NT];
    for (int i = 0; i < NT; ++i) row[i] = cache + idx[t + i] * D;
    // The next rows, whole: a request's rows lie apart in the pool (one slot per request and step), each too short
    // for the hardware prefetcher to get going.
    const C* next[NT];
    for (int i = 0; i < NT; ++i) next[i] = cache + idx[t + NT + i < L ? t + NT + i : L - 1] * D;
    f32v acc[NH][NT];
    for (int j = 0; j < NH; ++j)
      for (int i = 0; i < NT; ++i) acc[j][i] = f32v{};
    for (int64_t d = 0; d < Dvec; d += kLanes) {
      if (d % kLineElemsOf<C> == 0)
        for (int i = 0; i < NT; ++i) __builtin_prefetch(next[i] + d);
      f32v r[NT];
      for (int i = 0; i < NT; ++i) r[i] = loadv(row[i] + d);
      for (int j = 0; j < NH; ++j) {
        const f32v qv = loadv(q + j * ldq + d);
        for (int i = 0; i < NT; ++i) acc[j][i] += qv * r[i];
      }
    }
    for (int j = 0; j < NH; ++j)
      for (int i = 0; i < NT; ++i) {
        float v = hsum(acc[j][i]);
        for (int64_t d = Dvec; d < D; ++d) v += to_f32(q[j * ldq + d]) * to_f32(row[i][d]);
        s[j * lds + t + i] = scale * v;
      }
  }
  if (NT > 1 && t < L) scores<NH, 1, Q, C>(q, ldq, cache, idx + t, L - t, D, scale, s + t, lds);
}

// s[j, :L] -> softmax in place, for nh heads.
void softmax(float* s, int nh, int64_t L) {
  for (int j = 0; j < nh; ++j) {
    float* p = s + j * L;
    float m = -INFINITY;
    for (int64_t t = 0; t < L; ++t) m = p[t] > m ? p[t] : m;
    float sum = 0.0f;
    for (int64_t t = 0; t < L; ++t) {
      p[t] = std::exp(p[t] - m);
      sum += p[t];
    }
    const float inv = 1.0f / sum;
    for (int64_t t = 0; t < L; ++t) p[t] *= inv;
  }
}

// o[j, c0:c0 + 8 NV] = sum_t p[j, t] * row_t[c0:c0 + 8 NV] for NH heads: the NH * NV accumulators stay in
// registers over all L rows (the rows' pieces come from L2), one store each at the end.
template <int NH, int NV, typename C>
inline void value_block(const float* p, const C* cache, const int64_t* idx, int64_t L, int64_t D, int64_t c0,
                        float* o, int64_t ldo) {
  f32v acc[NH][NV];
  for (int j = 0; j < NH; ++j)
    for (int v = 0; v < NV; ++v) acc[j][v] = f32v{};
  for (int64_t t = 0; t < L; ++t) {
    const C* row = cache + idx[t] * D + c0;
    f32v r[NV];
    for (int v = 0; v < NV; ++v) r[v] = loadv(row + v * kLanes);
    for (int j = 0; j < NH; ++j) {
      const f32v pj = f32v{} + p[j * L + t];
      for (int v = 0; v < NV; ++v) acc[j][v] += pj * r[v];
    }
  }
  for (int j = 0; j < NH; ++j)
    for (int v = 0; v < NV; ++v) storev(o + j * ldo + c0 + v * kLanes, acc[j][v]);
}

// o[j, :Dv] = sum_t p[j, t] * row_t[:Dv] for NH heads (o rows ldo apart).
template <int NH, typename C>
void values(const float* p, const C* cache, const int64_t* idx, int64_t L, int64_t D, int64_t Dv, float* o,
            int64_t ldo) {
  constexpr int NV = NH <= 2 ? 4 : (NH <= 4 ? 2 : 1);  // NH * NV <= 8 accumulators
  int64_t c = 0;
  for (; c + NV * kLanes <= Dv; c += NV * kLanes) value_block<NH, NV>(p, cache, idx, L, D, c, o, ldo);
  for (; c + kLanes <= Dv; c += kLanes) value_block<NH, 1>(p, cache, idx, L, D, c, o, ldo);
  for (; c < Dv; ++c)
    for (int j = 0; j < NH; ++j) {
      float v = 0.0f;
      for (int64_t t = 0; t < L; ++t) v += p[j * L + t] * to_f32(cache[idx[t] * D + c]);
      o[j * ldo + c] = v;
    }
}

#ifdef __AVX512BF16__
// scores over a bf16 cache with bf16 q (qb rows D apart), D a multiple of 32: NH * NT accumulators of 16 lanes,
// each step 32 products of a head and a row.
template <int NH, int NT>
void scores_bf16(const uint16_t* qb, const uint16_t* cache, const int64_t* idx, int64_t L, int64_t D, float scale,
                 float* s, int64_t lds) {
  int64_t t = 0;
  for (; t + NT <= L; t += NT) {
    const uint16_t* row[NT];
    const uint16_t* next[NT];
    for (int i = 0; i < NT; ++i) {
      row[i] = cache + idx[t + i] * D;
      next[i] = cache + idx[t + NT + i < L ? t + NT + i : L - 1] * D;
    }
    __m512 acc[NH][NT];
    for (int j = 0; j < NH; ++j)
      for (int i = 0; i < NT; ++i) acc[j][i] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 32) {  // 32 bf16: one cache line a row
      __m512bh r[NT];
      for (int i = 0; i < NT; ++i) {
        __builtin_prefetch(next[i] + d);
        r[i] = (__m512bh)_mm512_loadu_si512(row[i] + d);
      }
      for (int j = 0; j < NH; ++j) {
        const __m512bh qv = (__m512bh)_mm512_loadu_si512(qb + j * D + d);
        for (int i = 0; i < NT; ++i) acc[j][i] = _mm512_dpbf16_ps(acc[j][i], qv, r[i]);
      }
    }
    for (int j = 0; j < NH; ++j)
      for (int i = 0; i < NT; ++i) s[j * lds + t + i] = scale * _mm512_reduce_add_ps(acc[j][i]);
  }
  if (NT > 1 && t < L) scores_bf16<NH, 1>(qb, cache, idx + t, L - t, D, scale, s + t, lds);
}

#endif

// q as fp32 for the fp32 score loop: a bf16 q widened once per work item (thread-local), not at every row tile.
template <typename Q>
const float* q_f32(const Q* q, int64_t n) {
  if constexpr (std::is_same_v<Q, float>) {
    return q;
  } else {
    thread_local std::vector<float> qf;
    qf.resize(n);
    for (int64_t i = 0; i < n; ++i) qf[i] = to_f32(q[i]);
    return qf.data();
  }
}

// One work item: nh heads of one request, L rows.
template <int NH, typename Q, typename C>
void attend(const Q* q, const C* cache, const int64_t* idx, int64_t L, int64_t D, int64_t Dv, float scale,
            float* s, float* o) {
  constexpr int NT = NH <= 2 ? 4 : (NH <= 4 ? 2 : 1);  // NH * NT <= 8 score accumulators
#ifdef __AVX512BF16__
  if (std::is_same_v<C, uint16_t> && D % 32 == 0) {
    constexpr int NTB = NH <= 2 ? 8 : (NH <= 4 ? 4 : 2);  // NH * NTB <= 16 of AVX-512's 32 registers
    thread_local std::vector<uint16_t> qb;
    qb.resize(NH * D);
    for (int64_t i = 0; i < NH * D; ++i) qb[i] = to_bf16(q[i]);  // (a bf16 q as it is)
    scores_bf16<NH, NTB>(qb.data(), reinterpret_cast<const uint16_t*>(cache), idx, L, D, scale, s, L);
  } else {
    scores<NH, NT>(q_f32(q, NH * D), D, cache, idx, L, D, scale, s, L);
  }
#else
  scores<NH, NT>(q_f32(q, NH * D), D, cache, idx, L, D, scale, s, L);
#endif
  softmax(s, NH, L);
  values<NH>(s, cache, idx, L, D, Dv, o, Dv);
}

template <typename Q, typename C>
void attend_heads(int nh, const Q* q, const C* cache, const int64_t* idx, int64_t L, int64_t D, int64_t Dv,
                  float scale, float* s, float* o) {
  switch (nh) {
    case 8: attend<8, Q, C>(q, cache, idx, L, D, Dv, scale, s, o); break;
    case 7: attend<7, Q, C>(q, cache, idx, L, D, Dv, scale, s, o); break;
    case 6: attend<6, Q, C>(q, cache, idx, L, D, Dv, scale, s, o); break;
    case 5: attend<5, Q, C>(q, cache, idx, L, D, Dv, scale, s, o); break;
    case 4: attend<4, Q, C>(q, cache, idx, L, D, Dv, scale, s, o); break;
    case 3: attend<3, Q, C>(q, cache, idx, L, D, Dv, scale, s, o); break;
    case 2: attend<2, Q, C>(q, cache, idx, L, D, Dv, scale, s, o); break;
    default: attend<1, Q, C>(q, cache, idx, L, D, Dv, scale, s, o); break;
  }
}

// Q, O: float or uint16_t (bf16) for q and out; a bf16 out is summed in fp32 and rounded once.
template <typename Q, typename C, typename O>
void mla_decode(const Q* q, const C* cache, const int64_t* kv_indices, const int64_t* kv_indptr, int64_t B,
                int64_t H, int64_t D, int64_t Dv, float scale, O* out, int num_threads) {
  // Work items: (request, group of up to kMaxHeads heads); a small batch splits its heads further so that every
  // thread has work.
  const int threads = threads_for((kv_indptr[B] - kv_indptr[0]) * H * (D + Dv), num_threads);
  int64_t group = H < kMaxHeads ? H : kMaxHeads;
  while (group > 1 && B * ((H + group - 1) / group) < threads) group = (group + 1) / 2;
  const int64_t groups = (H + group - 1) / group;
  const int64_t n_items = B * groups;
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    std::vector<float> s, of;  // scores; the fp32 output of a bf16 out
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n_items; ++i) {
      const int64_t b = i / groups, h0 = (i % groups) * group;
      const int nh = static_cast<int>(H - h0 < group ? H - h0 : group);
      const int64_t L = kv_indptr[b + 1] - kv_indptr[b];
      O* o = out + (b * H + h0) * Dv;
      if (L <= 0) {  // nothing to attend to: zeros (the reference's empty softmax would be NaN)
        std::memset(o, 0, nh * Dv * sizeof(O));
        continue;
      }
      if (static_cast<int64_t>(s.size()) < nh * L) s.resize(nh * L);
      float* of_ = reinterpret_cast<float*>(o);
      if constexpr (!std::is_same_v<O, float>) {
        of.resize(nh * Dv);
        of_ = of.data();
      }
      attend_heads<Q, C>(nh, q + (b * H + h0) * D, cache, kv_indices + kv_indptr[b], L, D, Dv, scale, s.data(), of_);
      if constexpr (!std::is_same_v<O, float>)
        for (int64_t j = 0; j < nh * Dv; ++j) o[j] = to_bf16(of_[j]);
    }
  }
}

}  // namespace

extern "C" {

// q [B, H, D] fp32; cache [N, D] fp32 or bf16 by the entry point (the latent rows [c_kv | k_rope]); kv_indices
// [S] int64 slots in [0, N), request b's at kv_indptr[b] .. kv_indptr[b + 1] ([B + 1] int64); out [B, H, Dv]
// fp32 = softmax(scale * q · rows) · rows[:, :Dv]. num_threads: OpenMP threads (torch's intra-op count).
void moeserve_mla_decode_f32(const float* q, const float* cache, const int64_t* kv_indices, const int64_t* kv_indptr,
                             int64_t B, int64_t H, int64_t D, int64_t Dv, float scale, float* out, int num_threads) {
  mla_decode<float, float, float>(q, cache, kv_indices, kv_indptr, B, H, D, Dv, scale, out, num_threads);
}

void moeserve_mla_decode_bf16(const float* q, const uint16_t* cache, const int64_t* kv_indices,
                              const int64_t* kv_indptr, int64_t B, int64_t H, int64_t D, int64_t Dv, float scale,
                              float* out, int num_threads) {
  mla_decode<float, uint16_t, float>(q, cache, kv_indices, kv_indptr, B, H, D, Dv, scale, out, num_threads);
}

// The same all in bf16: q [B, H, D], cache, out [B, H, Dv] (a bf16 model's decode, no dtype copies around it).
void moeserve_mla_decode_bf16_io(const uint16_t* q, const uint16_t* cache, const int64_t* kv_indices,
                                 const int64_t* kv_indptr, int64_t B, int64_t H, int64_t D, int64_t Dv, float scale,
                                 uint16_t* out, int num_threads) {
  mla_decode<uint16_t, uint16_t, uint16_t>(q, cache, kv_indices, kv_indptr, B, H, D, Dv, scale, out, num_threads);
}

}
