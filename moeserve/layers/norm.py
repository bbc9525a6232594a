"""RMSNorm (moeserve/kernels/rms_norm.py: Triton on CUDA, with the residual add fused)."""

from __future__ import annotations

import torch
from torch import nn

from moeserve.kernels.rms_norm import rms_norm


class RMSNorm(nn.Module):
    """y = w * x / sqrt(mean(x^2) + eps), statistics in float32 (as transformers and DeepSeek do)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x); with `residual`: (norm(x + residual), x + residual), the add fused into the norm's pass."""
        return rms_norm(x, self.weight, self.eps, residual)
