"""Every routed expert's weights, available to the online rebalancer: phase 1 of EPLB (moeserve/eplb/rebalancer.py).

A rank holds only its experts on the device; a rebalance can hand it any other. `expert_source` returns a function
(moe_index, logical expert) -> the expert's slot tensors as the layer holds them (Experts.expert_slot: (w13 [2I, H],
w2 [H, I]) in the model's dtype, or FP8's e4m3 weights with their block scales), from one of (--eplb-expert-weights):
- memory: every expert read from the checkpoint once, at start-up, into host memory kept once per node: the node's
  first rank writes them into a shared-memory file (/dev/shm) that its other ranks map read-only, and the file is
  unlinked as soon as every rank has mapped it (a dead server leaves none behind): the most host memory and
  start-up time, the fastest prepare phase;
- mmap:   read when needed from the memory-mapped safetensors files (the page cache is shared by the ranks of a
  node): no start-up cost, a prepare phase that reads from disk the first time.
With --load-format dummy there is no checkpoint: an expert is drawn again from the seeded generator that made it
(models/loader.py dummy_tensor) on the experts' device, once at start-up into host memory (memory), or when needed
(mmap: no host copy at all).
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from moeserve.eplb.rebalancer import WEIGHT_SOURCES, ExpertSource
from moeserve.kernels.fp8_quant import FP8_DTYPE
from moeserve.layers.moe.layer import MoE
from moeserve.models.fp8_loading import QuantizingReader, is_scale_key
from moeserve.models.loader import checkpoint_files, dummy_tensor, read_headers
from moeserve.parallel.state import get_parallel_state

logger = logging.getLogger(__name__)
SHM_DIR = Path("/dev/shm")


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
    num_layers, num_experts = len(layers), experts.num_experts
    # one expert's slot tensors, packed as bytes (each at a 64-byte boundary); every expert has the same layout
    layout, per_expert = [], 0
    for t in read(0, 0):
        layout.append((per_expert, t.shape, t.dtype, t.numel() * t.element_size()))
        per_expert += -(-layout[-1][3] // 64) * 64

    def fill(flat: torch.Tensor) -> None:
        for i in range(num_layers):
            for logical in range(num_experts):
                at = (i * num_experts + logical) * per_expert
                for (off, _, _, nbytes), t in zip(layout, read(i, logical), strict=True):
                    flat[at + off:at + off + nbytes].copy_(t.contiguous().reshape(-1).view(torch.uint8))

    flat, ranks_on_node = node_shared_tensor(num_layers * num_experts * per_expert, torch.uint8, fill,
                                             get_parallel_state().world_cpu_group)
    logger.info("EPLB expert weights (--eplb-expert-weights memory): %.2f GiB of host memory per node, one copy "
                "shared by its %d ranks", flat.numel() / 2**30, ranks_on_node)

    def get_slot(i: int, logical: int) -> tuple[torch.Tensor, ...]:
        at = (i * num_experts + logical) * per_expert
        return tuple(flat[at + off:at + off + nbytes].view(dtype).view(shape) for off, shape, dtype, nbytes in layout)
    return get_slot


def node_shared_tensor(numel: int, dtype: torch.dtype, fill: Callable[[torch.Tensor], None],
                       group: dist.ProcessGroup | None) -> tuple[torch.Tensor, int]:
    """A flat host tensor [numel] of `dtype` kept once per node: the node's first rank of `group` (every rank
    calls this) fills it in a /dev/shm file, the others map that file; the file is unlinked once all have mapped
    it, so the memory goes when the last rank exits. Returns (the tensor, ranks of this node sharing it)."""
    if group is None:  # one rank: plain memory
        flat = torch.empty(numel, dtype=dtype)
        fill(flat)
        return flat, 1
    ranks = dist.get_world_size(group)
    hosts: list[tuple[str, str] | None] = [None] * ranks
    dist.all_gather_object(hosts, (socket.gethostname(), uuid.uuid4().hex), group=group)
    me = dist.get_rank(group)
    node = [r for r in range(ranks) if hosts[r][0] == hosts[me][0]]  # type: ignore[index]
    writer = node[0]
    path = SHM_DIR / f"moeserve-experts-{hosts[writer][1]}"  # type: ignore[index]  # the writer's nonce
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    shm = os.statvfs(SHM_DIR)
    if shm.f_bavail * shm.f_frsize < nbytes:  # writing past a full tmpfs would kill the writer with SIGBUS
        raise ValueError(
            f"--eplb-expert-weights memory keeps {nbytes / 2**30:.2f} GiB of experts in {SHM_DIR}, which has "
            f"{shm.f_bavail * shm.f_frsize / 2**30:.2f} GiB free: enlarge it (docker run --shm-size) or pass "
            "--eplb-expert-weights mmap")
    try:
        if me == writer:
            with open(path, "wb") as f:
                f.truncate(nbytes)
            flat = torch.from_file(str(path), shared=True, size=numel, dtype=dtype)
            fill(flat)
        dist.barrier(group=group)  # written
        if me != writer:
            flat = torch.from_file(str(path), shared=True, size=numel, dtype=dtype)
        dist.barrier(group=group)  # mapped everywhere
    finally:
        if me == writer and path.exists():
            os.unlink(path)
    return flat, len(node)


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
