// RMSNorm of bf16 or float32 rows on the CPU, optionally after the residual add, as kernels/rms_norm.py's reference
// computes it (cpu_norm.h), with no fp32 copies of bf16 rows and one call where torch's float32 form runs five ops:
//
//     h = T(x + residual)                       (with a residual; written out)
//     n = T(h * 1 / sqrt(mean(h^2) + eps))      (statistics in fp32)
//     y = T(weight * n)
//
// Each rounding is the reference's; only the order of the sum of squares differs from torch's. One pass over a
// row for h and the sum, one for y (the row stays in L1). Rows are split over the OpenMP threads where there are
// enough of them to pay for waking the threads.
//
// Plain C++ (GCC/Clang vector extensions) and OpenMP, no torch headers: moeserve/kernels/build.py compiles it on
// first use for the process's ISA, moeserve/kernels/cpu_rms_norm.py calls it through ctypes.

#include <cmath>
#include <cstdint>

#include "cpu_norm.h"
#include "cpu_vec.h"

namespace {

using namespace moeserve_vec;
using moeserve_norm::norm_row;

constexpr int64_t kOneThreadElems = 1 << 15;  // below this many elements, one thread

template <typename E>
void rms_norm(const E* x, const E* residual, const E* weight, int64_t rows, int64_t D, float eps, E* y, E* h,
              int num_threads) {
  const int threads = rows * D < kOneThreadElems ? 1 : num_threads;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int64_t t = 0; t < rows; ++t)
    norm_row(x + t * D, residual != nullptr ? residual + t * D : nullptr, weight, D, eps, y + t * D,
             h != nullptr ? h + t * D : nullptr);
}

}  // namespace

extern "C" {

// x [T, D] (rows D apart), residual [T, D] or null, weight [D], all bf16 or all float32 by the entry point -> y
// [T, D] and, with a residual, h = x + residual [T, D]. num_threads: OpenMP threads (torch's intra-op count).
void moeserve_rms_norm_bf16(const uint16_t* x, const uint16_t* residual, const uint16_t* weight, int64_t T, int64_t D,
                            float eps, uint16_t* y, uint16_t* h, int num_threads) {
  rms_norm(x, residual, weight, T, D, eps, y, h, num_threads);
}

void moeserve_rms_norm_f32(const float* x, const float* residual, const float* weight, int64_t T, int64_t D, float eps,
                           float* y, float* h, int num_threads) {
  rms_norm(x, residual, weight, T, D, eps, y, h, num_threads);
}

}
