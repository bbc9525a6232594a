"""Triton `moe_route` (moeserve/kernels/moe_route.py): two launches over blocks of pairs, no sort.

1. `_count_kernel`: each program counts its block's pairs per expert into hist[block, :].
2. `_place_kernel`: each program sums the histogram rows (all of them: the totals and so the padded segment starts;
   those of earlier blocks: where its own pairs start inside each segment), ranks its pairs within the block by a
   prefix sum over a one-hot [BLOCK, E] matrix, and writes dest and src. Program 0 writes counts and offsets.
A pair's row is segment start + pairs of that expert in earlier blocks + earlier pairs in its block: the stable
order. Blocks are sized so the one-hot matrix stays at 16K elements (BLOCK * E_P2 <= 2**14).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeserve.kernels.route_plan import RoutePlan, num_layout_rows
from moeserve.kernels.triton_ops.direct_launch import DirectLauncher


@triton.jit
def _count_kernel(ids_ptr, hist_ptr, num_pairs, E: tl.constexpr, E_P2: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1).to(tl.int32)
    e = tl.arange(0, E_P2)
    onehot = (ids[:, None] == e[None, :]).to(tl.int32)  # an id outside [0, E) matches no column below E
    tl.store(hist_ptr + pid * E_P2 + e, tl.sum(onehot, 0))


@triton.jit
def _place_kernel(ids_ptr, hist_ptr, counts_ptr, offsets_ptr, dest_ptr, src_ptr, num_pairs, num_rows, num_blocks,
                  E: tl.constexpr, E_P2: tl.constexpr, ALIGN: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    e = tl.arange(0, E_P2)
    emask = e < E
    total = tl.zeros([E_P2], dtype=tl.int32)
    before = tl.zeros([E_P2], dtype=tl.int32)
    for b in range(0, num_blocks):
        h = tl.load(hist_ptr + b * E_P2 + e)
        total += h
        before += tl.where(b < pid, h, 0)
    total = tl.where(emask, total, 0)
    padded = (total + ALIGN - 1) // ALIGN * ALIGN
    incl = tl.cumsum(padded, 0)
    starts = incl - padded
    if pid == 0:
        tl.store(counts_ptr + e, total, mask=emask)
        tl.store(offsets_ptr + 1 + e, incl, mask=emask)
        tl.store(offsets_ptr + e, 0, mask=e == 0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    in_range = offs < num_pairs
    ids = tl.load(ids_ptr + offs, mask=in_range, other=-1).to(tl.int32)
    onehot = ((ids[:, None] == e[None, :]) & emask[None, :]).to(tl.int32)
    rank = tl.cumsum(onehot, 0) - onehot  # earlier pairs of the same expert in this block
    row = tl.sum(onehot * (starts + before)[None, :] + onehot * rank, 1)
    valid = (ids >= 0) & (ids < E)
    row = tl.where(valid, row, num_rows)
    tl.store(dest_ptr + offs, row, mask=in_range)
    tl.store(src_ptr + row, offs, mask=in_range & valid)


_COUNT = DirectLauncher(_count_kernel)
_PLACE = DirectLauncher(_place_kernel)


def moe_route(topk_ids: torch.Tensor, num_experts: int, align: int = 1, all_valid: bool = False) -> RoutePlan:
    """Same outputs as moeserve.kernels.moe_route.moe_route_reference (all_valid: moe_route's)."""
    assert align >= 1
    flat = topk_ids.reshape(-1)
    num_pairs, device = flat.shape[0], flat.device
    num_rows = num_layout_rows(num_pairs, num_experts, align)
    e_p2 = triton.next_power_of_2(num_experts)
    block = max(16, min(1024, 2**14 // e_p2, triton.next_power_of_2(max(num_pairs, 1))))
    num_blocks = triton.cdiv(num_pairs, block)
    hist = torch.empty(num_blocks, e_p2, dtype=torch.int32, device=device)
    counts = torch.empty(num_experts, dtype=torch.int32, device=device)
    offsets = torch.empty(num_experts + 1, dtype=torch.int32, device=device)
    dest = torch.empty(num_pairs, dtype=torch.int32, device=device)
    if all_valid and align == 1:  # every row gets its pair: nothing to fill (the spare row is never named)
        src = torch.empty(num_rows + 1, dtype=torch.int32, device=device)
    else:
        src = torch.full((num_rows + 1,), -1, dtype=torch.int32, device=device)  # + the spare row invalid pairs name
    if num_pairs:
        _COUNT((num_blocks,), flat, hist, num_pairs, E=num_experts, E_P2=e_p2, BLOCK=block)
        _PLACE((num_blocks,), flat, hist, counts, offsets, dest, src, num_pairs, num_rows, num_blocks,
               E=num_experts, E_P2=e_p2, ALIGN=align, BLOCK=block)
    else:
        counts.zero_()
        offsets.zero_()
    return RoutePlan(counts=counts, offsets=offsets, dest=dest, src=src[:num_rows], num_rows=num_rows)
