"""The allgather dispatcher: every rank sees every token, runs its own experts, a reduce-scatter brings results home.

The simple oracle for the all2all modes. Each rank pads its tokens to `t_max`, the largest token count over the EP
ranks (from the lock-step header, so no extra sync), and all-gathers rows [R * t_max, H] plus their global expert
ids and weights. A rank keeps the pairs whose experts it holds (ContiguousLayout), applies the top-k weights to its
experts' outputs, and every rank's partial sums [R * t_max, H] (fp32) are reduce-scattered: rank r keeps rows
r * t_max : r * t_max + T_r.

Weights are applied on the rank that owns the expert, before the reduce-scatter; the reduction runs in fp32 (this
is the oracle: 2x the combine bytes of x's dtype, no rounding between ranks), then the result is cast to x's dtype.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from moeserve.core.layouts import ContiguousLayout
from moeserve.ep.base import Dispatcher
from moeserve.ep.routing import (
    ContiguousPlan,
    combine_contiguous,
    local_topk,
    max_tokens_over_ranks,
    pack_meta,
    plan_contiguous,
    scatter_contiguous,
    unpack_meta,
)

if TYPE_CHECKING:
    from moeserve.core.forward_batch import ForwardBatch

# torch 2.13 deprecates the *_tensor names for *_single; older torch (the GPU image's 2.11) has only the former.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class AllGatherDispatcher(Dispatcher):
    """Dispatcher by all-gather and reduce-scatter (see the module doc)."""

    name = "allgather"

    def _reset(self) -> None:
        super()._reset()
        self._num_tokens = self._t_max = 0
        self._recv_x = self._recv_meta = self._out = None
        self._plan: ContiguousPlan | None = None

    def dispatch_a(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                   batch: ForwardBatch | None) -> None:
        """x [T, H] dtype; topk_ids [T, k] int64 physical ids (-1 = none); topk_weights [T, k] fp32."""
        assert x.dtype == self.dtype and x.shape[1] == self.hidden_size, (x.dtype, x.shape)
        t, k = topk_ids.shape
        t_max = max_tokens_over_ranks(batch, t, self.group, self.device)
        send_x = x.new_zeros(t_max, self.hidden_size)
        send_x[:t] = x
        send_meta = pack_meta(torch.full((t_max, k), -1, dtype=torch.int64, device=x.device),
                              torch.zeros(t_max, k, device=x.device))
        send_meta[:t] = pack_meta(topk_ids, topk_weights)
        self._recv_x = x.new_empty(self.size * t_max, self.hidden_size)
        self._recv_meta = send_meta.new_empty(self.size * t_max, 2 * k)
        self._works = [_all_gather(self._recv_x, send_x, group=self.group, async_op=True),
                       _all_gather(self._recv_meta, send_meta, group=self.group, async_op=True)]
        self._num_tokens, self._t_max = t, t_max
        self._inflight = (send_x, send_meta)  # alive until the collectives are done
        peers = self.size - 1
        self.comm_bytes = {"dispatch": peers * (send_x.nbytes + send_meta.nbytes),
                           "combine": peers * t_max * self.hidden_size * 4}

    def dispatch_b(self) -> ContiguousLayout:
        """This rank's experts' pairs from all ranks: x [M, H] grouped by local expert, segments padded to align."""
        self._wait()
        ids, weights = unpack_meta(self._recv_meta)
        local_ids, weights = local_topk(ids, weights, self.rank, self.num_local_experts)
        self._plan = plan_contiguous(local_ids, weights, self.num_local_experts, self.align)
        return scatter_contiguous(self._recv_x, self._plan)

    def combine_a(self, expert_out: torch.Tensor) -> None:
        """expert_out [M, H]: unweighted expert outputs in the layout dispatch_b returned."""
        assert self._plan is not None, "combine_a before dispatch_b"
        partial = combine_contiguous(expert_out, self._plan, self.size * self._t_max)  # fp32, weights applied
        self._out = partial.new_empty(self._t_max, self.hidden_size)
        self._works = [_reduce_scatter(self._out, partial, group=self.group, async_op=True)]
        self._inflight = (partial,)

    def combine_b(self) -> torch.Tensor:
        """[T, H] in x's dtype: sum_k w_k * expert_k(x_t)."""
        self._wait()
        out = self._out[: self._num_tokens].to(self.dtype)
        self._reset()
        return out
