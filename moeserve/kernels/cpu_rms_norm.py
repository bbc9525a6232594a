"""RMSNorm of bf16 or float32 rows on the CPU (cpu_rms_norm.cpp), optionally after the residual add: what
rms_norm.rms_norm_reference computes, with each of its roundings to bf16, without copying the rows to fp32 and back
(torch's rms_norm of bf16 makes four such copies per call, each an op of its own), and in float32 in one call
(torch's runs its pow, mean, add, rsqrt and products as ops of their own: at a decode step's one row, each op's
dispatch is most of the time).

    cpu_rms_norm(x [..., D], weight [D], eps[, residual [..., D]]) -> y [..., D] (, h = x + residual), one dtype

`takes(x, weight, residual)` says whether it runs: CPU tensors of one dtype, bf16 or float32, with contiguous rows,
not under torch.compile.
The C++ source is compiled on first use (moeserve/kernels/build.py); where that is impossible `takes` is False and
the reference runs.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from moeserve.kernels.build import load_library

SOURCE = Path(__file__).with_name("cpu_rms_norm.cpp")
DTYPES = (torch.bfloat16, torch.float32)


def load() -> ctypes.CDLL | None:
    """The compiled kernel library; None where it cannot be built."""
    return load_library(SOURCE, _bind, "RMSNorm on the CPU runs torch's")


def takes(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> bool:
    """Whether cpu_rms_norm runs this norm (module docstring); the cheap tests first."""
    if x.dtype not in DTYPES or weight.dtype is not x.dtype or not x.is_cpu:
        return False
    return ((residual is None or (residual.dtype is x.dtype and residual.shape == x.shape))
            and weight.shape == x.shape[-1:] and weight.is_contiguous() and x.numel() > 0
            and not torch.compiler.is_compiling() and load() is not None)


def cpu_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
                 ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Module docstring; check takes() first."""
    lib = load()
    if lib is None:
        raise RuntimeError("the CPU RMSNorm kernel does not run here; check takes()")
    D = x.shape[-1]
    xc = x.contiguous()
    rc = residual.contiguous() if residual is not None else None
    y = torch.empty_like(xc)
    h = torch.empty_like(xc) if rc is not None else None
    fn = lib.moeserve_rms_norm_bf16 if x.dtype is torch.bfloat16 else lib.moeserve_rms_norm_f32
    fn(xc.data_ptr(), rc.data_ptr() if rc is not None else None, weight.data_ptr(), xc.numel() // D, D, float(eps),
       y.data_ptr(), h.data_ptr() if h is not None else None, torch.get_num_threads())
    return y if h is None else (y, h)


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    for fn in (lib.moeserve_rms_norm_bf16, lib.moeserve_rms_norm_f32):
        fn.restype = None
        fn.argtypes = [p, p, p, i64, i64, ctypes.c_float, p, p, ctypes.c_int]
    return lib
