"""Swap a built model's layers for their block-FP8 twins: what DeepSeek's FP8 checkpoints quantize, and what
--quantization fp8 quantizes at load.

Quantized: every linear layer (attention projections), dense MLPs, shared experts and routed experts. Unquantized,
as DeepSeek publishes them: embeddings, norms, the MoE gate (fp32 router), lm_head, and the MTP layer's eh_proj
(bf16 in DeepSeek-V3's FP8 checkpoint). Runs on the 'meta' model
before the loader allocates anything (models/loader.py build_model).
"""

from __future__ import annotations

import torch
from torch import nn

from moeserve.layers.linear import Linear
from moeserve.layers.mlp import GatedMLP
from moeserve.layers.moe.experts import Experts
from moeserve.layers.quantization.fp8_experts import Fp8Experts
from moeserve.layers.quantization.fp8_linear import fp8_twin
from moeserve.layers.quantization.fp8_mlp import Fp8GatedMLP

UNQUANTIZED = ("lm_head", "eh_proj")  # last parts of module names kept in the model's dtype (besides non-linear layers)


def to_fp8(model: nn.Module, activation_dtype: torch.dtype) -> None:
    """Replace, in place, each quantizable layer of `model` with its FP8 twin (same shapes and checkpoint keys, plus
    the `weight_scale_inv` tensors). Raises ValueError naming the layer whose parallel share of a weight does not
    fall on 128-element block boundaries (pick another --tp-size)."""
    swaps = [(name, module) for name, module in model.named_modules()
             if isinstance(module, Linear | GatedMLP | Experts) and name.rpartition(".")[2] not in UNQUANTIZED]
    for name, module in swaps:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, _twin(name, module, activation_dtype))


def _twin(name: str, module: nn.Module, activation_dtype: torch.dtype) -> nn.Module:
    if isinstance(module, Experts):
        return Fp8Experts(module.hidden_size, module.full_intermediate_size, module.num_experts, module.expert_ids,
                          module.checkpoint_names, module.runner_backend, activation_dtype, module.tp_size, module.tp_rank)
    if isinstance(module, GatedMLP):
        return Fp8GatedMLP(module.hidden_size, module.full_intermediate_size, activation_dtype, module.tp_size, module.tp_rank)
    try:
        return fp8_twin(module, activation_dtype)
    except ValueError as e:
        raise ValueError(f"FP8 weights: {name}'s share on this rank splits a 128 x 128 scale block ({e}); choose a "
                         "--tp-size that divides the layer into whole blocks") from None
