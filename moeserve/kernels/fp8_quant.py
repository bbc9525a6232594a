"""FP8 block quantization, DeepSeek-V3's recipe (e4m3, 128-wide blocks, scales in float32).

    weights      w [..., N, K]  ->  q [..., N, K] e4m3,  scale_inv [..., ceil(N/128), ceil(K/128)]
                 one scale per 128 x 128 block; w ~= q * scale_inv (DeepSeek's `weight_dequant` multiplies)
    activations  x [..., K]     ->  q [..., K] e4m3,     scale [..., ceil(K/128)]
                 one scale per token and group of 128 along K, computed on the fly (activation_scheme dynamic)

A block's scale is amax(|block|) / 448, the largest e4m3 value, so the block's largest entry lands on 448. A
partial block at the end of a dimension (N or K not a multiple of 128) is quantized by what it holds, as
DeepSeek's ceil-shaped scales imply. An all-zero block gets a tiny floor scale (0 stays 0; no division by 0).

`quantize_activations` takes the Triton kernel for CUDA tensors (kernels/triton_ops/fp8_quant.py), else
`quantize_activations_reference`; both have the same signature and, on the GPU, the same bits (both round to
nearest even; Triton 3.9's CPU interpreter drops some round-up carries, see tests/kernels/test_fp8_kernels.py).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from moeserve.core.layouts import gather_rows
from moeserve.kernels.activation import silu_and_mul
from moeserve.kernels.fp8_format import (  # noqa: F401 - the format's names, for the recipe's callers
    ACT_SCALE_FLOOR,
    BLOCK,
    FP8_DTYPE,
    FP8_MAX,
    WEIGHT_SCALE_FLOOR,
    num_blocks,
)
from moeserve.kernels.triton_available import use_triton


def _pad_to_blocks(t: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    pad: list[int] = []
    for d in range(t.dim() - 1, -1, -1):  # F.pad lists the last dimension first
        pad += [0, num_blocks(t.shape[d]) * BLOCK - t.shape[d]] if d in dims else [0, 0]
    return torch.nn.functional.pad(t, pad) if any(pad) else t


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] float -> (q [..., N, K] e4m3, scale_inv [..., ceil(N/128), ceil(K/128)] float32)."""
    *lead, n, k = w.shape
    nb, kb = num_blocks(n), num_blocks(k)
    padded = _pad_to_blocks(w.float(), (w.dim() - 2, w.dim() - 1))
    blocks = padded.view(*lead, nb, BLOCK, kb, BLOCK)
    scale = blocks.abs().amax(dim=(-3, -1)).clamp(min=WEIGHT_SCALE_FLOOR) / FP8_MAX  # [..., nb, kb]
    q = (blocks / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    q = q.view(*lead, nb * BLOCK, kb * BLOCK)[..., :n, :k].contiguous()
    return q, scale


def dequantize_weight(q: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q [..., N, K] e4m3 and scale_inv [..., ceil(N/128), ceil(K/128)] -> q * scale_inv [..., N, K] in `dtype`."""
    n, k = q.shape[-2:]
    assert scale_inv.shape[-2:] == (num_blocks(n), num_blocks(k)), (tuple(q.shape), tuple(scale_inv.shape))
    s = scale_inv.repeat_interleave(BLOCK, dim=-2)[..., :n, :].repeat_interleave(BLOCK, dim=-1)[..., :k]
    return (q.float() * s).to(dtype)


def scales_mn_major(scale: torch.Tensor) -> torch.Tensor:
    """scale [..., G] with the same values stored [G, rows] (rows = the leading dimensions flattened): the layout
    in which a GEMM tile reads its rows' scales of one K block as one contiguous run (and cuBLAS's 1 x 128 one)."""
    g = scale.shape[-1]
    return scale.reshape(-1, g).t().contiguous().t().view(scale.shape)


def quantize_activations_reference(x: torch.Tensor, mn_major: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (q [..., K] e4m3, scale [..., ceil(K/128)] float32): per token, per group of 128 along K.
    mn_major: the scales stored [groups, rows] (see `scales_mn_major`); the values are the same."""
    k = x.shape[-1]
    kb = num_blocks(k)
    groups = _pad_to_blocks(x.float(), (x.dim() - 1,)).view(*x.shape[:-1], kb, BLOCK)
    scale = groups.abs().amax(dim=-1).clamp(min=ACT_SCALE_FLOOR) / FP8_MAX
    q = (groups / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(*x.shape[:-1], kb * BLOCK)[..., :k].contiguous(), (scales_mn_major(scale) if mn_major else scale)


class QuantizedRows(NamedTuple):
    """Activations quantized by the op that made them (an RMSNorm with `quantize`, kernels/rms_norm.py), handed to
    the FP8 GEMM after it instead of the rows: q [..., K] e4m3, scale [..., ceil(K/128)] float32 (either layout)."""

    q: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The values the GEMM multiplies, in `dtype` (the CPU layers' math)."""
        return dequantize_activations(self.q, self.scale, dtype)


def dequantize_activations(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q [..., K] e4m3, scale [..., ceil(K/128)] -> q * scale [..., K] in `dtype`."""
    k = q.shape[-1]
    return (q.float() * scale.repeat_interleave(BLOCK, dim=-1)[..., :k]).to(dtype)


def fake_quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """x rounded through FP8 per token and group of 128, back in x's dtype: what an FP8 GEMM sees of x (for the CPU
    layers, which multiply by dequantized weights)."""
    return dequantize_activations(*quantize_activations_reference(x), x.dtype)


def silu_and_mul_quantize_reference(x: torch.Tensor, mn_major: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., 2I] ([gate | up]) -> quantize_activations(silu(gate) * up): the SwiGLU output straight to FP8, for
    the FP8 GEMM after it (the experts' and the dense MLP's down projection)."""
    return quantize_activations_reference(silu_and_mul(x), mn_major)


def silu_and_mul_quantize(x: torch.Tensor, mn_major: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's result in one Triton kernel on CUDA (the [..., I] product never reaches memory in x's
    dtype; it is rounded to it in registers, so the bits are the unfused pair's)."""
    if use_triton(x):
        from moeserve.kernels.triton_ops.fp8_quant import (
            silu_and_mul_quantize as triton_silu_and_mul_quantize,
        )

        return triton_silu_and_mul_quantize(x, mn_major)
    return silu_and_mul_quantize_reference(x, mn_major)


def quantize_activations(x: torch.Tensor, mn_major: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (q [..., K] e4m3, scale [..., ceil(K/128)] float32), the Triton kernel on CUDA. mn_major: the
    scales stored [groups, rows], as the GEMMs read them best (`scales_mn_major`)."""
    if use_triton(x):
        from moeserve.kernels.triton_ops.fp8_quant import quantize_activations as triton_quantize

        return triton_quantize(x, mn_major)
    return quantize_activations_reference(x, mn_major)


def quantize_gathered_reference(tokens: torch.Tensor, pairs: torch.Tensor, top_k: int,
                                mn_major: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens [T, K], pairs [M] int32 (a contiguous MoE layout's rows: row r is token pairs[r] // top_k, zeros
    where pairs[r] is -1) -> quantize_activations of those rows: (q [M, K] e4m3, scale [M, ceil(K/128)])."""
    return quantize_activations_reference(gather_rows(tokens, pairs, top_k), mn_major)


def quantize_rows_reference(x: torch.Tensor, silu: bool = False, mn_major: bool = False,
                            pairs: torch.Tensor | None = None, top_k: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows a GEMM multiplies, quantized: x's rows, or with pairs the tokens they gather
    (`quantize_gathered_reference`), or with silu silu(gate) * up of x's [gate | up] rows. (The Triton side:
    triton_ops/fp8_quant.quantize_rows.)"""
    if pairs is not None:
        return quantize_gathered_reference(x, pairs, top_k, mn_major)
    return (silu_and_mul_quantize_reference if silu else quantize_activations_reference)(x, mn_major)


def quantize_gathered(tokens: torch.Tensor, pairs: torch.Tensor, top_k: int,
                      mn_major: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's result in one Triton pass on CUDA (the rows are read from the tokens, not copied first)."""
    if use_triton(tokens):
        from moeserve.kernels.triton_ops.fp8_quant import quantize_gathered as triton_quantize_gathered

        return triton_quantize_gathered(tokens, pairs, top_k, mn_major)
    return quantize_gathered_reference(tokens, pairs, top_k, mn_major)
