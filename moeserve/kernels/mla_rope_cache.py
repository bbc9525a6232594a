"""MLA's per-layer latent write, fused: the latent's RMSNorm, rotary on the query's and the key's rope parts, and
the write of this step's rows into the latent cache, in one pass over each token.

    mla_rope_cache(q_rope [T, h, R], c_kv [T, r], k_rope [T, R], norm_weight [r], eps, rope [T, 2, R] float32,
                   interleaved, cache [N, r + R], loc [T] int) -> q_rope rotated, a new [T, h, R] tensor

    cache[loc[t]] = [rms_norm(c_kv[t]) | rotate(k_rope[t])]  cast to the cache's dtype   (in place)

`rope` is RotaryEmbedding.forward's per-token cos and signed sin (YaRN's attention factor already in them), laid
out like x: the rotation is x * cos + partner(x) * sin in float32, partner swapping a pair's two members, pairs
being neighbours (interleaved, DeepSeek-V3) or the two halves (V2). The rotated parts and the norm are rounded to
the activations' dtype (c_kv's) before the cast to the cache's, as the unfused sequence rounds them. The inputs
may be strided views (q_rope is a slice of q, c_kv and k_rope of kv_a_proj's output); only the last dimension
must be dense.

The Triton kernel (triton_ops/mla_rope_cache.py) runs on CUDA for float32/float16/bfloat16 caches: one program per
token, no host synchronisation, so it is captured in CUDA graphs. On the CPU in bf16 the C++ kernel
(cpu_mla_rope_cache.py) does the same pass. `mla_rope_cache_reference` (the same signature) is the sequence of torch
ops and runs everywhere else (and under torch.compile).
"""

from __future__ import annotations

import torch

from moeserve.kernels import cpu_mla_rope_cache
from moeserve.kernels.rms_norm import rms_norm_reference
from moeserve.kernels.rotary import rotate
from moeserve.kernels.triton_available import use_triton

_CACHE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # casts the kernel rounds exactly as torch does


def mla_rope_cache_reference(q_rope: torch.Tensor, c_kv: torch.Tensor, k_rope: torch.Tensor,
                             norm_weight: torch.Tensor, eps: float, rope: torch.Tensor, interleaved: bool,
                             cache: torch.Tensor, loc: torch.Tensor) -> torch.Tensor:
    c_kv = rms_norm_reference(c_kv, norm_weight, eps)
    q_out = rotate(q_rope, rope, interleaved)
    k_out = rotate(k_rope[:, None, :], rope, interleaved)[:, 0]
    cache.index_copy_(0, loc, torch.cat((c_kv, k_out), dim=-1).to(cache.dtype))  # one copy, one scatter
    return q_out


def mla_rope_cache(q_rope: torch.Tensor, c_kv: torch.Tensor, k_rope: torch.Tensor, norm_weight: torch.Tensor,
                   eps: float, rope: torch.Tensor, interleaved: bool, cache: torch.Tensor,
                   loc: torch.Tensor) -> torch.Tensor:
    """Module docstring. Triton on CUDA, C++ on the CPU in bf16 and float32, the reference elsewhere (and under
    torch.compile)."""
    if cpu_mla_rope_cache.takes(q_rope, c_kv, k_rope, norm_weight, rope, cache):
        return cpu_mla_rope_cache.cpu_mla_rope_cache(q_rope, c_kv, k_rope, norm_weight, eps, rope, interleaved, cache,
                                                     loc)
    if (use_triton(q_rope) and not torch.compiler.is_compiling() and cache.dtype in _CACHE_DTYPES
            and norm_weight.dtype == c_kv.dtype == k_rope.dtype and rope.dtype == torch.float32
            and q_rope.shape[0] > 0):
        from moeserve.kernels.triton_ops.mla_rope_cache import mla_rope_cache as triton_mla_rope_cache

        return triton_mla_rope_cache(q_rope, c_kv, k_rope, norm_weight, eps, rope, interleaved, cache, loc)
    return mla_rope_cache_reference(q_rope, c_kv, k_rope, norm_weight, eps, rope, interleaved, cache, loc)
