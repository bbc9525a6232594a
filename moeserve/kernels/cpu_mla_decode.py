"""MLA decode attention on the CPU (cpu_mla_decode.cpp): one query per request over its rows of the latent cache,
read in place through kv_indices / kv_indptr.

`mla_decode(q, cache, kv_indices, kv_indptr, v_dim, scale)` computes what `mla_decode_reference` (beside it, the
same signature) computes: for request b, softmax(scale * q[b] · K^T) · V with K = its latent rows [c_kv | k_rope]
and V = their first v_dim columns (c_kv): the weight-absorbed MLA decode, all heads against one latent head.
The reference layers/attention/ops.decode_attention gathers the rows into a padded block first; at batch 64 that
copy and the padded products were most of a CPU decode step.

The C++ source is compiled on first use (moeserve/kernels/build.py); `available()` is False where that is
impossible and callers keep the reference path. Under torch.compile the kernel is the custom op
`moeserve::cpu_mla_decode`.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from moeserve.kernels.build import load_library

SOURCE = Path(__file__).with_name("cpu_mla_decode.cpp")
DTYPES = (torch.float32, torch.bfloat16)


def load() -> ctypes.CDLL | None:
    """The compiled kernel library; None where it cannot be built."""
    return load_library(SOURCE, _bind, "MLA decode gathers the cache rows (layers/attention/ops.py)")


def available(dtype: torch.dtype) -> bool:
    return dtype in DTYPES and load() is not None


def mla_decode(q: torch.Tensor, cache: torch.Tensor, kv_indices: torch.Tensor, kv_indptr: torch.Tensor,
               v_dim: int, scale: float) -> torch.Tensor:
    """q [B, h, D]; cache [N, D] latent rows (fp32 or bf16); kv_indices [S] int64 slots, request b's at
    kv_indptr[b] .. kv_indptr[b + 1] ([B + 1] int64) -> [B, h, v_dim] in q's dtype (sums in fp32; q and cache both
    bf16 are read and written as bf16, other q dtypes through fp32).
    A request with no rows gets zeros."""
    if torch.compiler.is_compiling():
        return torch.ops.moeserve.cpu_mla_decode(q, cache, kv_indices, kv_indptr, v_dim, scale)
    lib = load()
    if lib is None or cache.dtype not in DTYPES:
        raise RuntimeError(f"the CPU MLA decode kernel does not run here (cache {cache.dtype}); check available()")
    B, H, D = q.shape
    if cache.dim() != 2 or cache.shape[1] != D or not 0 < v_dim <= D:
        raise ValueError(f"mla_decode: cache {tuple(cache.shape)} and v_dim {v_dim} do not fit q {tuple(q.shape)}")
    assert kv_indptr.shape[0] == B + 1 and cache.is_contiguous()
    idx = kv_indices.to(torch.int64).contiguous()
    indptr = kv_indptr.to(torch.int64).contiguous()
    if q.dtype == cache.dtype == torch.bfloat16:  # a bf16 model: q and out stay bf16 (no dtype copies)
        qk, fn = q.contiguous(), lib.moeserve_mla_decode_bf16_io
    else:  # q in fp32, out in fp32
        qk = q.float().contiguous()
        fn = lib.moeserve_mla_decode_f32 if cache.dtype == torch.float32 else lib.moeserve_mla_decode_bf16
    out = qk.new_empty(B, H, v_dim)
    fn(qk.data_ptr(), cache.data_ptr(), idx.data_ptr(), indptr.data_ptr(), B, H, D, v_dim, float(scale),
       out.data_ptr(), torch.get_num_threads())
    return out if out.dtype == q.dtype else out.to(q.dtype)


def mla_decode_reference(q: torch.Tensor, cache: torch.Tensor, kv_indices: torch.Tensor, kv_indptr: torch.Tensor,
                         v_dim: int, scale: float) -> torch.Tensor:
    """What `mla_decode` computes, one request at a time in q's dtype (the tests run it in float64)."""
    out = q.new_zeros(q.shape[0], q.shape[1], v_dim)
    for b in range(q.shape[0]):
        rows = cache[kv_indices[kv_indptr[b]:kv_indptr[b + 1]]].to(q.dtype)  # [L, D]
        if rows.shape[0]:
            out[b] = torch.softmax(scale * q[b] @ rows.T, dim=-1) @ rows[:, :v_dim]
    return out


@torch.library.custom_op("moeserve::cpu_mla_decode", mutates_args=())
def _mla_decode_op(q: torch.Tensor, cache: torch.Tensor, kv_indices: torch.Tensor, kv_indptr: torch.Tensor,
                   v_dim: int, scale: float) -> torch.Tensor:
    return mla_decode(q, cache, kv_indices, kv_indptr, v_dim, scale)


@_mla_decode_op.register_fake
def _(q: torch.Tensor, cache: torch.Tensor, kv_indices: torch.Tensor, kv_indptr: torch.Tensor, v_dim: int,
      scale: float) -> torch.Tensor:
    return q.new_empty(q.shape[0], q.shape[1], v_dim)


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    for fn in (lib.moeserve_mla_decode_f32, lib.moeserve_mla_decode_bf16, lib.moeserve_mla_decode_bf16_io):
        fn.restype = None
        fn.argtypes = [p, p, p, p, i64, i64, i64, i64, ctypes.c_float, p, ctypes.c_int]
    return lib
