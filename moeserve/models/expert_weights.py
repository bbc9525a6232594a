"""Every routed expert's weights, available to the online rebalancer: phase 1 of EPLB (moeserve/eplb/rebalancer.py).

A rank holds only its experts on the device; a rebalance can hand it any other. `expert_source` returns a function
(moe_index, logical expert) -> the expert's slot tensors as the layer holds them (Experts.expert_slot: (w13 [2I, H],
w2 [H, I]) in the model's dtype, or FP8's e4m3 weights with their block scales), from one of (--eplb-expert-weights):
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
from moeserve.kernels.fp8_quant import FP8_DTYPE
from moeserve.layers.moe.layer import MoE
from moeserve.models.fp8_loading import QuantizingReader, is_scale_key
from moeserve.models.loader import checkpoint_files, dummy_tensor, read_headers


def expert_source(model: nn.Module, model_path: str, load_format: str, mode: str, seed: int) -> ExpertSource:
    """The weight source of `model`'s MoE layers (in model order: moe_index is the position in that order)."""
    if mode not in WEIGHT_SOURCES:
        raise ValueError(f"--eplb-expert-weights must be one of {', '.join(WEIGHT_SOURCES)}, got {mode!r}")
    layers = [(name, m) for name, m in model.named_modules() if isinstance(m, MoE)]
    experts = layers[0][1].experts
    fp8, device = experts.w13.dtype == FP8_DTYPE, experts.w13.device
    inter, hidden = experts.intermediate_size, experts.hidden_size

    def keys(i: int, logical: int) -> tuple[str, str, str]:
        name, moe = layers[i]
        return moe.experts.expert_keys(f"{name}.experts", logical)

    # get(key): a checkpoint tensor; FP8 experts also ask for `weight_scale_inv`, quantized here (the loader's recipe)
    # where the checkpoint has none
    if load_format == "dummy":
        def get(key: str) -> torch.Tensor:
            down = key.split(".")[-2] == experts.checkpoint_names[2]
            return dummy_tensor(key, (hidden, inter) if down else (inter, hidden), torch.float32, device, seed)
        if fp8:
            get = QuantizingReader(get).get
    else:
        reader = _CheckpointReader(Path(model_path))
        get = reader.get
        if fp8 and not any(is_scale_key(k) for k in reader.files):
            get = QuantizingReader(reader.get).get

    def read(i: int, logical: int) -> tuple[torch.Tensor, ...]:
        return layers[i][1].experts.expert_slot(get, keys(i, logical))

    if mode == "mmap":
        return read
    pin = device.type == "cuda"
    table = {}
    for i in range(len(layers)):
        for logical in range(experts.num_experts):
            table[i, logical] = tuple(t.to("cpu", copy=True).pin_memory() if pin else t.to("cpu", copy=True)
                                      for t in read(i, logical))
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
