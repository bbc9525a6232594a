"""Triton `skinny_gemm` (moeserve/kernels/skinny_gemm.py): out [M, N] = x [M, K] W^T for a few rows (M <= 8), a
GEMV that streams the weights once at the memory's rate.

Grid (column blocks, K splits): a program takes BLOCK_N rows of w (output columns) and walks its share of K in
steps of BLOCK_K, loading a [BLOCK_N, BLOCK_K] tile of w per step (contiguous along K: 16-byte loads, coalesced)
and, for each of the BLOCK_M rows of x (a static loop, rows past M masked), sums w * x_row along K in fp32 on the
CUDA cores: M is too small for the tensor cores. All of a tile's loads are in flight before its first use, so a
program keeps BLOCK_N x BLOCK_K x elem bytes in flight, and `blocks` picks tiles small enough that even the
smallest weights (V2-Lite's kv_a, 576 x 2,048) spread over several programs per SM. With SPLIT_K > 1 the K
splits add their fp32 partial sums into a zeroed fp32 buffer with atomics, cast to x's dtype afterwards."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeserve.kernels.triton_ops.direct_launch import DirectLauncher

MAX_ROWS = 8  # the kernel's limit (M accumulators a column); the dispatch, kernels/skinny_gemm.py, sends fewer
TILE = 8192  # elements of w a program loads a step: 16 KB of bf16, 64 a thread at 4 warps
MIN_PROGRAMS = 4 * 132  # a few programs for each of the H200's 132 SMs


@triton.jit
def _skinny_gemm_kernel(x_ptr, w_ptr, out_ptr, M, N, K, stride_x, stride_w, stride_o,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        SPLIT_K: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    nm = rn < N
    w_rows = w_ptr + rn[:, None].to(tl.int64) * stride_w
    k_span = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K  # each split's share of K, whole steps
    k_lo = tl.program_id(1) * k_span
    k_hi = tl.minimum(k_lo + k_span, K)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # column m: row m of x's sums
    for k0 in range(k_lo, k_hi, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        km = rk < k_hi
        w = tl.load(w_rows + rk[None, :], mask=nm[:, None] & km[None, :], other=0.0).to(tl.float32)
        for m in tl.static_range(BLOCK_M):
            # rows past M read row M - 1 again (from L1), their sums are never stored
            xm = tl.load(x_ptr + tl.minimum(m, M - 1) * stride_x + rk, mask=km, other=0.0).to(tl.float32)
            acc += tl.where(rm[None, :] == m, tl.sum(w * xm[None, :], axis=1)[:, None], 0.0)
    out = out_ptr + rm[None, :] * stride_o + rn[:, None]
    om = nm[:, None] & (rm[None, :] < M)
    if SPLIT_K == 1:
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=om)
    else:
        tl.atomic_add(out, acc, mask=om, sem="relaxed")


_KERNEL = DirectLauncher(_skinny_gemm_kernel)


def blocks(M: int, N: int, K: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, SPLIT_K, num_stages), from scripts/gpu/bench_skinny_gemm.py on the H200.
    One row: 8 warps, 2 columns of 2,048 a program; for very wide weights (over 32k columns: the LM head) or K
    that 2,048-steps would pad by over a fifth (V3's q_b, K 1,536), 16 columns in pipelined steps of 512. More
    rows: 4 warps, TILE elements a step (K in steps of up to 2,048), fewer columns a program (down to 1) until there
    are MIN_PROGRAMS programs."""
    if M == 1:
        if N > 32768 or triton.cdiv(K, 2048) * 2048 > 1.2 * K:
            return 16, min(512, triton.next_power_of_2(K)), 8, 1, 3
        return 2, 2048, 8, 1, 1
    block_k = min(triton.next_power_of_2(K), 2048)
    block_n = max(TILE // block_k, 1)
    while block_n > 1 and triton.cdiv(N, block_n) < MIN_PROGRAMS:
        block_n //= 2
    return block_n, block_k, 4, 1, 1


def skinny_gemm(x: torch.Tensor, w: torch.Tensor,
                block: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """x [M, K] (1 <= M <= MAX_ROWS) times w [N, K] transposed, in x's dtype (bf16, fp16, fp32; w the same), summed
    in fp32. block: (BLOCK_N, BLOCK_K, num_warps, SPLIT_K, num_stages) in place of `blocks`' choice (scripts/gpu/
    bench_skinny_gemm.py compares them)."""
    M, K = x.shape
    N = w.shape[0]
    if w.dim() != 2 or w.shape[1] != K or w.dtype != x.dtype or not 1 <= M <= MAX_ROWS:
        raise ValueError(f"skinny_gemm: x {tuple(x.shape)} {x.dtype} and w {tuple(w.shape)} {w.dtype} do not fit "
                         f"(1 to {MAX_ROWS} rows, one dtype)")
    x = x if x.stride(1) == 1 else x.contiguous()
    w = w if w.stride(1) == 1 else w.contiguous()
    block_n, block_k, num_warps, split_k, num_stages = block or blocks(M, N, K)
    split_k = max(min(split_k, triton.cdiv(K, block_k)), 1)  # no split without a step of its own
    out = torch.zeros if split_k > 1 else torch.empty
    out = out(M, N, dtype=torch.float32 if split_k > 1 else x.dtype, device=x.device)
    _KERNEL((triton.cdiv(N, block_n), split_k), x, w, out, M, N, K, x.stride(0), w.stride(0), out.stride(0),
            BLOCK_M=triton.next_power_of_2(M), BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k,
            num_warps=num_warps, num_stages=num_stages)
    return out if split_k == 1 else out.to(x.dtype)
