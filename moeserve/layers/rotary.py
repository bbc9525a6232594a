"""Rotary position embedding: plain RoPE and YaRN, pairs interleaved (DeepSeek) or split in halves (Llama/NeoX).

The angles are computed from the positions at each step (no table), exactly as transformers does:
angle = position * inv_freq in float32, and cos/sin are scaled by YaRN's attention factor.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from moeserve.models.config import RopeConfig


def rope_inv_freq(dim: int, rope: RopeConfig) -> tuple[torch.Tensor, float]:
    """(inv_freq [dim/2] float32 on CPU, attention_factor) for a rotary dimension `dim`."""
    with torch.device("cpu"):  # NOTE: the model may be built under torch.device("meta"); this must be real
        base = rope.theta
        pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
        if rope.type == "default":
            return 1.0 / pos_freqs, 1.0
        assert rope.type == "yarn", rope.type
        factor = rope.factor
        attention_factor = rope.attention_factor
        if attention_factor is None:
            if rope.mscale and rope.mscale_all_dim:
                attention_factor = _yarn_mscale(factor, rope.mscale) / _yarn_mscale(factor, rope.mscale_all_dim)
            else:
                attention_factor = _yarn_mscale(factor)
        orig = rope.original_max_position_embeddings

        def correction_dim(num_rotations: float) -> float:
            return (dim * math.log(orig / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

        low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
        if rope.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # prevent a division by zero
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        extrapolation = 1 - ramp  # 1: keep the original frequency (high frequencies), 0: interpolate
        inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
        return inv_freq, float(attention_factor)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


class RotaryEmbedding(nn.Module):
    """cos/sin of each position (computed once per step, shared by all layers) and their application."""

    def __init__(self, dim: int, rope: RopeConfig):
        super().__init__()
        self.dim = dim
        self.interleaved = rope.interleaved
        inv_freq, self.attention_factor = rope_inv_freq(dim, rope)
        self._inv_freq = {torch.device("cpu"): inv_freq}  # per device; a plain attribute, not a buffer

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] int64 -> cos, sin [T, dim/2] float32 (attention factor included)."""
        inv_freq = self._inv_freq.get(positions.device)
        if inv_freq is None:
            inv_freq = self._inv_freq[positions.device] = self._inv_freq[torch.device("cpu")].to(positions.device)
        angles = positions[:, None].float() * inv_freq
        return angles.cos() * self.attention_factor, angles.sin() * self.attention_factor

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate x [T, heads, dim] by the angles of its token (cos, sin [T, dim/2]); computed in float32."""
        dtype = x.dtype
        x = x.float()
        cos, sin = cos[:, None, :], sin[:, None, :]
        if self.interleaved:
            x1, x2 = x[..., 0::2], x[..., 1::2]
            out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        else:
            x1, x2 = x.chunk(2, dim=-1)
            out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        return out.to(dtype)
