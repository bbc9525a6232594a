"""The bf16 / fp16 grouped GEMM over the contiguous and masked MoE layouts written with Gluon (Triton's explicit layer
over Hopper's warpgroup MMA), warp-specialized and persistent, with SiLU-and-mul fused into the gate/up GEMM
(triton_ops/moe_gemm.py sends a shape here where its tuned table says "WGMMA": true).

Why a second kernel: at prefill sizes Triton's own pipelined kernel keeps its tensor cores busy about two thirds of
the time; a program here is partitions that never wait for each other's work: a producer fills STAGES shared-memory
slots (a "ready" barrier each, and an "empty" one the consumers release); two consumer warpgroups each own 64 rows of
a 128-row tile and keep one K step's MMAs in flight while the next is issued, accumulating in place. A program stays
on one SM and walks its tiles (gluon_tiles.py); the producer runs ahead into the next tile while the consumers store.

The producer: with the rows in place (a through a tensor descriptor), one warp issuing TMA reads of a and w; with
the rows named by `pairs` (GATHER: row r is x[pairs[r] // TOPK], -1 zeros, as the Triton kernel reads them), one
warpgroup copying a's rows with cp.async (Hopper's TMA has no row gather) and TMA for w; the ready barrier then counts
the copies of each of its threads and the TMA's bytes, and the consumers fence the copies to the MMA's proxy.
SILU: w is [gate; up] ([E, 2N, K]); a slot holds a's tile and both halves' tiles, each warpgroup accumulates gate and
up and stores silu(gate) * up. fp32 accumulation; output in x's dtype.

Gluon has no interpreter: on CPU the kernel is compiled for sm_90 (tests/kernels/test_moe_gemm_wgmma.py); on a GPU
it is checked against the torch reference like the Triton kernel.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from moeserve.kernels.triton_ops.gluon_tiles import sm_count, store_tile, tile, tma_load
from moeserve.kernels.triton_ops.tile_order import tile_map

# Triton 3.6 (the GPU machine's) names the cp.async copy async_copy_global_to_shared; later versions async_load
_cp_async = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
GATHER_WARPS = gl.constexpr(4)  # the producer's warps where it gathers a's rows with cp.async (one warp issues TMA alone)


@gluon.jit
def _moe_gemm_wgmma_kernel(a_desc, a_ptr, b_desc, c_ptr, starts_ptr, counts_ptr, pairs_ptr, map_ptr, N, K, cap,
                           tiles_per_expert, num_m, stride_am, stride_cm, E: gl.constexpr, E_P2: gl.constexpr,
                           MASKED: gl.constexpr, TILE_MAP: gl.constexpr, SILU: gl.constexpr, GATHER: gl.constexpr,
                           TOPK: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                           GROUP_M: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr):
    # a's slots take w's shared layout: both [rows, BLOCK_K] of the same dtype (a_desc is w's where a is gathered)
    a_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BLOCK_M, BLOCK_K], b_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES * (2 if SILU else 1), BLOCK_N, BLOCK_K], b_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        # the TMA's expect, and with GATHER each producer thread's cp.async arrival (counted at init: "noinc")
        mbarrier.init(ready.index(i), count=1 + (32 * GATHER_WARPS if GATHER else 0))
        mbarrier.init(empty.index(i), count=2)  # both warpgroups have read the slot
    fence_async_shared()
    num_n = gl.cdiv(N, BLOCK_N)
    # (each partition's arguments spelt out: a tuple built with + would turn the constants into values)
    if GATHER:
        gl.warp_specialize([
            (_consume, (0, a_bufs, b_bufs, ready, empty, c_ptr, N, K, stride_cm, starts_ptr, counts_ptr, map_ptr,
                        cap, tiles_per_expert, num_m, num_n, E, E_P2, MASKED, TILE_MAP, SILU, GATHER, BLOCK_M,
                        GROUP_M)),
            (_consume, (1, a_bufs, b_bufs, ready, empty, c_ptr, N, K, stride_cm, starts_ptr, counts_ptr, map_ptr,
                        cap, tiles_per_expert, num_m, num_n, E, E_P2, MASKED, TILE_MAP, SILU, GATHER, BLOCK_M,
                        GROUP_M)),
            (_gather, (a_ptr, b_desc, a_bufs, b_bufs, ready, empty, N, K, stride_am, pairs_ptr, starts_ptr,
                       counts_ptr, map_ptr, num_m, num_n, E, E_P2, TILE_MAP, SILU, TOPK, BLOCK_M, GROUP_M))],
            [4, GATHER_WARPS], [216, 72])
    else:
        gl.warp_specialize([
            (_consume, (0, a_bufs, b_bufs, ready, empty, c_ptr, N, K, stride_cm, starts_ptr, counts_ptr, map_ptr,
                        cap, tiles_per_expert, num_m, num_n, E, E_P2, MASKED, TILE_MAP, SILU, GATHER, BLOCK_M,
                        GROUP_M)),
            (_consume, (1, a_bufs, b_bufs, ready, empty, c_ptr, N, K, stride_cm, starts_ptr, counts_ptr, map_ptr,
                        cap, tiles_per_expert, num_m, num_n, E, E_P2, MASKED, TILE_MAP, SILU, GATHER, BLOCK_M,
                        GROUP_M)),
            (_produce, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, N, K, starts_ptr, counts_ptr, map_ptr, cap,
                        tiles_per_expert, num_m, num_n, E, E_P2, MASKED, TILE_MAP, SILU, BLOCK_M, GROUP_M))],
            [4, 1], [232, 40])


@gluon.jit
def _load_w(b_desc, b_bufs, bar, s, e, n0, kb, N, SILU: gl.constexpr):
    """Expert e's weight tile at columns n0 of K step kb into slot s (with SILU the up half's beside it)."""
    STAGES: gl.constexpr = b_bufs.shape[0] // (2 if SILU else 1)
    BLOCK_K: gl.constexpr = b_bufs.shape[2]
    if SILU:
        tma_load(b_desc, [e * 2 * N + n0, kb * BLOCK_K], bar, b_bufs.index(s))
        tma_load(b_desc, [e * 2 * N + N + n0, kb * BLOCK_K], bar, b_bufs.index(STAGES + s))
    else:
        tma_load(b_desc, [e * N + n0, kb * BLOCK_K], bar, b_bufs.index(s))


@gluon.jit
def _produce(a_desc, b_desc, a_bufs, b_bufs, ready, empty, N, K, starts_ptr, counts_ptr, map_ptr, cap,
             tiles_per_expert, num_m, num_n, E: gl.constexpr, E_P2: gl.constexpr, MASKED: gl.constexpr,
             TILE_MAP: gl.constexpr, SILU: gl.constexpr, BLOCK_M: gl.constexpr, GROUP_M: gl.constexpr):
    """The producer warp (a's rows in place): every K step of this program's tiles, in order, into the slots by
    turns, each once both warpgroups are done with it (a fresh barrier's phase "1" counts as complete: the first
    round does not wait)."""
    STAGES: gl.constexpr = a_bufs.shape[0]
    BLOCK_N: gl.constexpr = b_bufs.shape[1]
    BLOCK_K: gl.constexpr = a_bufs.shape[2]
    nbytes: gl.constexpr = (BLOCK_M + BLOCK_N * (2 if SILU else 1)) * BLOCK_K * a_desc.dtype.primitive_bitwidth // 8
    nk = gl.cdiv(K, BLOCK_K)
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
            for kb in range(nk):
                s = it % STAGES
                mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
                bar = ready.index(s)
                mbarrier.expect(bar, nbytes)
                tma_load(a_desc, [row0, kb * BLOCK_K], bar, a_bufs.index(s))
                _load_w(b_desc, b_bufs, bar, s, e, pid_n * BLOCK_N, kb, N, SILU)
                it += 1


@gluon.jit
def _gather(a_ptr, b_desc, a_bufs, b_bufs, ready, empty, N, K, stride_am, pairs_ptr, starts_ptr, counts_ptr,
            map_ptr, num_m, num_n, E: gl.constexpr, E_P2: gl.constexpr, TILE_MAP: gl.constexpr, SILU: gl.constexpr,
            TOPK: gl.constexpr, BLOCK_M: gl.constexpr, GROUP_M: gl.constexpr):
    """The producer warpgroup (contiguous layout, a's rows named by pairs): each tile's rows looked up once, then
    every K step's [BLOCK_M, BLOCK_K] of them copied with cp.async (a padding row, or one past the segment, reads
    as zeros), each thread's copies arriving on the slot's ready barrier as they land; w's tiles by TMA."""
    STAGES: gl.constexpr = a_bufs.shape[0]
    BLOCK_N: gl.constexpr = b_bufs.shape[1]
    BLOCK_K: gl.constexpr = a_bufs.shape[2]
    nbytes: gl.constexpr = BLOCK_N * (2 if SILU else 1) * BLOCK_K * b_desc.dtype.primitive_bitwidth // 8
    # 16 bytes a thread, a row's BLOCK_K across BLOCK_K // 8 threads
    lay: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[256 // BLOCK_K, BLOCK_K // 8],
                                         warps_per_cta=[GATHER_WARPS, 1], order=[1, 0])
    r = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, lay))
    c = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, lay))
    nk = gl.cdiv(K, BLOCK_K)
    it = 0
    last = num_m * num_n - 1
    nxt = tile(gl.program_id(0), starts_ptr, counts_ptr, map_ptr, 0, 0, num_m, num_n, E, E_P2, False, TILE_MAP,
               BLOCK_M, GROUP_M)
    for t in range(gl.program_id(0), num_m * num_n, gl.num_programs(0)):
        e, row0, left, pid_n = nxt
        nxt = tile(gl.minimum(t + gl.num_programs(0), last), starts_ptr, counts_ptr, map_ptr, 0, 0, num_m, num_n, E,
                   E_P2, False, TILE_MAP, BLOCK_M, GROUP_M)
        if left > 0:
            pair = gl.load(pairs_ptr + row0 + r, mask=r < left, other=-1)
            ok = pair >= 0
            src = a_ptr + (gl.where(ok, pair // TOPK, 0).to(gl.int64) * stride_am)[:, None] + c[None, :]
            for kb in range(nk):
                s = it % STAGES
                mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
                bar = ready.index(s)
                mbarrier.expect(bar, nbytes)
                _load_w(b_desc, b_bufs, bar, s, e, pid_n * BLOCK_N, kb, N, SILU)
                _cp_async(a_bufs.index(s), src + kb * BLOCK_K, mask=ok[:, None])
                async_copy.mbarrier_arrive(bar, increment_count=False)
                it += 1


@gluon.jit
def _consume(wg: gl.constexpr, a_bufs, b_bufs, ready, empty, c_ptr, N, K, stride_cm, starts_ptr, counts_ptr, map_ptr,
             cap, tiles_per_expert, num_m, num_n, E: gl.constexpr, E_P2: gl.constexpr, MASKED: gl.constexpr,
             TILE_MAP: gl.constexpr, SILU: gl.constexpr, GATHER: gl.constexpr, BLOCK_M: gl.constexpr,
             GROUP_M: gl.constexpr):
    """Warpgroup wg's 64 rows of each tile (a's rows wg * 64..): step k's MMAs issued on the accumulators while step
    k - 1's complete, whose slot is then released; the tile's rows stored after the last step."""
    STAGES: gl.constexpr = a_bufs.shape[0]
    BLOCK_N: gl.constexpr = b_bufs.shape[1]
    BLOCK_K: gl.constexpr = a_bufs.shape[2]
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
    nk = gl.cdiv(K, BLOCK_K)
    it = 0
    last = num_m * num_n - 1
    nxt = tile(gl.program_id(0), starts_ptr, counts_ptr, map_ptr, cap, tiles_per_expert, num_m, num_n, E, E_P2,
               MASKED, TILE_MAP, BLOCK_M, GROUP_M)
    for t in range(gl.program_id(0), num_m * num_n, gl.num_programs(0)):
        e, row0, left, pid_n = nxt
        nxt = tile(gl.minimum(t + gl.num_programs(0), last), starts_ptr, counts_ptr, map_ptr, cap, tiles_per_expert,
                   num_m, num_n, E, E_P2, MASKED, TILE_MAP, BLOCK_M, GROUP_M)
        if left > 0:
            acc = gl.zeros([64, BLOCK_N], gl.float32, layout=mma)
            up = gl.zeros([64, BLOCK_N], gl.float32, layout=mma)
            for kb in range(nk):
                s = it % STAGES
                mbarrier.wait(ready.index(s), (it // STAGES) & 1)
                if GATHER:  # a's rows came by cp.async (the generic proxy); the MMA reads through the async one
                    fence_async_shared()
                a = a_bufs.index(s).slice(wg * 64, 64)
                acc = warpgroup_mma(a, b_bufs.index(s).permute((1, 0)), acc, is_async=True)
                if SILU:
                    up = warpgroup_mma(a, b_bufs.index(STAGES + s).permute((1, 0)), up, is_async=True)
                    acc, up = warpgroup_mma_wait(num_outstanding=2, deps=(acc, up))
                else:
                    acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
                if kb > 0:  # step kb - 1's MMAs are done: its slot is free
                    mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1)
                it += 1
            if SILU:
                acc, up = warpgroup_mma_wait(num_outstanding=0, deps=(acc, up))
                acc = acc / (1.0 + gl.exp(-acc)) * up
            else:
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1)
            store_tile(c_ptr, acc, row0 + wg * 64, left - wg * 64, pid_n * BLOCK_N, N, stride_cm, 64, BLOCK_N, False,
                       4)


def usable(a: torch.Tensor, w: torch.Tensor, config: dict, silu: bool, gather: bool, masked: bool) -> bool:
    """The shapes and forms this kernel takes: bf16 or fp16 operands; BLOCK_M 128 (64 rows a warpgroup), BLOCK_N
    64, 128 or (without SiLU) 256, BLOCK_K 64 (128 bytes a row, the TMA's widest swizzle); K a multiple of BLOCK_K
    and N of BLOCK_N; rows gathered only in the contiguous layout, from a 16-byte aligned a whose row stride is a
    multiple of 16 elements (what Triton's launcher must see to emit 16-byte cp.async copies); 4 warps a
    warpgroup."""
    bm, bn, bk = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
    n = w.shape[1] // 2 if silu else w.shape[1]
    return (a.dtype in (torch.bfloat16, torch.float16) and w.dtype == a.dtype and bm == 128
            and bn in ((64, 128) if silu else (64, 128, 256)) and bk == 64 and config["num_warps"] == 4
            and a.shape[-1] % bk == 0 and n % bn == 0 and not (gather and masked) and a.stride(-1) == 1
            and w.is_contiguous() and (a.stride(-2) * a.element_size()) % 16 == 0
            and (not gather or (a.stride(-2) % 16 == 0 and a.data_ptr() % 16 == 0)))


def launch(a, w, out, starts, counts, cap, masked, num_m, silu, pairs, top_k, config):
    """out[rows of each tile] = the product over num_m row tiles (silu(gate) * up with silu). Contiguous: starts /
    counts the experts' segments, a's rows named by pairs where given, and with the configuration's "TILE_MAP" the
    tiles come from a map (tile_order.tile_map, one launch more); masked: counts is masked_m."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    e, n_w, k = w.shape
    n = n_w // 2 if silu else n_w
    bm, bn, bk = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
    dt = gl.bfloat16 if a.dtype == torch.bfloat16 else gl.float16
    b_desc = TensorDescriptor(w, [e * n_w, k], [k, 1], [bn, bk], gl.NVMMASharedLayout.get_default_for([bn, bk], dt))
    gather = pairs is not None
    a_desc = b_desc if gather else TensorDescriptor(a, [a.shape[0], k], [a.stride(0), 1], [bm, bk],
                                                    gl.NVMMASharedLayout.get_default_for([bm, bk], dt))
    mapped = bool(config.get("TILE_MAP")) and not masked
    tiles = tile_map(starts, counts, num_m, bm) if mapped else counts
    grid = (min(num_m * triton.cdiv(n, bn), sm_count(a.device)),)  # persistent: a program an SM at most
    _moe_gemm_wgmma_kernel[grid](
        a_desc, a, b_desc, out, starts, counts, pairs if gather else counts, tiles, n, k, cap,
        triton.cdiv(cap, bm) if masked else 0, num_m, a.stride(0), out.stride(0), E=e, E_P2=triton.next_power_of_2(e),
        MASKED=masked, TILE_MAP=mapped, SILU=silu, GATHER=gather, TOPK=top_k, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        GROUP_M=config.get("GROUP_M", 8), STAGES=config["num_stages"], num_warps=4)
    return out
