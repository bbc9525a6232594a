"""Combine fused with the top-k weighted sum: each token's k expert outputs gathered and summed in one pass.

    moe_combine(y [M, H], rows [T, k] int (-1: skip), weights [T, k] fp32, out_dtype, add=None) -> [T, H]
        out[t] = sum_j weights[t, j] * y[rows[t, j]] (+ add[t]), summed in fp32, written in out_dtype (y's dtype by
        default); add [T, H]: the shared experts' output, added in the same pass (no extra kernel)

Rows named -1 are never read (so unread layout rows may hold anything, NaN included). The Triton kernel
(triton_ops/moe_combine.py) runs for CUDA tensors, `moe_combine_reference` elsewhere.
"""

from __future__ import annotations

import torch

from moeserve.kernels.triton_available import use_triton


def moe_combine_reference(y: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor,
                          out_dtype: torch.dtype | None = None, add: torch.Tensor | None = None) -> torch.Tensor:
    T, k = rows.shape
    valid = rows >= 0
    picked = y.index_select(0, rows.clamp(min=0).reshape(-1).long()).view(T, k, y.shape[-1]).float()
    picked = picked.masked_fill_(~valid[..., None], 0.0)  # NaN * 0 would be NaN: fill, not multiply
    w = torch.where(valid, weights.float(), 0.0)
    out = torch.bmm(w[:, None, :], picked)[:, 0]  # [T, 1, k] x [T, k, H]: the weighted sum
    if add is not None:
        out = out + add.float()
    return out.to(out_dtype or y.dtype)


def moe_combine(y: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor,
                out_dtype: torch.dtype | None = None, add: torch.Tensor | None = None) -> torch.Tensor:
    """Module docstring. Triton on CUDA, the reference elsewhere."""
    if use_triton(y) and y.stride(-1) == 1 and rows.shape[0] > 0 and not torch.compiler.is_compiling():
        from moeserve.kernels.triton_ops.moe_combine import moe_combine as triton_moe_combine

        return triton_moe_combine(y, rows, weights, out_dtype, add)
    return moe_combine_reference(y, rows, weights, out_dtype, add)
