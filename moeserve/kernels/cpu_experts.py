"""The CPU experts kernel (cpu_experts.cpp): a whole layer's routed experts in one call, for few rows per expert.

`cpu_moe_local(x, topk_ids, topk_weights, w13, w2)` is the one-rank form: grouping the pairs by expert, the
experts and the weighted sum of each token's k results, in one call (no dispatcher).

`cpu_experts(x, w13, w2, offsets, counts)` computes what `Experts` computes with two grouped GEMMs and SwiGLU, over
a ContiguousLayout. The weights keep their logical shapes ([E, 2I, H] and [E, H, I]) but are stored transposed, as
`Experts` keeps them on the CPU: w.transpose(1, 2) is contiguous. fp32 and bf16 weights; the sums are in fp32.
Where the experts average more rows than `MAX_ROWS_PER_EXPERT` (a long prefill) a GEMM library is faster, and it
runs the grouped GEMMs instead.
NOTE: a packed per-column-block weight layout (each expert's [K, 64] column block contiguous, so that the tiles
stream it and it stays in cache across the row blocks) is not done: the rebalancer (eplb/) writes the experts'
slots in the transposed layout, so a packed copy needs a repack hook there. At a batch of 64 (16 rows per expert)
the kernel is about 20% of a decode step (benchmark/results/, 2026-12-01); tiles of up to 6 rows took some of it.

The C++ source is compiled on first use (moeserve/kernels/build.py). `load()` returns None (and logs why, once)
where that is impossible, and callers keep the grouped GEMMs. Under torch.compile the kernels are the custom ops
`moeserve::cpu_experts` and `moeserve::cpu_moe_local`.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from moeserve.kernels.activation import silu_and_mul
from moeserve.kernels.build import load_library
from moeserve.kernels.grouped_gemm import grouped_gemm

SOURCE = Path(__file__).with_name("cpu_experts.cpp")
MAX_ROWS_PER_EXPERT = 32  # measured crossover with MKL's grouped GEMM is 32-64 rows per expert (2 AVX2 cores)
DTYPES = (torch.float32, torch.bfloat16)


def load() -> ctypes.CDLL | None:
    """The compiled kernel library (moeserve/kernels/build.py); None where it cannot be built."""
    return load_library(SOURCE, _bind, "using grouped GEMMs")


def available(dtype: torch.dtype) -> bool:
    return dtype in DTYPES and load() is not None


def _library_and_weights(w13: torch.Tensor, w2: torch.Tensor) -> tuple[ctypes.CDLL, torch.Tensor, torch.Tensor]:
    """The kernel library and the weights' contiguous transposes [E, H, 2I] and [E, I, H], or why not."""
    lib = load()
    if lib is None or w13.dtype not in DTYPES or w2.dtype != w13.dtype:
        raise RuntimeError(f"the CPU experts kernel does not run here (weights {w13.dtype}); check available()")
    w13t, w2t = w13.transpose(1, 2), w2.transpose(1, 2)
    if not (w13t.is_contiguous() and w2t.is_contiguous()):
        raise ValueError("the CPU experts kernel needs expert weights stored transposed ([E, H, 2I] and [E, I, H])")
    return lib, w13t, w2t


