"""Triton `router_logits` (moeserve/kernels/router_gemm.py): grid (token blocks, expert blocks); a program walks
H in blocks, loading its tokens' x (upcast in registers) and its experts' fp32 weights, and accumulates their fp32
dot (IEEE: no TF32 rounding of the weights)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeserve.kernels.triton_ops.direct_launch import DirectLauncher


@triton.jit
def _router_logits_kernel(x_ptr, w_ptr, out_ptr, T, E, H, stride_x, stride_w, stride_o,
                          BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr):
    rt = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    re = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    tm, em = rt < T, re < E
    acc = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        rh = h0 + tl.arange(0, BLOCK_H)
        hm = rh < H
        x = tl.load(x_ptr + rt[:, None].to(tl.int64) * stride_x + rh[None, :], mask=tm[:, None] & hm[None, :],
                    other=0.0).to(tl.float32)
        w = tl.load(w_ptr + re[:, None] * stride_w + rh[None, :], mask=em[:, None] & hm[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(w), input_precision="ieee")
    tl.store(out_ptr + rt[:, None].to(tl.int64) * stride_o + re[None, :], acc, mask=tm[:, None] & em[None, :])


_KERNEL = DirectLauncher(_router_logits_kernel)


def router_logits(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Same signature as moeserve.kernels.router_gemm.router_logits_reference (x 2-D, w float32)."""
    T, H = x.shape
    E = w.shape[0]
    if w.shape[1] != H or w.dtype != torch.float32:
        raise ValueError(f"router_logits: x {tuple(x.shape)} and w {tuple(w.shape)} {w.dtype} do not fit")
    x = x if x.stride(-1) == 1 else x.contiguous()
    w = w if w.stride(-1) == 1 else w.contiguous()
    out = torch.empty(T, E, dtype=torch.float32, device=x.device)
    if T == 0:
        return out
    block_t = 16 if T <= 16 else 32 if T <= 256 else 64  # tl.dot's smallest M is 16
    block_e = 16 if T <= 256 else 64  # (the layer calls it up to MAX_TOKENS; larger T works too)
    _KERNEL((triton.cdiv(T, block_t), triton.cdiv(E, block_e)), x, w, out, T, E, H, x.stride(0), w.stride(0),
            out.stride(0), BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_H=128 if block_t * block_e <= 512 else 64,
            num_warps=4, num_stages=3)
    return out
