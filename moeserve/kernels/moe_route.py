"""Routing and permutation for the contiguous layout: where each (token, top-k slot) pair goes, without a sort.

    topk_ids [T, k] (expert ids in [0, E), -1 = no expert) -> RoutePlan:
      counts  [E]     int32  valid pairs per expert
      offsets [E + 1] int32  segment starts, each segment padded up to a multiple of `align` rows
      dest    [T * k] int32  layout row of pair p = t * k + j; `num_rows` (one spare row) for a pair with id -1
      src     [num_rows] int32  the pair each layout row holds (-1 for a padding row); src // k is its token

Within an expert's segment pairs keep their (token, slot) order, so the result equals a stable sort by expert
id. `num_rows` is the static bound T * k + E * (align - 1) (no host read: CUDA-graph safe); rows at and past
offsets[E] are padding. The Triton kernel (triton_ops/moe_route.py) counts per expert over blocks of pairs and
places each pair by a prefix sum; `moe_route_reference` computes the same with a stable argsort.
"""

from __future__ import annotations

import torch

from moeserve.kernels.route_plan import RoutePlan, num_layout_rows
from moeserve.kernels.triton_available import use_triton

__all__ = ["RoutePlan", "moe_route", "moe_route_reference", "num_layout_rows"]


def moe_route_reference(topk_ids: torch.Tensor, num_experts: int, align: int = 1) -> RoutePlan:
    """The torch version of `moe_route` (stable argsort), same outputs."""
    assert align >= 1
    flat = topk_ids.reshape(-1).long()
    num_pairs, device = flat.shape[0], flat.device
    num_rows = num_layout_rows(num_pairs, num_experts, align)
    valid = (flat >= 0) & (flat < num_experts)
    key = torch.where(valid, flat, num_experts)  # invalid pairs sort last, into a spare bucket
    order = torch.argsort(key, stable=True)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device).scatter_add_(0, key, torch.ones_like(key))
    counts = counts[:num_experts]
    padded = (counts + align - 1) // align * align
    offsets = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    offsets[1:] = torch.cumsum(padded, 0)
    starts = torch.cumsum(counts, 0) - counts
    sorted_key = key[order]
    bucket = sorted_key.clamp(max=num_experts - 1)
    rank = torch.arange(num_pairs, device=device) - starts[bucket]  # position inside the expert's pairs
    dest_sorted = torch.where(sorted_key < num_experts, offsets[bucket] + rank, num_rows)
    dest = torch.empty_like(dest_sorted)
    dest[order] = dest_sorted
    src = torch.full((num_rows + 1,), -1, dtype=torch.int64, device=device)
    src[dest] = torch.arange(num_pairs, device=device)
    return RoutePlan(counts=counts.to(torch.int32), offsets=offsets.to(torch.int32), dest=dest.to(torch.int32),
                     src=src[:num_rows].to(torch.int32), num_rows=num_rows)


def moe_route(topk_ids: torch.Tensor, num_experts: int, align: int = 1, all_valid: bool = False) -> RoutePlan:
    """topk_ids [T, k] int -> RoutePlan (module docstring). Triton on CUDA, the reference elsewhere.
    all_valid: the caller vouches that every id is in [0, E) (a router's output): with align 1 every layout row
    then holds a pair, and the Triton path skips filling src with -1 first."""
    if use_triton(topk_ids) and topk_ids.numel() > 0 and not torch.compiler.is_compiling():
        from moeserve.kernels.triton_ops.moe_route import moe_route as triton_moe_route

        return triton_moe_route(topk_ids, num_experts, align, all_valid)
    return moe_route_reference(topk_ids, num_experts, align)
