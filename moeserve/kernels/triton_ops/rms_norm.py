"""Triton `rms_norm` and `rms_norm_quant` (moeserve/kernels/rms_norm.py): one program per row, the whole row in
registers. With QUANT the normed row (rounded to the activations' dtype, as the plain kernel stores it) is quantized
in the same program, per group of 128 as the FP8 recipe says (triton_ops/fp8_quant.py `quantize_groups`): the
row's e4m3 values and its scales are stored instead of the row, so the FP8 GEMM after the norm needs no quantizer
launch of its own and the normed row never reaches memory.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeserve.kernels.fp8_format import ACT_SCALE_FLOOR, FP8_DTYPE, FP8_MAX, num_blocks
from moeserve.kernels.fp8_format import BLOCK as GROUP_SIZE
from moeserve.kernels.triton_ops.direct_launch import DirectLauncher
from moeserve.kernels.triton_ops.fp8_quant import quantize_groups


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, y_ptr, h_ptr, s_ptr, D, eps, stride_x, stride_r, stride_y, stride_h,
                     stride_sm, stride_sg, HAS_RESIDUAL: tl.constexpr, QUANT: tl.constexpr, BLOCK: tl.constexpr,
                     GROUP: tl.constexpr, FLOOR: tl.constexpr, QMAX: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < D
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        x = (x.to(tl.float32) + tl.load(res_ptr + row * stride_r + cols, mask=ok, other=0.0).to(tl.float32))
        x = x.to(h_ptr.dtype.element_ty)  # h in the activations' dtype, as the unfused add leaves it
        tl.store(h_ptr + row * stride_h + cols, x, mask=ok)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / D + eps)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    normed = (xf * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    y = (normed * w).to(x_ptr.dtype.element_ty)  # zeros past D
    if QUANT:  # y_ptr: the e4m3 row, s_ptr its scales
        q, scale = quantize_groups(tl.reshape(y, (BLOCK // GROUP, GROUP)), FLOOR, QMAX)
        tl.store(y_ptr + row * stride_y + cols, tl.reshape(q, (BLOCK,)).to(y_ptr.dtype.element_ty), mask=ok)
        g = tl.arange(0, BLOCK // GROUP)
        tl.store(s_ptr + row * stride_sm + g * stride_sg, scale, mask=g * GROUP < D)
    else:
        tl.store(y_ptr + row * stride_y + cols, y, mask=ok)


_RMS_NORM = DirectLauncher(_rms_norm_kernel)


def _launch(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None, quant: bool):
    """(y, h, s) as [rows, D]: y the normed rows in x's dtype, or their e4m3 values with quant (s their scales,
    stored M-major [groups, rows], the layout the FP8 GEMMs read best; else None); h = x + residual (else y)."""
    D = x.shape[-1]
    x2 = x.reshape(-1, D)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    y = torch.empty(x2.shape, dtype=FP8_DTYPE if quant else x.dtype, device=x.device)
    s = torch.empty(num_blocks(D), rows, dtype=torch.float32, device=x.device).t() if quant else None
    h = torch.empty(x2.shape, dtype=x.dtype, device=x.device) if residual is not None else y
    r2 = residual.reshape(-1, D).contiguous() if residual is not None else x2
    if rows:
        block = max(triton.next_power_of_2(D), GROUP_SIZE if quant else 1)
        _RMS_NORM((rows,), x2, r2, weight, y, h, y if s is None else s, D, eps, x2.stride(0), r2.stride(0),
                  y.stride(0), h.stride(0), 0 if s is None else s.stride(0), 0 if s is None else s.stride(1),
                  HAS_RESIDUAL=residual is not None, QUANT=quant, BLOCK=block, GROUP=GROUP_SIZE,
                  FLOOR=ACT_SCALE_FLOOR, QMAX=FP8_MAX, num_warps=max(1, min(16, block // 256)))
    return y, h, s


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Same signature as moeserve.kernels.rms_norm.rms_norm_reference."""
    y, h, _ = _launch(x, weight, eps, residual, quant=False)
    y = y.view(x.shape)
    return y if residual is None else (y, h.view(x.shape))


def rms_norm_quant(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """moeserve.kernels.rms_norm.rms_norm_quant_reference's values as (q [..., D] e4m3, scale [..., groups] float32,
    M-major, h or None without a residual)."""
    q, h, s = _launch(x, weight, eps, residual, quant=True)
    return q.view(x.shape), s.view(*x.shape[:-1], s.shape[-1]), None if residual is None else h.view(x.shape)
