// MLA's absorbed extend on the CPU: new query rows of each request attend, causally, over the request's rows of the
// paged latent cache, all heads against one latent head (the decode's form, layers/attention/latent_extend.py):
//
//     s[t, h, j] = scale * q[t, h] · cache[slot_j]               (key: the whole latent row [c_kv | k_rope])
//     o[t, h]    = sum_{j <= pos_t} softmax_j(s[t, h, :]) * cache[slot_j][:Dv]   (value: its c_kv part)
//
// for request b's new rows q_indptr[b] .. q_indptr[b + 1] (n of them) and its keys kv_indices[kv_indptr[b] ..
// kv_indptr[b + 1]) (s of them, the new rows' own last): new row i sees keys 0 .. s - n + i.
//
// torch's form (bmm, the mask's add, softmax, bmm) writes and reads the whole [rows * h, keys] score matrix several
// times and runs each product as one large GEMM; here a work item takes a block of one request's query rows (every
// head of a few tokens) and keeps its scores in L2: the keys packed transposed once per request ([D, keys], read
// from the cache through the indices: no gathered copy), the scores of the block by a register-blocked product
// (MR rows x NR vectors of keys), each row's softmax over its own causal length (the keys past it are neither
// scored past the block's last nor weighed), the values by another register-blocked product straight from the cache
// rows, and the softmax's normalization folded into the output.
//
// Plain C++ (GCC/Clang vector extensions) and OpenMP, no torch headers: moeserve/kernels/build.py compiles it on
// first use for the process's ISA, moeserve/kernels/cpu_latent_extend.py calls it through ctypes.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_vec.h"

