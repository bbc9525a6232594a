"""bf16 x W^T on the CPU for one to four rows (cpu_skinny_gemm.cpp): the decode batch's dense projections.

    cpu_skinny_gemm(x [..., K] bf16, w [N, K] bf16 contiguous) -> [..., N] bf16, summed in fp32
    cpu_batched_skinny_gemm(x [G, M, K] bf16, w [G, N, K] bf16, out=None) -> [G, M, N] bf16: torch.bmm(x, w^T)
        per group (MLA's absorbed decode: the query's rows through W_UK and W_UV per head)

At one row torch's bf16 F.linear (oneDNN) pays its own fixed cost per call, about three times fp32's on the
shared Xeon this was aimed at (issue 50); the kernel reads each weight row once for all rows, with AVX-512 BF16
dot products in the amx and avx512bf16 builds and fp32 fused multiply-adds in the avx512 and avx2 builds
(kernels/cpu_isa.py).
`takes(x, w)` says whether it runs a product: CPU bf16 tensors, 1 to MAX_ROWS rows, w contiguous, not under
torch.compile (a traced row-count test would split the compiled forward by batch size).

In the builds with AVX-512 BF16 (amx, avx512bf16) `cpu_packed_gemm` runs 1 to MAX_PACKED_ROWS rows over a packed
copy of the weight (16-column blocks, bf16 pairs along K: the experts' VNNI layout, cpu_bf16_dot.h), made on the
weight's first product and kept on the tensor (`packed_copy`; made again when the weight is rewritten in place).
No horizontal sums: it beat F.linear at 1 to 64 rows and the row kernel at 2 to 4 on the tiny V3's and V2-Lite's
shapes (one thread of the 2-core EPYC VM, 2026-12-07: 1024 x 256 at 4 rows 20.9 us against F.linear's 54.2 and the
row kernel's 50.0; at 64 rows 168 against 185, at 128 rows 3-24% faster on five shapes, from 256 rows on within
5%). It runs on one thread only (`_one_thread`): where torch runs more,
products past ONE_THREAD_WORK multiply-adds keep F.linear. The copy doubles the dense bf16 weights' memory.

The batched form reads x, w and out through their strides (x and out with their last dimension contiguous, w with
K or N contiguous: W_UK's per-head transpose is N-contiguous, W_UV K-contiguous), so the views MLA passes need no
copies. torch's bf16 bmm there paid 30-49 us a call at one row on the tiny V3's heads (4 x [32, 512]) against the
kernel's 10-13, and at 16 heads of V3's shapes 148 / 1,042 us (W_UK / W_UV) against 76 / 80; from 16 rows on
torch's was faster (one thread of the 2-core EPYC VM, 2026-12-07): `batched_takes` takes 1 to MAX_ROWS rows.

The C++ source is compiled on first use (moeserve/kernels/build.py); where that is impossible `takes` is False and
callers keep F.linear.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from moeserve.core.derived import derived
from moeserve.kernels.build import load_library

SOURCE = Path(__file__).with_name("cpu_skinny_gemm.cpp")
MAX_ROWS = 4  # the kernel's kMaxRows
MAX_PACKED_ROWS = 128  # rows of the packed product, at most (more: F.linear, as fast from 256 rows on)
ONE_THREAD_WORK = 1 << 18  # multiply-adds a packed product runs on one thread beside torch's many (_one_thread)


def load() -> ctypes.CDLL | None:
    """The compiled kernel library; None where it cannot be built."""
    return load_library(SOURCE, _bind, "bf16 linear layers of few rows run F.linear")


def uses_dpbf16() -> bool:
    """True where the loaded build multiplies with AVX-512 BF16 dot products (the amx and
    avx512bf16 builds)."""
    lib = load()
    return lib is not None and bool(lib.moeserve_skinny_dpbf16())


def takes(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether cpu_skinny_gemm runs x W^T (module docstring). Asked on every dense product, so the cheap tests (and
    the ones that reject other dtypes and devices) come first, and torch.compile before any test of a size: under
    the compiler a size compared becomes a guard of the graph (`x.numel() <= MAX_ROWS * K` bounded the compiled
    bf16 decode to batches of 4, and the first larger batch compiled a second graph)."""
    if x.dtype is not torch.bfloat16 or w.dtype is not torch.bfloat16 or not x.is_cpu or torch.compiler.is_compiling():
        return False
    K = x.shape[-1]
    return (0 < x.numel() <= MAX_ROWS * K and w.dim() == 2 and w.shape[1] == K and w.is_contiguous()
            and load() is not None)


