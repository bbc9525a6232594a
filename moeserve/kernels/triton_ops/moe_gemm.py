"""Triton grouped GEMM over the MoE layouts (moeserve/kernels/moe_gemm.py), with SiLU-and-mul fused.

One kernel serves both layouts. A program computes a [BLOCK_M, BLOCK_N] tile of one expert's rows, found by
`expert_tile` (triton_ops/tile_order.py): contiguous, from the per-expert tile counts (segments need no padding,
the grid is the static bound cdiv(M, BLOCK_M) + min(E, M), extra programs return at once: graph safe); masked,
tile m % tiles of expert m // tiles, tiles past masked_m[e] return at once.
With SILU, w is [gate; up] ([E, 2I, K]): the program accumulates the gate and up columns n and I + n together and
writes silu(gate) * up, so the [M, 2I] intermediate never reaches memory. fp32 accumulation; output in x's dtype.
GATHER (contiguous): the rows are named by `pairs` (row r is x[pairs[r] // TOPK], -1 zeros) and loaded from the
tokens where the tiles are read, as vLLM's and SGLang's fused MoE kernels do: no [M, K] copy of the rows.
TMA (a configuration's "TMA": true): w read through a tensor descriptor, and a too where the rows are not gathered
(the down GEMM), as the FP8 grouped GEMM reads them (Hopper; the pointer path elsewhere).
GROUP_M (a configuration's "GROUP_M": g > 0): a 1-D grid in grouped-M order, g row tiles sweeping every column tile
before the next g start, so that the programs resident together share rows and weights in L2; 0, a 2-D grid.
TILE_MAP (a configuration's "TILE_MAP": true, contiguous): each program reads its tile from a map built before the
GEMM (tile_order.py `tile_map`, one small launch) instead of summing the tile counts itself.
WGMMA (a configuration's "WGMMA": true, Hopper): the Gluon kernel (triton_ops/moe_gemm_wgmma.py, warp-specialized
and persistent) runs the configuration's tiles instead, where it takes the shape; the tally is then a torch add.
TALLY: the first program also adds the first num_tally counts into an int64 tally (the expert-utilization
counter, ep/stats.py), where an add of its own was a launch per MoE layer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeserve.kernels.moe_config import default_config, get_config
from moeserve.kernels.triton_ops.direct_launch import DirectLauncher
from moeserve.kernels.triton_ops.tile_order import expert_tile, grouped_order, tile_map
from moeserve.kernels.triton_ops.tma import descriptor_usable


@triton.jit(do_not_specialize=["num_m"])  # (read only in grouped order: no recompile per grid size)
def _moe_gemm_kernel(a_ptr, w_ptr, out_ptr, starts_ptr, counts_ptr, pairs_ptr, tally_ptr, map_ptr, num_tally, N, K,
                     cap, tiles_per_expert, num_m, stride_am, stride_we, stride_wn, stride_om,
                     E: tl.constexpr, E_P2: tl.constexpr, MASKED: tl.constexpr, SILU: tl.constexpr,
                     PRECISION: tl.constexpr, UPCAST: tl.constexpr, GATHER: tl.constexpr, TOPK: tl.constexpr,
                     TALLY: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     TMA: tl.constexpr, A_TMA: tl.constexpr, GROUP_M: tl.constexpr, TILE_MAP: tl.constexpr):
    if GROUP_M > 0:  # a 1-D grid in grouped-M order (tile_order.py)
        pid_m, pid_n = grouped_order(tl.program_id(0), num_m, tl.cdiv(N, BLOCK_N), GROUP_M)
    else:
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
    if TALLY:  # the first program adds the first num_tally counts into the int64 tally: no launch of its own
        if pid_m + pid_n == 0:
            ei = tl.arange(0, E_P2)
            tm = ei < num_tally
            c = tl.load(counts_ptr + ei, mask=tm, other=0).to(tl.int64)
            tl.store(tally_ptr + ei, tl.load(tally_ptr + ei, mask=tm, other=0) + c, mask=tm)
    e, tile, start, count = expert_tile(pid_m, starts_ptr, counts_ptr, cap, tiles_per_expert, map_ptr, num_m, E,
                                        E_P2, MASKED, BLOCK_M, TILE_MAP)
    if tile * BLOCK_M >= count:
        return
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < count
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    if GATHER:
        pair = tl.load(pairs_ptr + start + rows, mask=row_ok, other=-1)
        a_ok = row_ok & (pair >= 0)
        a_rows = tl.where(a_ok, pair // TOPK, 0).to(tl.int64)
    else:
        a_ok = row_ok
        a_rows = (start + rows).to(tl.int64)
    if not A_TMA:  # (with A_TMA, a_ptr is a descriptor)
        a_ptrs = a_ptr + a_rows[:, None] * stride_am + ks[None, :]
    if not TMA:
        b_ptrs = w_ptr + e.to(tl.int64) * stride_we + cols.to(tl.int64)[None, :] * stride_wn + ks[:, None]
    w_row = e * (2 * N if SILU else N) + pid_n * BLOCK_N  # TMA: the tile's first row of w viewed [E * n_w, K]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k_ok = ks < K - kb * BLOCK_K
        if A_TMA:  # rows past the expert's are the next expert's (or zeros past M): masked at the store
            a = a_ptr.load([start + tile * BLOCK_M, kb * BLOCK_K])
        else:
            a = tl.load(a_ptrs, mask=a_ok[:, None] & k_ok[None, :], other=0.0)
        if TMA:  # columns past N read the next rows of w (the up half, another expert): masked at the store
            b = w_ptr.load([w_row, kb * BLOCK_K]).T
        else:
            b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if UPCAST:  # Triton's interpreter gets bf16 dots wrong (3.9): the CPU tests multiply in fp32
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        if SILU:
            if TMA:
                u = w_ptr.load([w_row + N, kb * BLOCK_K]).T
            else:
                u = tl.load(b_ptrs + N * stride_wn, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            if UPCAST:
                u = u.to(tl.float32)
            acc_up = tl.dot(a, u, acc_up, input_precision=PRECISION)
        if not A_TMA:
            a_ptrs += BLOCK_K
        if not TMA:
            b_ptrs += BLOCK_K
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    out_ptrs = out_ptr + (start + rows).to(tl.int64)[:, None] * stride_om + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


_MOE_GEMM = DirectLauncher(_moe_gemm_kernel)


def _launch(a: torch.Tensor, w: torch.Tensor, starts: torch.Tensor | None, counts: torch.Tensor, out: torch.Tensor,
            *, masked: bool, silu: bool, cap: int, rows: int, config: dict | None,
            pairs: torch.Tensor | None = None, top_k: int = 1, tally: torch.Tensor | None = None) -> None:
    E, n_w, K = w.shape
    N = n_w // 2 if silu else n_w
    assert a.stride(-1) == 1 and w.stride(-1) == 1 and a.shape[-1] == K, (a.shape, a.stride(), w.shape)
    cfg = config or get_config("moe_gemm_silu" if silu else "moe_gemm", rows, E, N, K, w.dtype, w.device)
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    if cfg.get("backend") == "torch":  # a table entry for the contiguous picker; the masked kernel runs anyway
        cfg = default_config(rows, E)
    if masked:
        tiles = triton.cdiv(cap, bm)
        grid_m = E * tiles
    else:
        tiles = 0
        grid_m = triton.cdiv(rows, bm) + min(E, rows)
    if grid_m == 0:  # no rows: the counts are zeros, nothing to tally either
        return
    if cfg.get("WGMMA") and _wgmma_usable(a, w, cfg, silu, pairs is not None, masked):
        from moeserve.kernels.triton_ops import moe_gemm_wgmma

        if tally is not None:
            tally += counts[:tally.shape[0]]
        moe_gemm_wgmma.launch(a, w, out, counts if starts is None else starts, counts, cap, masked, grid_m, silu,
                              pairs, top_k, cfg)
        return
    precision = "ieee" if a.dtype == torch.float32 else "tf32"
    upcast = not a.is_cuda and a.dtype != torch.float32  # only under TRITON_INTERPRET (CPU tensors)
    tma = bool(cfg.get("TMA")) and descriptor_usable(w)
    a_tma = tma and pairs is None and not masked and descriptor_usable(a)
    mapped = bool(cfg.get("TILE_MAP")) and not masked
    tmap = tile_map(starts, counts, grid_m, bm) if mapped else counts
    args = (a, w, out, counts if starts is None else starts, counts, counts if pairs is None else pairs,
            counts if tally is None else tally, tmap, 0 if tally is None else tally.shape[0], N, K, cap,
            tiles, grid_m, a.stride(-2), w.stride(0), w.stride(1), out.stride(-2))
    meta = dict(E=E, E_P2=triton.next_power_of_2(E), MASKED=masked, SILU=silu, PRECISION=precision, UPCAST=upcast,
                GATHER=pairs is not None, TOPK=top_k, TALLY=tally is not None,
                BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg.get("GROUP_M", 0), TILE_MAP=mapped,
                num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    grid = (grid_m * triton.cdiv(N, bn),) if meta["GROUP_M"] else (grid_m, triton.cdiv(N, bn))
    if not tma:
        _MOE_GEMM(grid, *args, TMA=False, A_TMA=False, **meta)
        return
    # descriptors are built per call and launched through Triton's own binding (the direct launcher keys
    # arguments by value): prefill sizes, where the host's few microseconds are not what the step waits on
    from triton.tools.tensor_descriptor import TensorDescriptor

    w_desc = TensorDescriptor(w, [E * n_w, K], [K, 1], [bn, bk])
    a_desc = TensorDescriptor(a, [a.shape[0], K], [a.stride(0), 1], [bm, bk]) if a_tma else a
    _moe_gemm_kernel[grid](a_desc, w_desc, *args[2:], TMA=True, A_TMA=a_tma, **meta)


def _wgmma_usable(a: torch.Tensor, w: torch.Tensor, cfg: dict, silu: bool, gather: bool, masked: bool) -> bool:
    """The Gluon kernel (triton_ops/moe_gemm_wgmma.py) runs where the table asks for it ("WGMMA": true), on a
    Hopper-class GPU, for shapes it takes; elsewhere this module's kernel runs the same configuration's tiles."""
    if not (a.is_cuda and torch.cuda.get_device_capability(a.device)[0] >= 9 and descriptor_usable(w)):
        return False
    from moeserve.kernels.triton_ops import moe_gemm_wgmma

    return moe_gemm_wgmma.usable(a, w, cfg, silu, gather, masked)


def moe_gemm(x: torch.Tensor, w: torch.Tensor, expert_offsets: torch.Tensor, num_tokens_per_expert: torch.Tensor,
             silu: bool = False, config: dict | None = None, pairs: torch.Tensor | None = None,
             top_k: int = 1, tally: torch.Tensor | None = None) -> torch.Tensor:
    """Same signature as moeserve.kernels.moe_gemm.moe_gemm_reference (config: a launch configuration that
    overrides the table; the tuner passes it)."""
    N = w.shape[1] // 2 if silu else w.shape[1]
    rows = x.shape[0] if pairs is None else pairs.shape[0]
    out = x.new_empty(rows, N)
    _launch(x, w, expert_offsets, num_tokens_per_expert, out, masked=False, silu=silu, cap=0, rows=rows,
            config=config, pairs=pairs, top_k=top_k, tally=tally)
    return out


def moe_gemm_masked(x: torch.Tensor, w: torch.Tensor, masked_m: torch.Tensor, silu: bool = False,
                    config: dict | None = None, tally: torch.Tensor | None = None) -> torch.Tensor:
    """Same signature as moeserve.kernels.moe_gemm.moe_gemm_masked_reference."""
    E, cap, _ = x.shape
    N = w.shape[1] // 2 if silu else w.shape[1]
    out = x.new_empty(E, cap, N)
    # the table is keyed by the rows the experts may hold (E * cap); decode batches fill a few per expert
    _launch(x.reshape(E * cap, -1), w, None, masked_m, out.view(E * cap, N), masked=True, silu=silu, cap=cap,
            rows=E * cap, config=config, tally=tally)
    return out
