"""Triton `rms_norm` (moeserve/kernels/rms_norm.py): one program per row, the whole row in registers."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeserve.kernels.triton_ops.direct_launch import DirectLauncher


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, y_ptr, h_ptr, D, eps, stride_x, stride_r, stride_y, stride_h,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
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
    normed = (xf * rstd).to(y_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + cols, (normed * w).to(y_ptr.dtype.element_ty), mask=ok)


_RMS_NORM = DirectLauncher(_rms_norm_kernel)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Same signature as moeserve.kernels.rms_norm.rms_norm_reference."""
    D = x.shape[-1]
    x2 = x.reshape(-1, D)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    h = torch.empty_like(y) if residual is not None else y
    r2 = residual.reshape(-1, D).contiguous() if residual is not None else x2
    if x2.shape[0]:
        block = triton.next_power_of_2(D)
        _RMS_NORM((x2.shape[0],), x2, r2, weight, y, h, D, eps, x2.stride(0), r2.stride(0), y.stride(0),
                  h.stride(0), HAS_RESIDUAL=residual is not None, BLOCK=block,
                  num_warps=max(1, min(16, block // 256)))
    y = y.view(x.shape)
    return y if residual is None else (y, h.view(x.shape))
