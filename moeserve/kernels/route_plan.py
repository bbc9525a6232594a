"""What moe_route returns (moeserve/kernels/moe_route.py), shared by the reference and the Triton kernel."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RoutePlan:
    counts: torch.Tensor  # [E] int32
    offsets: torch.Tensor  # [E + 1] int32
    dest: torch.Tensor  # [T * k] int32
    src: torch.Tensor  # [num_rows] int32
    num_rows: int


def num_layout_rows(num_pairs: int, num_experts: int, align: int) -> int:
    """The static row bound of a layout: every pair plus at most align - 1 padding rows per expert."""
    return num_pairs + num_experts * (align - 1)
