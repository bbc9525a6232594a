"""Per-rank expert utilization: how many (token, expert) pairs this rank's experts computed, counted on the device.

The experts add the layout's valid rows per local expert (ContiguousLayout.num_tokens_per_expert or
MaskedLayout.masked_m) of every MoE layer, every forward pass, into one int64 tensor [E_local] on the device: no
host sync per step, and the add is captured into CUDA graphs (the tensor exists before any capture and is only
zeroed in place). `Experts.forward` hands the tensor (`local_tally`) to its first grouped GEMM, whose Triton kernel
adds the counts in its own launch (kernels/moe_gemm.py `tally`: at batch 1 the separate add was 26 launches a
step, about 36 us on an H200); the other expert paths call `record_local_tokens(counts)`. The worker reads it when it
writes its periodic log line (`take()`: one `.tolist()`, then zero).

What is counted: pairs that reached this rank's experts from every rank (after dispatch), summed over MoE layers.
A pair is counted once per layer it passes through, so a step of T tokens with top-k routing adds T * k * (MoE
layers) pairs over all ranks (the low-latency dispatcher merges a token's repeated expert into one pair). Under attention TP every rank of an
attention group dispatches the group's tokens, so the experts compute (and count) each pair attn_tp_size times. Under CUDA
graphs the padding rows of the captured batch size and the capture warm-up passes are counted too.

One counter per process (a rank is a process); none is installed unless the ModelRunner enables it.
"""

from __future__ import annotations

import torch


class LocalExpertTokens:
    """Pairs computed by each local expert since the last `take()`, as an int64 device tensor [E_local]."""

    def __init__(self, num_local_experts: int, device: torch.device | str):
        self.counts = torch.zeros(num_local_experts, dtype=torch.int64, device=device)

    def tally(self, num_local_experts: int, device: torch.device) -> torch.Tensor | None:
        """The counter tensor for a layer of this many local experts on this device, else None: a layer with
        another expert count or on another device is another model's (tests build several in one process)."""
        if num_local_experts == self.counts.shape[0] and torch.device(device) == self.counts.device:
            return self.counts
        return None

    def add(self, counts: torch.Tensor) -> None:
        tally = self.tally(counts.shape[0], counts.device) if counts.dim() == 1 else None
        if tally is not None:
            tally.add_(counts)

    def take(self) -> list[int]:
        """Counts since the last take (a host sync), then reset to zero in place."""
        out = self.counts.tolist()
        self.counts.zero_()
        return out


_counter: LocalExpertTokens | None = None


def enable_local_expert_tokens(num_local_experts: int, device: torch.device | str) -> LocalExpertTokens:
    """Install this process's counter (replacing any previous one) and return it."""
    global _counter
    _counter = LocalExpertTokens(num_local_experts, device)
    return _counter


def local_tally(num_local_experts: int, device: torch.device) -> torch.Tensor | None:
    """The installed counter's tensor for a layer of this many local experts on `device`, or None (none
    installed, or another model's layer): what a kernel adds the counts into."""
    return _counter.tally(num_local_experts, device) if _counter is not None else None


def record_local_tokens(counts: torch.Tensor) -> None:
    """Called by the experts with [E_local] valid rows per local expert; a no-op unless a counter is installed."""
    if _counter is not None:
        _counter.add(counts)
