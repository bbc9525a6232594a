"""RMSNorm, optionally with the residual add fused in front of it, optionally quantized to FP8 as it is made.

    rms_norm(x [..., D], weight [D], eps)                 -> y = weight * x / sqrt(mean(x^2) + eps)
    rms_norm(x [..., D], weight [D], eps, residual [..., D]) -> (y of h, h) with h = x + residual
    rms_norm_quant(x, weight, eps[, residual])            -> QuantizedRows(quantize_activations(y)) [, h]

Statistics in fp32; x / rms is rounded to x's dtype before the weight multiplies it, as transformers and DeepSeek
do. The Triton kernel (triton_ops/rms_norm.py) reads x (and the residual) once and writes y (and h) once, one
program per row; the reference runs everywhere else. `rms_norm_quant` is for a norm whose only reader is an FP8
GEMM (the attention's first projections): the Triton kernel quantizes y per token in groups of 128 in the same
program (the bits of y rounded to x's dtype, then the recipe), so the GEMM needs no quantizer launch and y is never
stored.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moeserve.kernels import cpu_rms_norm
from moeserve.kernels.fp8_quant import QuantizedRows, quantize_activations_reference
from moeserve.kernels.triton_available import use_triton


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float,
                       residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    h = x if residual is None else x + residual
    # one fused op instead of five: at decode sizes the per-op cost, not the arithmetic, is what counts. On the CPU
    # torch's rms_norm of bf16 upcasts inside and rounds once: the same bits as the upcast here (tests/kernels/
    # test_rms_norm.py), two ops fewer.
    y = weight * (F.rms_norm(h, (h.shape[-1],), eps=eps) if h.is_cpu
                  else F.rms_norm(h.float(), (h.shape[-1],), eps=eps).to(h.dtype))
    return y if residual is None else (y, h)


def _triton_takes(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> bool:
    return (use_triton(x) and not torch.compiler.is_compiling() and x.shape[-1] <= 16384 and weight.dtype == x.dtype
            and (residual is None or residual.dtype == x.dtype))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Module docstring. Triton on CUDA, C++ for bf16 and float32 on the CPU (kernels/cpu_rms_norm.py), the reference elsewhere
    (and under torch.compile)."""
    if cpu_rms_norm.takes(x, weight, residual):
        return cpu_rms_norm.cpu_rms_norm(x, weight, eps, residual)
    if _triton_takes(x, weight, residual):
        from moeserve.kernels.triton_ops.rms_norm import rms_norm as triton_rms_norm

        return triton_rms_norm(x, weight, eps, residual)
    return rms_norm_reference(x, weight, eps, residual)


def rms_norm_quant_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
                             ) -> QuantizedRows | tuple[QuantizedRows, torch.Tensor]:
    """rms_norm_reference's y quantized with the FP8 recipe (kernels/fp8_quant.py): QuantizedRows(q, scale), and h
    with a residual."""
    out = rms_norm_reference(x, weight, eps, residual)
    y, h = out if residual is not None else (out, None)
    q = QuantizedRows(*quantize_activations_reference(y))
    return q if h is None else (q, h)


def rms_norm_quant(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
                   ) -> QuantizedRows | tuple[QuantizedRows, torch.Tensor]:
    """The reference's result; on CUDA one Triton pass (the scales M-major)."""
    if cpu_rms_norm.takes(x, weight, residual):
        return cpu_rms_norm.cpu_rms_norm(x, weight, eps, residual)
    if _triton_takes(x, weight, residual):
        from moeserve.kernels.triton_ops.rms_norm import rms_norm_quant as triton_rms_norm_quant

        q, scale, h = triton_rms_norm_quant(x, weight, eps, residual)
        return QuantizedRows(q, scale) if h is None else (QuantizedRows(q, scale), h)
    return rms_norm_quant_reference(x, weight, eps, residual)
