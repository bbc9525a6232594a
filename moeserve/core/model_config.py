"""ModelConfig: what moeserve needs to know about a checkpoint, parsed from its config.json.

`ModelConfig.from_pretrained(path)` reads config.json (and generation_config.json for the stop tokens) of a
Hugging Face checkpoint directory. One flat dataclass covers the four supported families; fields that do not
apply to a family keep neutral values (e.g. `kv_lora_rank` is None for GQA models, `num_experts` is 0 for dense
layers). The rank sizes its KV cache from `kv_bytes_per_token(dtype, attn_tp_size)` and builds it with
`moeserve.kvcache.kv_pool.make_kv_pool`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from moeserve.core.quant_config import Fp8Config, parse_quantization_config

# architecture name in config.json -> model family (moeserve/models/<family>.py builds it)
ARCHITECTURES: dict[str, str] = {
    "DeepseekV3ForCausalLM": "deepseek",
    "DeepseekV2ForCausalLM": "deepseek",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
}
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(ARCHITECTURES)

# model_type -> architecture, for configs without an "architectures" list
MODEL_TYPES: dict[str, str] = {
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
}

# a key that only one family's config.json has -> that family's architecture, first match wins (MLA first);
# how `from_dict(..., shapes_only=True)` reads a config that names no supported architecture
FAMILY_KEYS: tuple[tuple[str, str], ...] = (
    ("kv_lora_rank", "DeepseekV3ForCausalLM"),
    ("num_local_experts", "MixtralForCausalLM"),
    ("num_experts", "Qwen3MoeForCausalLM"),
)

_DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
           "float16": torch.float16, "half": torch.float16}

_ROPE_TYPES = ("default", "yarn")


@dataclass
class RopeConfig:
    """Rotary embedding parameters (rope_parameters / rope_scaling of config.json)."""

    theta: float = 10000.0
    type: str = "default"  # default | yarn
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None  # scales cos/sin; derived from factor and mscale when None
    truncate: bool = True
    interleaved: bool = False  # rotate pairs (x0,x1),(x2,x3).. (DeepSeek) instead of halves (x_i, x_{i+d/2})


@dataclass
class ModelConfig:
    """One checkpoint's architecture. Sizes are the whole model's (not per rank)."""

    architecture: str
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    vocab_size: int
    context_length: int  # max_position_embeddings
    eos_token_ids: list[int]
    dtype: torch.dtype  # the checkpoint's dtype (torch_dtype / dtype in config.json)
    rms_norm_eps: float
    tie_word_embeddings: bool

    # --- attention ---
    attention_kind: str  # "mla" | "gqa"
    num_attention_heads: int
    num_key_value_heads: int  # gqa; for mla equal to num_attention_heads (unused)
    head_dim: int  # query/key head dim (mla: qk_nope_head_dim + qk_rope_head_dim)
    v_head_dim: int
    rope: RopeConfig
    q_lora_rank: int | None = None  # mla
    kv_lora_rank: int | None = None  # mla
    qk_nope_head_dim: int | None = None  # mla
    qk_rope_head_dim: int | None = None  # mla
    attention_bias: bool = False
    qk_norm: bool = False  # gqa: RMSNorm over head_dim of q and k (Qwen3)
    sliding_window: int | None = None

    # --- MLP and MoE ---
    intermediate_size: int = 0  # dense MLP
    moe_intermediate_size: int = 0  # one routed expert
    num_experts: int = 0  # routed (logical) experts; 0: dense model
    num_experts_per_tok: int = 0
    num_shared_experts: int = 0  # shared MLP width = num_shared_experts * moe_intermediate_size
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's shared expert (for the planner; not served)
    moe_layers: tuple[int, ...] = ()  # indices of MoE layers
    scoring_func: str = "softmax"  # softmax | sigmoid
    topk_method: str = "greedy"  # greedy | group_limited_greedy | noaux_tc
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0

    num_mtp_layers: int = 0  # DeepSeek's multi-token-prediction layers, stored after the main ones (models/mtp.py)
    mtp_is_moe: bool = False  # the MTP layer's FFN is an MoE (the main layers' rule at index num_hidden_layers)
    quantization: str | None = None  # quantization_config.quant_method of the checkpoint, if any
    fp8: Fp8Config | None = None  # the checkpoint's block FP8 format (core/quant_config.py); None: unquantized
    path: str | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    # ------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        """Parse `path`/config.json (+ generation_config.json). Raises FileNotFoundError or ValueError."""
        root = Path(path)
        if not root.exists():
            raise FileNotFoundError(f"model path {str(path)!r} does not exist")
        if not root.is_dir():
            raise ValueError(f"model path {str(path)!r} is not a directory (expected a Hugging Face checkpoint dir)")
        cfg_file = root / "config.json"
        if not cfg_file.is_file():
            raise FileNotFoundError(f"{cfg_file} not found: {str(path)!r} is not a Hugging Face checkpoint directory")
        raw = _read_json(cfg_file)
        gen_file = root / "generation_config.json"
        generation = _read_json(gen_file) if gen_file.is_file() else None
        config = cls.from_dict(raw, generation)
        config.path = str(root)
        return config

    @classmethod
    def from_dict(cls, raw: dict[str, Any], generation: dict[str, Any] | None = None, *,
                  shapes_only: bool = False) -> ModelConfig:
        """Parse a config.json dict (and an optional generation_config.json dict).

        shapes_only: for the offline planner (eplb/tools/plan_models.py), which wants the sizes of models
        moeserve may not serve. A multimodal config is read from its text_config, and one that names no
        supported architecture as the family its keys belong to (FAMILY_KEYS; Qwen2-MoE reads as Qwen3-MoE
        plus its shared expert). Serving never sets it.
        """
        if shapes_only:
            raw = raw.get("text_config", raw)
        arch = _architecture(raw, shapes_only)
        family = ARCHITECTURES[arch]
        try:
            hidden = int(raw["hidden_size"])
            heads = int(raw["num_attention_heads"])
            common = dict(
                architecture=arch,
                model_type=raw.get("model_type", ""),
                hidden_size=hidden,
                num_hidden_layers=int(raw["num_hidden_layers"]),
                vocab_size=int(raw["vocab_size"]),
                context_length=int(raw.get("max_position_embeddings") or 4096),
                eos_token_ids=_eos_ids(raw, generation),
                dtype=_dtype(raw),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                num_attention_heads=heads,
                attention_bias=bool(raw.get("attention_bias", False)),
                quantization=(raw.get("quantization_config") or {}).get("quant_method"),
                fp8=None if shapes_only else parse_quantization_config(raw.get("quantization_config")),
                raw=raw)
            act = raw.get("hidden_act", "silu")
            if act != "silu":
                raise ValueError(f"hidden_act {act!r} is not supported (only silu)")
            if family == "deepseek":
                return cls(**common, **_deepseek_fields(raw, arch))
            return cls(**common, **_gqa_fields(raw, family))
        except KeyError as e:
            raise ValueError(f"config.json of {arch} lacks the field {e.args[0]!r}") from None

    # ------------------------------------------------------------------
    @property
    def is_mla(self) -> bool:
        return self.attention_kind == "mla"

    def is_moe_layer(self, layer_id: int) -> bool:
        return layer_id in self.moe_layers

    @property
    def softmax_scale(self) -> float:
        """Attention scale: head_dim^-0.5, times yarn_get_mscale(factor, mscale_all_dim)^2 for DeepSeek YaRN."""
        scale = self.head_dim**-0.5
        r = self.rope
        if self.is_mla and r.type != "default" and r.mscale_all_dim:
            m = yarn_get_mscale(r.factor, r.mscale_all_dim)
            scale = scale * m * m
        return scale

    def num_local_kv_heads(self, attn_tp_size: int = 1) -> int:
        """KV heads one attention-TP rank stores (GQA; replicated when there are fewer heads than ranks)."""
        return max(1, self.num_key_value_heads // attn_tp_size)

    def kv_bytes_per_token(self, dtype: torch.dtype, attn_tp_size: int = 1) -> int:
        """KV cache bytes one token takes on one rank (of an attention-TP group of attn_tp_size) over all layers."""
        elt = torch.empty((), dtype=dtype).element_size()
        if self.is_mla:  # the latent is replicated over attention-TP ranks
            per_layer = self.kv_lora_rank + self.qk_rope_head_dim
        else:
            per_layer = self.num_local_kv_heads(attn_tp_size) * (self.head_dim + self.v_head_dim)
        return self.num_hidden_layers * per_layer * elt


def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


# ----------------------------------------------------------------------
# parsing helpers


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None


def _architecture(raw: dict[str, Any], shapes_only: bool = False) -> str:
    archs = raw.get("architectures") or []
    if not archs and raw.get("model_type") in MODEL_TYPES:
        archs = [MODEL_TYPES[raw["model_type"]]]
    if shapes_only and (not archs or archs[0] not in SUPPORTED_ARCHITECTURES):
        inferred = next((arch for key, arch in FAMILY_KEYS if key in raw), None)
        if inferred:
            return inferred
        if not archs:
            raise ValueError(f"config.json names no architecture (model_type {raw.get('model_type')!r}) "
                             f"and has none of the MoE keys {', '.join(key for key, _ in FAMILY_KEYS)}; "
                             f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    if not archs:
        raise ValueError(f"config.json names no architecture (model_type {raw.get('model_type')!r}); "
                         f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    arch = archs[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported model architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    return arch


def _eos_ids(raw: dict[str, Any], generation: dict[str, Any] | None) -> list[int]:
    """Stop tokens: generation_config.json's eos_token_id when it has one, else config.json's."""
    eos = (generation or {}).get("eos_token_id")
    if eos is None:
        eos = raw.get("eos_token_id")
    if eos is None:
        return []
    ids = [eos] if isinstance(eos, int) else list(eos)
    return list(dict.fromkeys(int(i) for i in ids))


def _dtype(raw: dict[str, Any]) -> torch.dtype:
    name = raw.get("torch_dtype") or raw.get("dtype") or "float32"
    name = str(name).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"config.json dtype {name!r} is not supported; use one of float32, bfloat16, float16")
    return _DTYPES[name]


def _rope(raw: dict[str, Any], default_theta: float, interleaved: bool) -> RopeConfig:
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(params, dict) or any(isinstance(v, dict) for v in params.values()):
        raise ValueError(f"rope parameters per layer type are not supported: {params!r}")
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind not in _ROPE_TYPES:
        raise ValueError(f"rope_type {kind!r} is not supported; supported: {', '.join(_ROPE_TYPES)}")
    theta = float(params.get("rope_theta") or raw.get("rope_theta") or default_theta)
    rope = RopeConfig(theta=theta, type=kind, interleaved=interleaved)
    if kind == "yarn":
        max_pos = int(raw.get("max_position_embeddings") or 4096)
        orig = params.get("original_max_position_embeddings") or raw.get("original_max_position_embeddings") or max_pos
        rope.original_max_position_embeddings = int(orig)
        factor = params.get("factor")
        rope.factor = float(factor) if factor is not None else max_pos / rope.original_max_position_embeddings
        rope.beta_fast = float(params.get("beta_fast") or 32)
        rope.beta_slow = float(params.get("beta_slow") or 1)
        rope.mscale = params.get("mscale")
        rope.mscale_all_dim = params.get("mscale_all_dim")
        rope.attention_factor = params.get("attention_factor")
        rope.truncate = bool(params.get("truncate", True))
    return rope


def _deepseek_fields(raw: dict[str, Any], arch: str) -> dict[str, Any]:
    v3 = arch == "DeepseekV3ForCausalLM"
    layers = int(raw["num_hidden_layers"])
    num_experts = int(raw.get("n_routed_experts") or raw.get("num_local_experts") or 0)
    first_dense = int(raw.get("first_k_dense_replace") or 0)
    freq = int(raw.get("moe_layer_freq") or 1)
    def is_moe(i: int) -> bool:
        return bool(num_experts) and i >= first_dense and i % freq == 0

    moe_layers = tuple(i for i in range(layers) if is_moe(i))
    # NOTE: configs written by transformers lack topk_method/scoring_func: V3 means noaux_tc + sigmoid (what
    # transformers' DeepseekV3TopkRouter does); V2 means transformers' DeepseekV2Config defaults (greedy, softmax).
    topk_method = raw.get("topk_method") or ("noaux_tc" if v3 else "greedy")
    scoring = raw.get("scoring_func") or ("sigmoid" if v3 else "softmax")
    if topk_method not in ("greedy", "group_limited_greedy", "noaux_tc"):
        raise ValueError(f"topk_method {topk_method!r} is not supported")
    if scoring not in ("softmax", "sigmoid"):
        raise ValueError(f"scoring_func {scoring!r} is not supported")
    nope, rope_dim = int(raw["qk_nope_head_dim"]), int(raw["qk_rope_head_dim"])
    heads = int(raw["num_attention_heads"])
    n_group = int(raw.get("n_group") or 1)
    if num_experts and num_experts % n_group:
        raise ValueError(f"n_routed_experts {num_experts} is not a multiple of n_group {n_group}")
    return dict(
        attention_kind="mla",
        num_key_value_heads=heads,
        head_dim=nope + rope_dim,
        v_head_dim=int(raw["v_head_dim"]),
        # V2 rotates interleaved pairs (complex form); V3 follows rope_interleave (transformers' default True).
        rope=_rope(raw, 10000.0, interleaved=bool(raw.get("rope_interleave", True)) if v3 else True),
        q_lora_rank=raw.get("q_lora_rank"),
        kv_lora_rank=int(raw["kv_lora_rank"]),
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope_dim,
        intermediate_size=int(raw["intermediate_size"]),
        moe_intermediate_size=int(raw.get("moe_intermediate_size") or 0),
        num_experts=num_experts,
        num_experts_per_tok=int(raw.get("num_experts_per_tok") or 0),
        num_shared_experts=int(raw.get("n_shared_experts") or 0),
        moe_layers=moe_layers,
        scoring_func=scoring,
        topk_method=topk_method,
        n_group=n_group,
        topk_group=int(raw.get("topk_group") or 1),
        norm_topk_prob=bool(raw.get("norm_topk_prob", v3)),
        routed_scaling_factor=float(raw.get("routed_scaling_factor") or 1.0),
        num_mtp_layers=int(raw.get("num_nextn_predict_layers") or 0),
        mtp_is_moe=is_moe(layers))


def _gqa_fields(raw: dict[str, Any], family: str) -> dict[str, Any]:
    layers = int(raw["num_hidden_layers"])
    heads = int(raw["num_attention_heads"])
    head_dim = int(raw.get("head_dim") or int(raw["hidden_size"]) // heads)
    kv_heads = int(raw.get("num_key_value_heads") or heads)
    if family == "qwen3_moe":
        num_experts = int(raw.get("num_experts") or raw.get("num_local_experts") or 0)
        step = int(raw.get("decoder_sparse_step") or 1)
        mlp_only = set(raw.get("mlp_only_layers") or [])
        moe_layers = tuple(i for i in range(layers) if i not in mlp_only and num_experts and (i + 1) % step == 0)
        sliding = raw.get("sliding_window") if raw.get("use_sliding_window") else None
        extra = dict(
            qk_norm=True,
            intermediate_size=int(raw.get("intermediate_size") or 0),
            moe_intermediate_size=int(raw["moe_intermediate_size"]),
            shared_expert_intermediate_size=int(raw.get("shared_expert_intermediate_size") or 0),
            norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
            rope=_rope(raw, 10000.0, interleaved=False))
    else:  # mixtral: every layer is MoE; experts are intermediate_size wide
        num_experts = int(raw.get("num_local_experts") or raw.get("num_experts") or 8)
        moe_layers = tuple(range(layers))
        sliding = raw.get("sliding_window")
        extra = dict(
            intermediate_size=int(raw["intermediate_size"]),
            moe_intermediate_size=int(raw["intermediate_size"]),
            norm_topk_prob=True,
            rope=_rope(raw, 1000000.0, interleaved=False))
    return dict(
        attention_kind="gqa",
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        v_head_dim=head_dim,
        sliding_window=int(sliding) if sliding else None,
        num_experts=num_experts,
        num_experts_per_tok=int(raw.get("num_experts_per_tok") or 2),
        moe_layers=moe_layers,
        scoring_func="softmax",
        topk_method="greedy",
        **extra)