def cpu_skinny_gemm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., K] bf16 (at most MAX_ROWS rows), w [N, K] bf16 contiguous -> x W^T [..., N] bf16; check takes()."""
    lib = load()
    if lib is None:
        raise RuntimeError("the CPU skinny GEMM does not run here; check takes()")
    K, N = x.shape[-1], w.shape[0]
    x2 = x.reshape(-1, K).contiguous()  # (no copy where x is contiguous)
    M = x2.shape[0]
    if not 1 <= M <= MAX_ROWS or w.shape[1] != K:
        raise ValueError(f"cpu_skinny_gemm: x {tuple(x.shape)} (1-{MAX_ROWS} rows) does not fit w {tuple(w.shape)}")
    y = x2.new_empty(M, N)
    lib.moeserve_skinny_gemm_bf16(x2.data_ptr(), w.data_ptr(), M, N, K, y.data_ptr(), torch.get_num_threads())
    return y.view(*x.shape[:-1], N)


def pack(w: torch.Tensor) -> torch.Tensor | None:
    """w [N, K] bf16 -> its packed copy [N / 16, K / 2, 16, 2] (16-column blocks, bf16 pairs along K interleaved),
    or None where the packed product does not run it (N not a multiple of 16, K odd, a build without AVX-512 BF16)."""
    N, K = w.shape
    if w.dtype is not torch.bfloat16 or N % 16 or K % 2 or not uses_dpbf16():
        return None
    return w.detach().reshape(N // 16, 16, K // 2, 2).permute(0, 2, 1, 3).contiguous()


def packed_copy(w: torch.Tensor) -> torch.Tensor | None:
    """The packed copy of a weight the model keeps (a parameter, or a tensor that is no view), made on its first
    product and kept on the tensor: made again when the weight is rewritten in place (its version moves), None
    for a view (a view made per call would be packed per call) or what `pack` refuses."""
    if w._base is not None and not isinstance(w, torch.nn.Parameter):
        return None
    return derived(w, "_moeserve_packed", lambda: pack(w))


def _one_thread(work: int) -> bool:
    """The packed products run on one thread: where torch runs one, or the product is too small to wake more.
    Measured on the 16-core Xeon (2026-12-07, 15 threads): the packed products' own parallel regions, between
    torch's 15-thread ones, slowed the decode step's other kernels 1.5-3x (the tiny V3 at batch 64: 7,457 tok/s
    with them, 12,745 with F.linear there); on one thread they beat F.linear at every row count."""
    return work <= ONE_THREAD_WORK or torch.get_num_threads() == 1


def packed_takes(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether cpu_packed_gemm runs x W^T (module docstring): CPU bf16, 1 to MAX_PACKED_ROWS rows, a build with
    AVX-512 BF16, a weight `packed_copy` packs."""
    if (x.dtype is not torch.bfloat16 or w.dtype is not torch.bfloat16 or not x.is_cpu or w.dim() != 2
            or torch.compiler.is_compiling()):
        return False
    K = x.shape[-1]
    return (0 < x.numel() <= MAX_PACKED_ROWS * K and w.shape[1] == K and _one_thread(x.numel() * w.shape[0])
            and uses_dpbf16() and packed_copy(w) is not None)


def cpu_packed_gemm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., K] bf16 -> x W^T [..., N] bf16 over W's packed copy; check packed_takes() first. One group of the
    batched product, called without the group dimension's views (they cost ~4 us a call, a 1-row product ~17)."""
    lib, wp = load(), packed_copy(w)
    if lib is None or wp is None:
        raise RuntimeError("the packed CPU GEMM does not run here; check packed_takes()")
    K, N = x.shape[-1], w.shape[0]
    x2 = x.reshape(-1, K)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    y = x2.new_empty(x2.shape[0], N)
    _packed_product(lib, x2.data_ptr(), 0, x2.stride(0), wp.data_ptr(), 1, x2.shape[0], N, K, y.data_ptr(), 0, N)
    return y.view(*x.shape[:-1], N)


def _packed_product(lib: ctypes.CDLL, *args: int) -> None:
    """moeserve_batched_packed_gemm_bf16 (x, its group and row strides, wp, G, M, N, K, y, its strides)."""
    if lib.moeserve_batched_packed_gemm_bf16(*args, torch.get_num_threads()):
        raise RuntimeError("the packed CPU GEMM is not in this build (no AVX-512 BF16)")


