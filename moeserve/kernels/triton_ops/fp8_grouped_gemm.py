"""Triton block-scaled FP8 grouped GEMMs over the contiguous and masked layouts (moeserve/kernels/fp8_grouped_gemm.py).

A program computes a [BLOCK_M, BLOCK_N] tile of one expert's rows with `block_scaled_tile` (triton_ops/fp8_gemm.py:
K in steps of 128, the scale blocks, one scale multiply per step on the fp32 accumulator). The 1-D grid runs in
grouped-M order and each program finds its expert and tile with `expert_tile` (triton_ops/tile_order.py):
- contiguous: segments need no padding to the block; the grid is the static bound cdiv(M, BLOCK_M) + min(E, M)
  row tiles and programs past the last tile return at once (no host read: CUDA-graph safe). Padding rows are left
  unwritten, as the bf16 grouped GEMM leaves them (the combines read valid rows only). With "TILE_MAP": true in the
  configuration, the programs read their tiles from a map built before the GEMM (`tile_map`, one small launch):
  one load, where the prefix sum takes two dependent ones;
- masked: tiles at or past masked_m[e] return at once (their rows stay unspecified, as the layout allows).
Reads: with "TMA": true in the configuration (the default; it needs K a multiple of 16 and a Hopper-class GPU, else
the pointer path runs), a and b through tensor descriptors (no per-element address arithmetic); a by pointers where
the configuration says "A_TMA": false (decode: a 64-row tile's rows past its expert's few are not read); the scales
"SCALE_AHEAD" K blocks ahead of their step (1 by default; 0 or 2; 3: one ahead, loaded after the step's add:
triton_ops/fp8_gemm.py block_scaled_tile_tma); "maxnreg" caps the registers a thread (182 at
64 x 128 on 4 warps hold an SM to 2 programs, where shared memory allows 3). Else pointers with 64-bit row and
column indices. Launch configurations come from the tuned tables (moeserve/kernels/moe_config.py, ops `fp8_grouped_gemm`
and `fp8_grouped_gemm_masked`, written by benchmark/kernels/tune_fp8.py), else `default_config`. An entry with
"WGMMA": true sends the shape to the warp-specialized Gluon kernel (triton_ops/fp8_grouped_wgmma.py) on a Hopper
GPU: at prefill sizes it beat this kernel by 5-9% (benchmark/results/, 2026-12-03).
`fp8_grouped_gemm_act` / `fp8_grouped_gemm_masked_act` start from the activations (the tokens and the pairs that
gather them, or [gate | up] rows for SiLU-and-mul): the quantizer (triton_ops/fp8_quant.py), then the GEMM.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeserve.kernels.fp8_format import BLOCK, FP8_DTYPE
from moeserve.kernels.moe_config import get_config
from moeserve.kernels.triton_ops.fp8_gemm import block_scaled_tile, block_scaled_tile_tma
from moeserve.kernels.triton_ops.fp8_quant import quantize_rows
from moeserve.kernels.triton_ops.tile_order import expert_tile, grouped_order, tile_map
from moeserve.kernels.triton_ops.tma import descriptor_usable

OPS = {False: "fp8_grouped_gemm", True: "fp8_grouped_gemm_masked"}  # the tables' op names by layout (masked?)


def default_config(M: int, E: int) -> dict:
    """Without a table: 64 x 128 tiles read through tensor descriptors, 4 warps, 4 stages, the best of the sweep at
    every size of DeepSeek-V3's expert GEMMs on an H200 (benchmark/results/, 2026-12-01)."""
    return dict(BLOCK_M=64, BLOCK_N=128, GROUP_M=8, num_warps=4, num_stages=4, TMA=True)


