"""Tiny collective helpers. With one rank (or no group) every function returns its input untouched."""

from __future__ import annotations

import torch
import torch.distributed as dist


def group_size(group: dist.ProcessGroup | None) -> int:
    if group is None or not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def all_reduce(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum x over the ranks of `group`, in place; a no-op for one rank."""
    if group_size(group) > 1:
        dist.all_reduce(x, group=group)
    return x


def all_gather(x: torch.Tensor, group: dist.ProcessGroup | None, dim: int = 0) -> torch.Tensor:
    """Concatenate x of every rank of `group` along dim (equal shapes); x itself for one rank."""
    n = group_size(group)
    if n == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)
