"""One MoE layer (docs/ARCHITECTURE.md, 'One MoE layer'): routed experts spread over the EP ranks, plus shared ones.

    y = sum_{e in topk(x)} w_e(x) E_e(x)  +  S(x)

gate (the model's, router.py) -> physical slots (placement.py) -> dispatch -> this rank's experts -> combine, + S(x).
`forward` runs the stages `dispatch`, `compute`, `combine`; two-batch overlap (moeserve/models/tbo.py) interleaves
them with another micro-batch's. On one CPU rank, few rows per expert (decode) take one kernel: `forward_fused_cpu`.

Tensor-parallel MoE (--ep-size 1 with --tp-size N, no DP attention): every rank holds every expert's I / N rows of
the intermediate dimension (and the shared experts' likewise), runs them on all the tokens (the same on every
rank), and the partial outputs are summed by one all-reduce over the TP group, as a row-parallel linear's are.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from moeserve.core.model_config import ModelConfig
from moeserve.ep.base import Dispatcher
from moeserve.ep.local import LocalDispatcher
from moeserve.ep.registry import DispatchOptions, make_dispatcher
from moeserve.ep.stats import record_local_tokens
from moeserve.eplb.location import ExpertLocation
from moeserve.kernels import cpu_experts
from moeserve.kernels.activation import silu_and_mul
from moeserve.kernels.fp8_quant import quantize_activations
from moeserve.kernels.moe_select import append_slots
from moeserve.layers.mlp import GatedMLP
from moeserve.layers.moe.experts import Experts
from moeserve.layers.moe.placement import LayerPlacement
from moeserve.layers.moe.token_split import TokenSplit
from moeserve.parallel.comm import all_reduce
from moeserve.parallel.state import get_parallel_state

if TYPE_CHECKING:
    from moeserve.core.forward_batch import ForwardBatch


# --enable-shared-experts-fusion: from this many tokens a step (prefill sizes) the fused shared experts run apart, as
# a dense MLP on their slots' weights: every token is one of their rows, and cuBLAS's dense GEMMs measured about 745
# TFLOP/s there against about 500 for the slots inside the grouped GEMM (one H200, V2-Lite, 4 x 2,048 tokens).
SHARED_APART_TOKENS = 512


class ExpertRecorder(Protocol):
    """Receives each MoE layer's chosen logical experts (moeserve/eplb/recorder.py)."""

    def on_select_experts(self, layer_id: int, topk_ids: torch.Tensor) -> None: ...


@dataclass(frozen=True)
class MoEOptions:
    """What an MoE layer takes from the server's flags (moeserve/models/options.py builds it from ServerArgs)."""

    dispatch: DispatchOptions = field(default_factory=DispatchOptions)
    runner_backend: str = "auto"  # --moe-runner-backend: the routed experts' kernels
    num_redundant_experts: int = 0  # --ep-num-redundant-experts: physical slots beyond the logical experts
    placement: ExpertLocation | None = None  # --init-expert-location; None: slot e holds expert e
    two_batch_overlap: bool = False  # --enable-two-batch-overlap: micro-batch B needs a dispatcher of its own
    dynamic_dispatch: bool = False  # --ep-dispatch-algorithm dynamic: each token picks a replica at random
    rebalance: bool = False  # --enable-eplb: the placement changes while serving (maps kept, updated in place)
    fuse_shared_experts: bool = False  # --enable-shared-experts-fusion: shared experts run as always-picked slots


