"""MLA's absorbed extend attention on the CPU (cpu_latent_extend.cpp): each request's new query rows, every head,
causally over its rows of the latent cache, read in place through kv_indices / kv_indptr.

`latent_extend(q, cache, kv_indices, kv_indptr, q_indptr, v_dim, scale)` computes what `latent_extend_reference`
(beside it, the same signature) computes: for request b with n new rows (q_indptr) over s keys (kv_indptr, its
new rows' own keys last), new row i's softmax(scale * q · K^T) · V over keys 0 .. s - n + i, K its latent rows
[c_kv | k_rope] and V their first v_dim columns. layers/attention/latent_extend.py's torch form gathers the rows,
materializes the [rows * heads, keys] scores and masks them; the kernel keeps a block of rows' scores in cache and
skips the causal far side row by row (`benchmark/experiments/bench_latent_extend.py`).

`takes(q, cache)` says whether it runs: q float32 and a float32 or bf16 cache on the CPU, not under torch.compile
(the torch form runs there), and the C++ source built (moeserve/kernels/build.py; where that is impossible the
torch form runs).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from moeserve.kernels.build import load_library

SOURCE = Path(__file__).with_name("cpu_latent_extend.cpp")
CACHE_DTYPES = (torch.float32, torch.bfloat16)


def load() -> ctypes.CDLL | None:
    """The compiled kernel library; None where it cannot be built."""
    return load_library(SOURCE, _bind, "the absorbed extend runs in torch (layers/attention/latent_extend.py)")


def takes(q: torch.Tensor, cache: torch.Tensor) -> bool:
    """Whether latent_extend runs this attention (module docstring); the cheap tests first."""
    return (q.is_cpu and q.dtype is torch.float32 and cache.dtype in CACHE_DTYPES and cache.dim() == 2
            and not torch.compiler.is_compiling() and load() is not None)


def latent_extend(q: torch.Tensor, cache: torch.Tensor, kv_indices: torch.Tensor, kv_indptr: torch.Tensor,
                  q_indptr: torch.Tensor, v_dim: int, scale: float) -> torch.Tensor:
    """q [T, h, D] float32; cache [N, D]; kv_indices [S] slots, request b's keys at kv_indptr[b] .. kv_indptr[b + 1]
    and its new rows at q_indptr[b] .. q_indptr[b + 1] ([B + 1] each) -> [T, h, v_dim] float32. Check takes()."""
    lib = load()
    T, H, D = q.shape
    B = q_indptr.shape[0] - 1
    if cache.shape[1] != D or not 0 < v_dim <= D or kv_indptr.shape[0] != B + 1 or int(q_indptr[-1]) != T:
        raise ValueError(f"latent_extend: q {tuple(q.shape)}, cache {tuple(cache.shape)}, v_dim {v_dim}, "
                         f"{B + 1} q offsets ending at {int(q_indptr[-1])}, {kv_indptr.shape[0]} kv offsets")
    if bool(((kv_indptr.diff() < q_indptr.diff())).any()):
        raise ValueError("latent_extend: a request has fewer keys than new rows")
    q = q.contiguous()
    cache = cache if cache.is_contiguous() else cache.contiguous()
    idx, kv_ptr, q_ptr = (t.to(torch.int64).contiguous() for t in (kv_indices, kv_indptr, q_indptr))
    out = q.new_empty(T, H, v_dim)
    fn = lib.moeserve_latent_extend_f32 if cache.dtype is torch.float32 else lib.moeserve_latent_extend_bf16
    fn(q.data_ptr(), cache.data_ptr(), idx.data_ptr(), kv_ptr.data_ptr(), q_ptr.data_ptr(), B, H, D, v_dim,
       float(scale), out.data_ptr(), torch.get_num_threads())
    return out


def latent_extend_reference(q: torch.Tensor, cache: torch.Tensor, kv_indices: torch.Tensor,
                            kv_indptr: torch.Tensor, q_indptr: torch.Tensor, v_dim: int,
                            scale: float) -> torch.Tensor:
    """What `latent_extend` computes, one request at a time in q's dtype (the tests run it in float64)."""
    out = q.new_empty(q.shape[0], q.shape[1], v_dim)
    for b in range(q_indptr.shape[0] - 1):
        q0, q1 = int(q_indptr[b]), int(q_indptr[b + 1])
        rows = cache[kv_indices[int(kv_indptr[b]):int(kv_indptr[b + 1])]].to(q.dtype)  # [s, D]
        s, n = rows.shape[0], q1 - q0
        scores = scale * torch.einsum("thd,kd->thk", q[q0:q1], rows)
        visible = torch.arange(s)[None, :] <= torch.arange(s - n, s)[:, None]  # [n, s]
        scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
        out[q0:q1] = torch.einsum("thk,kd->thd", scores.softmax(-1), rows[:, :v_dim])
    return out


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    for fn in (lib.moeserve_latent_extend_f32, lib.moeserve_latent_extend_bf16):
        fn.restype = None
        fn.argtypes = [p, p, p, p, p, i64, i64, i64, i64, ctypes.c_float, p, ctypes.c_int]
    return lib
