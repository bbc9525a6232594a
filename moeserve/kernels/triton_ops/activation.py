"""Triton `silu_and_mul` (moeserve/kernels/activation.py): grid (rows, column blocks); a program loads a block of
the gate and the same block of the up half of one row, and writes silu(gate) * up, rounded as torch's two ops."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeserve.kernels.triton_ops.direct_launch import DirectLauncher

BLOCK = 1024


@triton.jit
def silu_mul(gate, up):
    """silu(gate) * up in up's dtype, rounded as torch's two ops round it: silu in fp32, rounded to the dtype,
    then the product. (Also the FP8 quantizer's SiLU-and-mul input, triton_ops/fp8_quant.py.)"""
    gf = gate.to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(up.dtype)
    return (act.to(tl.float32) * up.to(tl.float32)).to(up.dtype)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, inter, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=ok, other=0.0)
    tl.store(out_ptr + row * stride_o + cols, silu_mul(gate, up).to(out_ptr.dtype.element_ty), mask=ok)


_KERNEL = DirectLauncher(_silu_and_mul_kernel)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Same signature as moeserve.kernels.activation.silu_and_mul_reference."""
    two_i = x.shape[-1]
    if two_i % 2:
        raise ValueError(f"silu_and_mul: the last dimension ({two_i}) is not [gate | up]")
    x2 = x.reshape(-1, two_i)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    inter = two_i // 2
    out = torch.empty(x2.shape[0], inter, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        block = min(BLOCK, max(16, triton.next_power_of_2(inter)))
        _KERNEL((x2.shape[0], triton.cdiv(inter, block)), x2, out, inter, x2.stride(0), out.stride(0), BLOCK=block,
                num_warps=4)
    return out.view(*x.shape[:-1], inter)
