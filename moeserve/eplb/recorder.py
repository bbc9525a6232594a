"""The expert-distribution recorder (--expert-distribution-recorder-mode stat): how many tokens each MoE layer
routed to each logical expert, for `moeserve eplb` and --init-expert-location.

Every MoE layer reports its chosen logical experts (MoE._route, before the logical-to-physical map); the recorder
adds them into one int64 tensor [MoE layers, experts] on the device: no host sync, and the add is captured into
CUDA graphs (the tensor exists before any capture and is never replaced). So the counter always runs, and
recording is a window over it: start remembers the counts, stop freezes the difference, dump reads the window.
A rank counts the tokens it routes; the server sums the ranks (attention-TP ranks that route the same tokens
count them once: only the group's first rank reports them).

The dump (the server's dump_expert_distribution) is a .pt file with `logical_count` [1, layers, experts], the
format `moeserve eplb` and ExpertLocation.load read (SGLang's stat dump has the same key), written under
`expert_distribution_dir()` unless the offline Engine gives a path.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from moeserve.paths import cache_root


def expert_distribution_dir() -> Path:
    """Where the server writes dumps: $MOESERVE_CACHE/expert_distribution (see moeserve/paths.py)."""
    return cache_root() / "expert_distribution"


class ExpertDistributionRecorder:
    """Counts of every (MoE layer, logical expert) on one rank since start-up, and the recording window."""

    def __init__(self, moe_layers: Sequence[int], num_experts: int, device: torch.device | str):
        self.layer_index = {layer: i for i, layer in enumerate(moe_layers)}
        self.counts = torch.zeros(len(moe_layers), num_experts, dtype=torch.int64, device=device)
        self._start: torch.Tensor | None = None  # counts when recording started; None when not recording
        self._window: torch.Tensor | None = None  # the last stopped window

    def on_select_experts(self, layer_id: int, topk_ids: torch.Tensor) -> None:
        i = self.layer_index.get(layer_id)
        if i is None or topk_ids.device != self.counts.device:  # another model's layer (tests build several)
            return
        ids = topk_ids.reshape(-1)
        self.counts[i].scatter_add_(0, ids, torch.ones_like(ids))

    def start(self) -> None:
        """Begin a new window (a window in progress is dropped)."""
        self._start, self._window = self.counts.clone(), None

    def stop(self) -> None:
        if self._start is not None:
            self._window, self._start = self.counts - self._start, None

    def window(self) -> torch.Tensor:
        """[layers, experts] int64 on the CPU: the window in progress, else the last stopped one, else zeros."""
        if self._start is not None:
            return (self.counts - self._start).cpu()
        return self._window.cpu() if self._window is not None else torch.zeros_like(self.counts, device="cpu")