class MoE(nn.Module):
    """Routed experts (expert-parallel) plus optional shared experts (replicated on every rank)."""

    def __init__(self, config: ModelConfig, layer_id: int, gate: nn.Module, options: MoEOptions | None = None,
                 expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")):
        super().__init__()
        options = options or MoEOptions()
        ps = get_parallel_state()
        self.layer_id = layer_id
        self.top_k = config.num_experts_per_tok
        self.gate = gate  # x [T, H] -> (logical topk_ids [T, k] int64, topk_weights [T, k] fp32)
        num_physical = config.num_experts + options.num_redundant_experts
        # NOTE: with DP attention and --ep-size 1 each rank keeps every whole expert for its own DP group's tokens
        self.tp_group = ps.attn_tp_group if ps.ep_size == 1 and ps.dp_size == 1 and ps.world_size > 1 else None
        tp_size, tp_rank = (ps.world_size, ps.rank) if self.tp_group is not None else (1, 0)
        if config.moe_intermediate_size % tp_size:
            raise ValueError(f"a tensor-parallel MoE (--ep-size 1) splits the experts' intermediate size "
                             f"{config.moe_intermediate_size} over --tp-size {tp_size} ranks: it does not divide; "
                             f"use --ep-size {tp_size}")
        if num_physical % ps.ep_size:
            raise ValueError(f"{num_physical} physical experts do not split over ep_size {ps.ep_size}")
        num_local = num_physical // ps.ep_size
        self.placement = LayerPlacement(options.placement, config.moe_layers.index(layer_id), ps.ep_rank,
                                        config.num_experts, options.rebalance, options.dynamic_dispatch)
        first = ps.ep_rank * num_local
        self.experts = Experts(config.hidden_size, config.moe_intermediate_size, config.num_experts,
                               self.placement.slots[first:first + num_local], expert_names,
                               runner_backend=options.runner_backend, tp_size=tp_size, tp_rank=tp_rank)
        self.shared_experts = (
            GatedMLP(config.hidden_size, config.moe_intermediate_size * config.num_shared_experts, tp_size, tp_rank)
            if config.num_shared_experts else None
        )
        # --enable-shared-experts-fusion: at load the shared MLP becomes num_shared_experts more local slots
        # (`_fuse_shared_experts`), which `route` appends to every token's choice with weight 1
        self.shared_ids: torch.Tensor | None = None  # [num_shared] their local slots, once fused
        self.shared_apart_from: int | None = None  # from this many tokens a step they run apart (plain weights)
        self._gate_appends = False  # the gate writes them itself (no slot mapping between): no concatenation
        self.split = TokenSplit(ps)
        self.recorder: ExpertRecorder | None = None
        # Built at load (process_weights_after_loading), when the activations' dtype and device are known; one per
        # micro-batch of two-batch overlap (a dispatcher keeps state between its halves).
        self.dispatchers: tuple[Dispatcher, ...] = ()
        num_shared = config.num_shared_experts if options.fuse_shared_experts else 0
        self._dispatch = (options.dispatch, num_physical, num_local, 2 if options.two_batch_overlap else 1, num_shared)
        self.fused_cpu = False  # forward_fused_cpu runs (one CPU rank, moeserve's kernel): decided at load

    def forward(self, x: torch.Tensor, batch: ForwardBatch | None = None) -> torch.Tensor:
        """x [T, H] -> [T, H]. Runs for T = 0 too: an IDLE rank still joins the dispatch collectives."""
        if self.fused_cpu and cpu_experts.kernel_takes(x.shape[0] * self.top_k, self.experts.num_experts,
                                                       self.experts.cpu_packed):
            return self.forward_fused_cpu(x)
        self.dispatch(x, batch)
        self.compute()
        return self.combine(x)

    # The stages of forward. Between dispatch and compute the dispatch is in flight, between compute and combine
    # the combine. `mb` picks the dispatcher: 0 for micro-batch A of two-batch overlap (and steps without it), 1 for B.
    def dispatch(self, x: torch.Tensor, batch: ForwardBatch | None = None, mb: int = 0) -> None:
        """gate -> physical slots -> dispatch_a, for this rank's share of the tokens."""
        x = self.split.own(x)
        topk_ids, topk_weights = self.route(x)
        self.dispatchers[mb].dispatch_a(x, topk_ids, topk_weights, batch)

    def compute(self, mb: int = 0) -> None:
        """dispatch_b (wait) -> this rank's experts -> combine_a (issue)."""
        d = self.dispatchers[mb]
        d.combine_a(self.experts(d.dispatch_b()))

    def combine(self, x: torch.Tensor, mb: int = 0) -> torch.Tensor:
        """The shared experts (while the combine is in flight), then combine_b (wait) with their sum added (in the
        combine's own kernel where the dispatcher combines locally)."""
        d = self.dispatchers[mb]
        shared = self._shared_out(self.split.own(x))
        y = d.combine_b() if shared is None else d.combine_b_plus(shared)
        return self.split.gather(all_reduce(y, self.tp_group), x.shape[0])

    def forward_fused_cpu(self, x: torch.Tensor) -> torch.Tensor:
        """forward on one CPU rank: routing straight into one kernel call (grouping the pairs by expert, the
        experts, the weighted sum), no dispatcher. For few rows per expert (decode)."""
        topk_ids, topk_weights = self.route(x)
        y, counts = cpu_experts.cpu_moe_local(x, topk_ids, topk_weights, self.experts.w13, self.experts.w2,
                                              self.experts.cpu_packed)
        record_local_tokens(counts[:self.experts.num_local_experts])
        shared = self._shared_out(x)
        return all_reduce(y + shared if shared is not None else y, self.tp_group)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """gate -> (recorder) -> physical slots: (topk_ids [T, k] int64, topk_weights [T, k] fp32)."""
        apart = self._shared_apart(x.shape[0])  # the fused shared experts run apart: not appended
        topk_ids, topk_weights = self.gate(x, append=False) if apart else self.gate(x)  # [T, k] (+ num_shared)
        if self.recorder is not None:  # logical ids: the load EPLB plans from
            self.recorder.on_select_experts(self.layer_id, topk_ids[:, :self.top_k])
        topk_ids = self.placement.to_physical(topk_ids)
        if self.shared_ids is not None and not self._gate_appends and not apart:  # the fused shared experts, weight 1
            topk_ids, topk_weights = append_slots(topk_ids, topk_weights, self.shared_ids)
        return topk_ids, topk_weights

    def _shared_apart(self, num_tokens: int) -> bool:
        """The fused shared experts run apart (not routed) this step: a step of prefill size (SHARED_APART_TOKENS)."""
        return self.shared_apart_from is not None and num_tokens >= self.shared_apart_from

    def _shared_out(self, x: torch.Tensor) -> torch.Tensor | None:
        """The shared experts' output for x, where it is not routed: the unfused MLP, or the fused slots as a dense
        MLP on their weights (sum_j down_j (silu(gate_j x) * up_j x), as the grouped GEMM computes them)."""
        if self.shared_experts is not None:
            return self.shared_experts(x)
        if not self._shared_apart(x.shape[0]):
            return None
        ex = self.experts
        if ex.cpu_packed is not None:  # packed slots: every token goes to each fused slot, one kernel call
            first, n, T = ex.num_local_experts, ex.w13.shape[0] - ex.num_local_experts, x.shape[0]
            counts = torch.zeros(ex.w13.shape[0], dtype=torch.int32)
            counts[first:] = T
            offsets = torch.cat((counts.new_zeros(1), counts.cumsum(0, dtype=torch.int32)))
            rows = cpu_experts.cpu_experts(x.repeat(n, 1), ex.w13, ex.w2, offsets, counts, ex.cpu_packed)
            return rows.view(n, T, -1).sum(0, dtype=torch.float32).to(x.dtype)
        y = None
        for j in range(self.experts.num_local_experts, self.experts.w13.shape[0]):
            h = silu_and_mul(torch.nn.functional.linear(x, self.experts.w13[j]))
            y = torch.nn.functional.linear(h, self.experts.w2[j]) if y is None else y.addmm_(h, self.experts.w2[j].t())
        return y

    def recorded_rows(self, num_tokens: int) -> int:
        """Rows this layer reported to its recorder in a pass of num_tokens tokens (its share of them with the
        attention-TP token split; none where another rank of the group reports)."""
        rows = self.split.rows(num_tokens)
        return rows.stop - rows.start if self.recorder is not None else 0

    def set_recorder(self, recorder: ExpertRecorder | None) -> None:
        """Report the chosen experts to `recorder` (None: stop). Ranks of an attention group that route the same
        tokens (no token split) leave it to the group's first rank, so the server's sum counts each token once."""
        self.recorder = recorder if self.split.active or self.split.rank == 0 else None

    # ------------------------------------------------------------------ what the online rebalancer moves
    def slot_weights(self) -> tuple[torch.Tensor, ...]:
        """This rank's expert slots, the experts' slot_params in order: (w13 [E_local, 2I, H], w2 [E_local, H, I]; on
        a CPU that runs them packed, their packed forms), or FP8's (w13, w13_scale_inv, w2, w2_scale_inv)."""
        return tuple(getattr(self.experts, name).data for name in self.experts.slot_params)

    def set_placement(self, location: ExpertLocation, moe_index: int) -> None:
        """Take this layer's row of `location` into the maps, in place (CUDA graphs keep reading them); the slots
        were swapped just before (the experts refresh what they derive from them)."""
        self.experts.slots_changed()
        self.placement.update(location)
        first, n = self.placement.ep_rank * self.experts.num_local_experts, self.experts.num_local_experts
        self.experts.expert_ids = location.physical_to_logical_map[moe_index, first:first + n].tolist()

    def process_weights_after_loading(self, device: torch.device) -> None:
        """Build the dispatchers for the activations (the experts' dtype) on `device`, buffers allocated now."""
        self.placement.to(device)
        options, num_physical, num_local, count, num_shared = self._dispatch
        if num_shared:
            self._fuse_shared_experts(num_shared, device)
        cfg = self.experts
        self.dispatchers = tuple(
            make_dispatcher(options, num_physical + num_shared, num_local + num_shared,
                            dtype=cfg.activation_dtype, device=device, hidden_size=cfg.hidden_size,
                            top_k=self.top_k + num_shared,
                            fp8_quantize=quantize_activations if cfg.takes_fp8 else None) for _ in range(count))
        # The experts' load hook ran first (the loader runs children before parents): use_cpu_kernel is decided.
        self.fused_cpu = (self.experts.use_cpu_kernel and isinstance(self.dispatchers[0], LocalDispatcher)
                          and not self.split.active)

    def _fuse_shared_experts(self, n: int, device: torch.device) -> None:
        """The shared MLP (intermediate n * I) as n experts of intermediate I after this rank's routed slots:
        sum_j down_j (silu(gate_j x) * up_j x) over its column blocks j is the MLP, exactly."""
        first = self.experts.add_slots(self.shared_experts.expert_slots(n))
        self.shared_ids = torch.arange(first, first + n, device=device)
        self.shared_experts = None
        if not self.experts.takes_fp8:  # (FP8 slots stay in the grouped GEMM at every size)
            self.shared_apart_from = SHARED_APART_TOKENS
        if self.placement.identity and hasattr(self.gate, "append"):
            self.gate.append, self._gate_appends = (first, n), True