def cpu_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, offsets: torch.Tensor,
                counts: torch.Tensor) -> torch.Tensor:
    """x [M, H]; w13 [E, 2I, H], w2 [E, H, I] stored transposed; offsets [E + 1], counts [E] -> [M, H] in x's dtype.

    Rows offsets[e] .. offsets[e] + counts[e] get W2_e (silu(W1_e x) * W3_e x); other rows are unspecified.
    """
    if torch.compiler.is_compiling():
        return torch.ops.moeserve.cpu_experts(x, w13, w2, offsets, counts)
    E, I2, H = w13.shape
    M = x.shape[0]
    if M > MAX_ROWS_PER_EXPERT * E:
        return grouped_gemm(silu_and_mul(grouped_gemm(x, w13, offsets, counts)), w2, offsets, counts)
    lib, w13t, w2t = _library_and_weights(w13, w2)
    xf = x.float().contiguous()
    offsets = offsets.to(torch.int32).contiguous()
    counts = counts.to(torch.int32).contiguous()
    act = xf.new_empty(M, I2 // 2)
    out = xf.new_empty(M, H)
    fn = lib.moeserve_experts_f32 if w13.dtype == torch.float32 else lib.moeserve_experts_bf16
    fn(xf.data_ptr(), w13t.data_ptr(), w2t.data_ptr(), offsets.data_ptr(), counts.data_ptr(), E, H, I2 // 2,
       act.data_ptr(), out.data_ptr(), torch.get_num_threads())
    return out if x.dtype == torch.float32 else out.to(x.dtype)


def cpu_moe_local(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
                  w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One rank's whole routed-expert step: x [T, H], topk_ids [T, k] (every expert local), topk_weights [T, k]
    -> (out [T, H] in x's dtype, pairs per expert [E] int64), out[t] = sum_j topk_weights[t, j] *
    expert_{topk_ids[t, j]}(x[t]), summed in fp32.

    What LocalDispatcher + `cpu_experts` + combine compute, in one call: for decode steps (few rows per expert;
    the caller checks MAX_ROWS_PER_EXPERT)."""
    if torch.compiler.is_compiling():
        return torch.ops.moeserve.cpu_moe_local(x, topk_ids, topk_weights, w13, w2)
    E, I2, H = w13.shape
    T, k = topk_ids.shape
    lib, w13t, w2t = _library_and_weights(w13, w2)
    xf = x.float().contiguous()
    ids = topk_ids.to(torch.int64).contiguous()
    weights = topk_weights.float().contiguous()
    scratch = xf.new_empty(T * k * (2 * H + I2 // 2))
    out = xf.new_empty(T, H)
    counts = ids.new_empty(E)
    fn = lib.moeserve_moe_local_f32 if w13.dtype == torch.float32 else lib.moeserve_moe_local_bf16
    rc = fn(xf.data_ptr(), ids.data_ptr(), weights.data_ptr(), T, k, w13t.data_ptr(), w2t.data_ptr(), E, H,
            I2 // 2, scratch.data_ptr(), out.data_ptr(), counts.data_ptr(), torch.get_num_threads())
    if rc:
        raise ValueError(f"cpu_moe_local: an expert id outside [0, {E}) in topk_ids")
    return (out if x.dtype == torch.float32 else out.to(x.dtype)), counts


@torch.library.custom_op("moeserve::cpu_moe_local", mutates_args=())
def _cpu_moe_local_op(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
                      w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return cpu_moe_local(x, topk_ids, topk_weights, w13, w2)


@_cpu_moe_local_op.register_fake
def _(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
      w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x.new_empty(x.shape[0], x.shape[1]), topk_ids.new_empty(w13.shape[0], dtype=torch.int64)


@torch.library.custom_op("moeserve::cpu_experts", mutates_args=())
def _cpu_experts_op(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, offsets: torch.Tensor,
                    counts: torch.Tensor) -> torch.Tensor:
    return cpu_experts(x, w13, w2, offsets, counts)


@_cpu_experts_op.register_fake
def _(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, offsets: torch.Tensor,
      counts: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], w13.shape[2])


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    for fn in (lib.moeserve_experts_f32, lib.moeserve_experts_bf16):
        fn.restype = None
        fn.argtypes = [p, p, p, p, p, i64, i64, i64, p, p, ctypes.c_int]
    for fn in (lib.moeserve_moe_local_f32, lib.moeserve_moe_local_bf16):
        fn.restype = ctypes.c_int
        fn.argtypes = [p, p, p, i64, i64, p, p, i64, i64, i64, p, p, p, ctypes.c_int]
    return lib
