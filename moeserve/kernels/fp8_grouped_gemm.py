"""Block-scaled FP8 grouped GEMMs over the two expert layouts (moeserve/core/layouts.py): each expert's rows times
its own e4m3 weight, activations already quantized per token in groups of 128 (moeserve/kernels/fp8_quant.py).

    contiguous  xq [M, K], x_scale [M, ceil(K/128)], w [E, N, K], w_scale_inv [E, ceil(N/128), ceil(K/128)],
                expert_offsets [E + 1], num_tokens_per_expert [E]                        -> [M, N]
                (rows offsets[e] .. offsets[e] + count[e] times w[e]^T; the reference writes 0 in the others,
                which the Triton kernel leaves unwritten: no combine reads them)
    masked      xq [E, C, K], x_scale [E, C, ceil(K/128)], w, w_scale_inv, masked_m [E]  -> [E, C, N]
                (the first masked_m[e] rows of expert e are meaningful; the rest are unspecified)

Each takes the Triton kernel for CUDA tensors (kernels/triton_ops/fp8_grouped_gemm.py), else the torch reference
beside it with the same signature (dequantize, then a float32 matmul per expert).

`fp8_grouped_gemm_act` and `fp8_grouped_gemm_masked_act` start from the activations instead: the layout's rows
quantized per token in groups of 128 (gathered from the tokens by `pairs`, or silu(gate) * up of [gate | up] rows),
then the GEMM (on CUDA the Triton quantizer, then the Triton GEMM).
"""

from __future__ import annotations

import torch

from moeserve.kernels.fp8_quant import (
    dequantize_activations,
    dequantize_weight,
    quantize_rows_reference,
)
from moeserve.kernels.triton_available import use_triton


def fp8_grouped_gemm_reference(xq: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale_inv: torch.Tensor,
                               expert_offsets: torch.Tensor, num_tokens_per_expert: torch.Tensor,
                               out_dtype: torch.dtype) -> torch.Tensor:
    """Contiguous layout, a loop over experts that touches valid rows only (reads the counts on the host)."""
    out = torch.zeros(xq.shape[0], w.shape[1], dtype=out_dtype, device=xq.device)
    offsets, counts = expert_offsets.tolist(), num_tokens_per_expert.tolist()
    for e, n in enumerate(counts):
        if n:
            rows = slice(offsets[e], offsets[e] + n)
            a = dequantize_activations(xq[rows], x_scale[rows])
            out[rows] = (a @ dequantize_weight(w[e], w_scale_inv[e]).t()).to(out_dtype)
    return out


def fp8_grouped_gemm_masked_reference(xq: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor,
                                      w_scale_inv: torch.Tensor, masked_m: torch.Tensor,
                                      out_dtype: torch.dtype) -> torch.Tensor:
    """Masked layout: every row is computed (static shapes, no host read); rows past masked_m are ignored later."""
    a = dequantize_activations(xq, x_scale)
    return torch.bmm(a, dequantize_weight(w, w_scale_inv).transpose(1, 2)).to(out_dtype)


def fp8_grouped_gemm(xq: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale_inv: torch.Tensor,
                     expert_offsets: torch.Tensor, num_tokens_per_expert: torch.Tensor,
                     out_dtype: torch.dtype) -> torch.Tensor:
    """The contiguous reference's signature; the Triton kernel on CUDA."""
    if use_triton(xq):
        from moeserve.kernels.triton_ops.fp8_grouped_gemm import fp8_grouped_gemm as triton_gemm

        return triton_gemm(xq, x_scale, w, w_scale_inv, expert_offsets, num_tokens_per_expert, out_dtype)
    return fp8_grouped_gemm_reference(xq, x_scale, w, w_scale_inv, expert_offsets, num_tokens_per_expert, out_dtype)


def fp8_grouped_gemm_masked(xq: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale_inv: torch.Tensor,
                            masked_m: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """The masked reference's signature; the Triton kernel on CUDA."""
    if use_triton(xq):
        from moeserve.kernels.triton_ops.fp8_grouped_gemm import fp8_grouped_gemm_masked as triton_masked

        return triton_masked(xq, x_scale, w, w_scale_inv, masked_m, out_dtype)
    return fp8_grouped_gemm_masked_reference(xq, x_scale, w, w_scale_inv, masked_m, out_dtype)


def fp8_grouped_gemm_act(x: torch.Tensor, w: torch.Tensor, w_scale_inv: torch.Tensor, expert_offsets: torch.Tensor,
                         num_tokens_per_expert: torch.Tensor, out_dtype: torch.dtype, pairs: torch.Tensor | None = None,
                         top_k: int = 1, silu: bool = False) -> torch.Tensor:
    """Contiguous layout from the activations: x's rows (with pairs, row r is token pairs[r] // top_k of x, -1 a row
    of zeros; silu: x's rows are [gate | up] and the row is silu(gate) * up), quantized, times each expert's w."""
    if use_triton(x):
        from moeserve.kernels.triton_ops.fp8_grouped_gemm import fp8_grouped_gemm_act as triton_act

        return triton_act(x, w, w_scale_inv, expert_offsets, num_tokens_per_expert, out_dtype, pairs, top_k, silu)
    return fp8_grouped_gemm_reference(*quantize_rows_reference(x, silu, pairs=pairs, top_k=top_k), w, w_scale_inv, expert_offsets,
                                      num_tokens_per_expert, out_dtype)


def fp8_grouped_gemm_masked_act(x: torch.Tensor, w: torch.Tensor, w_scale_inv: torch.Tensor, masked_m: torch.Tensor,
                                out_dtype: torch.dtype, silu: bool = False) -> torch.Tensor:
    """Masked layout from the activations: x [E, C, K] (silu: [E, C, 2K]) quantized, times each expert's w."""
    if use_triton(x):
        from moeserve.kernels.triton_ops.fp8_grouped_gemm import fp8_grouped_gemm_masked_act as triton_act

        return triton_act(x, w, w_scale_inv, masked_m, out_dtype, silu)
    return fp8_grouped_gemm_masked_reference(*quantize_rows_reference(x, silu), w, w_scale_inv, masked_m,
                                             out_dtype)
