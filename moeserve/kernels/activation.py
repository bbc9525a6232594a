"""Activations.

    silu_and_mul(x [..., 2I]) -> silu(x[..., :I]) * x[..., I:]   (SwiGLU on a fused [gate | up] projection)

On CUDA one Triton kernel (triton_ops/activation.py) reads each row once and writes the product, where torch's two
ops (silu, then the multiply) make two passes and an intermediate the size of the output: the dense MLP and the
shared experts at every step, and the experts' torch grouped-GEMM path at prefill sizes. It rounds as the two ops
do (silu's result to the input's dtype, then the product), so it gives the reference's values.
`silu_and_mul_reference` runs everywhere else.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moeserve.kernels.triton_available import use_triton


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Module docstring. Triton on CUDA, the reference elsewhere (and under torch.compile)."""
    if use_triton(x) and x.numel() and not torch.compiler.is_compiling():
        from moeserve.kernels.triton_ops.activation import silu_and_mul as triton_silu_and_mul

        return triton_silu_and_mul(x)
    return silu_and_mul_reference(x)
