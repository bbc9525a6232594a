"""Mixtral: GQA (optionally a sliding window), and on every layer an MoE block `block_sparse_moe` of
intermediate_size-wide experts stored as w1 (gate), w3 (up), w2 (down); softmax top-2, always renormalized.
"""

from __future__ import annotations

from moeserve.models.decoder import CausalLM


class MixtralForCausalLM(CausalLM):
    moe_name = "block_sparse_moe"
    expert_names = ("w1", "w3", "w2")
