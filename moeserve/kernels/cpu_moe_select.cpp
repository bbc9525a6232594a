// Expert selection on the CPU after the scores (kernels/moe_select.py's reference, from its correction bias on):
//
//     choice = scores + bias                        (the bias only chooses; the weights are the scores)
//     groups: keep the topk_group groups of n_group with the largest max (group_limited_greedy) or top-2 sum
//             (noaux_tc) of choice; the others' experts masked to -inf
//     ids = top-k of choice; weights = scores[ids] (/ their sum + 1e-20 when renormalizing) * scale
//
// per token, in one call (the reference runs up to 15 torch ops for DeepSeek-V3's grouped gate). fp32 throughout;
// the scores are torch's (softmax or sigmoid, computed before the call), so the weights are the reference's up to
// the order of the renormalizing sum. Ties between equal choices go to the lower expert id.
//
// Plain C++ and OpenMP, no torch headers: moeserve/kernels/build.py compiles it on first use for the process's ISA,
// moeserve/kernels/cpu_moe_select.py calls it through ctypes.

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kOneThreadTokens = 256;  // fewer tokens than this: one thread

// The index of the largest of v[0..n) not yet taken (ties: the lower index).
inline int64_t argmax_free(const float* v, const bool* taken, int64_t n) {
  int64_t best = -1;
  for (int64_t i = 0; i < n; ++i)
    if (!taken[i] && (best < 0 || v[i] > v[best])) best = i;
  return best;
}

void select_token(const float* scores, const float* bias, int64_t E, int64_t k, int64_t n_group, int64_t topk_group,
                  int group_score, bool renormalize, float scale, int64_t* ids, float* weights, float* choice,
                  bool* taken, float* gscore) {
  for (int64_t e = 0; e < E; ++e) choice[e] = bias != nullptr ? scores[e] + bias[e] : scores[e];
  if (group_score != 0 && n_group > 1) {
    const int64_t per = E / n_group;
    for (int64_t g = 0; g < n_group; ++g) {
      const float* c = choice + g * per;
      float first = -std::numeric_limits<float>::infinity(), second = first;
      for (int64_t i = 0; i < per; ++i) {
        if (c[i] > first) {
          second = first;
          first = c[i];
        } else if (c[i] > second) {
          second = c[i];
        }
      }
      gscore[g] = group_score == 1 ? first : (per >= 2 ? first + second : first);
      taken[g] = false;
    }
    for (int64_t j = 0; j < topk_group; ++j) {
      const int64_t g = argmax_free(gscore, taken, n_group);
      if (g >= 0) taken[g] = true;  // taken = kept
    }
    for (int64_t g = 0; g < n_group; ++g)
      if (!taken[g])
        for (int64_t i = 0; i < per; ++i) choice[g * per + i] = -std::numeric_limits<float>::infinity();
  }
  for (int64_t e = 0; e < E; ++e) taken[e] = false;
  float sum = 0.0f;
  for (int64_t j = 0; j < k; ++j) {
    const int64_t e = argmax_free(choice, taken, E);
    taken[e] = true;
    ids[j] = e;
    weights[j] = scores[e];
    sum += scores[e];
  }
  for (int64_t j = 0; j < k; ++j) {
    if (renormalize) weights[j] = weights[j] / (sum + 1e-20f);
    if (scale != 1.0f) weights[j] = weights[j] * scale;
  }
}

}  // namespace

extern "C" {

// scores [T, E] fp32 contiguous; bias [E] fp32 or null; group_score 0 (no groups), 1 (max), 2 (top-2 sum); k <= E
// -> ids [T, k] int64, weights [T, k] fp32. num_threads: OpenMP threads.
void moeserve_moe_select(const float* scores, const float* bias, int64_t T, int64_t E, int64_t k, int64_t n_group,
                         int64_t topk_group, int group_score, int renormalize, float scale, int64_t* ids,
                         float* weights, int num_threads) {
  const int threads = T < kOneThreadTokens ? 1 : num_threads;
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    std::vector<float> choice(E), gscore(n_group > 0 ? n_group : 1);
    std::vector<char> taken(E > n_group ? E : n_group);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t)
      select_token(scores + t * E, bias, E, k, n_group, topk_group, group_score, renormalize != 0, scale,
                   ids + t * k, weights + t * k, choice.data(), reinterpret_cast<bool*>(taken.data()),
                   gscore.data());
  }
}

}
