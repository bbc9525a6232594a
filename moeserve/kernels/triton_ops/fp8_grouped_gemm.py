"""Triton block-scaled FP8 grouped GEMMs over the contiguous and masked layouts (moeserve/kernels/fp8_grouped_gemm.py).

A program computes a [BLOCK_M, BLOCK_N] tile of one expert's rows with `block_scaled_tile` (triton_ops/fp8_gemm.py):
- contiguous: program m finds its (expert, tile) from the per-expert tile counts (a prefix sum over E in registers),
  so segments need no padding to the block; the grid is the static bound cdiv(M, BLOCK_M) + min(E, M) and programs
  past the last tile return at once (no host read: CUDA-graph safe). The output starts zeroed (padding rows are 0);
- masked: program m is tile m % tiles of expert m // tiles; tiles at or past masked_m[e] return at once (their
  rows stay unspecified, as the layout allows).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeserve.kernels.fp8_format import BLOCK
from moeserve.kernels.triton_ops.fp8_gemm import DEFAULT_CONFIG, block_scaled_tile


@triton.jit
def _fp8_grouped_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, starts_ptr, counts_ptr, N, K, cap, tiles_per_expert,
                        stride_am, stride_asm, stride_be, stride_bn, stride_bse, stride_bsn, stride_cm,
                        E: tl.constexpr, E_P2: tl.constexpr, MASKED: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr):
    pid_m = tl.program_id(0)
    if MASKED:
        e = pid_m // tiles_per_expert
        tile = pid_m % tiles_per_expert
        start = e * cap
        count = tl.minimum(tl.load(counts_ptr + e), cap)
    else:
        ei = tl.arange(0, E_P2)
        tiles = (tl.load(counts_ptr + ei, mask=ei < E, other=0) + BLOCK_M - 1) // BLOCK_M
        incl = tl.cumsum(tiles, 0)
        e = tl.sum((incl <= pid_m).to(tl.int32), 0)  # the first expert whose tiles reach past pid_m
        tile = pid_m - tl.sum(tl.where(ei < e, tiles, 0), 0)
        e = tl.minimum(e, E - 1)  # programs past the last tile: any expert; `count` below stops them
        start = tl.load(starts_ptr + e)
        count = tl.where(tile < tl.sum(tl.where(ei == e, tiles, 0), 0), tl.load(counts_ptr + e), 0)
    if tile * BLOCK_M >= count:
        return
    local = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = local < count
    rows = (start + local).to(tl.int64)
    cols = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    col_ok = cols < N
    e64 = e.to(tl.int64)
    acc = block_scaled_tile(a_ptr, as_ptr, b_ptr + e64 * stride_be, bs_ptr + e64 * stride_bse, rows, row_ok, cols,
                            col_ok, K, stride_am, stride_asm, stride_bn, stride_bsn, BLOCK_M, BLOCK_N, GROUP)
    c_ptrs = c_ptr + rows[:, None] * stride_cm + cols[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def _launch(xq, x_scale, w, w_scale_inv, out, starts, counts, cap, masked, config):
    cfg = {**DEFAULT_CONFIG, **(config or {})}
    m, k = xq.shape
    e, n = w.shape[0], w.shape[1]
    assert w.shape[2] == k and xq.stride(1) == 1 and w.stride(2) == 1, (xq.shape, w.shape)
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    tiles_per_expert = triton.cdiv(cap, bm) if masked else 0
    num_m = e * tiles_per_expert if masked else triton.cdiv(m, bm) + min(e, m)
    if num_m == 0 or n == 0:
        return out
    _fp8_grouped_kernel[(num_m, triton.cdiv(n, bn))](
        xq, x_scale, w, w_scale_inv, out, starts, counts, n, k, cap, tiles_per_expert,
        xq.stride(0), x_scale.stride(0), w.stride(0), w.stride(1), w_scale_inv.stride(0), w_scale_inv.stride(1),
        out.stride(0), E=e, E_P2=triton.next_power_of_2(e), MASKED=masked, BLOCK_M=bm, BLOCK_N=bn, GROUP=BLOCK,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out


def fp8_grouped_gemm(xq: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale_inv: torch.Tensor,
                     expert_offsets: torch.Tensor, num_tokens_per_expert: torch.Tensor, out_dtype: torch.dtype,
                     config: dict | None = None) -> torch.Tensor:
    """Contiguous layout: xq [M, K] -> [M, N] (padding rows 0); the reference's signature."""
    out = torch.zeros(xq.shape[0], w.shape[1], dtype=out_dtype, device=xq.device)
    return _launch(xq, x_scale.contiguous(), w, w_scale_inv.contiguous(), out, expert_offsets,
                   num_tokens_per_expert, 0, False, config)


def fp8_grouped_gemm_masked(xq: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale_inv: torch.Tensor,
                            masked_m: torch.Tensor, out_dtype: torch.dtype, config: dict | None = None) -> torch.Tensor:
    """Masked layout: xq [E, C, K] -> [E, C, N]; rows past masked_m[e] unspecified. The reference's signature."""
    e, cap, k = xq.shape
    out = torch.empty(e, cap, w.shape[1], dtype=out_dtype, device=xq.device)
    _launch(xq.reshape(e * cap, k), x_scale.reshape(e * cap, -1).contiguous(), w, w_scale_inv.contiguous(),
            out.view(e * cap, -1), masked_m, masked_m, cap, True, config)
    return out
