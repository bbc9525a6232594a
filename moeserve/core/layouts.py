"""What a dispatcher hands the experts: this rank's tokens grouped by local expert, in one of two layouts."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ContiguousLayout:
    """Normal mode: tokens for this rank's experts, grouped by local expert, each segment padded to `align` rows."""

    x: torch.Tensor  # [M, H]
    expert_offsets: torch.Tensor  # [E_local + 1] int32, segment starts (segment e is rows offsets[e]:offsets[e+1])
    num_tokens_per_expert: torch.Tensor  # [E_local] int32, valid rows at the start of each segment


@dataclass
class MaskedLayout:
    """Low-latency mode: static shapes, graph-capturable."""

    x: torch.Tensor  # [E_local, cap, H], the activations' dtype, or e4m3 when x_scale is given
    masked_m: torch.Tensor  # [E_local] int32, valid rows per expert
    # FP8 dispatch (low-latency mode with FP8 experts): x's scales [E_local, cap, ceil(H/128)] float32, one per token
    # and group of 128 (moeserve/kernels/fp8_quant.py); None: x is in the activations' dtype.
    x_scale: torch.Tensor | None = None