namespace {

using namespace moeserve_vec;

// Micro-tiles: MR query rows by NR vectors of keys (scores) or NV vectors of output columns (values), MR * NR
// accumulators of AVX-512's 32 registers (AVX2's 16 where vectors are 8 lanes). bench_latent_extend.py, one thread of
// an AMD EPYC Zen 4: 8 x 3 ran DeepSeek-V2's widths at 45-49 GMAC/s (torch's bmm 44-49), 6 x 2 at 32.
constexpr int MR = kLanes == 16 ? 8 : 4;
constexpr int NR = kLanes == 16 ? 3 : 2;
constexpr int NV = NR;
constexpr int64_t kBlockRows = 64;  // query rows (tokens x heads) of one work item at most, a whole token at least

typedef int32_t i32v __attribute__((vector_size(4 * kLanes)));

// e^x per lane for x <= 0 (the softmax's x - max): Cephes' expf polynomial on the reduced argument, 2^n put into
// the exponent; lanes under -87 give 0.
inline f32v exp_v(f32v x) {
  const f32v lo = f32v{} - 87.0f;
  const i32v under = x < lo;
  x = x < lo ? lo : x;
  const f32v n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
  f32v r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  f32v p = f32v{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  i32v bits;
  std::memcpy(&bits, &p, sizeof bits);
  bits += __builtin_convertvector(n, i32v) << 23;
  bits = under ? i32v{} : bits;
  f32v out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}

constexpr int64_t TK = NR * kLanes;  // keys of a score micro-tile

// One request's rows in float32, in order (they lie scattered over the pool; the products pass over them once per
// block of query rows): kt, the keys transposed by tiles of TK keys, key j's element d at
// kt[(j / TK) * D * TK + d * TK + j % TK] (0 past the last key), so that one tile, [D, TK], is contiguous; vb, the
// values, vb[j * Dv + c] = cache[idx[j]][c].
template <typename C>
void pack_rows(const C* cache, const int64_t* idx, int64_t s, int64_t D, int64_t Dv, float* kt, float* vb) {
  const int64_t tiles = (s + TK - 1) / TK;
  std::memset(kt, 0, tiles * D * TK * sizeof(float));
  for (int64_t j = 0; j < s; ++j) {
    const C* row = cache + idx[j] * D;
    float* col = kt + (j / TK) * D * TK + j % TK;
    for (int64_t d = 0; d < D; ++d) col[d * TK] = to_f32(row[d]);
    for (int64_t c = 0; c < Dv; ++c) vb[j * Dv + c] = to_f32(row[c]);
  }
}

// s[m * lds + j0 .. + TK) = q_m · keys j0 .. j0 + TK for ROWS rows of q (D apart); tile: the keys' [D, TK] tile.
template <int ROWS>
inline void score_tile(const float* q, int64_t D, const float* tile, int64_t j0, float* s, int64_t lds) {
  f32v acc[ROWS][NR];
  for (int m = 0; m < ROWS; ++m)
    for (int v = 0; v < NR; ++v) acc[m][v] = f32v{};
  for (int64_t d = 0; d < D; ++d) {
    f32v k[NR];
    for (int v = 0; v < NR; ++v) k[v] = loadv(tile + d * TK + v * kLanes);
    for (int m = 0; m < ROWS; ++m) {
      const f32v qv = f32v{} + q[m * D + d];
      for (int v = 0; v < NR; ++v) acc[m][v] += qv * k[v];
    }
  }
  for (int m = 0; m < ROWS; ++m)
    for (int v = 0; v < NR; ++v) storev(s + m * lds + j0 + v * kLanes, acc[m][v]);
}

// The scores of a block's rows over keys 0 .. len: a tile of keys at a time over every row (the tile, D * TK
// floats, is read from L2 by each micro-tile of rows, the rows' q stay there too).
void scores(const float* q, int64_t D, const float* kt, int64_t len, int64_t rows, float* s, int64_t lds) {
  for (int64_t j0 = 0; j0 < len; j0 += TK) {
    const float* tile = kt + (j0 / TK) * D * TK;
    int64_t m = 0;
    for (; m + MR <= rows; m += MR) score_tile<MR>(q + m * D, D, tile, j0, s + m * lds, lds);
    for (; m < rows; ++m) score_tile<1>(q + m * D, D, tile, j0, s + m * lds, lds);
  }
}

// o[m][c0 .. c0 + NVV * kLanes) = sum_{j < len} p[m * lds + j] * vb[j][c0 ..] for ROWS rows (o rows Dv apart).
template <int ROWS, int NVV>
inline void value_tile(const float* p, int64_t lds, const float* vb, int64_t len, int64_t Dv, int64_t c0, float* o) {
  f32v acc[ROWS][NVV];
  for (int m = 0; m < ROWS; ++m)
    for (int v = 0; v < NVV; ++v) acc[m][v] = f32v{};
  for (int64_t j = 0; j < len; ++j) {
    const float* row = vb + j * Dv + c0;
    f32v r[NVV];
    for (int v = 0; v < NVV; ++v) r[v] = loadv(row + v * kLanes);
    for (int m = 0; m < ROWS; ++m) {
      const f32v pm = f32v{} + p[m * lds + j];
      for (int v = 0; v < NVV; ++v) acc[m][v] += pm * r[v];
    }
  }
  for (int m = 0; m < ROWS; ++m)
    for (int v = 0; v < NVV; ++v) storev(o + m * Dv + c0 + v * kLanes, acc[m][v]);
}

template <int NVV>
void value_cols(const float* p, int64_t lds, const float* vb, int64_t len, int64_t Dv, int64_t rows, int64_t c0,
                float* o) {
  int64_t m = 0;
  for (; m + MR <= rows; m += MR) value_tile<MR, NVV>(p + m * lds, lds, vb, len, Dv, c0, o + m * Dv);
  for (; m < rows; ++m) value_tile<1, NVV>(p + m * lds, lds, vb, len, Dv, c0, o + m * Dv);
}

// o = p · vb for a block's rows (their probabilities p, unnormalized, lds apart): a slice of output columns at a
// time over every row (the slice of vb, len * NV * kLanes floats, is read from L2 by each micro-tile of rows).
void values(const float* p, int64_t lds, const float* vb, int64_t len, int64_t Dv, int64_t rows, float* o) {
  int64_t c = 0;
  for (; c + NV * kLanes <= Dv; c += NV * kLanes) value_cols<NV>(p, lds, vb, len, Dv, rows, c, o);
  for (; c + kLanes <= Dv; c += kLanes) value_cols<1>(p, lds, vb, len, Dv, rows, c, o);
  for (; c < Dv; ++c)
    for (int64_t m = 0; m < rows; ++m) {
      float v = 0.0f;
      for (int64_t j = 0; j < len; ++j) v += p[m * lds + j] * vb[j * Dv + c];
      o[m * Dv + c] = v;
    }
}

// One work item: request rows [i0, i1) (tokens) of a request with n new rows over s keys, every head.
void attend_block(const float* q, const float* kt, const float* vb, int64_t s,
                  int64_t n, int64_t i0, int64_t i1, int64_t H, int64_t D, int64_t Dv, float scale,
                  std::vector<float>& sbuf, float* out) {
  const int64_t rows = (i1 - i0) * H;
  const int64_t past = s - n;                // keys before the request's first new row
  const int64_t len = past + i1;             // keys the block's last token sees
  const int64_t lds = (len + TK - 1) / TK * TK;
  if (static_cast<int64_t>(sbuf.size()) < rows * lds) sbuf.resize(rows * lds);
  float* sc = sbuf.data();
  scores(q, D, kt, len, rows, sc, lds);
  std::vector<float> inv(rows);
  for (int64_t m = 0; m < rows; ++m) {
    float* p = sc + m * lds;
    const int64_t own = past + i0 + m / H + 1;  // this row's keys
    const int64_t vec = own / kLanes * kLanes;
    f32v mx = f32v{} - INFINITY;
    for (int64_t j = 0; j < vec; j += kLanes) {
      const f32v x = loadv(p + j);
      mx = x > mx ? x : mx;
    }
    float top = -INFINITY;
    for (int l = 0; l < kLanes; ++l) top = mx[l] > top ? mx[l] : top;
    for (int64_t j = vec; j < own; ++j) top = p[j] > top ? p[j] : top;
    top *= scale;
    f32v sum = f32v{};
    for (int64_t j = 0; j < vec; j += kLanes) {
      const f32v e = exp_v(loadv(p + j) * scale - top);
      storev(p + j, e);
      sum += e;
    }
    float total = 0.0f;
    for (int l = 0; l < kLanes; ++l) total += sum[l];
    for (int64_t j = vec; j < own; ++j) {
      p[j] = std::exp(p[j] * scale - top);
      total += p[j];
    }
    std::memset(p + own, 0, (len - own) * sizeof(float));  // the causal far side weighs nothing
    inv[m] = 1.0f / total;
  }
  values(sc, lds, vb, len, Dv, rows, out);
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t c = 0; c < Dv; ++c) out[m * Dv + c] *= inv[m];
}

template <typename C>
void latent_extend(const float* q, const C* cache, const int64_t* kv_indices, const int64_t* kv_indptr,
                   const int64_t* q_indptr, int64_t B, int64_t H, int64_t D, int64_t Dv, float scale, float* out,
                   int num_threads) {
  // Every request's rows packed once (pack_rows): its keys, tiles of TK, then its values.
  std::vector<int64_t> koff(B + 1, 0), voff(B);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t s = kv_indptr[b + 1] - kv_indptr[b];
    voff[b] = koff[b] + (s + TK - 1) / TK * TK * D;
    koff[b + 1] = voff[b] + s * Dv;
  }
  std::vector<float> packed(koff[B]);
  int64_t work = 0;
  for (int64_t b = 0; b < B; ++b)
    work += (q_indptr[b + 1] - q_indptr[b]) * H * (kv_indptr[b + 1] - kv_indptr[b]) * (D + Dv);
  const int threads = threads_for(work, num_threads);
  // Work items: (request, block of its tokens), a block kBlockRows rows (tokens x heads) at most, a whole token at
  // least, and the step's tokens cut into a multiple of the threads' count of blocks: 80 tokens of 4 heads on two
  // threads made 5 blocks of 16 tokens, 3 on one thread and 2 on the other; 6 blocks of 14 tokens keep both busy.
  const int64_t max_tokens = kBlockRows / H > 0 ? kBlockRows / H : 1;
  int64_t blocks = (q_indptr[B] + max_tokens - 1) / max_tokens;
  blocks = (blocks + threads - 1) / threads * threads;
  const int64_t tokens_per_block = blocks > 0 ? (q_indptr[B] + blocks - 1) / blocks : 1;
  std::vector<int64_t> item_b, item_i0;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i0 = 0; i0 < q_indptr[b + 1] - q_indptr[b]; i0 += tokens_per_block) {
      item_b.push_back(b);
      item_i0.push_back(i0);
    }
  const int64_t n_items = static_cast<int64_t>(item_b.size());
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
#pragma omp for schedule(static)
    for (int64_t b = 0; b < B; ++b)
      pack_rows(cache, kv_indices + kv_indptr[b], kv_indptr[b + 1] - kv_indptr[b], D, Dv, packed.data() + koff[b],
                packed.data() + voff[b]);
    std::vector<float> sbuf;
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < n_items; ++it) {
      const int64_t b = item_b[it], i0 = item_i0[it];
      const int64_t n = q_indptr[b + 1] - q_indptr[b], s = kv_indptr[b + 1] - kv_indptr[b];
      const int64_t i1 = i0 + tokens_per_block < n ? i0 + tokens_per_block : n;
      const int64_t row0 = (q_indptr[b] + i0) * H;
      attend_block(q + row0 * D, packed.data() + koff[b], packed.data() + voff[b], s, n, i0, i1, H, D, Dv, scale, sbuf,
                   out + row0 * Dv);
    }
  }
}

}  // namespace