@triton.jit
def _fp8_grouped_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, starts_ptr, counts_ptr, map_ptr, N, K, cap,
                        tiles_per_expert, num_m, stride_am, stride_asm, stride_ask, stride_be, stride_bn, stride_bse,
                        stride_bsn, stride_cm,
                        E: tl.constexpr, E_P2: tl.constexpr, MASKED: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr, GROUP: tl.constexpr, TMA: tl.constexpr,
                        A_TMA: tl.constexpr, TILE_MAP: tl.constexpr, SCALE_AHEAD: tl.constexpr):
    pid_m, pid_n = grouped_order(tl.program_id(0), num_m, tl.cdiv(N, BLOCK_N), GROUP_M)
    e, tile, start, count = expert_tile(pid_m, starts_ptr, counts_ptr, cap, tiles_per_expert, map_ptr, num_m, E,
                                        E_P2, MASKED, BLOCK_M, TILE_MAP)
    if tile * BLOCK_M >= count:
        return
    m0 = (start + tile * BLOCK_M).to(tl.int64)  # the tile's first row in a and c
    n0 = pid_n * BLOCK_N
    rows, cols = tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < count - tile * BLOCK_M, cols < N - n0
    e64 = e.to(tl.int64)
    if TMA:  # b_ptr a descriptor over w viewed as [E * N, K], a_ptr one over xq [M, K] with A_TMA
        acc = block_scaled_tile_tma(a_ptr, b_ptr, as_ptr + m0 * stride_asm, bs_ptr + e64 * stride_bse,
                                    start + tile * BLOCK_M, e * N + n0, rows, row_ok, cols, col_ok, n0, K, stride_am,
                                    stride_asm, stride_ask, stride_bsn, BLOCK_M, BLOCK_N, GROUP, A_TMA,
                                    SCALE_AHEAD)
    else:  # 64-bit row and column indices (the fallback path; Hopper reads through descriptors)
        acc = block_scaled_tile(a_ptr, as_ptr, b_ptr + e64 * stride_be, bs_ptr + e64 * stride_bse,
                                m0 + rows, row_ok, (n0 + cols).to(tl.int64), col_ok, n0, K, stride_am, stride_asm,
                                stride_ask, stride_bn, stride_bsn, BLOCK_M, BLOCK_N, GROUP, SCALE_AHEAD)
    c_ptrs = c_ptr + m0 * stride_cm + rows[:, None] * stride_cm + (n0 + cols)[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def _launch(xq, x_scale, w, w_scale_inv, out, starts, counts, cap, masked, config):
    m, k = xq.shape
    e, n = w.shape[0], w.shape[1]
    assert w.shape[2] == k and xq.stride(1) == 1 and w.stride(2) == 1, (xq.shape, w.shape)
    cfg = config or get_config(OPS[masked], m, e, n, k, FP8_DTYPE, xq.device, default=default_config)
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    tiles_per_expert = triton.cdiv(cap, bm) if masked else 0
    num_m = e * tiles_per_expert if masked else triton.cdiv(m, bm) + min(e, m)
    if num_m == 0 or n == 0:
        return out
    if cfg.get("WGMMA") and _wgmma_usable(xq, w, cfg):
        from moeserve.kernels.triton_ops import fp8_grouped_wgmma

        return fp8_grouped_wgmma.launch(xq, x_scale, w, w_scale_inv, out, starts, counts, cap, masked, num_m, cfg)
    tma = bool(cfg.get("TMA")) and tma_usable(xq, w)
    a_tma = tma and cfg.get("A_TMA", True)
    a, b = (_descriptors(xq, w, bm, bn, a_tma) if tma else (xq, w))
    mapped = bool(cfg.get("TILE_MAP")) and not masked
    tiles = tile_map(starts, counts, num_m, bm) if mapped else counts
    _fp8_grouped_kernel[(num_m * triton.cdiv(n, bn),)](
        a, x_scale, b, w_scale_inv, out, starts, counts, tiles, n, k, cap, tiles_per_expert, num_m,
        xq.stride(0), x_scale.stride(0), x_scale.stride(1), w.stride(0), w.stride(1), w_scale_inv.stride(0),
        w_scale_inv.stride(1), out.stride(0), E=e, E_P2=triton.next_power_of_2(e), MASKED=masked, BLOCK_M=bm,
        BLOCK_N=bn, GROUP_M=cfg.get("GROUP_M", 8), GROUP=BLOCK, TMA=tma, A_TMA=a_tma, TILE_MAP=mapped,
        SCALE_AHEAD=cfg.get("SCALE_AHEAD", 1), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        **({"maxnreg": cfg["maxnreg"]} if "maxnreg" in cfg else {}))
    return out


def _wgmma_usable(xq: torch.Tensor, w: torch.Tensor, cfg: dict) -> bool:
    """The Gluon kernel (triton_ops/fp8_grouped_wgmma.py) runs where the table asks for it ("WGMMA": true), on a
    Hopper-class GPU, for shapes it takes; elsewhere this module's kernel runs the same configuration's tiles."""
    if not (xq.is_cuda and torch.cuda.get_device_capability(xq.device)[0] >= 9 and tma_usable(xq, w)):
        return False
    from moeserve.kernels.triton_ops import fp8_grouped_wgmma

    return fp8_grouped_wgmma.usable(xq, w, cfg)


def tma_usable(xq: torch.Tensor, w: torch.Tensor) -> bool:
    """Both operands readable through tensor descriptors (triton_ops/tma.py): in e4m3, K a multiple of 16."""
    return descriptor_usable(xq) and descriptor_usable(w)


def _descriptors(xq: torch.Tensor, w: torch.Tensor, bm: int, bn: int, a_tma: bool):
    """(a, b) for the kernel: descriptors over xq (or xq itself, read by pointers) and over w viewed [E * N, K]."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    e, n, k = w.shape
    a = TensorDescriptor(xq, list(xq.shape), [xq.stride(0), 1], [bm, BLOCK]) if a_tma else xq
    return a, TensorDescriptor(w, [e * n, k], [k, 1], [bn, BLOCK])


def fp8_grouped_gemm(xq: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale_inv: torch.Tensor,
                     expert_offsets: torch.Tensor, num_tokens_per_expert: torch.Tensor, out_dtype: torch.dtype,
                     config: dict | None = None) -> torch.Tensor:
    """Contiguous layout: xq [M, K] -> [M, N]; the reference's signature. Rows past a segment's count are left
    unwritten (the combines never read them), where the reference writes zeros."""
    out = torch.empty(xq.shape[0], w.shape[1], dtype=out_dtype, device=xq.device)
    return _launch(xq, x_scale, w, w_scale_inv.contiguous(), out, expert_offsets,
                   num_tokens_per_expert, 0, False, config)


def fp8_grouped_gemm_act(x: torch.Tensor, w: torch.Tensor, w_scale_inv: torch.Tensor, expert_offsets: torch.Tensor,
                         num_tokens_per_expert: torch.Tensor, out_dtype: torch.dtype, pairs: torch.Tensor | None = None,
                         top_k: int = 1, silu: bool = False, config: dict | None = None) -> torch.Tensor:
    """Contiguous layout from the activations: the layout's rows (x's rows; with pairs, row r is token pairs[r] //
    top_k of x, -1 a row of zeros; silu: x's rows are [gate | up] and the row is silu(gate) * up) quantized per
    token in groups of 128 (`quantize_rows`, scales M-major), then `fp8_grouped_gemm` -> [M, N]."""
    xq, xs = quantize_rows(x, silu, mn_major=True, pairs=pairs, top_k=top_k)
    return fp8_grouped_gemm(xq, xs, w, w_scale_inv, expert_offsets, num_tokens_per_expert, out_dtype, config)


def fp8_grouped_gemm_masked_act(x: torch.Tensor, w: torch.Tensor, w_scale_inv: torch.Tensor, masked_m: torch.Tensor,
                                out_dtype: torch.dtype, silu: bool = False, config: dict | None = None) -> torch.Tensor:
    """Masked layout from the activations: x [E, C, K] (silu: [E, C, 2K], the rows silu(gate) * up) quantized per
    token in groups of 128, then `fp8_grouped_gemm_masked` -> [E, C, N]."""
    return fp8_grouped_gemm_masked(*quantize_rows(x, silu, mn_major=True), w, w_scale_inv, masked_m, out_dtype, config)


def fp8_grouped_gemm_masked(xq: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale_inv: torch.Tensor,
                            masked_m: torch.Tensor, out_dtype: torch.dtype, config: dict | None = None) -> torch.Tensor:
    """Masked layout: xq [E, C, K] -> [E, C, N]; rows past masked_m[e] unspecified. The reference's signature."""
    e, cap, k = xq.shape
    out = torch.empty(e, cap, w.shape[1], dtype=out_dtype, device=xq.device)
    _launch(xq.reshape(e * cap, k), x_scale.reshape(e * cap, -1), w, w_scale_inv.contiguous(),
            out.view(e * cap, -1), masked_m, masked_m, cap, True, config)
    return out
