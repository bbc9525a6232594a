"""Triton per-token-group FP8 quantization of activations (moeserve/kernels/fp8_quant.py has the recipe).

One program quantizes one group of 128 of one row: amax, scale = amax / 448 (floored), q = x / scale in e4m3.
Rows are any leading shape flattened; the last dimension must be contiguous. `silu_and_mul_quantize` first forms
the group from a [gate | up] row: silu(gate) * up, each step rounded to x's dtype as torch's two ops round it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeserve.kernels.fp8_format import ACT_SCALE_FLOOR, BLOCK, FP8_DTYPE, FP8_MAX, num_blocks
from moeserve.kernels.triton_ops.activation import silu_mul


@triton.jit
def _quantize_groups_kernel(x_ptr, q_ptr, s_ptr, K, num_groups, stride_xm, stride_qm, SILU: tl.constexpr,
                            FLOOR: tl.constexpr, QMAX: tl.constexpr, GROUP: tl.constexpr):
    """One group of one row; SILU: the row is [gate | up] (2K wide) and the group is silu(gate) * up."""
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    cols = g * GROUP + tl.arange(0, GROUP)
    ok = cols < K
    v = tl.load(x_ptr + row * stride_xm + cols, mask=ok, other=0.0)
    if SILU:
        v = silu_mul(v, tl.load(x_ptr + row * stride_xm + K + cols, mask=ok, other=0.0))  # in x's dtype
    x = v.to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=0), FLOOR) / QMAX
    q = tl.clamp(x / scale, -QMAX, QMAX)
    tl.store(q_ptr + row * stride_qm + cols, q.to(q_ptr.dtype.element_ty), mask=ok)
    tl.store(s_ptr + row * num_groups + g, scale)


def _quantize(x: torch.Tensor, silu: bool) -> tuple[torch.Tensor, torch.Tensor]:
    k = x.shape[-1] // 2 if silu else x.shape[-1]
    kb = num_blocks(k)
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    q = torch.empty(m, k, dtype=FP8_DTYPE, device=x.device)
    s = torch.empty(m, kb, dtype=torch.float32, device=x.device)
    if m:
        _quantize_groups_kernel[(m, kb)](x2, q, s, k, kb, x2.stride(0), q.stride(0), SILU=silu,
                                         FLOOR=ACT_SCALE_FLOOR, QMAX=FP8_MAX, GROUP=BLOCK)
    return q.view(*x.shape[:-1], k), s.view(*x.shape[:-1], kb)


def silu_and_mul_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., 2I] -> (q [..., I] e4m3, scale [..., ceil(I/128)] float32); the reference's signature."""
    return _quantize(x, silu=True)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (q [..., K] e4m3, scale [..., ceil(K/128)] float32); the reference's signature."""
    return _quantize(x, silu=False)
