"""Triton per-token-group FP8 quantization of activations (moeserve/kernels/fp8_quant.py has the recipe).

A program quantizes GROUPS groups of 128 of one row ([GROUPS, 128] in registers): each group's amax, scale =
amax / 448 (floored), q = x / scale in e4m3. Rows are any leading shape flattened; the last dimension must be
contiguous. The scales are written row-major [rows, groups], or M-major with `mn_major` (the same shape, stored
[groups, rows]: the GEMMs read a tile's scales of one K block as one run). `silu_and_mul_quantize` first forms the
group from a [gate | up] row: silu(gate) * up, each step rounded to x's dtype as torch's two ops round it.
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

MAX_GROUPS = 8  # groups a program takes: 1,024 values, 8 a thread at 4 warps


@triton.jit
def _quantize_groups_kernel(x_ptr, q_ptr, s_ptr, pairs_ptr, K, num_groups, stride_xm, stride_qm, stride_sm,
                            stride_sg, SILU: tl.constexpr, GATHER: tl.constexpr, TOPK: tl.constexpr,
                            FLOOR: tl.constexpr, QMAX: tl.constexpr, GROUP: tl.constexpr, GROUPS: tl.constexpr):
    """Groups GROUPS * pid(1) .. of row pid(0); SILU: the row is [gate | up] (2K wide) and a group is
    silu(gate) * up; GATHER: the row is read from token pairs[row] // TOPK (-1: a row of zeros)."""
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    cols = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    ok = (cols < K) & (g < num_groups)[:, None]
    src = row
    read = ok
    if GATHER:  # a padding row (pair -1) reads nothing and is written as zeros
        pair = tl.load(pairs_ptr + row)
        read = ok & ((pair + tl.zeros_like(cols)) >= 0)  # (broadcast first: the interpreter wants a tensor mask)
        src = tl.maximum(pair, 0).to(tl.int64) // TOPK
    v = tl.load(x_ptr + src * stride_xm + cols, mask=read, other=0.0)
    if SILU:
        v = silu_mul(v, tl.load(x_ptr + src * stride_xm + K + cols, mask=read, other=0.0))  # in x's dtype
    x = v.to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=1), FLOOR) / QMAX
    q = tl.clamp(x / scale[:, None], -QMAX, QMAX)
    tl.store(q_ptr + row * stride_qm + cols, q.to(q_ptr.dtype.element_ty), mask=ok)
    tl.store(s_ptr + row * stride_sm + g * stride_sg, scale, mask=g < num_groups)


_QUANTIZE = DirectLauncher(_quantize_groups_kernel)


def _quantize(x: torch.Tensor, silu: bool, mn_major: bool, pairs: torch.Tensor | None = None,
              top_k: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
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
        groups = min(MAX_GROUPS, triton.next_power_of_2(kb))
        _QUANTIZE((m, triton.cdiv(kb, groups)), x2, q, s, q if pairs is None else pairs, k, kb, x2.stride(0),
                  q.stride(0), s.stride(0), s.stride(1), SILU=silu, GATHER=pairs is not None, TOPK=top_k,
                  FLOOR=ACT_SCALE_FLOOR, QMAX=FP8_MAX, GROUP=BLOCK, GROUPS=groups, num_warps=4)
    if pairs is not None:
        return q, s
    return q.view(*x.shape[:-1], k), s.view(*x.shape[:-1], kb)


def quantize_gathered(tokens: torch.Tensor, pairs: torch.Tensor, top_k: int,
                      mn_major: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens [T, K], pairs [M] int32 -> quantize_activations(gather_rows(tokens, pairs, top_k)) in one pass:
    (q [M, K] e4m3, scale [M, ceil(K/128)] float32)."""
    return _quantize(tokens, silu=False, mn_major=mn_major, pairs=pairs, top_k=top_k)


def silu_and_mul_quantize(x: torch.Tensor, mn_major: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., 2I] -> (q [..., I] e4m3, scale [..., ceil(I/128)] float32); the reference's signature."""
    return _quantize(x, silu=True, mn_major=mn_major)


def quantize_activations(x: torch.Tensor, mn_major: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (q [..., K] e4m3, scale [..., ceil(K/128)] float32); the reference's signature."""
    return _quantize(x, silu=False, mn_major=mn_major)
