"""RMSNorm (moeserve/kernels/rms_norm.py: Triton on CUDA, with the residual add fused, and the FP8 quantization of
its output where the layer after it multiplies in FP8)."""

from __future__ import annotations

import torch
from torch import nn

from moeserve.kernels.fp8_quant import QuantizedRows
from moeserve.kernels.rms_norm import rms_norm, rms_norm_quant


class RMSNorm(nn.Module):
    """y = w * x / sqrt(mean(x^2) + eps), statistics in float32 (as transformers and DeepSeek do)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, quantize: bool = False
                ) -> torch.Tensor | QuantizedRows | tuple[torch.Tensor | QuantizedRows, torch.Tensor]:
        """norm(x); with `residual`: (norm(x + residual), x + residual), the add fused into the norm's pass. quantize:
        norm(x) as QuantizedRows (FP8 per token and group of 128), for an FP8 layer that is its only reader."""
        return (rms_norm_quant if quantize else rms_norm)(x, self.weight, self.eps, residual)
