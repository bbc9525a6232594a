"""Model shapes for the step-time model: presets, and ModelSpec from a Hugging Face config.json.

Only what costs time is kept: parameter counts per part (attention, dense MLP, shared and routed experts,
LM head), attention FLOPs per (query, key) pair, and KV-cache bytes per token. Attention is MLA (DeepSeek
V2/V3: absorbed for decode, naive multi-head for prefill, as production systems run it) or GQA (Qwen3-MoE,
Mixtral).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from moeserve.core.model_config import ModelConfig


@dataclass(frozen=True)
class ModelSpec:
    """Shapes of an MoE transformer, as far as step time depends on them."""

    name: str
    hidden: int
    num_layers: int
    num_dense_layers: int  # leading layers with a dense MLP instead of MoE
    dense_intermediate: int
    moe_intermediate: int
    num_experts: int
    num_shared_experts: int  # shared-expert width = num_shared_experts * moe_intermediate
    topk: int
    vocab: int
    num_heads: int
    attention: str = "mla"  # "mla" | "gqa"
    # MLA
    q_lora_rank: int = 0  # 0: a full q projection
    kv_lora_rank: int = 512
    qk_nope_dim: int = 128
    qk_rope_dim: int = 64
    v_head_dim: int = 128
    # GQA
    num_kv_heads: int = 0
    head_dim: int = 128
    num_groups: int = 1  # expert groups (n_group), for EPLB's hierarchical policy
    weight_bytes: float = 1.0  # bytes per weight of GEMMs as served: 1 for FP8 checkpoints, 2 for BF16
    shared_intermediate: int = 0  # explicit shared-expert width (Qwen2-MoE); 0: num_shared * moe_intermediate

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.num_dense_layers

    @property
    def attn_params(self) -> int:
        """Weights of one attention block (projections; norms ignored)."""
        h = self.hidden
        if self.attention == "mla":
            qk_head = self.qk_nope_dim + self.qk_rope_dim
            q_in = self.q_lora_rank or h  # through the low-rank q projection where there is one
            q = h * self.q_lora_rank + q_in * self.num_heads * qk_head
            kv_a = h * (self.kv_lora_rank + self.qk_rope_dim)
            kv_b = self.kv_lora_rank * self.num_heads * (self.qk_nope_dim + self.v_head_dim)
            out = self.num_heads * self.v_head_dim * h
            return q + kv_a + kv_b + out
        q_out = 2 * h * self.num_heads * self.head_dim
        return q_out + 2 * h * self.num_kv_heads * self.head_dim

    @property
    def kv_b_params(self) -> int:
        """MLA's latent-to-heads projection, applied to every cached token in naive (prefill) attention."""
        if self.attention != "mla":
            return 0
        return self.kv_lora_rank * self.num_heads * (self.qk_nope_dim + self.v_head_dim)

    @property
    def expert_params(self) -> int:
        """One routed expert (gate, up, down)."""
        return 3 * self.hidden * self.moe_intermediate

    @property
    def shared_params(self) -> int:
        width = self.shared_intermediate or self.num_shared_experts * self.moe_intermediate
        return 3 * self.hidden * width

    @property
    def dense_mlp_params(self) -> int:
        return 3 * self.hidden * self.dense_intermediate

    @property
    def gate_params(self) -> int:
        return self.hidden * self.num_experts

    @property
    def head_params(self) -> int:
        return self.hidden * self.vocab

    @property
    def kv_bytes_per_token_layer(self) -> int:
        """KV-cache bytes one token holds in one layer (BF16 cache)."""
        if self.attention == "mla":
            return 2 * (self.kv_lora_rank + self.qk_rope_dim)
        return 2 * 2 * self.num_kv_heads * self.head_dim

    def pair_flops(self, phase: str) -> int:
        """Core-attention FLOPs per (query token, key token) pair in one layer.

        MLA decode runs absorbed (MQA over the 576-wide latent, 512-wide values); MLA prefill runs naive
        multi-head attention (192-wide keys, 128-wide values per head). GQA is the same in both phases.
        """
        if self.attention == "mla":
            if phase == "decode":
                return 2 * self.num_heads * (2 * self.kv_lora_rank + self.qk_rope_dim)
            return 2 * self.num_heads * (self.qk_nope_dim + self.qk_rope_dim + self.v_head_dim)
        return 4 * self.num_heads * self.head_dim

    @property
    def total_params(self) -> int:
        experts = self.num_experts * self.expert_params
        moe = self.num_moe_layers * (experts + self.shared_params + self.gate_params)
        dense = self.num_dense_layers * self.dense_mlp_params
        return self.num_layers * self.attn_params + moe + dense + 2 * self.head_params

    @property
    def active_params(self) -> int:
        """Weights one token touches (embedding lookup excluded)."""
        moe = self.num_moe_layers * (self.topk * self.expert_params + self.shared_params + self.gate_params)
        dense = self.num_dense_layers * self.dense_mlp_params
        return self.num_layers * self.attn_params + moe + dense + self.head_params


