"""LocalDispatcher: the single-rank case, every expert is local and nothing moves between ranks.

dispatch sorts the (token, expert) pairs by expert into a ContiguousLayout; combine gathers each pair's expert
output back and sums a token's k outputs weighted by its top-k weights (applied here, exactly once).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from moeserve.core.layouts import ContiguousLayout
from moeserve.ep.base import Dispatcher

if TYPE_CHECKING:
    from moeserve.core.forward_batch import ForwardBatch


class LocalDispatcher(Dispatcher):
    """Dispatcher for ep_size == 1: every expert is on this rank, nothing moves between ranks."""

    name = "none"
    graph_safe = True

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
        E, align = self.num_experts, self.align
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # pairs grouped by expert, token order kept inside a group
        # scatter_add, not bincount: bincount reads the max id back to the host (a sync; breaks CUDA graphs)
        counts = torch.zeros(E, dtype=torch.int64, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))
        if align == 1:  # no padding: the sorted pairs are the rows, and the fewest ops per layer
            offsets = torch.cat((counts.new_zeros(1), torch.cumsum(counts, 0)))
            self._rows = torch.argsort(order).view(T, k)  # the inverse permutation: row of each pair
            return ContiguousLayout(x=x.index_select(0, order // k), expert_offsets=offsets.to(torch.int32),
                                    num_tokens_per_expert=counts.to(torch.int32))
        padded = (counts + align - 1) // align * align
        offsets = torch.zeros(E + 1, dtype=torch.int64, device=x.device)
        offsets[1:] = torch.cumsum(padded, 0)
        starts = torch.zeros_like(offsets)
        starts[1:] = torch.cumsum(counts, 0)
        sorted_ids = flat[order]
        # row of the j-th sorted pair: its segment start + its rank inside the expert's pairs
        rows_sorted = offsets[sorted_ids] + torch.arange(T * k, device=x.device) - starts[sorted_ids]
        rows = torch.empty_like(rows_sorted)
        rows[order] = rows_sorted
        self._rows = rows.view(T, k)
        # NOTE: sized without reading counts back to the host: T*k pairs plus at most align-1 pad rows per expert.
        num_rows = T * k + E * (align - 1)
        buf = x.new_zeros(num_rows, x.shape[1])
        buf[rows_sorted] = x[order // k]
        return ContiguousLayout(x=buf, expert_offsets=offsets.to(torch.int32),
                                num_tokens_per_expert=counts.to(torch.int32))

    def combine_a(self, expert_out: torch.Tensor) -> None:
        self._out = expert_out

    def combine_b(self) -> torch.Tensor:
        """[T, H] = sum_k w[t, k] * expert_out[row(t, k)], summed in float32, returned in x's dtype."""
        out, rows, w, x = self._out, self._rows, self._weights, self._x
        T, k = rows.shape
        picked = out.index_select(0, rows.reshape(-1)).view(T, k, out.shape[-1]).float()
        y = torch.bmm(w[:, None, :].float(), picked)[:, 0].to(x.dtype)  # [T, 1, k] x [T, k, H]: the weighted sum
        self._reset()
        return y
