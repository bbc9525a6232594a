"""Every routed expert's weights, available to the online rebalancer: phase 1 of EPLB (moeserve/eplb/rebalancer.py).

A rank holds only its experts on the device; a rebalance can hand it any other. `expert_source` returns a function
(moe_index, logical expert) -> (w13 [2I, H], w2 [H, I]) in the model's dtype, from one of (--eplb-expert-weights):
- memory: every expert read from the checkpoint once, at start-up, into host memory (pinned on CUDA, so the
  upload is asynchronous): the most host memory and start-up time, the fastest prepare phase;
- mmap:   read when needed from the memory-mapped safetensors files (the page cache is shared by the ranks of a
  node): no start-up cost, a prepare phase that reads from disk the first time.
With --load-format dummy there is no checkpoint: an expert is drawn again from the seeded generator that made it
(models/loader.py dummy_tensor) on the experts' device, once at start-up into host memory (memory), or when needed
(mmap: no host copy at all).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from moeserve.eplb.rebalancer import WEIGHT_SOURCES, ExpertSource
from moeserve.layers.moe.layer import MoE
from moeserve.models.loader import checkpoint_files, dummy_tensor, read_headers


def expert_source(model: nn.Module, model_path: str, load_format: str, mode: str, seed: int) -> ExpertSource:
    """The weight source of `model`'s MoE layers (in model order: moe_index is the position in that order)."""
    if mode not in WEIGHT_SOURCES:
        raise ValueError(f"--eplb-expert-weights must be one of {', '.join(WEIGHT_SOURCES)}, got {mode!r}")
    layers = [(name, m) for name, m in model.named_modules() if isinstance(m, MoE)]
    experts = layers[0][1].experts
    dtype, device = experts.w13.dtype, experts.w13.device
    inter, hidden = experts.intermediate_size, experts.hidden_size

    def keys(i: int, logical: int) -> tuple[str, str, str]:
        name, moe = layers[i]
        return moe.experts.expert_keys(f"{name}.experts", logical)

    if load_format == "dummy":
        def read(i: int, logical: int) -> tuple[torch.Tensor, torch.Tensor]:
            gate, up, down = (dummy_tensor(k, s, dtype, device, seed) for k, s in
                              zip(keys(i, logical), ((inter, hidden), (inter, hidden), (hidden, inter)), strict=True))
            return torch.cat([gate, up]), down
    else:
        reader = _CheckpointReader(Path(model_path))

        def read(i: int, logical: int) -> tuple[torch.Tensor, torch.Tensor]:
            gate, up, down = (reader.get(k).to(dtype) for k in keys(i, logical))
            return torch.cat([gate, up]), down

    if mode == "mmap":
        return read
    pin = device.type == "cuda"
    table = {}
    for i in range(len(layers)):
        for logical in range(experts.num_experts):
            w13, w2 = (t.to("cpu", copy=True) for t in read(i, logical))
            table[i, logical] = (w13.pin_memory(), w2.pin_memory()) if pin else (w13, w2)
    return lambda i, logical: table[i, logical]


class _CheckpointReader:
    """Tensors of a safetensors checkpoint by key, each file opened (memory-mapped) once."""

    def __init__(self, path: Path):
        self.files = {key: file for key, (file, _, _) in read_headers(checkpoint_files(path)).items()}
        self._open: dict[Path, object] = {}

    def get(self, key: str) -> torch.Tensor:
        from safetensors import safe_open

        file = self.files[key]
        if file not in self._open:
            self._open[file] = safe_open(str(file), framework="pt")
        return self._open[file].get_tensor(key)
