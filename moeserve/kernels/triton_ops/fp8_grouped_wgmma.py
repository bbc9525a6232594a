"""The block-scaled FP8 grouped GEMM written with Gluon (Triton's explicit layer over Hopper's warpgroup MMA),
warp-specialized (moeserve/kernels/fp8_grouped_gemm.py sends a shape here where its tuned table says "WGMMA": true).

Why a second kernel: each 128-wide K step's product is scaled (a's row scales times b's block scale) before it is
added to the fp32 accumulator, so the MMA must be waited for every step. In the Triton kernel (triton_ops/
fp8_gemm.py) the whole program waits, and the tensor cores idle while its warps scale and add. Keeping one step's
MMA in flight while the previous product is scaled, in one warpgroup, made ptxas serialize the MMAs (its warning
C7514: registers of an MMA in flight read, by the copies a loop-carried product needs), measured 25-30% slower on an
H200. So, as DeepSeek's DeepGEMM does, a program here is three partitions: one producer warp issues the TMA reads
of a ([rows, K] e4m3) and b ([E * N, K] e4m3) into STAGES shared-memory slots (a "ready" barrier each, and an
"empty" one the consumers release); two consumer warpgroups each own 64 rows of the MMA's M side, wait for their own
product, release the slot, and scale and add while the other warpgroup's MMA runs. The scales are loaded two steps
ahead of their use.

A program computes a [BLOCK_M, BLOCK_N] tile of one expert's rows: BLOCK_M 128 (64 a warpgroup), BLOCK_N 64 or 128
(one b scale a K step). Row tiles, in grouped-M order: contiguous, from the tile map (`tile_order.tile_map`:
expert, first row, rows left) where the configuration says "TILE_MAP" and always in the plain form (`map_tiles`),
else from the experts' counts summed in registers (no launch more: decode); masked, tile t of expert e at rows
e * cap + t * BLOCK_M, masked_m[e] valid. Rows past the segment are read (other experts' rows or zeros) and not
stored.

"PAIRS" (decode; BLOCK_M 64): each warpgroup owns a whole tile of 64 rows, the two warpgroups two tiles at once
(tiles t and t + programs of the persistent walk), each with its own half of the slots, which the producer fills by
turns (a step of warpgroup 0's tile, then one of 1's). So the two MMAs in flight read different slots, a slot
carries 64 rows of a (at decode mostly other experts' rows) where the plain form's carries 128, and more stages fit:
more of the weights' bytes in flight an SM. A warpgroup reads its half in order, as a pipeline's one consumer does
(one shared ring, with a warpgroup idle while the other had a tile alone, would have had it wait on a slot a whole
round ahead of the producer, whose barrier's parity reads as already complete).

"SWAP_AB" (decode): the product is computed as b . a^T, the weights' 128 rows (BLOCK_N) on the MMA's M side, 64 a
warpgroup, and an expert's few rows on its N side (BLOCK_M of 16 to 64): a tile no longer pads an expert's ~24 rows
to 64, and its accumulators are small; the tile is stored transposed.

Gluon has no interpreter: on CPU the kernel is compiled for sm_90 (tests/kernels/test_fp8_wgmma.py); on a
GPU it is checked against the torch reference like the Triton kernel.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from moeserve.kernels.fp8_format import BLOCK
from moeserve.kernels.triton_ops.gluon_tiles import sm_count, store_tile, tile, tma_load
from moeserve.kernels.triton_ops.tile_order import tile_map


@gluon.jit
def _scales(as_ptrs, bs_ptr, row_ok, kb, stride_ask, SWAP: gl.constexpr):
    """K step kb's row scales of a ([BLOCK_M], in the accumulator's row layout) and b's block scale: a copy for
    each of a thread's rows (a scalar load is moved to a uniform register right after it, waiting for it there),
    except with SWAP, where a thread holds many of a's rows (a scalar, the registers are short there)."""
    a = gl.load(as_ptrs + kb * stride_ask, mask=row_ok, other=0.0)
    if SWAP:
        b = gl.load(bs_ptr + kb)
    else:
        b = gl.load(bs_ptr + kb + gl.zeros_like(as_ptrs.to(gl.int64, bitcast=True)), mask=row_ok, other=0.0)
    return a, b


