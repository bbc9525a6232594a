"""Qwen3-MoE: GQA with RMSNorm on each query and key head (q_norm, k_norm) before RoPE, then an MoE layer on every
decoder_sparse_step-th layer not in mlp_only_layers. No shared experts.

    gate: s = softmax(x W_g^T), the top-k experts of s, their weights renormalized to sum to 1 when norm_topk_prob
"""

from __future__ import annotations

from torch import nn

from moeserve.core.model_config import ModelConfig
from moeserve.layers.attention.gqa import GQAttention
from moeserve.layers.moe.router import TopKRouter
from moeserve.models.decoder import CausalLM


class Qwen3MoeForCausalLM(CausalLM):
    @staticmethod
    def attention_class(config: ModelConfig) -> type[nn.Module]:
        return GQAttention  # with config.qk_norm

    @staticmethod
    def make_gate(config: ModelConfig) -> TopKRouter:
        return TopKRouter(config.hidden_size, config.num_experts, config.num_experts_per_tok,
                          renormalize=config.norm_topk_prob)
