"""One MoE layer (DESIGN.md 'One MoE layer'):

    hidden [T, H] -> gate (fp32 logits) -> select_experts -> (recorder) -> logical to physical -> dispatch
                  -> experts -> combine + shared_experts(hidden)

The layer holds this rank's experts [ep_rank * E_local, (ep_rank + 1) * E_local) of the physical expert list;
the placement (placement.py) says which logical expert each physical slot holds and, where it is not the
identity (redundant experts, --init-expert-location), which slot a token routed to logical expert e goes to.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from moeserve.core.model_config import ModelConfig
from moeserve.ep import make_dispatcher
from moeserve.ep.local import LocalDispatcher
from moeserve.ep.stats import record_local_tokens
from moeserve.kernels import cpu_experts
from moeserve.layers.mlp import GatedMLP
from moeserve.layers.moe.experts import Experts
from moeserve.layers.moe.placement import layer_placement
from moeserve.layers.moe.router import Router, select_experts
from moeserve.parallel.comm import all_gather
from moeserve.parallel.state import get_parallel_state

if TYPE_CHECKING:
    from moeserve.args import ServerArgs
    from moeserve.core.forward_batch import ForwardBatch


class ExpertRecorder(Protocol):
    def on_select_experts(self, layer_id: int, topk_ids: torch.Tensor) -> None: ...


_recorder: ExpertRecorder | None = None


def set_expert_recorder(recorder: ExpertRecorder | None) -> None:
    """Install (or remove, with None) the object every MoE layer reports its chosen experts to."""
    global _recorder
    _recorder = recorder


class MoE(nn.Module):
    """Routed experts (expert-parallel) plus optional shared experts (replicated)."""

    def __init__(self, config: ModelConfig, layer_id: int, server_args: ServerArgs | None = None,
                 expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")):
        super().__init__()
        ps = get_parallel_state()
        self.layer_id = layer_id
        self.top_k = config.num_experts_per_tok
        self.num_experts = config.num_experts
        self.scoring_func = config.scoring_func
        self.topk_method = config.topk_method
        self.n_group, self.topk_group = config.n_group, config.topk_group
        self.renormalize = config.norm_topk_prob
        self.routed_scaling_factor = config.routed_scaling_factor

        redundant = server_args.ep_num_redundant_experts if server_args is not None else 0
        num_physical = config.num_experts + redundant
        if num_physical % ps.ep_size:
            raise ValueError(f"{num_physical} physical experts do not split over ep_size {ps.ep_size}")
        num_local = num_physical // ps.ep_size
        physical_to_logical, self.dispatch_table = layer_placement(config, server_args, layer_id, ps.ep_size,
                                                                   ps.ep_rank)
        first = ps.ep_rank * num_local
        local_ids = list(physical_to_logical[first:first + num_local])

        self.gate = Router(config.hidden_size, config.num_experts, correction_bias=config.topk_method == "noaux_tc")
        self.experts = Experts(config.hidden_size, config.moe_intermediate_size, config.num_experts, local_ids,
                               expert_names,
                               runner_backend=server_args.moe_runner_backend if server_args is not None else "auto")
        self.shared_experts = (
            GatedMLP(config.hidden_size, config.moe_intermediate_size * config.num_shared_experts)
            if config.num_shared_experts else None
        )
        def dispatcher():
            return make_dispatcher(server_args if server_args is not None else "none", num_physical, num_local,
                                   hidden_size=config.hidden_size, top_k=self.top_k)

        self.dispatcher = dispatcher()
        # Two-batch overlap: micro-batch B needs its own dispatcher (each keeps state between its a and b halves);
        # micro-batch A uses `dispatcher`, like a step without overlap.
        tbo = server_args is not None and getattr(server_args, "enable_two_batch_overlap", False)
        self.dispatchers = (self.dispatcher, dispatcher()) if tbo else (self.dispatcher,)
        # Attention TP + EP: the ranks of an attention group hold the same tokens, so each sends only its share
        # through the dispatcher and the group all-gathers the results (else every pair is computed tp times).
        self.attn_tp_size, self.attn_tp_rank, self.attn_tp_group = ps.attn_tp_size, ps.attn_tp_rank, ps.attn_tp_group
        self.split_tokens = ps.attn_tp_size > 1 and ps.ep_size > 1

    def forward(self, x: torch.Tensor, batch: ForwardBatch | Any = None) -> torch.Tensor:
        """x [T, H] -> [T, H]. Runs even for T = 0 (an IDLE rank still joins the dispatch collectives)."""
        if self._one_rank_cpu_kernel and x.shape[0] * self.top_k <= cpu_experts.MAX_ROWS_PER_EXPERT * self.num_experts:
            # every expert local and few rows each (decode): routing straight into one kernel call, no dispatcher
            topk_ids, topk_weights = self._route(x)
            y, counts = cpu_experts.cpu_moe_local(x, topk_ids, topk_weights, self.experts.w13, self.experts.w2)
            record_local_tokens(counts)
            return self._add_shared(x, y)
        self.op_dispatch_a(x, batch)
        self.op_experts()
        return self.op_combine(x)

    @property
    def _one_rank_cpu_kernel(self) -> bool:
        return self.experts.use_cpu_kernel and isinstance(self.dispatcher, LocalDispatcher) and not self.split_tokens

    def _route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """gate -> select_experts -> (recorder) -> physical ids: (topk_ids [T, k] int64, topk_weights [T, k])."""
        topk_ids, topk_weights = select_experts(
            self.gate(x), self.top_k, scoring_func=self.scoring_func, topk_method=self.topk_method,
            n_group=self.n_group, topk_group=self.topk_group, correction_bias=self.gate.e_score_correction_bias,
            renormalize=self.renormalize, routed_scaling_factor=self.routed_scaling_factor,
        )
        if _recorder is not None and (self.split_tokens or self.attn_tp_rank == 0):
            # logical ids, the load EPLB plans from; ranks of an attention group that route the same tokens
            # (no split) leave them to the group's first rank
            _recorder.on_select_experts(self.layer_id, topk_ids)
        if self.dispatch_table is not None:
            topk_ids = self.dispatch_table.index_select(0, topk_ids.reshape(-1)).view_as(topk_ids)
        return topk_ids, topk_weights

    # The same computation as stages, for two-batch overlap (moeserve/models/tbo.py). `mb` picks the dispatcher
    # (0: micro-batch A or no overlap, 1: micro-batch B). Between op_dispatch_a and op_experts the dispatch is in
    # flight; between op_experts and op_combine the combine is.
    def op_dispatch_a(self, x: torch.Tensor, batch: ForwardBatch | Any = None, mb: int = 0) -> None:
        """_route -> dispatch_a, on this rank's share of the tokens."""
        x = self._own_tokens(x)
        topk_ids, topk_weights = self._route(x)
        self.dispatchers[mb].dispatch_a(x, topk_ids, topk_weights, batch)

    def op_experts(self, mb: int = 0) -> None:
        """dispatch_b (wait) -> experts -> combine_a (issue)."""
        d = self.dispatchers[mb]
        d.combine_a(self.experts(d.dispatch_b()))

    def op_combine(self, x: torch.Tensor, mb: int = 0) -> torch.Tensor:
        """Shared experts (while the combine is in flight), then combine_b (wait) and the sum."""
        return self._add_shared(x, None, mb)

    def _add_shared(self, x: torch.Tensor, routed: torch.Tensor | None, mb: int = 0) -> torch.Tensor:
        """routed (or the dispatcher's combine_b, waited for after the shared experts ran) + shared_experts(x)."""
        num_tokens = x.shape[0]
        x = self._own_tokens(x)
        shared = self.shared_experts(x) if self.shared_experts is not None else None
        y = self.dispatchers[mb].combine_b() if routed is None else routed
        y = y + shared if shared is not None else y
        return self._gather_tokens(y, num_tokens) if self.split_tokens else y

    def process_weights_after_loading(self, device: torch.device) -> None:
        if self.dispatch_table is not None:
            self.dispatch_table = self.dispatch_table.to(device)

    def _own_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of the attention group's tokens (all of them without the split)."""
        if not self.split_tokens:
            return x
        chunk = -(-x.shape[0] // self.attn_tp_size)
        return x[self.attn_tp_rank * chunk : (self.attn_tp_rank + 1) * chunk]

    def _gather_tokens(self, y: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """[own share, H] on each rank of the group -> [num_tokens, H] on all of them."""
        if num_tokens == 0:  # the whole group is idle together (its ranks run the same batch)
            return y
        chunk = -(-num_tokens // self.attn_tp_size)
        if y.shape[0] < chunk:
            y = torch.cat([y, y.new_zeros(chunk - y.shape[0], y.shape[1])])
        return all_gather(y, self.attn_tp_group)[:num_tokens]
