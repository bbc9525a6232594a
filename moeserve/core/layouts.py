"""What a dispatcher hands the experts, and the dispatcher interface every EP backend implements."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from moeserve.core.forward_batch import ForwardBatch


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


class Dispatcher(Protocol):
    """Moves tokens to the ranks that hold their experts and the results back. a/b halves: issue, then wait."""

    def dispatch_a(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                   batch: ForwardBatch) -> None:
        """x [T, H]; topk_ids [T, k] int64 physical expert ids; topk_weights [T, k] float32."""

    def dispatch_b(self) -> ContiguousLayout | MaskedLayout: ...

    def combine_a(self, expert_out: torch.Tensor) -> None:
        """expert_out in the layout dispatch_b returned ([M, H] or [E_local, cap, H])."""

    def combine_b(self) -> torch.Tensor:
        """[T, H] = sum_k w_k * expert_k(x_t), in x's dtype."""
