"""Reference attention over the paged KV cache, correct for ragged batches (torch SDPA inside).

- `extend_attention`: new queries of each request attend causally over the request's whole sequence
  (cached prefix + new tokens). One SDPA call per request; a prefill step is compute-bound anyway.
- `decode_attention`: one query per request over its cached tokens. The cache rows are gathered into a padded
  [B, max_len] block and masked, so a step is a few batched kernels with no per-request Python loop.

`AttentionMetadata` is built once per forward from the ForwardBatch and shared by all layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moeserve.core.forward_batch import ForwardBatch, ForwardMode
from moeserve.core.kv_pool import KVPool


@dataclass
class AttentionMetadata:
    """What every attention layer of one step needs, derived once from the batch."""

    mode: ForwardMode
    kv_pool: KVPool | None
    out_cache_loc: torch.Tensor  # [T] slots written this step
    kv_indices: torch.Tensor  # [sum(seq_lens)] slots of every request's whole sequence
    kv_indptr: torch.Tensor  # [B + 1] request b's slots are kv_indices[kv_indptr[b]:kv_indptr[b + 1]]
    rope: torch.Tensor  # [T, 2, rotary_dim] float32: each token's cos and signed sin (RotaryEmbedding.forward)
    extend_lens: list[int]  # host
    seq_lens: list[int]  # host
    decode_slots: torch.Tensor | None = None  # [B, max_len] int64 cache slots (0 = scratch where masked)
    decode_bias: torch.Tensor | None = None  # [B, max_len] float32: 0 for a real token, -inf past seq_len

    @classmethod
    def build(cls, batch: ForwardBatch, rope: torch.Tensor) -> AttentionMetadata:
        # Decode reads no host lengths (torch.compile would guard on every one of them).
        extend = batch.mode.is_extend
        meta = cls(mode=batch.mode, kv_pool=batch.kv_pool, out_cache_loc=batch.out_cache_loc,
                   kv_indices=batch.kv_indices, kv_indptr=batch.kv_indptr, rope=rope, extend_lens=list(batch.extend_lens_cpu) if extend else [],
                   seq_lens=list(batch.seq_lens_cpu) if extend else [])
        if batch.mode.is_decode and batch.seq_lens.shape[0] > 0:
            if batch.decode_slots is not None:  # the scheduler's padded block (static shape under CUDA graphs)
                meta.decode_slots = batch.decode_slots
                meta.decode_bias = length_bias(batch.seq_lens, batch.decode_slots.shape[1])
            else:
                meta.decode_slots, meta.decode_bias = padded_kv_slots(batch.kv_indices, batch.kv_indptr,
                                                                      batch.seq_lens, max(batch.seq_lens_cpu))
        return meta

    @property
    def num_tokens(self) -> int:
        return int(self.out_cache_loc.shape[0])


def _past_end(seq_lens: torch.Tensor, max_len: int) -> torch.Tensor:
    """[B, max_len] bool: True at positions >= the request's seq_len."""
    return torch.arange(max_len, device=seq_lens.device)[None, :] >= seq_lens[:, None]


def _as_bias(past: torch.Tensor) -> torch.Tensor:
    return torch.zeros(past.shape, device=past.device).masked_fill_(past, float("-inf"))


def length_bias(seq_lens: torch.Tensor, max_len: int) -> torch.Tensor:
    """[B, max_len] float32 additive attention bias: 0 at positions < seq_len, -inf from there on."""
    return _as_bias(_past_end(seq_lens, max_len))


