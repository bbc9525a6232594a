"""Triton `moe_combine` (moeserve/kernels/moe_combine.py): one program per (token, block of H columns) reads its
k rows, weights them and sums in fp32. Each layout row is read once and each output row written once."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeserve.kernels.triton_ops.direct_launch import DirectLauncher


@triton.jit
def _combine_kernel(y_ptr, rows_ptr, w_ptr, out_ptr, add_ptr, H, stride_y, stride_out, stride_add,
                    TOPK: tl.constexpr, BLOCK_H: tl.constexpr, HAS_ADD: tl.constexpr):
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    col_ok = cols < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in tl.static_range(TOPK):
        row = tl.load(rows_ptr + t * TOPK + j).to(tl.int64)
        wt = tl.load(w_ptr + t * TOPK + j).to(tl.float32)
        v = tl.load(y_ptr + tl.maximum(row, 0) * stride_y + cols, mask=col_ok, other=0.0)
        acc += tl.where(row >= 0, wt * v.to(tl.float32), 0.0)  # where, not * 0: the row may hold NaN
    if HAS_ADD:
        acc += tl.load(add_ptr + t.to(tl.int64) * stride_add + cols, mask=col_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t.to(tl.int64) * stride_out + cols, acc.to(out_ptr.dtype.element_ty), mask=col_ok)


_COMBINE = DirectLauncher(_combine_kernel)


def moe_combine(y: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor,
                out_dtype: torch.dtype | None = None, add: torch.Tensor | None = None) -> torch.Tensor:
    """Same signature as moeserve.kernels.moe_combine.moe_combine_reference."""
    T, k = rows.shape
    H = y.shape[-1]
    out = torch.empty(T, H, dtype=out_dtype or y.dtype, device=y.device)
    if T == 0:
        return out
    block_h = min(1024, triton.next_power_of_2(H))
    if add is not None:
        assert add.shape == (T, H) and add.stride(-1) == 1, (add.shape, add.stride())
    _COMBINE((T, triton.cdiv(H, block_h)), y, rows.contiguous(), weights.contiguous(), out,
             add if add is not None else out, H, y.stride(0), out.stride(0), add.stride(0) if add is not None else 0,
             TOPK=k, BLOCK_H=block_h, HAS_ADD=add is not None, num_warps=4)
    return out
