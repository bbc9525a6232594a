"""MLA's absorbed decode attention over the latent cache, its kernel picked once at load (`pick_latent_decode`).

    decode(q_latent [B, h, r], q_rope [B, h, R], cache [N, r + R], meta, scale) -> o_latent [B, h, r]

All heads attend over one latent head: key the whole row [c_kv | k_rope], value its c_kv part. The kernels:
- CUDA with Triton: split over the KV length through the slot table (kernels/mla_decode.py), q's parts read apart;
  under torch.compile, which cannot trace it, the torch form;
- CPU where moeserve's C++ kernel builds (kernels/cpu_mla_decode.py): over the cache rows in place;
- elsewhere, the torch form: the padded slot block gathered, then `decode_attention`.
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


def _torch(q_latent: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata,
           scale: float) -> torch.Tensor:
    q = torch.cat((q_latent, q_rope), dim=-1)
    return decode_attention(q, cache[:, None, :], q_latent.shape[-1], meta.decode_slots, meta.decode_bias, scale)


def _triton(q_latent: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata,
            scale: float) -> torch.Tensor:
    if torch.compiler.is_compiling():
        return _torch(q_latent, q_rope, cache, meta, scale)
    return mla_decode(q_latent, cache, meta.decode_slots, meta.decode_seq_lens, q_latent.shape[-1], scale,
                      q_rope=q_rope)


def _cpu(q_latent: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata,
         scale: float) -> torch.Tensor:
    q = torch.cat((q_latent, q_rope), dim=-1)
    return cpu_mla_decode.mla_decode(q, cache, meta.kv_indices, meta.kv_indptr, q_latent.shape[-1], scale)


def pick_latent_decode(device: torch.device, dtype: torch.dtype) -> LatentDecode:
    """The kernel for a latent cache of `dtype` on `device`. Decided once: a check per call would hold a lock,
    which torch.compile cannot trace."""
    probe = torch.empty(0, device=device)
    if use_triton(probe):
        return _triton
    return _cpu if probe.is_cpu and cpu_mla_decode.available(dtype) else _torch


def latent_to_heads(o_latent: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """o_latent [B, h, r] through W_UV [h, v, r] -> [B, h, v], contiguous (the o_proj's input)."""
    if torch.compiler.is_compiling():  # (an out= tensor would make dynamo compile once per batch size)
        return torch.bmm(o_latent.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)
    # written straight into [B, h, v]: the per-head products write its strided [h, B, v] view, no transpose copy
    out = o_latent.new_empty(o_latent.shape[0], w_uv.shape[0], w_uv.shape[1])
    batched_skinny_gemm(o_latent.transpose(0, 1), w_uv, out=out.transpose(0, 1))
    return out