@gluon.jit
def _fp8_grouped_wgmma_kernel(a_desc, b_desc, as_ptr, bs_ptr, c_ptr, starts_ptr, counts_ptr, map_ptr, N, K, cap,
                              tiles_per_expert, num_m, stride_asm, stride_ask, stride_bse, stride_bsn, stride_cm,
                              E: gl.constexpr, E_P2: gl.constexpr, TILE_MAP: gl.constexpr,
                              MASKED: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                              GROUP_M: gl.constexpr, STAGES: gl.constexpr, PAIRS: gl.constexpr,
                              num_warps: gl.constexpr):
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BLOCK_M, 128], a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BLOCK_N, 128], b_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1 if PAIRS else 2)  # the warpgroups that read the slot are done
    fence_async_shared()
    num_n = gl.cdiv(N, BLOCK_N)
    # (each partition's arguments spelt out: a tuple built with + would turn the constants into values)
    if PAIRS:
        gl.warp_specialize([
            (_consume_pairs, (0, a_bufs, b_bufs, ready, empty, as_ptr, bs_ptr, c_ptr, N, K, stride_asm, stride_ask,
                              stride_bse, stride_bsn, stride_cm, starts_ptr, counts_ptr, map_ptr, cap,
                              tiles_per_expert, num_m, num_n, E, E_P2, MASKED, TILE_MAP, BLOCK_M, GROUP_M)),
            (_consume_pairs, (1, a_bufs, b_bufs, ready, empty, as_ptr, bs_ptr, c_ptr, N, K, stride_asm, stride_ask,
                              stride_bse, stride_bsn, stride_cm, starts_ptr, counts_ptr, map_ptr, cap,
                              tiles_per_expert, num_m, num_n, E, E_P2, MASKED, TILE_MAP, BLOCK_M, GROUP_M)),
            (_produce_pairs, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, N, K, starts_ptr, counts_ptr, map_ptr,
                              cap, tiles_per_expert, num_m, num_n, E, E_P2, MASKED, TILE_MAP, BLOCK_M, GROUP_M))],
            [4, 1], [232, 40])
    else:
        gl.warp_specialize([
            (_consume, (0, a_bufs, b_bufs, ready, empty, as_ptr, bs_ptr, c_ptr, N, K, stride_asm, stride_ask,
                        stride_bse, stride_bsn, stride_cm, starts_ptr, counts_ptr, map_ptr, cap, tiles_per_expert,
                        num_m, num_n, E, E_P2, MASKED, TILE_MAP, BLOCK_M, GROUP_M)),
            (_consume, (1, a_bufs, b_bufs, ready, empty, as_ptr, bs_ptr, c_ptr, N, K, stride_asm, stride_ask,
                        stride_bse, stride_bsn, stride_cm, starts_ptr, counts_ptr, map_ptr, cap, tiles_per_expert,
                        num_m, num_n, E, E_P2, MASKED, TILE_MAP, BLOCK_M, GROUP_M)),
            (_produce, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, N, K, starts_ptr, counts_ptr, map_ptr, cap,
                        tiles_per_expert, num_m, num_n, E, E_P2, MASKED, TILE_MAP, BLOCK_M, GROUP_M))],
            [4, 1], [232, 40])


