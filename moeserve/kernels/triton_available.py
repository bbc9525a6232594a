"""Whether a tensor's op should take its Triton kernel: CUDA tensors, Triton importable, not disabled."""

from __future__ import annotations

import functools
import os

import torch


@functools.cache
def triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def use_triton(x: torch.Tensor) -> bool:
    """True for CUDA tensors when Triton imports; MOESERVE_DISABLE_TRITON=1 keeps every op on its torch path."""
    return x.is_cuda and os.environ.get("MOESERVE_DISABLE_TRITON", "0") != "1" and triton_importable()
