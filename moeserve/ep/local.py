"""LocalDispatcher: the single-rank case, every expert is local and nothing moves between ranks.

dispatch groups the (token, expert) pairs by expert into a ContiguousLayout (moeserve/kernels/moe_route.py: one
counting pass, no sort, on CUDA) that names each row's token instead of copying it; combine gathers each pair's expert output back and sums a token's k outputs
weighted by its top-k weights (applied here, exactly once; moeserve/kernels/moe_combine.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from moeserve.core.layouts import ContiguousLayout
from moeserve.ep.base import Dispatcher
from moeserve.kernels.moe_combine import moe_combine
from moeserve.kernels.moe_route import moe_route

if TYPE_CHECKING:
    from moeserve.core.forward_batch import ForwardBatch


class LocalDispatcher(Dispatcher):
    """Dispatcher for ep_size == 1: every expert is on this rank, nothing moves between ranks."""

    name = "none"
    graph_safe = extend_graph_safe = True

    def __init__(self, num_experts: int, align: int = 1, **common) -> None:
        super().__init__(num_experts=num_experts, align=align, **common)

    def _reset(self) -> None:
        super()._reset()
        self._x: torch.Tensor | None = None
        self._ids: torch.Tensor | None = None
        self._weights: torch.Tensor | None = None
        self._rows: torch.Tensor | None = None  # [T, k] row of each (token, expert) pair in the layout
        self._out: torch.Tensor | None = None

    def dispatch_a(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                   batch: ForwardBatch | None = None) -> None:
        """x [T, H]; topk_ids [T, k] int64 in [0, num_experts); topk_weights [T, k] float32."""
        self._x, self._ids, self._weights = x, topk_ids, topk_weights

    def dispatch_b(self) -> ContiguousLayout:
        x, ids = self._x, self._ids
        T, k = ids.shape
        # counts, offsets and each pair's row in one routing pass (Triton on CUDA: no sort; torch elsewhere)
        plan = moe_route(ids, self.num_experts, self.align, all_valid=True)  # the router's ids (and fused slots)
        self._rows = plan.dest.view(T, k)
        # the rows stay named, not copied: the first grouped GEMM reads them from x (align 1: no padding rows)
        return ContiguousLayout(x=x, expert_offsets=plan.offsets, num_tokens_per_expert=plan.counts, pairs=plan.src,
                                top_k=k, padded=self.align > 1)

    def combine_a(self, expert_out: torch.Tensor) -> None:
        self._out = expert_out

    def combine_b(self) -> torch.Tensor:
        return self._combine(None)

    def combine_b_plus(self, add: torch.Tensor) -> torch.Tensor:
        return self._combine(add)

    def _combine(self, add: torch.Tensor | None) -> torch.Tensor:
        """[T, H] = sum_k w[t, k] * expert_out[row(t, k)] (+ add), summed in float32, returned in x's dtype."""
        y = moe_combine(self._out, self._rows, self._weights, self._x.dtype, add=add)
        self._reset()
        return y
