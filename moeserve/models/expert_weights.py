"""Every routed expert's weights, available to the online rebalancer: phase 1 of EPLB (moeserve/eplb/rebalancer.py).

A rank holds only its experts on the device; a rebalance can hand it any other. `expert_source` returns a function
(moe_index, logical expert) -> (w13 [2I, H], w2 [H, I]) in the model's dtype, from one of (--eplb-expert-weights):
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
from moeserve.layers.moe.layer import MoE
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
    num_layers, num_experts = len(layers), experts.num_experts
    per_expert = 3 * inter * hidden  # w13 [2I, H] then w2 [H, I]

    def fill(flat: torch.Tensor) -> None:
        for i in range(num_layers):
            for logical in range(num_experts):
                w13, w2 = read(i, logical)
                at = (i * num_experts + logical) * per_expert
                flat[at:at + 2 * inter * hidden].copy_(w13.reshape(-1))
                flat[at + 2 * inter * hidden:at + per_expert].copy_(w2.reshape(-1))

    flat, ranks_on_node = node_shared_tensor(num_layers * num_experts * per_expert, dtype, fill,
                                             get_parallel_state().world_cpu_group)
    logger.info("EPLB expert weights (--eplb-expert-weights memory): %.2f GiB of host memory per node, one copy "
                "shared by its %d ranks", flat.numel() * flat.element_size() / 2**30, ranks_on_node)

    def get(i: int, logical: int) -> tuple[torch.Tensor, torch.Tensor]:
        at = (i * num_experts + logical) * per_expert
        return (flat[at:at + 2 * inter * hidden].view(2 * inter, hidden),
                flat[at + 2 * inter * hidden:at + per_expert].view(hidden, inter))
    return get


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
