"""The CPU experts kernel (cpu_experts.cpp): a whole layer's routed experts in one call, for few rows per expert.

`cpu_moe_local(x, topk_ids, topk_weights, w13, w2)` is the one-rank form: grouping the pairs by expert, the
experts and the weighted sum of each token's k results, in one call (no dispatcher).

`cpu_experts(x, w13, w2, offsets, counts)` computes what `Experts` computes with two grouped GEMMs and SwiGLU, over
a ContiguousLayout. The weights keep their logical shapes ([E, 2I, H] and [E, H, I]) but are stored transposed, as
`Experts` keeps them on the CPU: w.transpose(1, 2) is contiguous. fp32 and bf16 weights; the sums are in fp32.
Where the experts average more rows than `MAX_ROWS_PER_EXPERT` (a long prefill) a GEMM library is faster, and it
runs the grouped GEMMs instead; over packed weights the kernel takes every row count (`kernel_takes`).
NOTE: for these (fp32, and bf16 without AVX-512 BF16) a packed per-column-block weight layout (each expert's [K, 64]
column block contiguous, so that the tiles stream it and it stays in cache across the row blocks) is not done; it
could replace the weights as the bf16 packing below does (the rebalancer needs only the slot as the first
dimension). At a batch of 64 (16 rows per expert) the kernel is about 20% of a decode step (benchmark/results/,
2026-12-01); tiles of up to 6 rows took some of it.

bf16 with AVX-512 BF16 (--cpu-isa amx or avx512bf16, kernels/cpu_isa.py): `pack(w13, w2)` gives the weights in the
VNNI layout, which then replaces them (layers/moe/experts.py: the experts keep no other copy, and the rebalancer
moves packed slots); both functions take it as `packed` (w13 and w2 then only name the dtype) and run both GEMMs as
bf16 dot products, or on AMX tiles in the amx build for an expert's rows where at least TILE_FROM_ROWS are left, x
and the activation rounded to bf16 as torch's bf16 path rounds them. `unpack` gives the logical shapes back.
torch's bf16 path does use AMX (oneDNN's brg_matmul:avx10_1_512_amx, ONEDNN_VERBOSE=1) but pays a call per
expert and matrix: the tiny V3's layer (16 experts, H 256, I 128) at 16 rows per expert took 3.3 ms as per-expert
F.linear against 0.54 ms here (1.95 ms on the AVX path), one thread of the shared 2-core Xeon, 2026-12-06.

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
# Over packed weights (bf16, AVX-512 BF16) no limit: torch's bf16 grouped GEMM runs a call per expert and matrix, and
# with the dispatcher around it the default model's whole bf16 prefill (2 threads, AMD EPYC Zen 4, 2026-12-07) took
# 26.5 ms at 129 tokens against 9.9 through the kernel, 88-113 against 52-54 at 1,024 and 177-246 against 143-144 at
# 2,048 (the kernel alone is slower than the grouped GEMMs from 256 rows per expert: 7.1 ms against 2.7).
# The amx build runs an expert's rows on AMX tiles (16 rows a tile, whatever the count) where at least this many are
# left, else as AVX-512 BF16 dot products (6 rows at a time). On the 16-core Xeon (2026-12-07) the tiny V3's layer
# at 16 rows per expert took 694 us on tiles against 1,155 as dot products on one thread, at one row per expert 73
# against 62; from 1, 8 and 16 rows the whole decode steps were within noise of each other.
TILE_FROM_ROWS = 8
DTYPES = (torch.float32, torch.bfloat16)


def load() -> ctypes.CDLL | None:
    """The compiled kernel library (moeserve/kernels/build.py); None where it cannot be built."""
    return load_library(SOURCE, _bind, "using grouped GEMMs")


def available(dtype: torch.dtype) -> bool:
    return dtype in DTYPES and load() is not None


def packed_runs() -> bool:
    """True where the process's kernels run bf16 experts over packed weights: the avx512bf16 build, or the amx build
    where the CPU gave this process its tiles."""
    lib = load()
    return lib is not None and bool(lib.moeserve_experts_packed_available())


Packed = tuple[torch.Tensor, torch.Tensor]  # pack's (w13p, w2p)


def pack(w13: torch.Tensor, w2: torch.Tensor) -> Packed | None:
    """bf16 w13 [E, 2I, H] and w2 [E, H, I] -> their AMX packing (w13p [E, 2I/16, H/2, 16, 2], w2p [E, H/16, I/2,
    16, 2]: 16-column blocks, bf16 pairs along K interleaved), or None where the packed kernels do not run them (not
    bf16, H or I not a multiple of 32, a build without AVX-512 BF16)."""
    E, I2, H = w13.shape
    inter = I2 // 2
    if w13.dtype != torch.bfloat16 or w2.dtype != torch.bfloat16 or H % 32 or inter % 32 or not packed_runs():
        return None
    w13p = w13.reshape(E, I2 // 16, 16, H // 2, 2).permute(0, 1, 3, 2, 4).contiguous()
    w2p = w2.reshape(E, H // 16, 16, inter // 2, 2).permute(0, 1, 3, 2, 4).contiguous()
    return w13p, w2p


def packed_dims(packed: Packed) -> tuple[int, int, int]:
    """(E, 2I, H) of pack's (w13p, w2p)."""
    w13p = packed[0]
    return w13p.shape[0], w13p.shape[1] * 16, w13p.shape[2] * 2


