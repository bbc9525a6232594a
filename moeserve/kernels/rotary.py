"""The rotary arithmetic: x rotated by its token's angles, as cos/sin rows (layers/rotary.py computes them).

    rotate(x [T, heads, R], rope [T, 2, R] float32, interleaved) -> [T, heads, R] in x's dtype
        = x * cos + partner(x) * sin, in float32; partner swaps a pair's members: neighbours (interleaved,
          DeepSeek-V3) or the two halves (split, Llama / NeoX / V2)

One definition for RotaryEmbedding.apply and the fused MLA kernel's reference (kernels/mla_rope_cache.py), whose
Triton kernel keeps this rounding order.
"""

from __future__ import annotations

import torch


def rotate(x: torch.Tensor, rope: torch.Tensor, interleaved: bool) -> torch.Tensor:
    dtype, (T, heads, dim) = x.dtype, x.shape
    x = x.float()
    if interleaved:
        partner = x.reshape(T, heads, dim // 2, 2).flip(-1).reshape(T, heads, dim)
    else:
        partner = x.reshape(T, heads, 2, dim // 2).flip(-2).reshape(T, heads, dim)
    return (x * rope[:, None, 0] + partner * rope[:, None, 1]).to(dtype)
