"""What the Gluon grouped GEMMs (fp8_grouped_wgmma.py, moe_gemm_wgmma.py) share: the persistent walk over an MoE
layout's tiles, the store of a tile from the MMA's registers, and the TMA load's name across Triton versions.

A persistent program walks tiles t = pid, pid + programs, ... of the num_m x num_n grid in grouped-M order
(triton_ops/tile_order.grouped_order, restated here: Gluon cannot call Triton's @triton.jit helpers) and finds each
tile's rows: contiguous, from the tile map (`tile_order.tile_map`: expert, first row, rows left) where the
configuration says "TILE_MAP", else from the experts' counts summed in registers; masked, tile t of expert e at rows
e * cap + t * BLOCK_M, masked_m[e] valid.
"""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import tma

# Triton 3.6 (the GPU machine's) names the TMA load async_copy_global_to_shared; later versions (CI's) async_load.
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared


@gluon.constexpr_function
def store_threads(block_n, columns_first=False):
    """threads_per_warp of the store layout: 8 columns (16 bytes of bf16) a thread, a warp across the tile's width
    ([columns, rows] where the tile holds c's columns along dim 0)."""
    across = min(block_n // 8, 32)
    return [across, 32 // across] if columns_first else [32 // across, across]


@gluon.jit
def add(a, b):
    return a + b


@gluon.jit
def tile_of(pid_m, starts_ptr, counts_ptr, E: gl.constexpr, E_P2: gl.constexpr, BLOCK_M: gl.constexpr,
            num_warps: gl.constexpr):
    """Contiguous layout without a map: (expert, first row, rows left) of row tile pid_m, from the experts' tile
    counts summed in registers (triton_ops/tile_order.expert_tile); rows left <= 0 past the last tile."""
    lay: gl.constexpr = gl.BlockedLayout(size_per_thread=[1], threads_per_warp=[32], warps_per_cta=[num_warps],
                                         order=[0])
    ei = gl.arange(0, E_P2, layout=lay)
    counts = gl.load(counts_ptr + ei, mask=ei < E, other=0)
    tiles = (counts + BLOCK_M - 1) // BLOCK_M
    incl = gl.associative_scan(tiles, 0, add)
    # (gl.reduce with a combine of ours, not gl.sum: Triton's standard library is interpreted under TRITON_INTERPRET)
    past = gl.reduce((incl <= pid_m).to(gl.int32), 0, add)  # the first expert whose tiles reach past pid_m
    tile = pid_m - gl.reduce(gl.where(ei < past, tiles, 0), 0, add)
    e = gl.minimum(past, E - 1)
    count = gl.reduce(gl.where(ei == e, counts, 0), 0, add)
    # past < E: past the last tile, `tile` counts from the end and would redo the last expert's first tiles
    mine = (past < E) & (tile < gl.reduce(gl.where(ei == e, tiles, 0), 0, add))
    left = gl.where(mine, count - tile * BLOCK_M, 0)
    return e, gl.load(starts_ptr + e) + tile * BLOCK_M, left


@gluon.jit
def tile(t, starts_ptr, counts_ptr, map_ptr, cap, tiles_per_expert, num_m, num_n, E: gl.constexpr,
         E_P2: gl.constexpr, MASKED: gl.constexpr, TILE_MAP: gl.constexpr, BLOCK_M: gl.constexpr,
         GROUP_M: gl.constexpr):
    """Tile t of the num_m x num_n grid in grouped-M order -> (expert, its first row, rows left (<= 0: nothing to
    do), column tile)."""
    width = GROUP_M * num_n
    first_m = (t // width) * GROUP_M
    size = gl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (t % width) % size
    pid_n = (t % width) // size
    if MASKED:
        e = pid_m // tiles_per_expert
        tile = pid_m % tiles_per_expert
        row0 = e * cap + tile * BLOCK_M
        left = gl.minimum(gl.load(counts_ptr + e), cap) - tile * BLOCK_M
    elif TILE_MAP:
        e = gl.load(map_ptr + pid_m)
        row0 = gl.load(map_ptr + num_m + pid_m)
        left = gl.load(map_ptr + 2 * num_m + pid_m)
    else:
        e, row0, left = tile_of(pid_m, starts_ptr, counts_ptr, E, E_P2, BLOCK_M, gl.num_warps())
    return e, row0, left, pid_n


@gluon.jit
def store_tile(c_ptr, acc, row0, left, n0, N, stride_cm, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
               SWAP: gl.constexpr, num_warps: gl.constexpr):
    """c[row0 + r, n0 + c] for the tile's rows below left and columns below N, 16 bytes a thread along c's rows
    (acc [BLOCK_M, BLOCK_N] in any layout; with SWAP [BLOCK_N, BLOCK_M], c's columns along dim 0)."""
    if SWAP:
        out: gl.constexpr = gl.BlockedLayout(size_per_thread=[8, 1], threads_per_warp=store_threads(BLOCK_N, True),
                                             warps_per_cta=[1, num_warps], order=[0, 1])
        res = gl.convert_layout(acc.to(c_ptr.dtype.element_ty), out)
        c = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, out))
        r = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, out))
        ptrs = c_ptr + (row0 + r).to(gl.int64)[None, :] * stride_cm + (n0 + c)[:, None]
        gl.store(ptrs, res, mask=(r < left)[None, :] & (c < N - n0)[:, None])
    else:
        out: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=store_threads(BLOCK_N),
                                             warps_per_cta=[num_warps, 1], order=[1, 0])
        res = gl.convert_layout(acc.to(c_ptr.dtype.element_ty), out)
        r = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, out))
        c = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, out))
        ptrs = c_ptr + (row0 + r).to(gl.int64)[:, None] * stride_cm + (n0 + c)[None, :]
        gl.store(ptrs, res, mask=(r < left)[:, None] & (c < N - n0)[None, :])


@functools.cache
def sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count
