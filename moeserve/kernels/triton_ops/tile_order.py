"""Which output tile a program of the grouped GEMMs computes (shared by triton_ops/moe_gemm.py and
triton_ops/fp8_grouped_gemm.py).

- `expert_tile`: program row `pid_m` -> (expert, tile within the expert, the expert's first row, its valid rows)
  over the two layouts. Contiguous: the per-expert tile counts are summed in registers (a prefix sum over E), so
  segments need no padding to BLOCK_M and the grid can be the static bound cdiv(M, BLOCK_M) + min(E, M); programs
  past the last tile get count 0. Masked: pid_m is tile pid_m % tiles of expert pid_m // tiles, rows capped at cap.
  A program whose tile * BLOCK_M >= count has nothing to do (no host read: CUDA-graph safe).
- `grouped_order`: a 1-D program id -> (pid_m, pid_n) in groups of GROUP_M row tiles that sweep every column tile
  before the next group starts, so the programs resident together share their A rows (and an expert's B) in L2.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def expert_tile(pid_m, starts_ptr, counts_ptr, cap, tiles_per_expert, E: tl.constexpr, E_P2: tl.constexpr,
                MASKED: tl.constexpr, BLOCK_M: tl.constexpr):
    """-> (e, tile, start, count): int32 scalars; rows start + tile * BLOCK_M + [0, BLOCK_M) of expert e, valid
    below start + count."""
    if MASKED:
        e = pid_m // tiles_per_expert
        tile = pid_m % tiles_per_expert
        start = e * cap
        count = tl.minimum(tl.load(counts_ptr + e), cap)
    else:
        ei = tl.arange(0, E_P2)
        tiles = (tl.load(counts_ptr + ei, mask=ei < E, other=0) + BLOCK_M - 1) // BLOCK_M
        incl = tl.cumsum(tiles, 0)
        e = tl.sum((incl <= pid_m).to(tl.int32), 0)  # the first expert whose tiles reach past pid_m
        tile = pid_m - tl.sum(tl.where(ei < e, tiles, 0), 0)
        e = tl.minimum(e, E - 1)  # programs past the last tile: any expert; count 0 stops them
        start = tl.load(starts_ptr + e)
        count = tl.where(tile < tl.sum(tl.where(ei == e, tiles, 0), 0), tl.load(counts_ptr + e), 0)
    return e, tile, start, count


@triton.jit
def grouped_order(pid, num_m, num_n, GROUP_M: tl.constexpr):
    """-> (pid_m, pid_n) for program `pid` of a num_m x num_n grid, GROUP_M row tiles at a time."""
    width = GROUP_M * num_n
    first_m = (pid // width) * GROUP_M
    size = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % width) % size, (pid % width) // size
