"""Block-scaled FP8 GEMM for linear layers: y = x W^T with W in e4m3 blocks of 128 x 128 and x quantized per token in
groups of 128 on the fly (DeepSeek-V3's recipe, moeserve/kernels/fp8_quant.py).

    fp8_linear(x [..., K], w [N, K] e4m3, w_scale_inv [ceil(N/128), ceil(K/128)])  -> [..., N] in x's dtype
        = fp8_gemm(*quantize_activations(x), w, w_scale_inv, x.dtype)
    fp8_linear(h [..., 2K], w, w_scale_inv, silu=True)   = the same on silu_and_mul(h) (a down projection)

`fp8_gemm` takes the Triton kernel for CUDA tensors (kernels/triton_ops/fp8_gemm.py), else `fp8_gemm_reference`:
dequantize both operands, then one float32 matmul. Same signature, same math (the kernel sums each 128-wide K block
in fp32 and scales it by the two blocks' scales).
"""

from __future__ import annotations

import torch

from moeserve.kernels.fp8_quant import (
    dequantize_activations,
    dequantize_weight,
    quantize_rows_reference,
)
from moeserve.kernels.triton_available import use_triton


def fp8_gemm_reference(xq: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale_inv: torch.Tensor,
                       out_dtype: torch.dtype) -> torch.Tensor:
    """xq [M, K] e4m3, x_scale [M, ceil(K/128)] fp32, w [N, K] e4m3, w_scale_inv [ceil(N/128), ceil(K/128)] fp32
    -> [M, N] in out_dtype."""
    a = dequantize_activations(xq, x_scale)
    return (a @ dequantize_weight(w, w_scale_inv).t()).to(out_dtype)


def fp8_gemm(xq: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale_inv: torch.Tensor,
             out_dtype: torch.dtype) -> torch.Tensor:
    """The reference's signature; the Triton kernel on CUDA."""
    if use_triton(xq):
        from moeserve.kernels.triton_ops.fp8_gemm import fp8_gemm as triton_gemm

        return triton_gemm(xq, x_scale, w, w_scale_inv, out_dtype)
    return fp8_gemm_reference(xq, x_scale, w, w_scale_inv, out_dtype)


def fp8_linear_reference(x: torch.Tensor, w: torch.Tensor, w_scale_inv: torch.Tensor,
                         silu: bool = False) -> torch.Tensor:
    """x [M, K] (silu: [M, 2K], [gate | up], and the product silu(gate) * up is what is multiplied) -> quantized per
    token and group of 128, then `fp8_gemm_reference`: [M, N] in x's dtype."""
    return fp8_gemm_reference(*quantize_rows_reference(x, silu), w, w_scale_inv, x.dtype)


def fp8_linear(x: torch.Tensor, w: torch.Tensor, w_scale_inv: torch.Tensor, silu: bool = False) -> torch.Tensor:
    """x [..., K] (bf16 / fp32; silu: [..., 2K]) -> x W^T [..., N] in x's dtype (silu: silu(gate) * up times W^T);
    x is quantized per token and group of 128. On CUDA the Triton quantizer, then the Triton GEMM
    (triton_ops/fp8_gemm.fp8_linear), else the reference."""
    x2 = x.reshape(-1, x.shape[-1])
    if use_triton(x):
        from moeserve.kernels.triton_ops.fp8_gemm import fp8_linear as triton_linear

        y = triton_linear(x2, w, w_scale_inv, silu)
    else:
        y = fp8_linear_reference(x2, w, w_scale_inv, silu)
    return y.view(*x.shape[:-1], w.shape[0])
