"""Triton per-token-group FP8 quantization of activations (moeserve/kernels/fp8_quant.py has the recipe).

A program quantizes GROUPS groups of 128 ([GROUPS, 128] in registers) of one row, or, where a row's groups are not
a multiple of GROUPS, of the rows' groups laid end to end (FLAT: at K 1,408, 11 groups a row, the second program of
a row had 3 of 8 groups' work; end to end, the SiLU-and-mul quantize of 65,536 such rows took 142 us where it took
167 on an H200; a row's groups in one program stay faster where they divide evenly, as the gathered rows' 16: 99
against 135 us); two warps a program (`WARPS`) stream faster than four. Each group: its amax, scale = amax / 448
(floored), q = x / scale in e4m3. Rows are any leading shape flattened; the last dimension must be contiguous. The scales are written row-major [rows, groups], or
M-major with `mn_major` (the same shape, stored [groups, rows]: the GEMMs read a tile's scales of one K block as
one run). `silu_and_mul_quantize` first forms the group from a [gate | up] row: silu(gate) * up, each step rounded
to x's dtype as torch's two ops round it.
`quantize_gathered` quantizes the rows of a contiguous MoE layout straight from the tokens they name (row r is
token pairs[r] // top_k, zeros where pairs[r] is -1), so no [M, H] copy of the rows is made first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeserve.kernels.fp8_format import ACT_SCALE_FLOOR, BLOCK, FP8_DTYPE, FP8_MAX, num_blocks
from moeserve.kernels.triton_ops.activation import silu_mul
from moeserve.kernels.triton_ops.direct_launch import DirectLauncher

GROUPS = 8  # groups of 128 a program: 1,024 values, 16 a thread at 2 warps
WARPS = 2  # measured against 4 at a 4 x 2,048 prefill's sizes on an H200 (quant_bench.py --sweep of 401bd23,
# benchmark/results/ 2026-12-04): V2-Lite's SiLU-and-mul 121 / 141 us, gathered rows 86 / 99, V3's 183 / 199 and
# 318 / 376, the plain quantizer 1-4% faster


@triton.jit
def load_groups(x_ptr, offs, read, up_cols, SILU: tl.constexpr):
    """x's values at element offsets offs ([R, C], zeros where not read), in x's dtype; SILU: silu(gate) * up, the
    up values up_cols columns on (as torch's two ops round it)."""
    v = tl.load(x_ptr + offs, mask=read, other=0.0)
    if SILU:
        v = silu_mul(v, tl.load(x_ptr + offs + up_cols, mask=read, other=0.0))
    return v


@triton.jit
def quantize_groups(v, FLOOR: tl.constexpr, QMAX: tl.constexpr):
    """[R, 128] values, a group a row -> (q [R, 128] float32 on e4m3's grid's range, scale [R]): scale = amax / QMAX
    (floored), q = v / scale clamped to +-QMAX; the caller casts q to e4m3 (round to nearest even)."""
    x = v.to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=1), FLOOR) / QMAX
    return tl.clamp(x / scale[:, None], -QMAX, QMAX), scale


