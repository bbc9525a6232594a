"""The dispatcher every EP backend is: what the MoE layer calls, what the model runner asks, what they share.

A dispatcher moves one MoE layer's (token, expert) pairs to the ranks that hold the experts and the experts' results
back. Each move is split into an issue half and a wait half, so two-batch overlap can run other work while a
collective is in flight:

    dispatch_a(x, topk_ids, topk_weights, batch)   x [T, H]; physical expert ids [T, k] (-1: none); weights [T, k]
    dispatch_b() -> ContiguousLayout | MaskedLayout   this rank's rows, grouped by local expert
    combine_a(expert_out)                             the experts' outputs, in the layout dispatch_b returned
    combine_b() -> [T, H]                             sum_k w_k * expert_k(x_t), in x's dtype

An instance keeps state between its halves, so every MoE layer owns one (and TBO's micro-batch B a second one).
Physical expert e lives on EP rank e // num_local_experts. Backends register by name (moeserve/ep/registry.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.distributed as dist

from moeserve.core.layouts import ContiguousLayout, MaskedLayout
from moeserve.ep.routing import num_local_experts

if TYPE_CHECKING:
    from moeserve.core.forward_batch import ForwardBatch


class Dispatcher(ABC):
    """One MoE layer call site's token movement over the EP group (`ep_size` ranks, this one `ep_rank`)."""

    name: ClassVar[str]  # the --moe-a2a-backend value that selects this backend
    graph_safe: ClassVar[bool] = False  # its decode steps read nothing back to the host: CUDA-graph capturable
    extend_graph_safe: ClassVar[bool] = False  # its extend steps too (piecewise CUDA graphs)
    # Bytes the last step sent to other ranks (benchmarks); a step replaces the dict, never mutates it.
    comm_bytes: dict[str, int] = {"dispatch": 0, "combine": 0}

    def __init__(self, *, num_experts: int, hidden_size: int | None = None, dtype: torch.dtype | None = None,
                 device: torch.device | str = "cpu", ep_group: dist.ProcessGroup | None = None, ep_rank: int = 0,
                 ep_size: int = 1, align: int = 1) -> None:
        """num_experts: physical experts over all EP ranks. hidden_size and dtype size the communication buffers.
        align: rows each expert's segment of a ContiguousLayout is padded to (1 on CPU; 128 for GPU GEMM tiles)."""
        assert 0 <= ep_rank < ep_size and align >= 1
        self.num_experts = num_experts
        self.num_local_experts = num_local_experts(num_experts, ep_size)
        self.hidden_size, self.dtype, self.device = hidden_size, dtype, torch.device(device)
        self.group, self.rank, self.size, self.align = ep_group, ep_rank, ep_size, align
        self._reset()

    def _reset(self) -> None:
        """Drop the state of the step in flight (called at construction and after combine_b). Subclasses add
        their own state and call this."""
        self._works: list[dist.Work] = []  # the collectives in flight
        self._inflight: tuple[torch.Tensor, ...] = ()  # their send buffers, kept alive until they are done

    def _wait(self) -> None:
        """Wait for the collectives in flight."""
        for w in self._works:
            w.wait()

    @abstractmethod
    def dispatch_a(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                   batch: ForwardBatch | None) -> None:
        """Issue: x [T, H] in `dtype`; topk_ids [T, k] int64 physical ids (-1 = none); topk_weights [T, k] fp32."""

    @abstractmethod
    def dispatch_b(self) -> ContiguousLayout | MaskedLayout:
        """Wait: the rows this rank's experts compute."""

    @abstractmethod
    def combine_a(self, expert_out: torch.Tensor) -> None:
        """Issue: expert_out in the layout dispatch_b returned ([M, H] or [E_local, C, H]), unweighted."""

    @abstractmethod
    def combine_b(self) -> torch.Tensor:
        """Wait: [T, H] in x's dtype, sum_k w_k * expert_k(x_t)."""

    def combine_b_plus(self, add: torch.Tensor) -> torch.Tensor:
        """combine_b() + add (the shared experts' [T, H]); a dispatcher whose combine is a local kernel adds it in
        that kernel's pass."""
        return self.combine_b() + add

    def buffer_bytes(self) -> int:
        """Bytes of fixed communication buffers this instance holds (for the memory log line)."""
        return 0

    def describe(self) -> str:
        """One line for the memory log: the backend and its mode."""
        return self.name
