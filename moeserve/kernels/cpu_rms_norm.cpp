// RMSNorm of bf16 rows on the CPU, optionally after the residual add, as kernels/rms_norm.py's reference computes
// it, with no fp32 copies of the rows:
//
//     h = bf16(x + residual)                       (with a residual; written out)
//     n = bf16(h * 1 / sqrt(mean(h^2) + eps))      (statistics in fp32)
//     y = bf16(weight * n)
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

}  // namespace

extern "C" {

// x [T, D] bf16 (rows D apart), residual [T, D] bf16 or null, weight [D] bf16 -> y [T, D] bf16 and, with a
// residual, h = x + residual [T, D] bf16. num_threads: OpenMP threads (torch's intra-op count).
void moeserve_rms_norm_bf16(const uint16_t* x, const uint16_t* residual, const uint16_t* weight, int64_t T, int64_t D,
                            float eps, uint16_t* y, uint16_t* h, int num_threads) {
  const int threads = T * D < kOneThreadElems ? 1 : num_threads;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int64_t t = 0; t < T; ++t)
    norm_row(x + t * D, residual != nullptr ? residual + t * D : nullptr, weight, D, eps, y + t * D,
             h != nullptr ? h + t * D : nullptr);
}

}