@triton.jit
def _quantize_groups_kernel(x_ptr, q_ptr, s_ptr, pairs_ptr, K, num_groups, total, stride_xm, stride_qm, stride_sm,
                            stride_sg, SILU: tl.constexpr, GATHER: tl.constexpr, TOPK: tl.constexpr,
                            FLAT: tl.constexpr, FLOOR: tl.constexpr, QMAX: tl.constexpr, GROUP: tl.constexpr,
                            GROUPS: tl.constexpr):
    """GROUPS groups of row pid(0) from group GROUPS * pid(1); FLAT: the rows' groups laid end to end (group j: row
    j // num_groups, its group j % num_groups; total = rows * num_groups), a program's groups may span two rows.
    SILU: the row is [gate | up] (2K wide) and a group is silu(gate) * up; GATHER: the row is read from token
    pairs[row] // TOPK (-1: a row of zeros)."""
    if FLAT:
        j = tl.program_id(0).to(tl.int64) * GROUPS + tl.arange(0, GROUPS)
        row, g, live = j // num_groups, j % num_groups, j < total
    else:
        row = tl.program_id(0).to(tl.int64)  # one row: its offsets are scalars
        g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
        live = g < num_groups
    cols = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    ok = (cols < K) & live[:, None]
    read = ok
    src = row
    if GATHER:  # a padding row (pair -1) reads nothing and is written as zeros
        pair = tl.load(pairs_ptr + row, mask=live, other=-1) if FLAT else tl.load(pairs_ptr + row)
        src = tl.maximum(pair, 0).to(tl.int64) // TOPK
        read = ok & (pair[:, None] >= 0 if FLAT else (pair + tl.zeros_like(cols)) >= 0)
    x_off = (src * stride_xm)[:, None] if FLAT else src * stride_xm
    q, scale = quantize_groups(load_groups(x_ptr, x_off + cols, read, K, SILU), FLOOR, QMAX)
    q_off = (row * stride_qm)[:, None] if FLAT else row * stride_qm
    tl.store(q_ptr + q_off + cols, q.to(q_ptr.dtype.element_ty), mask=ok)
    tl.store(s_ptr + row * stride_sm + g * stride_sg, scale, mask=live)


_QUANTIZE = DirectLauncher(_quantize_groups_kernel)


def quantize_rows(x: torch.Tensor, silu: bool, mn_major: bool, pairs: torch.Tensor | None = None,
                  top_k: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows a GEMM multiplies, quantized (kernels/fp8_quant.quantize_rows_reference's result): x's rows, the
    tokens pairs gathers, or silu(gate) * up of x's [gate | up] rows."""
    k = x.shape[-1] // 2 if silu else x.shape[-1]
    kb = num_blocks(k)
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0] if pairs is None else pairs.shape[0]
    q = torch.empty(m, k, dtype=FP8_DTYPE, device=x.device)
    s = torch.empty(kb, m, dtype=torch.float32, device=x.device).t() if mn_major else \
        torch.empty(m, kb, dtype=torch.float32, device=x.device)
    if m:
        groups = min(GROUPS, triton.next_power_of_2(kb))
        flat = kb % groups != 0  # a row's last program would hold a few groups: lay the rows' groups end to end
        grid = (triton.cdiv(m * kb, groups), 1) if flat else (m, kb // groups)
        _QUANTIZE(grid, x2, q, s, q if pairs is None else pairs, k, kb, m * kb, x2.stride(0), q.stride(0),
                  s.stride(0), s.stride(1), SILU=silu, GATHER=pairs is not None, TOPK=top_k, FLAT=flat,
                  FLOOR=ACT_SCALE_FLOOR, QMAX=FP8_MAX, GROUP=BLOCK, GROUPS=groups, num_warps=WARPS)
    if pairs is not None:
        return q, s
    return q.view(*x.shape[:-1], k), s.view(*x.shape[:-1], kb)


def quantize_gathered(tokens: torch.Tensor, pairs: torch.Tensor, top_k: int,
                      mn_major: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens [T, K], pairs [M] int32 -> quantize_activations(gather_rows(tokens, pairs, top_k)) in one pass:
    (q [M, K] e4m3, scale [M, ceil(K/128)] float32)."""
    return quantize_rows(tokens, silu=False, mn_major=mn_major, pairs=pairs, top_k=top_k)


def silu_and_mul_quantize(x: torch.Tensor, mn_major: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., 2I] -> (q [..., I] e4m3, scale [..., ceil(I/128)] float32); the reference's signature."""
    return quantize_rows(x, silu=True, mn_major=mn_major)


def quantize_activations(x: torch.Tensor, mn_major: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (q [..., K] e4m3, scale [..., ceil(K/128)] float32); the reference's signature."""
    return quantize_rows(x, silu=False, mn_major=mn_major)
