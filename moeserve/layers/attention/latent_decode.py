"""MLA's absorbed decode over the latent cache, its kernel picked once at load (`pick_latent_decode`).

    decode(q_latent [B, h, r], q_rope [B, h, R], cache [N, r + R], meta, scale) -> o_latent [B, h, r]

All heads attend over one latent head: the key is the whole row [c_kv | k_rope], the value its c_kv part.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from moeserve.kernels import cpu_mla_decode
from moeserve.kernels.mla_decode import mla_decode
from moeserve.kernels.skinny_gemm import batched_skinny_gemm
from moeserve.kernels.triton_available import use_triton
from moeserve.layers.attention.ops import AttentionMetadata, decode_attention

LatentDecode = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata, float], torch.Tensor]


def _torch(q_latent, q_rope, cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """The padded slot block gathered, then `decode_attention` (anywhere)."""
    q = torch.cat((q_latent, q_rope), dim=-1)
    return decode_attention(q, cache[:, None, :], q_latent.shape[-1], meta.decode_slots, meta.decode_bias, scale)


def _triton(q_latent, q_rope, cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Split over the KV length through the slot table, q's parts read apart; torch.compile traces the torch form."""
    if torch.compiler.is_compiling():
        return _torch(q_latent, q_rope, cache, meta, scale)
    return mla_decode(q_latent, cache, meta.decode_slots, meta.decode_seq_lens, q_latent.shape[-1], scale, q_rope)


def _cpu(q_latent, q_rope, cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """moeserve's C++ kernel over the cache rows in place (a custom op under torch.compile)."""
    q = torch.cat((q_latent, q_rope), dim=-1)
    return cpu_mla_decode.mla_decode(q, cache, meta.kv_indices, meta.kv_indptr, q_latent.shape[-1], scale)


def pick_latent_decode(device: torch.device, dtype: torch.dtype) -> LatentDecode:
    """Triton on CUDA, the C++ kernel on a CPU where it builds for the cache's dtype, else torch. Decided once:
    a check per call would hold a lock, which torch.compile cannot trace."""
    probe = torch.empty(0, device=device)
    if use_triton(probe):
        return _triton
    return _cpu if probe.is_cpu and cpu_mla_decode.available(dtype) else _torch


def latent_to_heads(o_latent: torch.Tensor, w_uv: torch.Tensor, packed: torch.Tensor | None = None) -> torch.Tensor:
    """o_latent [B, h, r] through W_UV [h, v, r] -> [B, h, v], contiguous (the o_proj's input). packed: W_UV's
    per-head packed copy (kernels/skinny_gemm.py's batched form)."""
    if torch.compiler.is_compiling():  # (an out= tensor would make dynamo compile once per batch size)
        return torch.bmm(o_latent.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)
    # written straight into [B, h, v]: the per-head products write its strided [h, B, v] view, no transpose copy
    out = o_latent.new_empty(o_latent.shape[0], w_uv.shape[0], w_uv.shape[1])
    batched_skinny_gemm(o_latent.transpose(0, 1), w_uv, out=out.transpose(0, 1), packed=packed)
    return out
