"""The all2all backend as the MoE layer sees it: normal, low-latency, or `auto` (choose per step, as SGLang does).

--deepep-mode normal runs every step through the normal dispatcher (variable sizes, a host sync: prefill),
low_latency through the low-latency one (static shapes: decode, CUDA graphs), auto picks per step: normal when any
rank prefills, low-latency otherwise. Each mode's dispatcher is built only where the mode can be picked.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from moeserve.core.layouts import ContiguousLayout, MaskedLayout
from moeserve.ep.all2all_low_latency import FP8Quantize, LowLatencyDispatcher
from moeserve.ep.all2all_normal import NormalDispatcher
from moeserve.ep.base import Dispatcher

if TYPE_CHECKING:
    from moeserve.core.forward_batch import ForwardBatch

DEEPEP_MODES = ("auto", "normal", "low_latency")


def resolve_deepep_mode(mode: str, batch: ForwardBatch | None) -> str:
    """'normal' or 'low_latency' for this step. `auto` picks normal when any rank prefills this step
    (`batch.any_extend`, the OR over ranks from the lock-step header), so every rank resolves the same way."""
    if mode not in DEEPEP_MODES:
        raise ValueError(f"--deepep-mode must be one of {', '.join(DEEPEP_MODES)}, got {mode!r}")
    if mode != "auto":
        return mode
    return "normal" if batch is not None and batch.any_extend else "low_latency"


class All2AllDispatcher(Dispatcher):
    """`--moe-a2a-backend all2all`: delegates each step to the mode `deepep_mode` resolves to."""

    name = "all2all"
    low_latency_cls: type[LowLatencyDispatcher] = LowLatencyDispatcher  # the decode transport

    def __init__(self, *, topk: int, deepep_mode: str = "auto", max_tokens_per_rank: int = 128,
                 fp8_quantize: FP8Quantize | None = None, **common) -> None:
        """`common`: the Dispatcher arguments (num_experts, hidden_size, dtype, device, ep_group, ep_rank,
        ep_size, align); align applies to normal mode's layout. fp8_quantize: low-latency mode sends FP8 (FP8
        experts; see all2all_low_latency.py); normal mode sends x's dtype."""
        resolve_deepep_mode(deepep_mode, None)  # validates the name
        super().__init__(**common)
        self.deepep_mode = deepep_mode
        align = common.pop("align", 1)
        self.normal = NormalDispatcher(**common, align=align) if deepep_mode != "low_latency" else None
        self.low_latency = (self.low_latency_cls(**common, topk=topk, max_tokens_per_rank=max_tokens_per_rank,
                                                 fp8_quantize=fp8_quantize)
                            if deepep_mode != "normal" else None)
        self.last_mode: str | None = None  # the mode the last dispatch_a resolved to

    def _reset(self) -> None:
        super()._reset()
        self._active: NormalDispatcher | LowLatencyDispatcher | None = None

    @property
    def graph_safe(self) -> bool:  # decode steps resolve to low-latency unless the mode is normal
        return self.deepep_mode != "normal"

    @property
    def extend_graph_safe(self) -> bool:  # extend steps resolve to normal (split counts read back) unless low_latency
        return self.deepep_mode == "low_latency"

    def buffer_bytes(self) -> int:
        """Bytes of fixed communication buffers (the low-latency ones; normal mode allocates per step)."""
        return self.low_latency.buffer_bytes() if self.low_latency is not None else 0

    def describe(self) -> str:
        ll = self.low_latency
        return f"{self.name} {self.deepep_mode}" + (f", low-latency slots of {ll.cap} tokens x {ll.size} ranks"
                                                    if ll is not None else "")

    @property
    def comm_bytes(self) -> dict[str, int]:
        return self._active.comm_bytes if self._active is not None else {"dispatch": 0, "combine": 0}

    def dispatch_a(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                   batch: ForwardBatch | None) -> None:
        self.last_mode = resolve_deepep_mode(self.deepep_mode, batch)
        self._active = self.normal if self.last_mode == "normal" else self.low_latency
        self._active.dispatch_a(x, topk_ids, topk_weights, batch)

    def dispatch_b(self) -> ContiguousLayout | MaskedLayout:
        return self._active.dispatch_b()

    def combine_a(self, expert_out: torch.Tensor) -> None:
        self._active.combine_a(expert_out)

    def combine_b(self) -> torch.Tensor:
        return self._active.combine_b()