def unpack(w13p: torch.Tensor, w2p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """pack's inverse: (w13 [E, 2I, H], w2 [E, H, I]), contiguous."""
    E, I2, H = packed_dims((w13p, w2p))
    w13 = w13p.permute(0, 1, 3, 2, 4).reshape(E, I2, H)
    w2 = w2p.permute(0, 1, 3, 2, 4).reshape(E, H, I2 // 2)
    return w13, w2


def _library_and_weights(w13: torch.Tensor, w2: torch.Tensor, packed: Packed | None
                         ) -> tuple[ctypes.CDLL, torch.Tensor, torch.Tensor]:
    """The kernel library and the weights' contiguous transposes [E, H, 2I] and [E, I, H] (with packed weights,
    w13 and w2 as they are: the packed kernels read only those), or why not."""
    lib = load()
    if lib is None or w13.dtype not in DTYPES or w2.dtype != w13.dtype:
        raise RuntimeError(f"the CPU experts kernel does not run here (weights {w13.dtype}); check available()")
    if packed is not None:
        return lib, w13, w2
    w13t, w2t = w13.transpose(1, 2), w2.transpose(1, 2)
    if not (w13t.is_contiguous() and w2t.is_contiguous()):
        raise ValueError("the CPU experts kernel needs expert weights stored transposed ([E, H, 2I] and [E, I, H])")
    return lib, w13t, w2t


def kernel_takes(rows: int, num_experts: int, packed: Packed | None) -> bool:
    """Whether the kernel runs `rows` (token, expert) pairs over num_experts experts, rather than the grouped GEMMs
    (MAX_ROWS_PER_EXPERT: the unpacked kernels only)."""
    return packed is not None or rows <= MAX_ROWS_PER_EXPERT * num_experts


def cpu_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, offsets: torch.Tensor,
                counts: torch.Tensor, packed: Packed | None = None) -> torch.Tensor:
    """x [M, H]; w13 [E, 2I, H], w2 [E, H, I] stored transposed; offsets [E + 1], counts [E] -> [M, H] in x's dtype.
    packed: pack(w13, w2), to run as bf16 dot products or on AMX tiles.

    Rows offsets[e] .. offsets[e] + counts[e] get W2_e (silu(W1_e x) * W3_e x); other rows are unspecified.
    """
    if torch.compiler.is_compiling():
        w13p, w2p = packed or (None, None)
        return torch.ops.moeserve.cpu_experts(x, w13, w2, offsets, counts, w13p, w2p)
    E, I2, H = w13.shape if packed is None else packed_dims(packed)
    M = x.shape[0]
    if not kernel_takes(M, E, packed):
        return grouped_gemm(silu_and_mul(grouped_gemm(x, w13, offsets, counts)), w2, offsets, counts)
    lib, w13t, w2t = _library_and_weights(w13, w2, packed)
    xf = x.float().contiguous()
    offsets = offsets.to(torch.int32).contiguous()
    counts = counts.to(torch.int32).contiguous()
    out = xf.new_empty(M, H)
    threads = torch.get_num_threads()
    if packed is not None:
        lib.moeserve_experts_packed(xf.data_ptr(), packed[0].data_ptr(), packed[1].data_ptr(), offsets.data_ptr(),
                                    counts.data_ptr(), E, H, I2 // 2, out.data_ptr(), TILE_FROM_ROWS, threads)
    else:
        act = xf.new_empty(M, I2 // 2)
        fn = lib.moeserve_experts_f32 if w13.dtype == torch.float32 else lib.moeserve_experts_bf16
        fn(xf.data_ptr(), w13t.data_ptr(), w2t.data_ptr(), offsets.data_ptr(), counts.data_ptr(), E, H, I2 // 2,
           act.data_ptr(), out.data_ptr(), threads)
    return out if x.dtype == torch.float32 else out.to(x.dtype)


def cpu_moe_local(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
                  w2: torch.Tensor, packed: Packed | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One rank's whole routed-expert step: x [T, H], topk_ids [T, k] (every expert local), topk_weights [T, k]
    -> (out [T, H] in x's dtype, pairs per expert [E] int64), out[t] = sum_j topk_weights[t, j] *
    expert_{topk_ids[t, j]}(x[t]), summed in fp32.

    What LocalDispatcher + `cpu_experts` + combine compute, in one call: for decode steps (few rows per expert;
    the caller checks kernel_takes). packed: as cpu_experts'."""
    if torch.compiler.is_compiling():
        w13p, w2p = packed or (None, None)
        return torch.ops.moeserve.cpu_moe_local(x, topk_ids, topk_weights, w13, w2, w13p, w2p)
    E, I2, H = w13.shape if packed is None else packed_dims(packed)
    T, k = topk_ids.shape
    lib, w13t, w2t = _library_and_weights(w13, w2, packed)
    xf = x.float().contiguous()
    ids = topk_ids.to(torch.int64).contiguous()
    weights = topk_weights.float().contiguous()
    out = xf.new_empty(T, H)
    counts = ids.new_empty(E)
    if packed is not None:
        fn, w_a, w_b, scratch = lib.moeserve_moe_local_packed, packed[0], packed[1], xf.new_empty(T * k * H)
    else:
        fn = lib.moeserve_moe_local_f32 if w13.dtype == torch.float32 else lib.moeserve_moe_local_bf16
        w_a, w_b, scratch = w13t, w2t, xf.new_empty(T * k * (2 * H + I2 // 2))
    args = [xf.data_ptr(), ids.data_ptr(), weights.data_ptr(), T, k, w_a.data_ptr(), w_b.data_ptr(), E, H, I2 // 2,
            scratch.data_ptr(), out.data_ptr(), counts.data_ptr()]
    rc = fn(*args, *([TILE_FROM_ROWS] if packed is not None else []), torch.get_num_threads())
    if rc:
        raise ValueError(f"cpu_moe_local: an expert id outside [0, {E}) in topk_ids")
    return (out if x.dtype == torch.float32 else out.to(x.dtype)), counts


def _packed(w13p: torch.Tensor | None, w2p: torch.Tensor | None) -> Packed | None:
    return None if w13p is None or w2p is None else (w13p, w2p)


@torch.library.custom_op("moeserve::cpu_moe_local", mutates_args=())
def _cpu_moe_local_op(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
                      w2: torch.Tensor, w13p: torch.Tensor | None,
                      w2p: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    return cpu_moe_local(x, topk_ids, topk_weights, w13, w2, _packed(w13p, w2p))


@_cpu_moe_local_op.register_fake
def _(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
      w13p: torch.Tensor | None, w2p: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    return x.new_empty(x.shape[0], x.shape[1]), topk_ids.new_empty(w13.shape[0], dtype=torch.int64)


@torch.library.custom_op("moeserve::cpu_experts", mutates_args=())
def _cpu_experts_op(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, offsets: torch.Tensor,
                    counts: torch.Tensor, w13p: torch.Tensor | None, w2p: torch.Tensor | None) -> torch.Tensor:
    return cpu_experts(x, w13, w2, offsets, counts, _packed(w13p, w2p))


@_cpu_experts_op.register_fake
def _(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, offsets: torch.Tensor, counts: torch.Tensor,
      w13p: torch.Tensor | None, w2p: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(x.shape)


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    for fn in (lib.moeserve_experts_f32, lib.moeserve_experts_bf16):
        fn.restype = None
        fn.argtypes = [p, p, p, p, p, i64, i64, i64, p, p, ctypes.c_int]
    for fn in (lib.moeserve_moe_local_f32, lib.moeserve_moe_local_bf16):
        fn.restype = ctypes.c_int
        fn.argtypes = [p, p, p, i64, i64, p, p, i64, i64, i64, p, p, p, ctypes.c_int]
    for fn in (lib.moeserve_experts_packed_available, lib.moeserve_experts_tiles):
        fn.restype = ctypes.c_int
        fn.argtypes = []
    if lib.moeserve_experts_packed_available():  # the avx512bf16 and amx builds: their entry points exist
        lib.moeserve_experts_packed.restype = None
        lib.moeserve_experts_packed.argtypes = [p, p, p, p, p, i64, i64, i64, p, i64, ctypes.c_int]
        lib.moeserve_moe_local_packed.restype = ctypes.c_int
        lib.moeserve_moe_local_packed.argtypes = [p, p, p, i64, i64, p, p, i64, i64, i64, p, p, p, i64, ctypes.c_int]
    return lib
