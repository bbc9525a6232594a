"""The routed experts' grouped GEMMs over both MoE layouts, with SiLU-and-mul fused into the gate/up GEMM.

    moe_gemm(x [M, K], w [E, N, K], expert_offsets [E + 1] int32, num_tokens_per_expert [E] int32, silu) -> [M, N']
        contiguous layout: rows offsets[e] .. offsets[e] + count[e] get x @ w[e]^T
    moe_gemm_masked(x [E, C, K], w [E, N, K], masked_m [E] int32, silu) -> [E, C, N']
        masked layout: the first masked_m[e] rows of x[e] get x[e] @ w[e]^T
    silu=False: N' = N.  silu=True: w holds [gate; up] (N = 2I) and the result is silu(x Wg^T) * (x Wu^T), N' = I.
    pairs [M] int32, top_k: the contiguous layout's rows are not in x but named: row r is x[pairs[r] // top_k]
        (-1: a padding row, zeros); the Triton kernel reads them from x where it loads its tiles
        (core/layouts.py ContiguousLayout).

    tally [n] int64: the first n experts' counts (num_tokens_per_expert / masked_m) are added into it (the expert-
        utilization counter, ep/stats.py); the Triton kernel does it in its own launch.

Rows outside the counted ones hold unspecified values (the combine never reads them). The Triton kernel
(triton_ops/moe_gemm.py) runs for CUDA tensors; the references (torch's grouped GEMM / bmm) everywhere else.
"""

from __future__ import annotations

import torch

from moeserve.core.layouts import gather_rows
from moeserve.kernels.activation import silu_and_mul
from moeserve.kernels.grouped_gemm import grouped_gemm
from moeserve.kernels.moe_config import get_config
from moeserve.kernels.triton_available import use_triton

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def gemm_op(silu: bool) -> str:
    """The op name the tuned tables are filed under (moeserve/kernels/moe_config.py)."""
    return "moe_gemm_silu" if silu else "moe_gemm"


def _add_tally(tally: torch.Tensor | None, counts: torch.Tensor) -> None:
    if tally is not None:
        tally += counts[:tally.shape[0]]


def moe_gemm_reference(x: torch.Tensor, w: torch.Tensor, expert_offsets: torch.Tensor,
                       num_tokens_per_expert: torch.Tensor, silu: bool = False, pairs: torch.Tensor | None = None,
                       top_k: int = 1, tally: torch.Tensor | None = None) -> torch.Tensor:
    _add_tally(tally, num_tokens_per_expert)
    if pairs is not None:
        x = gather_rows(x, pairs, top_k)
    y = grouped_gemm(x, w, expert_offsets, num_tokens_per_expert)
    return silu_and_mul(y) if silu else y


def moe_gemm_masked_reference(x: torch.Tensor, w: torch.Tensor, masked_m: torch.Tensor,
                              silu: bool = False, tally: torch.Tensor | None = None) -> torch.Tensor:
    _add_tally(tally, masked_m)
    y = torch.bmm(x, w.transpose(1, 2))  # every row, counted or not: static shapes for CUDA graphs
    return silu_and_mul(y) if silu else y


def _triton_ok(x: torch.Tensor, w: torch.Tensor) -> bool:
    return use_triton(x) and x.dtype == w.dtype and x.dtype in _DTYPES and w.stride(-1) == 1


def moe_gemm(x: torch.Tensor, w: torch.Tensor, expert_offsets: torch.Tensor, num_tokens_per_expert: torch.Tensor,
             silu: bool = False, pairs: torch.Tensor | None = None, top_k: int = 1,
             tally: torch.Tensor | None = None) -> torch.Tensor:
    """Contiguous layout (module docstring). Triton on CUDA, the reference elsewhere, and torch's grouped GEMM
    where the tuned table says it was faster at this size (bf16 only: {"backend": "torch"})."""
    if _triton_ok(x, w) and not torch.compiler.is_compiling():
        E, n_w, K = w.shape
        rows = x.shape[0] if pairs is None else pairs.shape[0]
        cfg = get_config(gemm_op(silu), rows, E, n_w // 2 if silu else n_w, K, w.dtype, w.device)
        if cfg.get("backend") != "torch" or x.dtype != torch.bfloat16:
            from moeserve.kernels.triton_ops import moe_gemm as triton_ops

            return triton_ops.moe_gemm(x.contiguous(), w, expert_offsets, num_tokens_per_expert, silu, cfg,
                                       pairs=pairs, top_k=top_k, tally=tally)
    return moe_gemm_reference(x, w, expert_offsets, num_tokens_per_expert, silu, pairs, top_k, tally)


def moe_gemm_masked(x: torch.Tensor, w: torch.Tensor, masked_m: torch.Tensor, silu: bool = False,
                    tally: torch.Tensor | None = None) -> torch.Tensor:
    """Masked layout (module docstring). Triton on CUDA, the reference elsewhere."""
    if _triton_ok(x, w) and not torch.compiler.is_compiling():
        from moeserve.kernels.triton_ops import moe_gemm as triton_ops

        return triton_ops.moe_gemm_masked(x.contiguous(), w, masked_m, silu, tally=tally)
    return moe_gemm_masked_reference(x, w, masked_m, silu, tally)
