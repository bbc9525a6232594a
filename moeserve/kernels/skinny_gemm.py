"""Dense x W^T for the few rows of a small decode batch, at the memory's rate.

    skinny_gemm(x [M, K], w [N, K]) -> [M, N] in x's dtype, summed in fp32

At decode a dense layer reads its whole weight for one to a few rows of x, so its time is the weight's bytes over
the copy bandwidth plus a launch. cuBLAS runs these shapes as GEMM tiles sized for more rows (its best measured
about 2.2 TB/s over V2-Lite's 8-23 MB weights); the Triton kernel (triton_ops/skinny_gemm.py) is a GEMV that
streams each weight row once and sums the M rows' dots on the CUDA cores. Measured in CUDA graphs over weights
past L2 (scripts/gpu/bench_skinny_gemm.py, H200), at one row it was faster than cuBLAS on every DeepSeek-V2-Lite
and V3 weight timed (V2-Lite's o_proj 4.3 against 6.0 us, its LM head 98 against 105, V3's q_a 7.8 against 10.9);
with more rows it loses as the weight grows (its work per weight element grows with M on the CUDA cores, cuBLAS's
does not). So it runs for CUDA tensors with one row, and with 2 to MAX_ROWS rows where rows x weight bytes is at
most MAX_WORK_BYTES; `skinny_gemm_reference` (F.linear) runs everywhere else, and under torch.compile.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moeserve.kernels.triton_available import use_triton

MAX_ROWS = 4
MAX_WORK_BYTES = 32 << 20


def skinny_gemm_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x, w)


def skinny_gemm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Module docstring; x may have leading dimensions ([..., K]) as for F.linear."""
    rows = x.numel() // max(x.shape[-1], 1)
    if (use_triton(x) and x.dtype == w.dtype and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and w.dim() == 2 and 1 <= rows <= MAX_ROWS and x.shape[-1] == w.shape[1]
            and (rows == 1 or rows * w.numel() * w.element_size() <= MAX_WORK_BYTES)
            and not torch.compiler.is_compiling()):
        from moeserve.kernels.triton_ops.skinny_gemm import skinny_gemm as triton_skinny_gemm

        return triton_skinny_gemm(x.reshape(-1, x.shape[-1]), w).view(*x.shape[:-1], w.shape[0])
    return skinny_gemm_reference(x, w)
