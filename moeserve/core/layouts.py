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

    x: torch.Tensor  # [E_local, cap, H]
    masked_m: torch.Tensor  # [E_local] int32, valid rows per expert