def pack_groups(w: torch.Tensor) -> torch.Tensor | None:
    """w [G, N, K] bf16 (any strides) -> each group's packed copy [G, N / 16, K / 2, 16, 2], or None (as `pack`)."""
    G, N, K = w.shape
    if w.dtype is not torch.bfloat16 or N % 16 or K % 2 or not uses_dpbf16():
        return None
    return w.detach().reshape(G, N // 16, 16, K // 2, 2).permute(0, 1, 3, 2, 4).contiguous()


def batched_packed_takes(x: torch.Tensor, packed: torch.Tensor | None, out: torch.Tensor | None = None) -> bool:
    """Whether cpu_batched_packed_gemm runs x [G, M, K] over `packed` (pack_groups' copy): CPU bf16, 1 to
    MAX_PACKED_ROWS rows, x's and out's last dimensions contiguous."""
    if (packed is None or x.dtype is not torch.bfloat16 or not x.is_cpu or x.dim() != 3
            or torch.compiler.is_compiling()):
        return False
    G, M, K = x.shape
    return (1 <= M <= MAX_PACKED_ROWS and packed.shape[0] == G and packed.shape[2] * 2 == K and x.stride(2) == 1
            and _one_thread(x.numel() * packed.shape[1] * 16)
            and (out is None or (out.dtype is torch.bfloat16 and out.shape == (G, M, packed.shape[1] * 16)
                                 and out.stride(2) == 1))
            and load() is not None)


def cpu_batched_packed_gemm(x: torch.Tensor, packed: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [G, M, K] bf16 -> [G, M, N] bf16 (into out where given), group g times W_g^T from pack_groups' copy; check
    batched_packed_takes() first."""
    lib = load()
    G, M, K = x.shape
    N = packed.shape[1] * 16
    y = x.new_empty(G, M, N) if out is None else out
    _packed_product(lib, x.data_ptr(), x.stride(0), x.stride(1), packed.data_ptr(), G, M, N, K, y.data_ptr(),
                    y.stride(0), y.stride(1))
    return y


def batched_takes(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None) -> bool:
    """Whether cpu_batched_skinny_gemm runs torch.bmm(x, w.transpose(1, 2)) (module docstring)."""
    if x.dtype is not torch.bfloat16 or w.dtype is not torch.bfloat16 or not x.is_cpu or torch.compiler.is_compiling():
        return False
    return (x.dim() == 3 and w.dim() == 3 and 1 <= x.shape[1] <= MAX_ROWS and x.shape[0] == w.shape[0]
            and x.shape[2] == w.shape[2]
            and x.stride(2) == 1 and 1 in (w.stride(1), w.stride(2))
            and (out is None or (out.dtype is torch.bfloat16 and out.shape == (x.shape[0], x.shape[1], w.shape[1])
                                 and out.stride(2) == 1))
            and load() is not None)


def cpu_batched_skinny_gemm(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [G, M, K] bf16, w [G, N, K] bf16 -> x w^T [G, M, N] bf16 (into out where given); check batched_takes()."""
    lib = load()
    if lib is None:
        raise RuntimeError("the CPU skinny GEMM does not run here; check batched_takes()")
    G, M, K = x.shape
    N = w.shape[1]
    y = x.new_empty(G, M, N) if out is None else out
    if M and N:
        lib.moeserve_batched_skinny_gemm_bf16(x.data_ptr(), x.stride(0), x.stride(1), w.data_ptr(), w.stride(0),
                                              w.stride(1), w.stride(2), G, M, N, K, y.data_ptr(), y.stride(0),
                                              y.stride(1), torch.get_num_threads())
    return y


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.moeserve_batched_packed_gemm_bf16.restype = ctypes.c_int
    lib.moeserve_batched_packed_gemm_bf16.argtypes = [p, i64, i64, p, i64, i64, i64, i64, p, i64, i64, ctypes.c_int]
    lib.moeserve_batched_skinny_gemm_bf16.restype = None
    lib.moeserve_batched_skinny_gemm_bf16.argtypes = [p, i64, i64, p, i64, i64, i64, i64, i64, i64, i64, p, i64,
                                                      i64, ctypes.c_int]
    lib.moeserve_skinny_gemm_bf16.restype = None
    lib.moeserve_skinny_gemm_bf16.argtypes = [p, p, i64, i64, i64, p, ctypes.c_int]
    lib.moeserve_skinny_dpbf16.restype = ctypes.c_int
    lib.moeserve_skinny_dpbf16.argtypes = []
    return lib
