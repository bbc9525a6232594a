"""MLA's per-layer latent write on the CPU (cpu_mla_rope_cache.cpp): kernels/mla_rope_cache.py's fused norm, rotary
and cache write in one C++ pass for bf16 or float32, the reference's bits (the norm's to a rounding: its sum of
squares in another order).

    cpu_mla_rope_cache(q_rope, c_kv, k_rope, norm_weight, eps, rope, interleaved, cache, loc) -> q_rope rotated

`takes(...)` says whether it runs: CPU activations, weight and cache all bf16 or all float32, float32 rope, last
dimensions dense, not under torch.compile. The reference (six torch ops, two copies) was about a tenth of a bf16
decode step of the tiny V3 at batch 1 (py-spy, one thread of the 2-core EPYC VM, 2026-12-07). The C++ source is compiled on first use
(moeserve/kernels/build.py); where that is impossible `takes` is False and the reference runs.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from moeserve.kernels.build import load_library

SOURCE = Path(__file__).with_name("cpu_mla_rope_cache.cpp")
DTYPES = (torch.bfloat16, torch.float32)


def load() -> ctypes.CDLL | None:
    """The compiled kernel library; None where it cannot be built."""
    return load_library(SOURCE, _bind, "MLA's latent write on the CPU runs torch's ops")


def takes(q_rope: torch.Tensor, c_kv: torch.Tensor, k_rope: torch.Tensor, norm_weight: torch.Tensor,
          rope: torch.Tensor, cache: torch.Tensor) -> bool:
    """Whether cpu_mla_rope_cache runs this write (module docstring); the cheap tests first."""
    dtype = q_rope.dtype
    if dtype not in DTYPES or cache.dtype is not dtype or not q_rope.is_cpu:
        return False
    return (c_kv.dtype is dtype and k_rope.dtype is dtype and norm_weight.dtype is dtype
            and rope.dtype is torch.float32 and q_rope.dim() == 3 and q_rope.stride(2) == 1
            and c_kv.stride(1) == 1 and k_rope.stride(1) == 1 and rope.is_contiguous() and cache.is_contiguous()
            and norm_weight.is_contiguous() and q_rope.shape[0] > 0
            and not torch.compiler.is_compiling() and load() is not None)


def cpu_mla_rope_cache(q_rope: torch.Tensor, c_kv: torch.Tensor, k_rope: torch.Tensor, norm_weight: torch.Tensor,
                       eps: float, rope: torch.Tensor, interleaved: bool, cache: torch.Tensor,
                       loc: torch.Tensor) -> torch.Tensor:
    """kernels/mla_rope_cache.py's signature and result; check takes() first."""
    lib = load()
    if lib is None:
        raise RuntimeError("the CPU MLA rope-cache kernel does not run here; check takes()")
    T, H, R = q_rope.shape
    r = c_kv.shape[1]
    if cache.shape[1] != r + R or k_rope.shape[1] != R or rope.shape != (T, 2, R):
        raise ValueError(f"mla_rope_cache: cache {tuple(cache.shape)}, c_kv {tuple(c_kv.shape)}, k_rope "
                         f"{tuple(k_rope.shape)}, rope {tuple(rope.shape)} do not fit q_rope {tuple(q_rope.shape)}")
    idx = loc.to(torch.int64).contiguous()
    q_out = q_rope.new_empty(T, H, R)
    fn = lib.moeserve_mla_rope_cache_bf16 if q_rope.dtype is torch.bfloat16 else lib.moeserve_mla_rope_cache_f32
    fn(q_rope.data_ptr(), q_rope.stride(0), q_rope.stride(1), c_kv.data_ptr(), c_kv.stride(0), k_rope.data_ptr(),
       k_rope.stride(0), norm_weight.data_ptr(), float(eps), rope.data_ptr(), int(interleaved), cache.data_ptr(),
       idx.data_ptr(), T, H, r, R, q_out.data_ptr(), torch.get_num_threads())
    return q_out


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    for fn in (lib.moeserve_mla_rope_cache_bf16, lib.moeserve_mla_rope_cache_f32):
        fn.restype = None
        fn.argtypes = [p, i64, i64, p, i64, p, i64, p, ctypes.c_float, p, ctypes.c_int, p, p, i64, i64, i64, i64, p,
                       ctypes.c_int]
    return lib
