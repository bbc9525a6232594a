"""Triton `skinny_gemm` and `batched_skinny_gemm` (moeserve/kernels/skinny_gemm.py): out [M, N] = x [M, K] W^T for
a few rows (M <= 8), a GEMV that streams the weights once at the memory's rate; batched, one per group (head).

Grid (column blocks, K splits, groups): a program takes BLOCK_N rows of w (output columns) and walks its share of K in
steps of BLOCK_K, loading a [BLOCK_N, BLOCK_K] tile of w per step (contiguous along K: 16-byte loads, coalesced)
and, for each of the BLOCK_M rows of x (a static loop, rows past M masked), sums w * x_row along K in fp32 on the
CUDA cores: M is too small for the tensor cores. All of a tile's loads are in flight before its first use, so a
program keeps BLOCK_N x BLOCK_K x elem bytes in flight, and `blocks` picks tiles small enough that even the
smallest weights (V2-Lite's kv_a, 576 x 2,048) spread over several programs per SM. With SPLIT_K > 1 the K
splits add their fp32 partial sums into a zeroed fp32 buffer with atomics, cast to x's dtype afterwards.
W_KN: the weight is stored [K, N] (N contiguous, as MLA's W_UK sits in kv_b_proj's weight): the same tile, its
loads contiguous along N instead (`blocks_kn`: 64 columns a program)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeserve.kernels.triton_ops.direct_launch import DirectLauncher

MAX_ROWS = 8  # the kernel's limit (M accumulators a column); the dispatch, kernels/skinny_gemm.py, sends fewer
TILE = 8192  # elements of w a program loads a step: 16 KB of bf16, 64 a thread at 4 warps
MIN_PROGRAMS = 4 * 132  # a few programs for each of the H200's 132 SMs


@triton.jit
def _skinny_gemm_kernel(x_ptr, w_ptr, out_ptr, M, N, K, stride_x, stride_w, stride_o, stride_xg, stride_wg, stride_og,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        SPLIT_K: tl.constexpr, W_KN: tl.constexpr):
    g = tl.program_id(2).to(tl.int64)  # the group (head) of a batched call; 0 otherwise
    x_ptr += g * stride_xg
    out_ptr += g * stride_og
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    nm = rn < N
    if W_KN:  # w stored [K, N] (N contiguous): element (n, k) at k * stride_w + n
        w_rows = w_ptr + g * stride_wg + rn[:, None]
    else:  # w stored [N, K] (K contiguous)
        w_rows = w_ptr + g * stride_wg + rn[:, None].to(tl.int64) * stride_w
    k_span = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K  # each split's share of K, whole steps
    k_lo = tl.program_id(1) * k_span
    k_hi = tl.minimum(k_lo + k_span, K)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # column m: row m of x's sums
    for k0 in range(k_lo, k_hi, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        km = rk < k_hi
        if W_KN:
            w_ptrs = w_rows + rk[None, :].to(tl.int64) * stride_w
        else:
            w_ptrs = w_rows + rk[None, :]
        w = tl.load(w_ptrs, mask=nm[:, None] & km[None, :], other=0.0).to(tl.float32)
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
    """(BLOCK_N, BLOCK_K, num_warps, SPLIT_K, num_stages), from benchmark/experiments/bench_skinny_gemm.py
    on the H200.
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


def blocks_kn(M: int, N: int, K: int) -> tuple[int, int, int, int, int]:
    """`blocks` for a weight stored [K, N] (N contiguous: MLA's W_UK as kv_b_proj holds it): 64 columns a program
    (128-byte rows of bf16), TILE elements a step."""
    block_n = min(triton.next_power_of_2(N), 64)
    block_k = min(triton.next_power_of_2(K), max(TILE // block_n, 16))
    return block_n, block_k, 4, 1, 1 if block_k >= K else 3


def _check(x: torch.Tensor, w: torch.Tensor, K: int) -> None:
    M = x.shape[-2]
    if w.shape[-1] != K or w.dtype != x.dtype or not 1 <= M <= MAX_ROWS:
        raise ValueError(f"skinny_gemm: x {tuple(x.shape)} {x.dtype} and w {tuple(w.shape)} {w.dtype} do not fit "
                         f"(1 to {MAX_ROWS} rows, one dtype)")


def _launch(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None, block: tuple[int, ...] | None,
            groups: int) -> torch.Tensor:
    """x [G, M, K] (K contiguous), w [G, N, K] with K or N contiguous, out [G, M, N] or None -> out."""
    _, M, K = x.shape
    N = w.shape[1]
    kn = w.stride(2) != 1
    block_n, block_k, num_warps, split_k, num_stages = block or (blocks_kn if kn else blocks)(M, N, K)
    split_k = max(min(split_k, triton.cdiv(K, block_k)), 1)  # no split without a step of its own
    target = out
    if split_k > 1:
        target = torch.zeros(groups, M, N, dtype=torch.float32, device=x.device)
    elif target is None:
        target = torch.empty(groups, M, N, dtype=x.dtype, device=x.device)
    _KERNEL((triton.cdiv(N, block_n), split_k, groups), x, w, target, M, N, K, x.stride(1),
            w.stride(2) if kn else w.stride(1), target.stride(1), x.stride(0), w.stride(0), target.stride(0),
            BLOCK_M=triton.next_power_of_2(M), BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k, W_KN=kn,
            num_warps=num_warps, num_stages=num_stages)
    if split_k == 1:
        return target
    if out is None:
        return target.to(x.dtype)
    return out.copy_(target)


def skinny_gemm(x: torch.Tensor, w: torch.Tensor,
                block: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """x [M, K] (1 <= M <= MAX_ROWS) times w [N, K] transposed, in x's dtype (bf16, fp16, fp32; w the same), summed
    in fp32. block: (BLOCK_N, BLOCK_K, num_warps, SPLIT_K, num_stages) in place of `blocks`' choice
    (benchmark/experiments/bench_skinny_gemm.py compares them)."""
    if w.dim() != 2 or x.dim() != 2:
        raise ValueError(f"skinny_gemm: x {tuple(x.shape)} and w {tuple(w.shape)} are not matrices")
    _check(x, w, x.shape[1])
    x = x if x.stride(1) == 1 else x.contiguous()
    w = w if w.stride(1) == 1 else w.contiguous()
    return _launch(x[None], w[None], None, block, 1)[0]


def batched_skinny_gemm(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None,
                        block: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """out [G, M, N] = x [G, M, K] (1 <= M <= MAX_ROWS) times each group's w [G, N, K] transposed: a GEMV per group
    (MLA's per-head W_UK and W_UV at decode). w may be strided with K or N contiguous (W_UK is kv_b_proj's [K, N]
    blocks); out, if given, any strides (written in place)."""
    if w.dim() != 3 or x.dim() != 3 or w.shape[0] != x.shape[0]:
        raise ValueError(f"batched_skinny_gemm: x {tuple(x.shape)} and w {tuple(w.shape)} are not [G, M, K] and "
                         f"[G, N, K]")
    _check(x, w, x.shape[2])
    x = x if x.stride(2) == 1 else x.contiguous()
    w = w if 1 in (w.stride(2), w.stride(1)) else w.contiguous()
    if out is not None:
        assert out.shape == (x.shape[0], x.shape[1], w.shape[1]) and out.dtype == x.dtype, (out.shape, out.dtype)
    return _launch(x, w, out, block, x.shape[0])
