"""Triton `put_rows` (moeserve/kernels/put_rows.py): dst[j] = src[index[j]] for j < count, count on the device.

Grid (M, ceil(W / BLOCK)): program (j, c) copies block c of row j, or returns at once when j >= count. Rows may be
strided (a column slice of a wider buffer); the last dimension is contiguous."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # elements a program copies


@triton.jit
def _put_rows_kernel(src_ptr, index_ptr, count_ptr, dst_ptr, W, src_stride, dst_stride,
                     HAS_INDEX: tl.constexpr, BLOCK: tl.constexpr):
    j = tl.program_id(0)
    c = tl.program_id(1)
    n = tl.load(count_ptr)
    if j < n:
        if HAS_INDEX:
            row = tl.load(index_ptr + j).to(tl.int64)
        else:
            row = j.to(tl.int64)
        offs = c * BLOCK + tl.arange(0, BLOCK)
        mask = offs < W
        values = tl.load(src_ptr + row * src_stride + offs, mask=mask)
        tl.store(dst_ptr + j.to(tl.int64) * dst_stride + offs, values, mask=mask)


def put_rows(src: torch.Tensor, index: torch.Tensor | None, count: torch.Tensor, dst: torch.Tensor) -> None:
    assert src.dim() == dst.dim() == 2 and src.stride(-1) == 1 and dst.stride(-1) == 1  # never a copy of dst
    m = dst.shape[0] if index is None else min(index.shape[0], dst.shape[0])
    w = dst.shape[1]
    if m == 0 or w == 0:
        return
    grid = (m, triton.cdiv(w, BLOCK))
    _put_rows_kernel[grid](src, index if index is not None else src, count, dst, w, src.stride(0), dst.stride(0),
                           HAS_INDEX=index is not None, BLOCK=BLOCK)
