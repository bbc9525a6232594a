"""The all2all dispatcher, normal mode (prefill): variable sizes, tokens sent once per destination rank.

Like DeepEP's normal kernels over torch.distributed:
1. dispatch_a: each token goes once to every rank that holds at least one of its experts, with its k expert ids
   rewritten to that rank's local ids (-1 where the expert lives elsewhere, weight zeroed). The per-rank counts go
   first (an int64 all_to_all_single, read back on the host: normal mode syncs the host and cannot be captured),
   then the rows and their ids + weights go by all_to_all_single with split sizes, asynchronously.
2. dispatch_b: wait, then sort the received pairs by local expert into a ContiguousLayout (segments padded to
   `align`: 1 on CPU, 128 for DeepGEMM-style grouped GEMMs).
3. combine_a: the owning rank applies the top-k weights and sums each received row's pairs in fp32, casts to x's
   dtype and sends one row back per received row (the reverse all_to_all_single).
4. combine_b: the source sums the rows coming back from every rank in fp32 and casts to x's dtype.
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
    pack_meta,
    plan_contiguous,
    scatter_contiguous,
    token_rank_mask,
    unpack_meta,
)

if TYPE_CHECKING:
    from moeserve.core.forward_batch import ForwardBatch


class NormalDispatcher(Dispatcher):
    """Dispatcher by variable-size all_to_all_single (see the module doc)."""

    name = "all2all"

    def describe(self) -> str:
        return "all2all normal"

    def _reset(self) -> None:
        super()._reset()
        self._num_tokens = 0
        self._send_token: torch.Tensor | None = None  # [S] int64, token of each row sent, rank-major
        self._send_splits: list[int] = []
        self._recv_splits: list[int] = []
        self._recv_x = self._recv_meta = self._back = None
        self._plan: ContiguousPlan | None = None

    def dispatch_a(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                   batch: ForwardBatch | None) -> None:
        """x [T, H] dtype; topk_ids [T, k] int64 physical ids (-1 = none); topk_weights [T, k] fp32."""
        assert x.dtype == self.dtype and x.shape[1] == self.hidden_size, (x.dtype, x.shape)
        t, k = topk_ids.shape
        in_rank = token_rank_mask(topk_ids, self.num_local_experts, self.size)  # [T, R]
        send_counts = in_rank.sum(0)  # [R] int64
        dest_rank, send_token = torch.nonzero(in_rank.T, as_tuple=True)  # rank-major, token order within a rank
        local_ids, weights = local_topk(topk_ids[send_token], topk_weights[send_token], dest_rank[:, None],
                                        self.num_local_experts)
        send_x = x.index_select(0, send_token)
        send_meta = pack_meta(local_ids, weights)  # [S, 2k] int32

        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        counts = torch.stack([send_counts, recv_counts]).tolist()  # the host sync of normal mode
        self._send_splits, self._recv_splits = counts
        num_recv = sum(self._recv_splits)
        self._recv_x = x.new_empty(num_recv, self.hidden_size)
        self._recv_meta = send_meta.new_empty(num_recv, 2 * k)
        splits = {"output_split_sizes": self._recv_splits, "input_split_sizes": self._send_splits}
        self._works = [
            dist.all_to_all_single(self._recv_x, send_x, **splits, group=self.group, async_op=True),
            dist.all_to_all_single(self._recv_meta, send_meta, **splits, group=self.group, async_op=True),
        ]
        self._num_tokens, self._send_token = t, send_token
        self._inflight = (send_x, send_meta)  # alive until the collectives are done
        sent_to_peers = sum(self._send_splits) - self._send_splits[self.rank]
        recv_from_peers = num_recv - self._recv_splits[self.rank]
        row = self.hidden_size * x.element_size()
        self.comm_bytes = {"dispatch": sent_to_peers * (row + 2 * k * 4) + (self.size - 1) * 8,
                           "combine": recv_from_peers * row}

    def dispatch_b(self) -> ContiguousLayout:
        """This rank's received pairs: x [M, H] grouped by local expert, segments padded to align."""
        self._wait()
        local_ids, weights = unpack_meta(self._recv_meta)
        self._plan = plan_contiguous(local_ids, weights, self.num_local_experts, self.align)
        return scatter_contiguous(self._recv_x, self._plan)

    def combine_a(self, expert_out: torch.Tensor) -> None:
        """expert_out [M, H]: unweighted expert outputs in the layout dispatch_b returned."""
        assert self._plan is not None, "combine_a before dispatch_b"
        partial = combine_contiguous(expert_out, self._plan, self._recv_x.shape[0]).to(self.dtype)
        self._back = partial.new_empty(self._send_token.shape[0], self.hidden_size)
        self._inflight = (partial,)
        self._works = [dist.all_to_all_single(self._back, partial, output_split_sizes=self._send_splits,
                                              input_split_sizes=self._recv_splits, group=self.group,
                                              async_op=True)]

    def combine_b(self) -> torch.Tensor:
        """[T, H] in x's dtype: sum_k w_k * expert_k(x_t)."""
        self._wait()
        out = torch.zeros(self._num_tokens, self.hidden_size, dtype=torch.float32, device=self._back.device)
        out.index_add_(0, self._send_token, self._back.float())
        self._reset()
        return out.to(self.dtype)
