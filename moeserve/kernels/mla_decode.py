"""MLA decode attention over the paged latent cache, in the weight-absorbed form (one latent "head" shared by all
query heads), for GPUs: split over the KV length, read through the per-request slot table.

    mla_decode(q [B, h, D], cache [N, D], slots [B, L] int64, seq_lens [B], v_dim, scale) -> [B, h, v_dim]
    mla_decode(q [B, h, v_dim], ..., q_rope=[B, h, D - v_dim]): the query's two parts apart (no concatenation)

Request b attends over cache rows slots[b, :seq_lens[b]] (K = the whole row [c_kv | k_rope], V = its first v_dim
columns, c_kv); the softmax is taken in fp32 and the result is in q's dtype. slots is the scheduler's padded
table (what CUDA graphs capture: L is static, seq_lens a device tensor); positions past seq_lens[b] are never
read. A request with seq_len 0 gets zeros.

The Triton kernel (triton_ops/mla_decode.py) runs on CUDA: each program takes one request, a block of 16 query
heads and one split of the request's rows, keeps an online softmax over blocks of rows, and writes its partial
output and log-sum-exp; a second kernel combines the splits. The number of splits is chosen from the batch and L
so that the GPU's SMs are busy at batch 1 as at batch 256. `mla_decode_reference` (the same signature) runs
everywhere else and is what the tests compare with.
"""

from __future__ import annotations

import torch

from moeserve.kernels.triton_available import use_triton


def mla_decode_reference(q: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor, seq_lens: torch.Tensor,
                         v_dim: int, scale: float, q_rope: torch.Tensor | None = None) -> torch.Tensor:
    if q_rope is not None:
        q = torch.cat((q, q_rope), dim=-1)
    B, L = slots.shape
    rows = cache.index_select(0, slots.reshape(-1)).view(B, L, -1).to(q.dtype)  # [B, L, D]
    acc = torch.promote_types(q.dtype, torch.float32)  # fp32 at least (fp64 stays fp64: the tests' reference)
    scores = torch.matmul(q, rows.transpose(1, 2)).to(acc) * scale  # [B, h, L]
    past = torch.arange(L, device=q.device)[None, :] >= seq_lens.to(q.device)[:, None]  # [B, L]
    scores = scores.masked_fill(past[:, None, :], float("-inf"))
    probs = torch.nan_to_num(scores.softmax(dim=-1), nan=0.0).to(q.dtype)  # seq_len 0: a row of zeros
    return torch.matmul(probs, rows[..., :v_dim])


def mla_decode(q: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor, seq_lens: torch.Tensor, v_dim: int,
               scale: float, q_rope: torch.Tensor | None = None) -> torch.Tensor:
    """Module docstring. Triton on CUDA, the reference elsewhere (and under torch.compile)."""
    if use_triton(q) and not torch.compiler.is_compiling():
        from moeserve.kernels.triton_ops.mla_decode import mla_decode as triton_mla_decode

        return triton_mla_decode(q, cache, slots, seq_lens, v_dim, scale, q_rope)
    return mla_decode_reference(q, cache, slots, seq_lens, v_dim, scale, q_rope)
