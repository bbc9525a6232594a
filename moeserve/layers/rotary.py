"""Rotary position embedding: plain RoPE and YaRN, pairs interleaved (DeepSeek) or split in halves (Llama/NeoX).

The angles are computed from the positions at each step (no table), exactly as transformers does:
angle = position * inv_freq in float32, and cos/sin are scaled by YaRN's attention factor.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from moeserve.core.model_config import RopeConfig
from moeserve.kernels.rotary import rotate


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
    """The rotation of each position (computed once per step, shared by all layers) and its application."""

    def __init__(self, dim: int, rope: RopeConfig):
        super().__init__()
        self.dim = dim
        self.interleaved = rope.interleaved
        inv_freq, self.attention_factor = rope_inv_freq(dim, rope)
        # Per device; a plain attribute, not a buffer: the model is built on 'meta' and cast to the weights' dtype.
        self._inv_freq = {torch.device("cpu"): inv_freq}

    def process_weights_after_loading(self, device: torch.device) -> None:
        """Put the frequencies on the model's device now: a first forward that did it would differ from the
        next ones (under torch.compile, a second graph)."""
        self._inv_freq.setdefault(torch.device(device), self._inv_freq[torch.device("cpu")].to(device))

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        """positions [T] int64 -> rope [T, 2, dim] float32: each token's cos and signed sin, laid out like x.

        Pair (x1, x2) rotated by angle a is (x1 cos a - x2 sin a, x2 cos a + x1 sin a) = x * cos + partner * sin,
        where partner swaps the pair's two members and sin carries the minus on the first one. Interleaved rope
        pairs neighbours (x[2j], x[2j+1]); the other form pairs the halves (x[j], x[j + dim/2])."""
        if positions.device not in self._inv_freq:  # a model the loader did not place (built directly)
            self.process_weights_after_loading(positions.device)
        inv_freq = self._inv_freq[positions.device]
        angles = positions[:, None].float() * inv_freq  # [T, dim/2]
        cos, sin = angles.cos() * self.attention_factor, angles.sin() * self.attention_factor
        pair_dim = -1 if self.interleaved else -2  # where a pair's two members sit in x.view(.., pairs)
        cos2 = torch.stack((cos, cos), dim=pair_dim)
        sin2 = torch.stack((-sin, sin), dim=pair_dim)
        return torch.stack((cos2, sin2), dim=1).flatten(2)  # [T, 2, dim]

    def apply(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        """Rotate x [T, heads, dim] by its token's angles (rope from `forward`); computed in float32."""
        return rotate(x, rope, self.interleaved)
