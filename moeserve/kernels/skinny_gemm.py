"""Dense x W^T for the few rows of a small decode batch, at the memory's rate.

    skinny_gemm(x [M, K], w [N, K]) -> [M, N] in x's dtype, summed in fp32
    batched_skinny_gemm(x [G, M, K], w [G, N, K], out [G, M, N] | None) -> [G, M, N]: one per group, as torch.bmm
        with w transposed (MLA's absorbed decode: W_UK and W_UV per head); w with K or N contiguous, out any strides

At decode a dense layer reads its whole weight for one to a few rows of x, so its time is the weight's bytes over
the copy bandwidth plus a launch. cuBLAS runs these shapes as GEMM tiles sized for more rows (its best measured
about 2.2 TB/s over V2-Lite's 8-23 MB weights); the Triton kernel (triton_ops/skinny_gemm.py) is a GEMV that
streams each weight row once and sums the M rows' dots on the CUDA cores. Measured in CUDA graphs over weights
past L2 (benchmark/experiments/bench_skinny_gemm.py, H200), at one row it was faster than cuBLAS on every DeepSeek-V2-Lite
and V3 weight timed (V2-Lite's o_proj 4.3 against 6.0 us, its LM head 98 against 105, V3's q_a 7.8 against 10.9);
with more rows it loses as the weight grows (its work per weight element grows with M on the CUDA cores, cuBLAS's
does not). So it runs for CUDA tensors with one row, and with 2 to MAX_ROWS rows where rows x weight bytes is at
most MAX_WORK_BYTES. The batched form runs only at one row over at most MAX_BATCHED_BYTES of weights: measured
beside torch.bmm on MLA's per-head products (bench_skinny_gemm.py --only mla), it won on V2-Lite's 2 MB W_UK and
W_UV at one row (3.1 against 3.4 us, 2.9 against 3.8) and lost or tied everywhere else (two or more rows; V3's
16 MB, 128-head ones). The references (F.linear, torch.bmm) run everywhere else, and under torch.compile.

On the CPU, bf16 products of 1 to 4 rows run the C++ kernel (kernels/cpu_skinny_gemm.py, built for the --cpu-isa
picked at load): torch's bf16 F.linear pays a fixed cost per call there that a decode step's many small
projections feel; the batched form runs MLA's per-head products. In the builds with AVX-512 BF16 (amx, avx512bf16)
a packed copy of the weight (made on its first product, kept on the tensor) serves 1 to 128 rows instead, faster
than F.linear at every such count on the EPYC VM (2026-12-07; on one thread: cpu_skinny_gemm.py). Other CPU dtypes (float32) keep F.linear and
torch.bmm.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moeserve.kernels import cpu_skinny_gemm
from moeserve.kernels.triton_available import use_triton

MAX_ROWS = 4
MAX_WORK_BYTES = 32 << 20
MAX_BATCHED_BYTES = 8 << 20


def skinny_gemm_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x, w)


def batched_skinny_gemm_reference(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    return torch.bmm(x, w.transpose(1, 2), out=out)


def _takes_kernel(x: torch.Tensor, w: torch.Tensor, rows: int) -> bool:
    # The compiler's check first: a row-count test it traced would split the compiled forward by batch size.
    return (not torch.compiler.is_compiling() and use_triton(x) and x.dtype == w.dtype
            and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and 1 <= rows <= MAX_ROWS and x.shape[-1] == w.shape[-1]
            and (rows == 1 or rows * w.numel() * w.element_size() <= MAX_WORK_BYTES))


def skinny_gemm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Module docstring; x may have leading dimensions ([..., K]) as for F.linear."""
    if cpu_skinny_gemm.packed_takes(x, w):
        return cpu_skinny_gemm.cpu_packed_gemm(x, w)
    if cpu_skinny_gemm.takes(x, w):
        return cpu_skinny_gemm.cpu_skinny_gemm(x, w)
    rows = x.numel() // max(x.shape[-1], 1)
    if w.dim() == 2 and _takes_kernel(x, w, rows):
        from moeserve.kernels.triton_ops.skinny_gemm import skinny_gemm as triton_skinny_gemm

        return triton_skinny_gemm(x.reshape(-1, x.shape[-1]), w).view(*x.shape[:-1], w.shape[0])
    return skinny_gemm_reference(x, w)


def batched_skinny_gemm(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None,
                        packed: torch.Tensor | None = None) -> torch.Tensor:
    """Module docstring: x [G, M, K], w [G, N, K] -> [G, M, N] (into out where given). packed: w's per-group packed
    copy (cpu_skinny_gemm.pack_groups), which the CPU's AVX-512 BF16 builds multiply by for 1 to 128 rows."""
    if cpu_skinny_gemm.batched_packed_takes(x, packed, out):
        return cpu_skinny_gemm.cpu_batched_packed_gemm(x, packed, out)
    if cpu_skinny_gemm.batched_takes(x, w, out):
        return cpu_skinny_gemm.cpu_batched_skinny_gemm(x, w, out)
    if (x.dim() == 3 and w.dim() == 3 and x.shape[0] == w.shape[0] and 1 in (w.stride(1), w.stride(2))
            and x.shape[1] == 1 and w.numel() * w.element_size() <= MAX_BATCHED_BYTES
            and _takes_kernel(x, w, x.shape[1])):
        from moeserve.kernels.triton_ops.skinny_gemm import batched_skinny_gemm as triton_batched

        return triton_batched(x, w, out)
    return batched_skinny_gemm_reference(x, w, out)
