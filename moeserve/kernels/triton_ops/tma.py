"""Whether a tensor can be read through a tensor descriptor (the tensor memory accelerator), shared by the grouped
GEMMs (triton_ops/moe_gemm.py, triton_ops/fp8_grouped_gemm.py)."""

from __future__ import annotations

import torch


def descriptor_usable(t: torch.Tensor) -> bool:
    """A Hopper-class GPU (or the interpreter), a 16-byte aligned base and row stride, the last dimension contiguous;
    a 3-D tensor (the experts' weights, viewed [E * N, K]) contiguous as a whole."""
    aligned = t.data_ptr() % 16 == 0 and t.stride(-2) * t.element_size() % 16 == 0 and t.stride(-1) == 1
    whole = t.dim() == 2 or t.is_contiguous()
    return aligned and whole and (not t.is_cuda or torch.cuda.get_device_capability(t.device)[0] >= 9)
