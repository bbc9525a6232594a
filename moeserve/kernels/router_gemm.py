"""The MoE gate's logits in float32 from activations in the model's dtype, in one kernel on GPUs.

    router_logits(x [T, H] (bf16 / fp16 / fp32), w [E, H] float32) -> [T, E] float32 = x W^T, summed in fp32

torch's way, `F.linear(x.float(), w)`, is three kernels at decode sizes (the upcast copy of x, then cuBLAS's fp32
GEMV in two: the dot and its reduction), each a launch of a few microseconds against less than one of work: the
Triton kernel (triton_ops/router_gemm.py) reads x in its dtype and multiplies in fp32 (no TF32) on the CUDA cores,
a program for each expert and block of tokens. It runs where the work is small (T x E x H under MAX_WORK
multiply-adds: V2-Lite's gate up to 64 tokens, V2's up to 16, V3's up to 8), where it measured 1.4-3.5x faster
than torch's three kernels in CUDA graphs. Larger gates with bf16 x at SPLIT_MIN_TOKENS tokens or more run a
second Triton kernel on the tensor cores (`router_logits_split`: the fp32 weights split into three bf16 parts in
registers, exact products, fp32 sums), where torch's upcast copy of x and SIMT fp32 SGEMM took 2.8 ms of a
4 x 2,048 V2-Lite prefill; between the two (decode batches of 128-256 tokens, short prefills), and for fp32 or
fp16 x, cuBLAS. `router_logits_reference` runs everywhere else.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moeserve.kernels.triton_available import use_triton

MAX_WORK = 1 << 24
SPLIT_MIN_TOKENS = 2048  # below it cuBLAS measured faster (V2-Lite's gate at 1,024 tokens: 32 against 42 us)


def router_logits_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x.float(), w.float())


def router_logits(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Module docstring. Triton on CUDA, the reference elsewhere (and under torch.compile)."""
    if use_triton(x) and w.dtype == torch.float32 and x.dim() == 2 and not torch.compiler.is_compiling():
        if x.shape[0] * w.shape[0] * w.shape[1] < MAX_WORK:
            from moeserve.kernels.triton_ops.router_gemm import router_logits as triton_router_logits

            return triton_router_logits(x, w)
        if x.dtype == torch.bfloat16 and x.shape[0] >= SPLIT_MIN_TOKENS:
            from moeserve.kernels.triton_ops.router_gemm import router_logits_split

            return router_logits_split(x, w)
    return router_logits_reference(x, w)