def padded_kv_slots(kv_indices: torch.Tensor, kv_indptr: torch.Tensor, seq_lens: torch.Tensor,
                    max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged kv_indices -> slots [B, max_len] (scratch slot 0 past each length) and their `length_bias`."""
    past = _past_end(seq_lens, max_len)
    pos = torch.arange(max_len, device=kv_indices.device)
    flat = (kv_indptr[:-1, None] + pos[None, :]).clamp_(max=max(kv_indices.shape[0] - 1, 0))
    return kv_indices[flat].masked_fill_(past, 0), _as_bias(past)


def extend_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, extend_lens: list[int],
                     seq_lens: list[int], scale: float, sliding_window: int | None = None) -> torch.Tensor:
    """Causal attention of each request's new queries over its whole sequence.

    q [T, Hq, D] (request b's rows are its extend_lens[b] new tokens, positions seq_len - extend_len ..
    seq_len - 1); k [S, Hkv, D] and v [S, Hkv, Dv], S = sum(seq_lens), request b's rows are its whole sequence.
    Returns [T, Hq, Dv]. Hq must be a multiple of Hkv (GQA/MQA).
    """
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
    q_start = kv_start = 0
    for n, s in zip(extend_lens, seq_lens, strict=True):
        if n > 0:
            qb = q[q_start:q_start + n].transpose(0, 1)[None]  # [1, Hq, n, D]
            kb = k[kv_start:kv_start + s].transpose(0, 1)[None]  # [1, Hkv, s, D]
            vb = v[kv_start:kv_start + s].transpose(0, 1)[None]
            mask = None
            if n != s or sliding_window is not None:
                q_pos = torch.arange(s - n, s, device=q.device)[:, None]
                k_pos = torch.arange(s, device=q.device)[None, :]
                mask = k_pos <= q_pos
                if sliding_window is not None:
                    mask = mask & (k_pos > q_pos - sliding_window)
            ob = _sdpa(qb, kb, vb, mask, mask is None, scale)
            out[q_start:q_start + n] = ob[0].transpose(0, 1)
        q_start += n
        kv_start += s
    return out


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor | int, slots: torch.Tensor,
                     bias: torch.Tensor, scale: float, sliding_window: int | None = None) -> torch.Tensor:
    """One query per request over its cached tokens.

    q [B, Hq, D]; k_cache [num_slots, Hkv, D]; v_cache [num_slots, Hkv, Dv], or an int Dv: the value is the
    first Dv dims of the key (MLA's latent cache, gathered once); slots [B, L] and bias [B, L] from
    `padded_kv_slots`. Returns [B, Hq, Dv].
    The query heads sharing a KV head are the rows of one matmul, so K and V are never repeated per head
    (for MLA's absorbed form, all heads against one latent head). The rows are gathered with index_select
    (on CPU several times faster than advanced indexing) and the mask is an additive bias built once per step.
    """
    B, num_heads, D = q.shape
    L = slots.shape[1]
    num_kv_heads = k_cache.shape[1]
    rep = num_heads // num_kv_heads
    flat = slots.reshape(-1)
    k_rows = k_cache.index_select(0, flat).view(B, L, num_kv_heads, D).to(q.dtype)
    if isinstance(v_cache, int):
        v_rows = k_rows[..., :v_cache]
    else:
        v_rows = v_cache.index_select(0, flat).view(B, L, num_kv_heads, -1).to(q.dtype)
    if sliding_window is not None:
        seq_lens = (bias == 0).sum(-1, keepdim=True)
        pos = torch.arange(L, device=bias.device)[None, :]
        bias = bias.masked_fill(pos <= seq_lens - 1 - sliding_window, float("-inf"))
    scores = torch.matmul(q.view(B, num_kv_heads, rep, D), k_rows.permute(0, 2, 3, 1))  # [B, Hkv, rep, L]
    scores = torch.add(bias[:, None, None, :], scores.float(), alpha=scale)  # bias + scale * scores, in fp32
    probs = scores.softmax(dim=-1).to(q.dtype)
    return torch.matmul(probs, v_rows.transpose(1, 2)).view(B, num_heads, -1)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool,
          scale: float) -> torch.Tensor:
    """SDPA on [B, H, L, D] with Hq a multiple of Hkv."""
    rep = q.shape[1] // k.shape[1]
    if rep > 1 and not q.is_cuda:
        # NOTE: on CPU, enable_gqa is far slower than repeating K and V per query head (as transformers does).
        B, Hkv, L = k.shape[:3]
        k = k[:, :, None].expand(B, Hkv, rep, L, k.shape[-1]).reshape(B, Hkv * rep, L, k.shape[-1])
        v = v[:, :, None].expand(B, Hkv, rep, L, v.shape[-1]).reshape(B, Hkv * rep, L, v.shape[-1])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                          enable_gqa=rep > 1 and q.is_cuda)
