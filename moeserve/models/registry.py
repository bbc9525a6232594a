"""Which model class serves which Hugging Face architecture name (imported lazily)."""

from __future__ import annotations

import importlib

from torch import nn

# architecture name in config.json -> (module, class)
_MODELS: dict[str, tuple[str, str]] = {
    "DeepseekV3ForCausalLM": ("moeserve.models.deepseek", "DeepseekV3ForCausalLM"),
    "DeepseekV2ForCausalLM": ("moeserve.models.deepseek", "DeepseekV2ForCausalLM"),
    "Qwen3MoeForCausalLM": ("moeserve.models.qwen3_moe", "Qwen3MoeForCausalLM"),
    "MixtralForCausalLM": ("moeserve.models.mixtral", "MixtralForCausalLM"),
}

SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(_MODELS)

# model_type -> architecture, for configs without an "architectures" list
MODEL_TYPES: dict[str, str] = {
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
}


def get_model_class(architecture: str) -> type[nn.Module]:
    if architecture not in _MODELS:
        raise ValueError(
            f"unsupported model architecture {architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    module, name = _MODELS[architecture]
    return getattr(importlib.import_module(module), name)
