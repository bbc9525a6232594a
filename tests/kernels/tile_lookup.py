"""A Triton kernel that runs `expert_tile`'s contiguous lookup for every program of a grid and writes what each got
(test_moe_gemm.py). A module of its own: a @triton.jit function finds the helpers it calls among its module's
globals, and the tests import kernel modules only once conftest.py has chosen the interpreter."""

from __future__ import annotations

import triton
import triton.language as tl

from moeserve.kernels.triton_ops.tile_order import expert_tile


@triton.jit
def lookup_kernel(starts_ptr, counts_ptr, out_ptr, E: tl.constexpr, E_P2: tl.constexpr, BLOCK_M: tl.constexpr):
    """out[pid] = (expert, first row of the tile, rows left in the segment (0: nothing to do))."""
    pid = tl.program_id(0)
    e, tile, start, count = expert_tile(pid, starts_ptr, counts_ptr, 0, 0, counts_ptr, 0, E, E_P2, False, BLOCK_M,
                                        False)
    tl.store(out_ptr + pid * 3, e)
    tl.store(out_ptr + pid * 3 + 1, start + tile * BLOCK_M)
    tl.store(out_ptr + pid * 3 + 2, tl.maximum(count - tile * BLOCK_M, 0))
