"""RMSNorm, optionally with the residual add fused in front of it.

    rms_norm(x [..., D], weight [D], eps)                 -> y = weight * x / sqrt(mean(x^2) + eps)
    rms_norm(x [..., D], weight [D], eps, residual [..., D]) -> (y of h, h) with h = x + residual

Statistics in fp32; x / rms is rounded to x's dtype before the weight multiplies it, as transformers and DeepSeek
do. The Triton kernel (triton_ops/rms_norm.py) reads x (and the residual) once and writes y (and h) once, one
program per row; the reference runs everywhere else.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moeserve.kernels.triton_available import use_triton


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float,
                       residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    h = x if residual is None else x + residual
    # one fused op instead of five: at decode sizes the per-op cost, not the arithmetic, is what counts
    y = weight * F.rms_norm(h.float(), (h.shape[-1],), eps=eps).to(h.dtype)
    return y if residual is None else (y, h)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Module docstring. Triton on CUDA, the reference elsewhere (and under torch.compile)."""
    if (use_triton(x) and not torch.compiler.is_compiling() and x.shape[-1] <= 16384 and weight.dtype == x.dtype
            and (residual is None or residual.dtype == x.dtype)):
        from moeserve.kernels.triton_ops.rms_norm import rms_norm as triton_rms_norm

        return triton_rms_norm(x, weight, eps, residual)
    return rms_norm_reference(x, weight, eps, residual)
