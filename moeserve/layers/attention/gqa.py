"""Grouped-query attention (Qwen3-MoE, Mixtral) over a K/V cache, heads split over the attention-TP group.

    q, k, v = W_Q x, W_K x, W_V x          (optionally RMSNorm over each head of q and k: Qwen3)
    o = W_O · softmax(q·k / sqrt(d)) v     with RoPE on q and k, each KV head shared by Hq/Hkv query heads
"""

from __future__ import annotations

import torch
from torch import nn

from moeserve.core.model_config import ModelConfig
from moeserve.layers.attention.ops import AttentionMetadata, attend_parts, decode_attention, extend_attention
from moeserve.layers.linear import ColumnParallelLinear, RowParallelLinear
from moeserve.layers.norm import RMSNorm
from moeserve.layers.rotary import RotaryEmbedding
from moeserve.layers.weights import shard
from moeserve.parallel.state import get_parallel_state


class GQAttention(nn.Module):
    """GQA with this rank's query heads and the KV heads they read."""

    quantized_input = False  # x comes as rows (its three projections quantize it, FP8 or not)

    def __init__(self, config: ModelConfig, layer_id: int, rotary: RotaryEmbedding):
        super().__init__()
        ps = get_parallel_state()
        tp, rank = ps.attn_tp_size, ps.attn_tp_rank
        self.layer_id = layer_id
        self.rotary = rotary
        hidden, heads, kv_heads = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
        self.head_dim = d = config.head_dim
        assert heads % tp == 0, f"{heads} attention heads do not split over {tp} ranks"
        self.num_heads = heads // tp
        if kv_heads % tp == 0:  # each rank holds its own KV heads
            kv_rows = shard(kv_heads * d, tp, rank)
        else:  # fewer KV heads than ranks: each rank holds the one KV head its query heads read
            assert tp % kv_heads == 0, f"{kv_heads} KV heads do not spread over {tp} ranks"
            head = rank // (tp // kv_heads)
            kv_rows = slice(head * d, (head + 1) * d)
        self.num_kv_heads = (kv_rows.stop - kv_rows.start) // d
        self.scale = d**-0.5
        self.sliding_window = config.sliding_window
        bias = config.attention_bias

        self.q_proj = ColumnParallelLinear(hidden, heads * d, bias, tp, rank)
        self.k_proj = ColumnParallelLinear(hidden, kv_heads * d, bias, rows=kv_rows)
        self.v_proj = ColumnParallelLinear(hidden, kv_heads * d, bias, rows=kv_rows)
        self.o_proj = RowParallelLinear(heads * d, hidden, bias, tp, rank, ps.attn_tp_group)
        if config.qk_norm:
            self.q_norm = RMSNorm(d, config.rms_norm_eps)
            self.k_norm = RMSNorm(d, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """x [T, H] -> [T, H]; writes this step's K and V to the cache first."""
        T = x.shape[0]
        if T == 0:
            return x.clone()
        q = self.q_proj(x).view(T, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = self.rotary.apply(q, meta.rope)
        k = self.rotary.apply(k, meta.rope)
        pool = meta.kv_pool
        pool.set_kv(self.layer_id, meta.out_cache_loc, k, v)
        o = attend_parts(meta, self._attend, q)
        return self.o_proj(o.reshape(T, self.num_heads * self.head_dim))

    def _attend(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q [t, h, d] of one EXTEND or DECODE part (their KV already in the cache) -> [t, h, d]."""
        k_cache, v_cache = meta.kv_pool.get_kv(self.layer_id)
        if meta.mode.is_decode:
            return decode_attention(q, k_cache, v_cache, meta.decode_slots, meta.decode_bias, self.scale,
                                    self.sliding_window)
        k_all = k_cache[meta.kv_indices].to(q.dtype)
        v_all = v_cache[meta.kv_indices].to(q.dtype)
        return extend_attention(q, k_all, v_all, meta.extend_lens, meta.seq_lens, self.scale, self.sliding_window,
                                meta.extend_plan)
