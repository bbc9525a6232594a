"""Triton `router_logits` (moeserve/kernels/router_gemm.py): grid (expert blocks, token blocks); a program walks H
in blocks, loading its tokens' x (upcast in registers) and its experts' fp32 weights, and sums their products in
fp32 on the CUDA cores (IEEE: no TF32 rounding of the weights).

At decode sizes the work is a few million multiply-adds, so the time is latency: how many programs run at once and
how many loop steps each waits on. A program takes one expert and a quarter of the tokens (up to 16), and sums a
[BLOCK_T, 1, BLOCK_H] product over H in steps of TILE / BLOCK_T, so V2-Lite's gate at batch 1 is 64 programs of one
step each. A `tl.dot` tile (16 rows at least) left most of the GPU idle and looped over H in small steps; larger
expert blocks measured slower too (on an H200: benchmark/results/).

At prefill sizes (`router_logits_split`, bf16 x) the work is a GEMM worth the tensor cores: each fp32 weight tile is
split in registers into three bf16 parts, hi + mid + lo, which sum to it exactly (each part holds the next 8 bits
of the 24-bit significand), and three bf16 `tl.dot`s with fp32 accumulation add x hi + x mid + x lo, smallest
first. Every product of a bf16 x with a bf16 part is exact in fp32, so the logits are the fp32 dot's up to the
order of the additions, where torch's way upcasts x (a copy of it in fp32) and runs cuBLAS's SIMT fp32 SGEMM."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeserve.kernels.triton_ops.direct_launch import DirectLauncher

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


@triton.jit
def _router_logits_split_kernel(x_ptr, w_ptr, out_ptr, T, E, H, stride_x, stride_w, stride_o,
                                BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                                UPCAST: tl.constexpr):
    rt = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    re = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    tm, em = rt < T, re < E
    acc = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        km = rk < H
        x = tl.load(x_ptr + rt[:, None].to(tl.int64) * stride_x + rk[None, :], mask=tm[:, None] & km[None, :],
                    other=0.0)
        w = tl.load(w_ptr + rk[:, None] + re[None, :] * stride_w, mask=km[:, None] & em[None, :], other=0.0)
        hi = w.to(tl.bfloat16)
        rest = w - hi.to(tl.float32)  # exact: w's bits below hi's
        mid = rest.to(tl.bfloat16)
        lo = (rest - mid.to(tl.float32)).to(tl.bfloat16)  # exact: the last 8 bits
        if UPCAST:  # the interpreter's bf16 dot is wrong: the same exact products in fp32
            x, hi, mid, lo = x.to(tl.float32), hi.to(tl.float32), mid.to(tl.float32), lo.to(tl.float32)
        acc = tl.dot(x, lo, acc)
        acc = tl.dot(x, mid, acc)
        acc = tl.dot(x, hi, acc)
    tl.store(out_ptr + rt[:, None].to(tl.int64) * stride_o + re[None, :], acc, mask=tm[:, None] & em[None, :])


_SPLIT_KERNEL = DirectLauncher(_router_logits_split_kernel)


def blocks(T: int, H: int) -> tuple[int, int, int]:
    """(BLOCK_T, BLOCK_E, BLOCK_H): a quarter of the tokens a program (1 to 16), one expert, H in steps that fill
    a TILE-element product (at least 16, at most H's next power of 2)."""
    block_t = min(max(triton.next_power_of_2(max(T, 1)) // 4, 1), 16)
    return block_t, 1, max(min(TILE // block_t, triton.next_power_of_2(H)), 16)


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
    block_t, block_e, block_h = blocks(T, H)
    _KERNEL((triton.cdiv(E, block_e), triton.cdiv(T, block_t)), x, w, out, T, E, H, x.stride(0), w.stride(0),
            out.stride(0), BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_H=block_h, num_warps=4, num_stages=2)
    return out


def split_blocks(T: int, E: int) -> tuple[int, int, int]:
    """(BLOCK_T, BLOCK_E, BLOCK_K) of the split kernel: 64 x 64 output tiles (16 rows and experts at least), 128
    tokens a tile for 128 experts or more (V3's gate at 8,192 tokens: 206 against 314 us), K in steps of 64."""
    t_max = 128 if E >= 128 else 64
    return (min(t_max, max(16, triton.next_power_of_2(T))), min(64, max(16, triton.next_power_of_2(E))), 64)


def router_logits_split(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """router_logits on the tensor cores for bf16 x (module docstring): same signature and result as the
    reference, up to the order of fp32 additions."""
    T, H = x.shape
    E = w.shape[0]
    if w.shape[1] != H or w.dtype != torch.float32 or x.dtype != torch.bfloat16:
        raise ValueError(f"router_logits_split: x {tuple(x.shape)} {x.dtype} and w {tuple(w.shape)} {w.dtype} do "
                         "not fit (bf16 x, fp32 w)")
    x = x if x.stride(-1) == 1 else x.contiguous()
    w = w if w.stride(-1) == 1 else w.contiguous()
    out = torch.empty(T, E, dtype=torch.float32, device=x.device)
    if T == 0:
        return out
    block_t, block_e, block_k = split_blocks(T, E)
    _SPLIT_KERNEL((triton.cdiv(T, block_t), triton.cdiv(E, block_e)), x, w, out, T, E, H, x.stride(0), w.stride(0),
                  out.stride(0), BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_K=block_k,
                  UPCAST=not x.is_cuda,  # only under TRITON_INTERPRET (CPU tensors)
                  num_warps=4, num_stages=3)
    return out
