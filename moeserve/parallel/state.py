"""Process groups of this rank: world (= tp), attention TP group, MoE EP group.

A single-process run never initializes torch.distributed: every getter then answers as for one rank, so layers
can always ask `attn_tp_size()` without caring whether a group exists.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist


@dataclass
class ParallelState:
    """This rank's place in the layout. attn groups are contiguous blocks of attn_tp_size ranks."""

    world_size: int = 1
    rank: int = 0
    dp_size: int = 1  # attention DP groups (1 without DP attention)
    attn_tp_size: int = 1
    ep_size: int = 1
    world_group: dist.ProcessGroup | None = None
    attn_tp_group: dist.ProcessGroup | None = None
    ep_group: dist.ProcessGroup | None = None
    # gloo twins for the host-side control collectives (lock-step header, request fan-out) under NCCL
    world_cpu_group: dist.ProcessGroup | None = None
    attn_tp_cpu_group: dist.ProcessGroup | None = None

    @property
    def attn_tp_rank(self) -> int:
        return self.rank % self.attn_tp_size

    @property
    def dp_rank(self) -> int:
        return self.rank // self.attn_tp_size

    @property
    def ep_rank(self) -> int:
        return self.rank if self.ep_size > 1 else 0


_STATE = ParallelState()


def get_parallel_state() -> ParallelState:
    return _STATE


def init_parallel_state(world_size: int, rank: int, dp_size: int, ep_size: int) -> ParallelState:
    """Create the groups (torch.distributed must be initialized on every rank; all ranks call this)."""
    global _STATE
    attn_tp = world_size // dp_size
    world = dist.group.WORLD if world_size > 1 else None
    attn_group = None
    if world_size > 1:
        for g in range(dp_size):  # every rank must create every group, in the same order
            ranks = list(range(g * attn_tp, (g + 1) * attn_tp))
            grp = dist.new_group(ranks) if attn_tp > 1 and attn_tp < world_size else (world if attn_tp > 1 else None)
            if rank in ranks:
                attn_group = grp
    world_cpu = attn_cpu = None
    if world_size > 1:
        world_cpu = dist.new_group(list(range(world_size)), backend="gloo")
        for g in range(dp_size):
            ranks = list(range(g * attn_tp, (g + 1) * attn_tp))
            grp = dist.new_group(ranks, backend="gloo") if attn_tp > 1 else None
            if rank in ranks:
                attn_cpu = grp
    state = ParallelState(
        world_size=world_size, rank=rank, dp_size=dp_size, attn_tp_size=attn_tp, ep_size=ep_size,
        world_group=world, attn_tp_group=attn_group, ep_group=world if ep_size > 1 else None,
        world_cpu_group=world_cpu, attn_tp_cpu_group=attn_cpu)
    _STATE = state
    return state
