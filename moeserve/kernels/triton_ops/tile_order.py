"""Which output tile a program of the grouped GEMMs computes (shared by triton_ops/moe_gemm.py and
triton_ops/fp8_grouped_gemm.py).

- `expert_tile`: program row `pid_m` -> (expert, tile within the expert, the expert's first row, its valid rows)
  over the two layouts. Contiguous: the per-expert tile counts are summed in registers (a prefix sum over E), so
  segments need no padding to BLOCK_M and the grid can be the static bound cdiv(M, BLOCK_M) + min(E, M); programs
  past the last tile get count 0. Masked: pid_m is tile pid_m % tiles of expert pid_m // tiles, rows capped at cap.
  A program whose tile * BLOCK_M >= count has nothing to do (no host read: CUDA-graph safe).
  With TILE_MAP, contiguous programs read their tile from a map `tile_map` wrote before the GEMM ([3, num_m]:
  expert, first row, rows left): one load where the prefix sum is two dependent ones. At prefill sizes a tile's
  lookup is a few percent of its time (the FP8 grouped GEMMs gained 3-4% on an H200); a configuration's
  "TILE_MAP": true picks it (a launch more, so not at decode).
- `grouped_order`: a 1-D program id -> (pid_m, pid_n) in groups of GROUP_M row tiles that sweep every column tile
  before the next group starts, so the programs resident together share their A rows (and an expert's B) in L2.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def expert_tile(pid_m, starts_ptr, counts_ptr, cap, tiles_per_expert, map_ptr, num_m, E: tl.constexpr,
                E_P2: tl.constexpr, MASKED: tl.constexpr, BLOCK_M: tl.constexpr, TILE_MAP: tl.constexpr):
    """-> (e, tile, start, count): int32 scalars; rows start + tile * BLOCK_M + [0, BLOCK_M) of expert e, valid
    below start + count. From a tile map (contiguous), tile is 0, start the tile's first row and count its rows
    left in the segment."""
    if TILE_MAP:
        e = tl.load(map_ptr + pid_m)
        tile = 0
        start = tl.load(map_ptr + num_m + pid_m)
        count = tl.load(map_ptr + 2 * num_m + pid_m)
    elif MASKED:
        e = pid_m // tiles_per_expert
        tile = pid_m % tiles_per_expert
        start = e * cap
        count = tl.minimum(tl.load(counts_ptr + e), cap)
    else:
        ei = tl.arange(0, E_P2)
        tiles = (tl.load(counts_ptr + ei, mask=ei < E, other=0) + BLOCK_M - 1) // BLOCK_M
        incl = tl.cumsum(tiles, 0)
        past = tl.sum((incl <= pid_m).to(tl.int32), 0)  # the first expert whose tiles reach past pid_m (E: none)
        tile = pid_m - tl.sum(tl.where(ei < past, tiles, 0), 0)
        e = tl.minimum(past, E - 1)  # programs past the last tile: any expert; count 0 stops them
        start = tl.load(starts_ptr + e)
        # (past < E: a program past the last tile has a small `tile` counted from the end, which the last expert's
        # own tile count would have let through, redoing that expert's first tiles)
        count = tl.where((past < E) & (tile < tl.sum(tl.where(ei == e, tiles, 0), 0)), tl.load(counts_ptr + e), 0)
    return e, tile, start, count


@triton.jit
def grouped_order(pid, num_m, num_n, GROUP_M: tl.constexpr):
    """-> (pid_m, pid_n) for program `pid` of a num_m x num_n grid, GROUP_M row tiles at a time."""
    width = GROUP_M * num_n
    first_m = (pid // width) * GROUP_M
    size = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % width) % size, (pid % width) // size


@triton.jit
def _tile_map_kernel(starts_ptr, counts_ptr, map_ptr, num_m, E: tl.constexpr, E_P2: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK: tl.constexpr):
    pids = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ei = tl.arange(0, E_P2)
    counts = tl.load(counts_ptr + ei, mask=ei < E, other=0)
    tiles = (counts + BLOCK_M - 1) // BLOCK_M
    incl = tl.cumsum(tiles, 0)
    e = tl.minimum(tl.sum((incl[None, :] <= pids[:, None]).to(tl.int32), 1), E - 1)  # past the last tile: E - 1
    mine = ei[None, :] == e[:, None]
    tile = pids - tl.sum(tl.where(mine, (incl - tiles)[None, :], 0), 1)
    left = tl.sum(tl.where(mine, counts[None, :], 0), 1) - tile * BLOCK_M  # <= 0 past the expert's last tile
    ok = pids < num_m
    tl.store(map_ptr + pids, e, mask=ok)
    tl.store(map_ptr + num_m + pids, tl.load(starts_ptr + e, mask=ok, other=0) + tile * BLOCK_M, mask=ok)
    tl.store(map_ptr + 2 * num_m + pids, tl.maximum(left, 0), mask=ok)


def tile_map(starts: torch.Tensor, counts: torch.Tensor, num_m: int, block_m: int) -> torch.Tensor:
    """int32 [3, num_m] for the contiguous layout's row tiles of block_m rows, in program order: each tile's expert,
    first row and rows left in its segment (0 past the last tile). One launch, no host read."""
    E = counts.shape[0]
    out = torch.empty(3, num_m, dtype=torch.int32, device=counts.device)
    block = max(16, 8192 // triton.next_power_of_2(E))  # [block, E] compares a program
    _tile_map_kernel[(triton.cdiv(num_m, block),)](starts, counts, out, num_m, E=E, E_P2=triton.next_power_of_2(E),
                                                   BLOCK_M=block_m, BLOCK=block)
    return out
