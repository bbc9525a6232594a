"""Grouped GEMM over a contiguous expert layout: each segment of rows times its own expert's weight.

`grouped_gemm` runs torch._grouped_mm where the device and dtype take it (probed once), else
`grouped_gemm_reference`, a loop over experts that touches valid rows only. Under torch.compile it is the custom
op `moeserve::grouped_gemm`.
"""

from __future__ import annotations

import torch


def grouped_gemm_reference(x: torch.Tensor, w: torch.Tensor, expert_offsets: torch.Tensor,
                           num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """x [M, K], w [E, N, K] -> [M, N]: rows offsets[e] .. offsets[e] + count[e] get x @ w[e]^T, the rest 0."""
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        return _grouped_gemm_static(x, w, expert_offsets, num_tokens_per_expert)
    out = x.new_zeros(x.shape[0], w.shape[1])
    offsets, counts = expert_offsets.tolist(), num_tokens_per_expert.tolist()
    for e, n in enumerate(counts):
        if n:
            rows = slice(offsets[e], offsets[e] + n)
            out[rows] = x[rows] @ w[e].t()
    return out


def _grouped_gemm_static(x: torch.Tensor, w: torch.Tensor, expert_offsets: torch.Tensor,
                         num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """The reference without host reads (for CUDA-graph capture where torch._grouped_mm cannot run): every expert
    multiplies every row and each row keeps its own expert's result. E times the FLOPs; small models only."""
    rows = torch.arange(x.shape[0], device=x.device)[:, None]
    starts = expert_offsets[:-1].long()[None, :]
    valid = (rows >= starts) & (rows < starts + num_tokens_per_expert.long()[None, :])  # [M, E]
    out = x.new_zeros(x.shape[0], w.shape[1])
    for e in range(w.shape[0]):
        out += valid[:, e : e + 1].to(x.dtype) * (x @ w[e].t())
    return out


def grouped_gemm(x: torch.Tensor, w: torch.Tensor, expert_offsets: torch.Tensor,
                 num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """x [M, K], w [E, N, K], expert_offsets [E + 1] int32 -> [M, N].

    Segment e (rows offsets[e]:offsets[e+1]) is multiplied by w[e]^T. Only the first num_tokens_per_expert[e]
    rows of a segment are meaningful; padding rows and rows past offsets[E] hold unspecified values.
    """
    if torch.compiler.is_compiling():  # opaque to the compiler: it reads offsets on the host and picks a kernel
        return torch.ops.moeserve.grouped_gemm(x, w, expert_offsets, num_tokens_per_expert)
    if x.shape[0] == 0:
        return x.new_zeros(0, w.shape[1])
    if _grouped_mm_ok(x, w):
        return torch._grouped_mm(x, w.transpose(1, 2), offs=expert_offsets[1:].to(torch.int32))
    return grouped_gemm_reference(x, w, expert_offsets, num_tokens_per_expert)


_PROBED: dict[tuple[str, torch.dtype], bool] = {}


def _grouped_mm_ok(x: torch.Tensor, w: torch.Tensor) -> bool:
    if not hasattr(torch, "_grouped_mm") or x.dtype != w.dtype or not x.is_contiguous():
        return False
    if x.is_cuda and (x.shape[1] % 8 or w.shape[1] % 8):  # 16-byte aligned rows for the CUDA kernel
        return False
    if x.is_cuda and x.dtype != torch.bfloat16:  # other dtypes take a fallback that reads offsets to the host
        return False
    key = (x.device.type, x.dtype)
    if key not in _PROBED:
        try:
            a = torch.ones(4, 8, dtype=x.dtype, device=x.device)
            b = torch.ones(2, 8, 8, dtype=x.dtype, device=x.device)
            y = torch._grouped_mm(a, b, offs=torch.tensor([1, 4], dtype=torch.int32, device=x.device))
            _PROBED[key] = bool((y == 8).all())
        except (RuntimeError, NotImplementedError):
            _PROBED[key] = False
    return _PROBED[key]


@torch.library.custom_op("moeserve::grouped_gemm", mutates_args=())
def _grouped_gemm_op(x: torch.Tensor, w: torch.Tensor, expert_offsets: torch.Tensor,
                     num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """`grouped_gemm` as one operator for torch.compile (eager calls take the function directly: a custom op's
    Python dispatch costs more than the small GEMMs of a decode step)."""
    return grouped_gemm(x, w, expert_offsets, num_tokens_per_expert)


@_grouped_gemm_op.register_fake
def _(x: torch.Tensor, w: torch.Tensor, expert_offsets: torch.Tensor,
      num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], w.shape[1])