MODEL_PRESETS: dict[str, ModelSpec] = {
    # config_671B.json + HF config (research/deepseek.md §5); FP8 128x128 block-scaled weights.
    "deepseek-v3": ModelSpec(
        "deepseek-v3", hidden=7168, num_layers=61, num_dense_layers=3, dense_intermediate=18432,
        moe_intermediate=2048, num_experts=256, num_shared_experts=1, topk=8, vocab=129280, num_heads=128,
        q_lora_rank=1536, kv_lora_rank=512, num_groups=8, weight_bytes=1.0),
    "deepseek-v2-lite": ModelSpec(
        "deepseek-v2-lite", hidden=2048, num_layers=27, num_dense_layers=1, dense_intermediate=10944,
        moe_intermediate=1408, num_experts=64, num_shared_experts=2, topk=6, vocab=102400, num_heads=16,
        q_lora_rank=0, kv_lora_rank=512, num_groups=1, weight_bytes=2.0),
    # Qwen/Qwen3-235B-A22B config.json: 94 layers, all MoE, 128 experts top-8, GQA 64 q / 4 kv heads of 128.
    "qwen3-235b-a22b": ModelSpec(
        "qwen3-235b-a22b", hidden=4096, num_layers=94, num_dense_layers=0, dense_intermediate=12288,
        moe_intermediate=1536, num_experts=128, num_shared_experts=0, topk=8, vocab=151936, num_heads=64,
        attention="gqa", num_kv_heads=4, head_dim=128, weight_bytes=2.0),
}


def model_from_config(config: ModelConfig, name: str) -> ModelSpec:
    """The step-time model's view of a parsed config.json: shapes, and FP8 or BF16 weights."""
    if not (config.num_experts and config.num_experts_per_tok):
        raise ValueError(f"{name}: not an MoE config (no routed experts); the planner models MoE models only")
    common = dict(
        name=name, hidden=config.hidden_size, num_layers=config.num_hidden_layers,
        num_dense_layers=config.num_hidden_layers - len(config.moe_layers),
        dense_intermediate=config.intermediate_size, moe_intermediate=config.moe_intermediate_size,
        num_experts=config.num_experts, num_shared_experts=config.num_shared_experts,
        topk=config.num_experts_per_tok, vocab=config.vocab_size, num_heads=config.num_attention_heads,
        num_groups=config.n_group,
        weight_bytes=1.0 if "fp8" in str(config.quantization or "").lower() else 2.0,
        shared_intermediate=config.shared_expert_intermediate_size)
    if config.is_mla:
        return ModelSpec(**common, attention="mla", q_lora_rank=config.q_lora_rank or 0,
                         kv_lora_rank=config.kv_lora_rank, qk_nope_dim=config.qk_nope_head_dim,
                         qk_rope_dim=config.qk_rope_head_dim, v_head_dim=config.v_head_dim)
    return ModelSpec(**common, attention="gqa", num_kv_heads=config.num_key_value_heads,
                     head_dim=config.head_dim)


def model_from_hf_config(config: dict, name: str = "hf") -> ModelSpec:
    """A ModelSpec from a Hugging Face config.json dict (DeepSeek-V2/V3, Qwen2/3-MoE, Mixtral).

    moeserve's one config.json reader parses it (ModelConfig.from_dict with shapes_only: a multimodal
    config's text_config, architectures moeserve does not serve by the family of their keys).
    """
    from moeserve.core.model_config import ModelConfig  # imports torch: only when a config is read

    try:
        parsed = ModelConfig.from_dict(config, shapes_only=True)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None
    return model_from_config(parsed, name)


def load_model(name_or_path: str) -> ModelSpec:
    """A preset by name, or a Hugging Face config.json (or a directory holding one)."""
    if name_or_path.lower() in MODEL_PRESETS:
        return MODEL_PRESETS[name_or_path.lower()]
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
    if not path.exists():
        raise ValueError(
            f"unknown model {name_or_path!r}: give a preset ({', '.join(MODEL_PRESETS)}) "
            "or a path to a Hugging Face config.json")
    return model_from_hf_config(json.loads(path.read_text()), name=path.parent.name or path.stem)
