"""Mixtral: GQA (optionally a sliding window), and on every layer an MoE block `block_sparse_moe` of
intermediate_size-wide experts stored as w1 (gate), w3 (up), w2 (down).

    gate: s = softmax(x W_g^T), the top-2 experts of s, their weights renormalized to sum to 1
"""

from __future__ import annotations

from torch import nn

from moeserve.core.model_config import ModelConfig
from moeserve.layers.attention.gqa import GQAttention
from moeserve.layers.moe.router import TopKRouter
from moeserve.models.decoder import CausalLM


class MixtralForCausalLM(CausalLM):
    moe_name = "block_sparse_moe"
    expert_names = ("w1", "w3", "w2")

    @staticmethod
    def attention_class(config: ModelConfig) -> type[nn.Module]:
        return GQAttention

    @staticmethod
    def make_gate(config: ModelConfig) -> TopKRouter:
        return TopKRouter(config.hidden_size, config.num_experts, config.num_experts_per_tok,
                          renormalize=config.norm_topk_prob)
