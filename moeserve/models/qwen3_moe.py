"""Qwen3-MoE: GQA with RMSNorm on each query and key head (q_norm, k_norm) before RoPE, then an MoE layer
(softmax top-k, renormalized when norm_topk_prob) on every decoder_sparse_step-th layer not in mlp_only_layers.
No shared experts.
"""

from __future__ import annotations

from moeserve.models.decoder import CausalLM


class Qwen3MoeForCausalLM(CausalLM):
    pass