extern "C" {

// q [T, H, D] fp32 (request b's new rows q_indptr[b] .. q_indptr[b + 1], [B + 1] int64); cache [N, D] fp32 or
// bf16 by the entry point (latent rows [c_kv | k_rope]); kv_indices [S] int64 slots, request b's keys at
// kv_indptr[b] .. kv_indptr[b + 1] ([B + 1] int64), at least as many as its new rows, its new rows' keys last;
// out [T, H, Dv] fp32. num_threads: OpenMP threads (torch's intra-op count).
void moeserve_latent_extend_f32(const float* q, const float* cache, const int64_t* kv_indices,
                                const int64_t* kv_indptr, const int64_t* q_indptr, int64_t B, int64_t H, int64_t D,
                                int64_t Dv, float scale, float* out, int num_threads) {
  latent_extend<float>(q, cache, kv_indices, kv_indptr, q_indptr, B, H, D, Dv, scale, out, num_threads);
}

void moeserve_latent_extend_bf16(const float* q, const uint16_t* cache, const int64_t* kv_indices,
                                 const int64_t* kv_indptr, const int64_t* q_indptr, int64_t B, int64_t H, int64_t D,
                                 int64_t Dv, float scale, float* out, int num_threads) {
  latent_extend<uint16_t>(q, cache, kv_indices, kv_indptr, q_indptr, B, H, D, Dv, scale, out, num_threads);
}

}