@gluon.jit
def _load_step(a_desc, b_desc, a_bufs, b_bufs, ready, empty, row0, b_row, kb, it, base: gl.constexpr,
               RING: gl.constexpr):
    """K step kb of a tile (a's rows from row0, b's from b_row) into slot base + it % RING of a ring of RING slots,
    once it is free (a fresh barrier's phase "1" counts as complete: the first round does not wait); returns it + 1."""
    s = base + it % RING
    mbarrier.wait(empty.index(s), ((it // RING) & 1) ^ 1)
    bar = ready.index(s)
    mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
    tma_load(a_desc, [row0, kb * 128], bar, a_bufs.index(s))
    tma_load(b_desc, [b_row, kb * 128], bar, b_bufs.index(s))
    return it + 1


@gluon.jit
def _produce(a_desc, b_desc, a_bufs, b_bufs, ready, empty, N, K, starts_ptr, counts_ptr, map_ptr, cap,
             tiles_per_expert, num_m, num_n, E: gl.constexpr, E_P2: gl.constexpr, MASKED: gl.constexpr,
             TILE_MAP: gl.constexpr, BLOCK_M: gl.constexpr, GROUP_M: gl.constexpr):
    """The producer warp: every K step of this program's tiles, in order, into the slots by turns, each once both
    warpgroups are done with it (a fresh barrier's phase "1" counts as complete: the first round does not wait).
    It runs ahead into the next tile while the warpgroups finish and store the last."""
    STAGES: gl.constexpr = a_bufs.shape[0]
    BLOCK_N: gl.constexpr = b_bufs.shape[1]
    nk = gl.cdiv(K, 128)
    it = 0
    last = num_m * num_n - 1
    nxt = tile(gl.program_id(0), starts_ptr, counts_ptr, map_ptr, cap, tiles_per_expert, num_m, num_n, E, E_P2,
                MASKED, TILE_MAP, BLOCK_M, GROUP_M)
    for t in range(gl.program_id(0), num_m * num_n, gl.num_programs(0)):
        e, row0, left, pid_n = nxt
        # the next tile's lookup now: its loads land while this tile's steps run
        nxt = tile(gl.minimum(t + gl.num_programs(0), last), starts_ptr, counts_ptr, map_ptr, cap, tiles_per_expert,
                    num_m, num_n, E, E_P2, MASKED, TILE_MAP, BLOCK_M, GROUP_M)
        if left > 0:
            b_row = e * N + pid_n * BLOCK_N
            for kb in range(nk):
                it = _load_step(a_desc, b_desc, a_bufs, b_bufs, ready, empty, row0, b_row, kb, it, 0, STAGES)


@gluon.jit
def _pair(t, starts_ptr, counts_ptr, map_ptr, cap, tiles_per_expert, num_m, num_n, E: gl.constexpr,
          E_P2: gl.constexpr, MASKED: gl.constexpr, TILE_MAP: gl.constexpr, BLOCK_M: gl.constexpr,
          GROUP_M: gl.constexpr):
    """PAIRS: tiles t and t + programs (nothing to do past the grid): (e, row0, left, pid_n) of each."""
    last = num_m * num_n - 1
    u = t + gl.num_programs(0)
    ea, ra, la, na = tile(t, starts_ptr, counts_ptr, map_ptr, cap, tiles_per_expert, num_m, num_n, E, E_P2, MASKED,
                          TILE_MAP, BLOCK_M, GROUP_M)
    eb, rb, lb, nb = tile(gl.minimum(u, last), starts_ptr, counts_ptr, map_ptr, cap, tiles_per_expert, num_m, num_n,
                          E, E_P2, MASKED, TILE_MAP, BLOCK_M, GROUP_M)
    return ea, ra, la, na, eb, rb, gl.where(u <= last, lb, 0), nb


@gluon.jit
def _produce_pairs(a_desc, b_desc, a_bufs, b_bufs, ready, empty, N, K, starts_ptr, counts_ptr, map_ptr, cap,
                   tiles_per_expert, num_m, num_n, E: gl.constexpr, E_P2: gl.constexpr, MASKED: gl.constexpr,
                   TILE_MAP: gl.constexpr, BLOCK_M: gl.constexpr, GROUP_M: gl.constexpr):
    """PAIRS: the producer walks the tiles two at a time (warpgroup 0's and 1's), each tile's K steps into its
    warpgroup's half of the slots, by turns: tile a's step kb, then tile b's."""
    BLOCK_N: gl.constexpr = b_bufs.shape[1]
    HALF: gl.constexpr = a_bufs.shape[0] // 2
    nk = gl.cdiv(K, 128)
    ia = 0
    ib = 0
    for t in range(gl.program_id(0), num_m * num_n, 2 * gl.num_programs(0)):
        ea, ra, la, na, eb, rb, lb, nb = _pair(t, starts_ptr, counts_ptr, map_ptr, cap, tiles_per_expert, num_m,
                                               num_n, E, E_P2, MASKED, TILE_MAP, BLOCK_M, GROUP_M)
        for kb in range(nk):
            if la > 0:
                ia = _load_step(a_desc, b_desc, a_bufs, b_bufs, ready, empty, ra, ea * N + na * BLOCK_N, kb, ia, 0,
                                HALF)
            if lb > 0:
                ib = _load_step(a_desc, b_desc, a_bufs, b_bufs, ready, empty, rb, eb * N + nb * BLOCK_N, kb, ib,
                                HALF, HALF)


@gluon.jit
def _consume(wg: gl.constexpr, a_bufs, b_bufs, ready, empty, as_ptr, bs_ptr, c_ptr, N, K, stride_asm, stride_ask,
             stride_bse, stride_bsn, stride_cm, starts_ptr, counts_ptr, map_ptr, cap, tiles_per_expert, num_m, num_n,
             E: gl.constexpr, E_P2: gl.constexpr, MASKED: gl.constexpr, TILE_MAP: gl.constexpr,
             BLOCK_M: gl.constexpr, GROUP_M: gl.constexpr):
    """Warpgroup wg's 64 rows of the MMA's M side (a's rows wg * 64.., or with SWAP the weights'), tile after tile:
    each K step's product waited for, its slot released, then scaled and added while the other warpgroup's MMA
    runs. A tile's rows are stored while the next tile's first MMA runs (the last tile's after the walk)."""
    STAGES: gl.constexpr = a_bufs.shape[0]
    BLOCK_N: gl.constexpr = b_bufs.shape[1]
    SWAP: gl.constexpr = BLOCK_M < 128  # (the plain form splits 128 rows of a between the warpgroups)
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, BLOCK_M if SWAP else BLOCK_N, 32])
    SHAPE: gl.constexpr = [64, BLOCK_M] if SWAP else [64, BLOCK_N]
    STORE_M: gl.constexpr = BLOCK_M if SWAP else 64
    STORE_N: gl.constexpr = 64 if SWAP else BLOCK_N
    nk = gl.cdiv(K, 128)
    zero = gl.zeros(SHAPE, gl.float32, layout=mma)
    it = 0
    # the tile waiting for its store: its accumulator, first row, rows left, first column (no rows: nothing stored)
    done = zero.to(c_ptr.dtype.element_ty)  # (in c's dtype: half the registers of fp32 while the next MMA runs)
    done_row = 0
    done_left = 0
    done_col = 0
    last = num_m * num_n - 1
    nxt = tile(gl.program_id(0), starts_ptr, counts_ptr, map_ptr, cap, tiles_per_expert, num_m, num_n, E, E_P2,
                MASKED, TILE_MAP, BLOCK_M, GROUP_M)
    for t in range(gl.program_id(0), num_m * num_n, gl.num_programs(0)):
        e, row0, left, pid_n = nxt
        nxt = tile(gl.minimum(t + gl.num_programs(0), last), starts_ptr, counts_ptr, map_ptr, cap, tiles_per_expert,
                    num_m, num_n, E, E_P2, MASKED, TILE_MAP, BLOCK_M, GROUP_M)
        if left > 0:
            n0 = pid_n * BLOCK_N
            if SWAP:  # weights' rows n0 + wg * 64.. (BLOCK_N is 128: one b scale block); a's rows on the N side
                rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, mma))
            else:  # a's rows wg * 64..
                rows = wg * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, mma))
            row_ok = rows < left
            as_ptrs = as_ptr + (row0 + rows).to(gl.int64) * stride_asm
            bs_ptrs = bs_ptr + e.to(gl.int64) * stride_bse + (n0 // 128) * stride_bsn
            acc = _tile_steps(a_bufs, b_bufs, ready, empty, as_ptrs, bs_ptrs, row_ok, stride_ask, nk, it, 0, STAGES,
                              wg * 64, zero, SWAP, True, c_ptr, done, done_row, done_left, done_col, N, stride_cm,
                              STORE_M, STORE_N)
            it += nk
            done = acc.to(c_ptr.dtype.element_ty)
            if SWAP:
                done_row, done_left, done_col = row0, left, n0 + wg * 64
            else:
                done_row, done_left, done_col = row0 + wg * 64, left - wg * 64, n0
    store_tile(c_ptr, done, done_row, done_left, done_col, N, stride_cm, STORE_M, STORE_N, SWAP, 4)


@gluon.jit
def _tile_steps(a_bufs, b_bufs, ready, empty, as_ptrs, bs_ptrs, row_ok, stride_ask, nk, it, base: gl.constexpr,
                RING: gl.constexpr, half, zero, SWAP: gl.constexpr, STORE: gl.constexpr, c_ptr, done, done_row,
                done_left, done_col, N, stride_cm, STORE_M: gl.constexpr, STORE_N: gl.constexpr):
    """One tile's nk K steps from the ring of RING slots from slot base, the ring's it-th fill first: each step's
    product waited for, its slot released, then scaled by the step's scales and added in fp32. With STORE, the
    previous tile (done: its accumulator, first row, rows left, first column) is stored while the first step's MMA
    runs: the store no longer leaves the tensor cores without this warpgroup's work (at V2-Lite's prefill sizes a
    tile cost about 2.6 K steps beyond its steps, 2026-12-04).

    Two steps an iteration, each with its own scale registers, loaded two steps before their use, after their last
    one. (Loaded two steps ahead and passed down a chain of registers, each copy waited for the load just issued,
    and the MMA's issue behind it: Nsight Compute, 2026-12-04. A load in the step that uses the scales fared no
    better, its product with b's scale computed ahead of the MMA.)"""
    a0, b0 = _scales(as_ptrs, bs_ptrs, row_ok, 0, stride_ask, SWAP)  # even steps' scales
    a1, b1 = _scales(as_ptrs, bs_ptrs, row_ok, gl.minimum(nk - 1, 1), stride_ask, SWAP)  # odd steps'
    s = base + it % RING
    mbarrier.wait(ready.index(s), (it // RING) & 1)
    first = _issue(a_bufs, b_bufs, s, half, zero, SWAP)
    if STORE:
        store_tile(c_ptr, done, done_row, done_left, done_col, N, stride_cm, STORE_M, STORE_N, SWAP, 4)
    part = warpgroup_mma_wait(num_outstanding=0, deps=(first, ))
    mbarrier.arrive(empty.index(s), count=1)
    acc = _scaled_add(zero, part, a0 * b0, SWAP)
    a0, b0 = _scales(as_ptrs, bs_ptrs, row_ok, gl.minimum(nk - 1, 2), stride_ask, SWAP)
    for kb in range(1, nk - 1, 2):
        part, acc = _step_product(a_bufs, b_bufs, ready, empty, base + (it + kb) % RING, ((it + kb) // RING) & 1,
                                  half, zero, acc, SWAP)
        acc = _scaled_add(acc, part, a1 * b1, SWAP)
        a1, b1 = _scales(as_ptrs, bs_ptrs, row_ok, gl.minimum(nk - 1, kb + 2), stride_ask, SWAP)
        part, acc = _step_product(a_bufs, b_bufs, ready, empty, base + (it + kb + 1) % RING,
                                  ((it + kb + 1) // RING) & 1, half, zero, acc, SWAP)
        acc = _scaled_add(acc, part, a0 * b0, SWAP)
        a0, b0 = _scales(as_ptrs, bs_ptrs, row_ok, gl.minimum(nk - 1, kb + 3), stride_ask, SWAP)
    if nk % 2 == 0 and nk > 1:  # the last step (odd), its scales in a1, b1
        part, acc = _step_product(a_bufs, b_bufs, ready, empty, base + (it + nk - 1) % RING,
                                  ((it + nk - 1) // RING) & 1, half, zero, acc, SWAP)
        acc = _scaled_add(acc, part, a1 * b1, SWAP)
    return acc


@gluon.jit
def _issue(a_bufs, b_bufs, s, half, zero, SWAP: gl.constexpr):
    """Slot s's MMA (its loads landed), not waited for. It reads rows half.. + 64 of the slot's a (with SWAP, of
    its b: the weights' rows) and all of the other operand."""
    if SWAP:
        mma = warpgroup_mma(b_bufs.index(s).slice(half, 64), a_bufs.index(s).permute((1, 0)), zero, use_acc=False,
                            is_async=True)
    else:
        mma = warpgroup_mma(a_bufs.index(s).slice(half, 64), b_bufs.index(s).permute((1, 0)), zero, use_acc=False,
                            is_async=True)
    return mma


@gluon.jit
def _step_product(a_bufs, b_bufs, ready, empty, s, phase, half, zero, acc, SWAP: gl.constexpr):
    """Slot s's product once its loads landed (ready's phase), waited for; the slot released. acc goes through
    the wait as well: the last step's add (which made acc) stays before this step's wait, next to its MMA, where
    ptxas (Triton 3.6's SASS, 2026-12-04) put both steps' adds after the second wait."""
    mbarrier.wait(ready.index(s), phase)
    part, acc = warpgroup_mma_wait(num_outstanding=0, deps=(_issue(a_bufs, b_bufs, s, half, zero, SWAP), acc))
    mbarrier.arrive(empty.index(s), count=1)
    return part, acc


@gluon.jit
def _consume_pairs(wg: gl.constexpr, a_bufs, b_bufs, ready, empty, as_ptr, bs_ptr, c_ptr, N, K, stride_asm,
                   stride_ask, stride_bse, stride_bsn, stride_cm, starts_ptr, counts_ptr, map_ptr, cap,
                   tiles_per_expert, num_m, num_n, E: gl.constexpr, E_P2: gl.constexpr, MASKED: gl.constexpr,
                   TILE_MAP: gl.constexpr, BLOCK_M: gl.constexpr, GROUP_M: gl.constexpr):
    """PAIRS: warpgroup wg's tile of each pair, all 64 rows of it, from its half of the slots."""
    BLOCK_N: gl.constexpr = b_bufs.shape[1]
    HALF: gl.constexpr = a_bufs.shape[0] // 2
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, BLOCK_N, 32])
    nk = gl.cdiv(K, 128)
    zero = gl.zeros([64, BLOCK_N], gl.float32, layout=mma)
    rows = gl.arange(0, 64, layout=gl.SliceLayout(1, mma))
    it = 0
    for t in range(gl.program_id(0), num_m * num_n, 2 * gl.num_programs(0)):
        ea, ra, la, na, eb, rb, lb, nb = _pair(t, starts_ptr, counts_ptr, map_ptr, cap, tiles_per_expert, num_m,
                                               num_n, E, E_P2, MASKED, TILE_MAP, BLOCK_M, GROUP_M)
        if wg == 0:
            e, row0, left, pid_n = ea, ra, la, na
        else:
            e, row0, left, pid_n = eb, rb, lb, nb
        if left > 0:
            n0 = pid_n * BLOCK_N
            row_ok = rows < left
            as_ptrs = as_ptr + (row0 + rows).to(gl.int64) * stride_asm
            bs_ptrs = bs_ptr + e.to(gl.int64) * stride_bse + (n0 // 128) * stride_bsn
            acc = _tile_steps(a_bufs, b_bufs, ready, empty, as_ptrs, bs_ptrs, row_ok, stride_ask, nk, it, wg * HALF,
                              HALF, 0, zero, False, False, c_ptr, zero, 0, 0, 0, N, stride_cm, 64, BLOCK_N)
            store_tile(c_ptr, acc, row0, left, n0, N, stride_cm, 64, BLOCK_N, False, 4)
            it += nk


@gluon.jit
def _scaled_add(acc, part, row_scale, SWAP: gl.constexpr):
    """acc + part * the scales of a's rows (times b's block scale), a's rows along dim 1 with SWAP."""
    if SWAP:
        acc = acc + part * row_scale[None, :]
    else:
        acc = acc + part * row_scale[:, None]
    return acc


def usable(xq: torch.Tensor, w: torch.Tensor, config: dict) -> bool:
    """The shapes and forms this kernel takes: K a multiple of 128 (whole scale blocks; a TMA row stride of 16
    bytes); plain, BLOCK_M 128 and BLOCK_N 64 or 128; PAIRS, BLOCK_M 64, BLOCK_N 64 or 128 and an even number of
    stages; SWAP_AB, BLOCK_N 128 and BLOCK_M 16, 32 or 64; N a multiple of BLOCK_N; 4 warps a warpgroup (the
    producer warp comes on top)."""
    bm, bn = config["BLOCK_M"], config["BLOCK_N"]
    if config.get("SWAP_AB"):
        form = bn == 128 and bm in (16, 32, 64) and not config.get("PAIRS")
    elif config.get("PAIRS"):  # an even number of slots: half a warpgroup
        form = bm == 64 and bn in (64, 128) and config["num_stages"] % 2 == 0
    else:
        form = bm == 128 and bn in (64, 128)
    return (form and config["num_warps"] == 4 and xq.shape[1] % BLOCK == 0 and w.shape[1] % bn == 0
            and xq.stride(1) == 1 and w.is_contiguous() and xq.stride(0) % 16 == 0)


def map_tiles(config: dict, masked: bool) -> bool:
    """Whether the contiguous layout's tiles come from a map (`tile_order.tile_map`): where the configuration says
    "TILE_MAP", and always in the plain form (its consumers hold two steps' products: summing the experts' tile
    counts in registers as well spilled, ptxas said)."""
    plain = not (config.get("PAIRS") or config.get("SWAP_AB"))
    return not masked and (bool(config.get("TILE_MAP")) or plain)


def launch(xq, x_scale, w, w_scale_inv, out, starts, counts, cap, masked, num_m, config):
    """out[rows of each tile] = the block-scaled product over num_m row tiles. Contiguous: starts / counts the
    experts' segments, the tiles from a map (tile_order.tile_map, one launch more) where `map_tiles` says, else the
    kernel sums the tile counts itself; masked: counts is masked_m."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    e, n, k = w.shape
    bm, bn = config["BLOCK_M"], config["BLOCK_N"]
    a_layout = gl.NVMMASharedLayout.get_default_for([bm, BLOCK], gl.float8e4nv)
    b_layout = gl.NVMMASharedLayout.get_default_for([bn, BLOCK], gl.float8e4nv)
    a_desc = TensorDescriptor(xq, list(xq.shape), [xq.stride(0), 1], [bm, BLOCK], a_layout)
    b_desc = TensorDescriptor(w, [e * n, k], [k, 1], [bn, BLOCK], b_layout)
    mapped = map_tiles(config, masked)
    tiles = tile_map(starts, counts, num_m, bm) if mapped else counts
    grid = (min(num_m * triton.cdiv(n, bn), sm_count(xq.device)),)  # persistent: a program an SM at most
    _fp8_grouped_wgmma_kernel[grid](
        a_desc, b_desc, x_scale, w_scale_inv, out, starts, counts, tiles, n, k, cap,
        triton.cdiv(cap, bm) if masked else 0, num_m, x_scale.stride(0), x_scale.stride(1), w_scale_inv.stride(0),
        w_scale_inv.stride(1), out.stride(0), E=e, E_P2=triton.next_power_of_2(e), TILE_MAP=mapped, MASKED=masked,
        BLOCK_M=bm, BLOCK_N=bn, GROUP_M=config.get("GROUP_M", 8), STAGES=config["num_stages"],
        PAIRS=bool(config.get("PAIRS")), num_warps=4)
    return out
