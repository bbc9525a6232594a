"""Triton `router_logits` (moeserve/kernels/router_gemm.py): grid (expert blocks, token blocks); a program walks H
in blocks, loading its tokens' x (upcast in registers) and its experts' fp32 weights, and sums their products in
fp32 on the CUDA cores (IEEE: no TF32 rounding of the weights).

At decode sizes the work is a few million multiply-adds, so the time is latency: how many programs run at once and
how many loop steps each waits on. The blocks are picked so that about `PROGRAMS` programs share the work (one
expert a program at batch 1, whole H in one or two steps), each a [BLOCK_T, BLOCK_E, BLOCK_H] product summed over
H, where a `tl.dot` tile (16 rows at least) would leave most of the GPU idle and loop over H in small steps."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeserve.kernels.triton_ops.direct_launch import DirectLauncher

PROGRAMS = 128  # about one a streaming multiprocessor on an H100 / H200 (132)
TILE = 8192  # elements of a program's [BLOCK_T, BLOCK_E, BLOCK_H] product: 64 a thread at 4 warps


@triton.jit
def _router_logits_kernel(x_ptr, w_ptr, out_ptr, T, E, H, stride_x, stride_w, stride_o,
                          BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr):
    re = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    rt = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    tm, em = rt < T, re < E
    acc = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        rh = h0 + tl.arange(0, BLOCK_H)
        hm = rh < H
        x = tl.load(x_ptr + rt[:, None].to(tl.int64) * stride_x + rh[None, :], mask=tm[:, None] & hm[None, :],
                    other=0.0).to(tl.float32)
        w = tl.load(w_ptr + re[:, None] * stride_w + rh[None, :], mask=em[:, None] & hm[None, :], other=0.0)
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    tl.store(out_ptr + rt[:, None].to(tl.int64) * stride_o + re[None, :], acc, mask=tm[:, None] & em[None, :])


_KERNEL = DirectLauncher(_router_logits_kernel)


def blocks(T: int, E: int, H: int) -> tuple[int, int, int]:
    """(BLOCK_T, BLOCK_E, BLOCK_H): tokens in blocks (up to 32) and then experts in groups until about PROGRAMS
    programs remain (one token and one expert a program while there are fewer), H in steps that fill a
    TILE-element product."""
    T = max(T, 1)
    block_t = min(triton.next_power_of_2(triton.cdiv(T * E, PROGRAMS)), triton.next_power_of_2(T), 32)
    share = E * triton.cdiv(T, block_t) // PROGRAMS  # experts a program for about PROGRAMS programs
    block_e = min(1 << max(share.bit_length() - 1, 0), 16, triton.next_power_of_2(E))  # (a power of 2, at most share)
    block_h = max(min(TILE // (block_t * block_e), triton.next_power_of_2(H)), 16)
    return block_t, block_e, block_h


def router_logits(x: torch.Tensor, w: torch.Tensor, block: tuple[int, int, int] | None = None) -> torch.Tensor:
    """Same signature as moeserve.kernels.router_gemm.router_logits_reference (x 2-D, w float32). block: (BLOCK_T,
    BLOCK_E, BLOCK_H) in place of `blocks`' choice (scripts/gpu/bench_router.py compares them)."""
    T, H = x.shape
    E = w.shape[0]
    if w.shape[1] != H or w.dtype != torch.float32:
        raise ValueError(f"router_logits: x {tuple(x.shape)} and w {tuple(w.shape)} {w.dtype} do not fit")
    x = x if x.stride(-1) == 1 else x.contiguous()
    w = w if w.stride(-1) == 1 else w.contiguous()
    out = torch.empty(T, E, dtype=torch.float32, device=x.device)
    if T == 0:
        return out
    block_t, block_e, block_h = block or blocks(T, E, H)
    _KERNEL((triton.cdiv(E, block_e), triton.cdiv(T, block_t)), x, w, out, T, E, H, x.stride(0), w.stride(0),
            out.stride(0), BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_H=block_h, num_warps=4, num_stages=2)
    return out
