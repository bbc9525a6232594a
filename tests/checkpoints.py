"""Tiny random-weight Hugging Face checkpoints built with transformers' own classes, for parity tests.

    build_checkpoint("v3_q_lora", "/tmp/x")            # config.json, generation_config.json, model.safetensors
    build_checkpoint("mixtral", "/tmp/y", sharded=True)  # + model.safetensors.index.json and several shards
    build_mtp_checkpoint("v3_q_lora", "/tmp/z")          # + DeepSeek's MTP layer, model.layers.{num_hidden_layers}

Every parameter is redrawn from a seeded generator at a scale that keeps activations O(1) and the logits
peaked (std = fan_in^-0.5), norm weights near 1 (not exactly: a forgotten norm weight must show), and
DeepSeek-V3's e_score_correction_bias nonzero so the biased expert choice is exercised. Weights are saved
float32. Each build takes well under a second.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

VOCAB = 512
MAX_POS = 512

_DEEPSEEK = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
    v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
    max_position_embeddings=MAX_POS, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1,
)
_YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=128,
             beta_fast=32, beta_slow=1)

# name -> (transformers config class name, model class name, config kwargs)
SPECS: dict[str, tuple[str, str, dict[str, Any]]] = {
    # DeepSeek-V3 (noaux_tc, sigmoid, bias), q_lora, one expert group
    "v3_q_lora": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                  dict(_DEEPSEEK, q_lora_rank=32, n_group=1, topk_group=1, routed_scaling_factor=2.5)),
    # without q_lora (full q_proj)
    "v3_no_q_lora": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                     dict(_DEEPSEEK, q_lora_rank=None, n_group=1, topk_group=1, routed_scaling_factor=2.5)),
    # 16 experts in 4 groups, 2 groups kept, top-4
    "v3_groups": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                  dict(_DEEPSEEK, q_lora_rank=32, n_routed_experts=16, num_experts_per_tok=4, n_group=4,
                       topk_group=2, routed_scaling_factor=2.5)),
    # YaRN with mscale != mscale_all_dim: cos/sin scaled by the attention factor, softmax scale by mscale^2
    "v3_yarn": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                dict(_DEEPSEEK, q_lora_rank=32, n_group=1, topk_group=1, routed_scaling_factor=2.5,
                     rope_parameters=dict(_YARN, mscale=1.0, mscale_all_dim=0.8))),
    # DeepSeek-V2-Lite form: no q_lora, greedy softmax, one group, no renormalization, YaRN (mscale 0.707)
    "v2_lite": ("DeepseekV2Config", "DeepseekV2ForCausalLM",
                dict(_DEEPSEEK, q_lora_rank=None, n_shared_experts=2, topk_method="greedy", n_group=None,
                     topk_group=None, norm_topk_prob=False, routed_scaling_factor=1.0,
                     rope_parameters=dict(_YARN, mscale=0.707, mscale_all_dim=0.707))),
    # DeepSeek-V2 form: q_lora, group_limited_greedy over 4 groups
    "v2_groups": ("DeepseekV2Config", "DeepseekV2ForCausalLM",
                  dict(_DEEPSEEK, q_lora_rank=32, n_routed_experts=16, num_experts_per_tok=4,
                       topk_method="group_limited_greedy", n_group=4, topk_group=2, norm_topk_prob=False,
                       routed_scaling_factor=2.0)),
    # Qwen3-MoE: GQA 4/2 with head_dim != hidden/heads, q/k norm, layer 0 dense
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                       num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                       num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[0],
                       max_position_embeddings=MAX_POS, rope_parameters=dict(rope_type="default", rope_theta=1e6),
                       tie_word_embeddings=False, bos_token_id=0, eos_token_id=1)),
    # Mixtral: GQA 4/2, 4 experts, top-2
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                     max_position_embeddings=MAX_POS, sliding_window=None, tie_word_embeddings=False,
                     bos_token_id=0, eos_token_id=1)),
    # Mixtral with a 5-token sliding window (longer test prompts cross it)
    "mixtral_swa": ("MixtralConfig", "MixtralForCausalLM",
                    dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                         max_position_embeddings=MAX_POS, sliding_window=5, tie_word_embeddings=False,
                         bos_token_id=0, eos_token_id=1)),
    # DeepSeek-V3 sized for FP8 blocks of 128: hidden 256 (2 blocks), partial blocks everywhere else (q_lora 160,
    # kv_a 128 + 32, dense MLP 320, experts 192: fused gate/up padded to whole blocks); the sharded attention
    # projections split into whole blocks over 2 ranks (8 heads: q_b and kv_b 512 rows, o_proj 256 columns)
    "v3_fp8": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
               dict(_DEEPSEEK, hidden_size=256, intermediate_size=320, moe_intermediate_size=192, q_lora_rank=160,
                    kv_lora_rank=128, num_attention_heads=8, num_key_value_heads=8, qk_nope_head_dim=32,
                    qk_rope_head_dim=32, v_head_dim=32, n_group=1, topk_group=1, routed_scaling_factor=2.5)),
}

INIT_STD = {"v3_fp8": 0.02}  # checkpoints initialized like a fresh model (see randomize)
NAMES = tuple(n for n in SPECS if n != "v3_fp8")  # the parity matrix; v3_fp8 is for the FP8 tests
FP8_QUANTIZATION_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                           "weight_block_size": [128, 128]}
SHIPPED = "shipped"  # tiny_checkpoint(SHIPPED): the trained default model (moeserve/models/default/)


def make_hf_model(name: str, seed: int = 0, init_std: float | None = None, **overrides: Any) -> torch.nn.Module:
    """The transformers model of checkpoint `name`, float32, randomized (not saved); init_std: see randomize."""
    import transformers

    config_cls, model_cls, kwargs = SPECS[name]
    config = getattr(transformers, config_cls)(**{**kwargs, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).float().eval()
    randomize(model, seed, init_std)
    return model


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int = 0, init_std: float | None = None) -> None:
    """init_std: every matrix normal(0, init_std) as a freshly initialized model (initializer_range), instead of
    fan_in^-0.5: the residual stream stays near the embeddings, so the layers perturb well-separated logits."""
    gen = torch.Generator().manual_seed(seed)
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if name.endswith("inv_freq"):
            continue
        if name.endswith("e_score_correction_bias"):
            t.copy_(0.1 * torch.randn(t.shape, generator=gen))
        elif name.endswith("norm.weight"):
            t.copy_(1.0 + 0.1 * torch.randn(t.shape, generator=gen))
        elif t.dim() >= 2:
            std = init_std or (1.0 if "embed_tokens" in name else t.shape[-1] ** -0.5)
            t.copy_(std * torch.randn(t.shape, generator=gen))
        elif t.is_floating_point():
            t.copy_(0.02 * torch.randn(t.shape, generator=gen))


def build_checkpoint(name: str, out_dir: str | Path, sharded: bool = False, seed: int = 0,
                     **overrides: Any) -> str:
    """Write checkpoint `name` (a key of SPECS) into out_dir; sharded: several files + index.json."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = make_hf_model(name, seed, INIT_STD.get(name), **overrides)
    kwargs = {"max_shard_size": "100KB"} if sharded else {}
    model.save_pretrained(str(out), **kwargs)
    return str(out)


# config.json of released checkpoints (public), for config parsing, dummy loads and parameter counts.
REAL_CONFIGS: dict[str, dict[str, Any]] = {
    "DeepSeek-V2-Lite": {
        "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "attention_bias": False,
        "bos_token_id": 100000, "eos_token_id": 100001, "first_k_dense_replace": 1, "hidden_act": "silu",
        "hidden_size": 2048, "intermediate_size": 10944, "kv_lora_rank": 512, "max_position_embeddings": 163840,
        "moe_intermediate_size": 1408, "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 64,
        "n_shared_experts": 2, "norm_topk_prob": False, "num_attention_heads": 16, "num_experts_per_tok": 6,
        "num_hidden_layers": 27, "num_key_value_heads": 16, "q_lora_rank": None, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
        "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
                         "original_max_position_embeddings": 4096, "type": "yarn"},
        "rope_theta": 10000, "routed_scaling_factor": 1.0, "scoring_func": "softmax", "tie_word_embeddings": False,
        "topk_group": 1, "topk_method": "greedy", "torch_dtype": "bfloat16", "v_head_dim": 128,
        "vocab_size": 102400,
    },
    "DeepSeek-V3": {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "attention_bias": False,
        "bos_token_id": 0, "eos_token_id": 1, "first_k_dense_replace": 3, "hidden_act": "silu",
        "hidden_size": 7168, "intermediate_size": 18432, "kv_lora_rank": 512, "max_position_embeddings": 163840,
        "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256,
        "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128, "num_experts_per_tok": 8,
        "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "q_lora_rank": 1536,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                "weight_block_size": [128, 128]},
        "rms_norm_eps": 1e-06,
        "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "original_max_position_embeddings": 4096, "type": "yarn"},
        "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "tie_word_embeddings": False,
        "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "v_head_dim": 128,
        "vocab_size": 129280,
    },
}


def write_config_only(name: str, out_dir: str | Path) -> str:
    """A directory with only config.json of a released model (REAL_CONFIGS) - enough for --load-format dummy."""
    import json

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(REAL_CONFIGS[name], indent=2))
    return str(out)


# MTP tensors DeepSeek-V3's FP8 checkpoint keeps in bf16, though 2-D and inside model.layers.61
MTP_UNQUANTIZED = (".eh_proj.weight", ".shared_head.head.weight", ".embed_tokens.weight")


def deepseek_quantized(key: str, tensor: torch.Tensor) -> bool:
    """Whether DeepSeek's FP8 checkpoints store `key` in FP8: the 2-D projection weights of the decoder layers
    (attention, dense MLP, shared and routed experts; the MTP layer's too), not the embeddings, norms, the gate,
    lm_head, nor the MTP layer's eh_proj and its copies of the embedding and head."""
    return (key.startswith("model.layers.") and key.endswith(".weight") and tensor.dim() == 2
            and not key.endswith((".mlp.gate.weight", *MTP_UNQUANTIZED)))


@torch.no_grad()
def mtp_layer_tensors(name: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random tensors of DeepSeek's MTP layer for checkpoint `name` (a DeepSeek entry of SPECS), keyed as DeepSeek
    publishes them: model.layers.{L}.{enorm, hnorm, eh_proj, shared_head.norm} and a decoder layer, without the
    embedding and head copies. The decoder layer is layer L of transformers' model one layer deeper, randomized and
    saved by transformers (so its experts have the published per-expert keys). Float32."""
    import tempfile

    from safetensors.torch import load_file

    L = SPECS[name][2]["num_hidden_layers"]
    deeper = make_hf_model(name, seed + 1000, INIT_STD.get(name), num_hidden_layers=L + 1)
    H = deeper.config.hidden_size
    prefix = f"model.layers.{L}."
    with tempfile.TemporaryDirectory() as tmp:
        deeper.save_pretrained(tmp)
        out = {k: v for k, v in load_file(f"{tmp}/model.safetensors").items() if k.startswith(prefix)}
    gen = torch.Generator().manual_seed(seed + 2000)
    for norm in ("enorm", "hnorm", "shared_head.norm"):  # near 1, not exactly: a forgotten norm must show
        out[f"{prefix}{norm}.weight"] = 1.0 + 0.1 * torch.randn(H, generator=gen)
    out[f"{prefix}eh_proj.weight"] = (INIT_STD.get(name) or (2 * H) ** -0.5) * torch.randn(H, 2 * H, generator=gen)
    return out


def build_mtp_checkpoint(name: str, out_dir: str | Path, seed: int = 0) -> str:
    """Checkpoint `name` with DeepSeek's MTP layer appended in the published layout (`mtp_layer_tensors`, plus the
    copies of the embedding and head DeepSeek stores under the layer) and num_nextn_predict_layers 1."""
    import json

    from safetensors.torch import load_file, save_file

    out = Path(build_checkpoint(name, out_dir, seed=seed, num_nextn_predict_layers=1))
    tensors = load_file(str(out / "model.safetensors"))
    mtp = mtp_layer_tensors(name, seed)
    prefix = f"model.layers.{SPECS[name][2]['num_hidden_layers']}"
    mtp[f"{prefix}.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    mtp[f"{prefix}.shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file({**tensors, **mtp}, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    assert config.get("num_nextn_predict_layers") == 1, "transformers dropped num_nextn_predict_layers"
    return str(out)


def build_fp8_checkpoint(name: str, out_dir: str | Path, seed: int = 0) -> tuple[str, str]:
    """Checkpoint `name` (random weights, see SPECS) through `quantize_checkpoint`. Returns (fp8 dir, dequantized dir)."""
    out = Path(out_dir)
    ref = build_checkpoint(name, out / "plain", seed=seed)
    return quantize_checkpoint(ref, out)


def quantize_checkpoint(src: str | Path, out_dir: str | Path) -> tuple[str, str]:
    """The single-file checkpoint in `src` quantized with DeepSeek's recipe, in DeepSeek's key layout (`X.weight` e4m3
    beside `X.weight_scale_inv` float32 [ceil(N/128), ceil(K/128)], quantization_config in config.json) under
    out/fp8, and the same model holding the dequantized weights in float32 (no quantization_config; the dequantized
    values q * scale are not all representable in bf16) under out/dequantized; the other tensors keep their dtype.
    config.json, generation_config.json and the tokenizer files are copied. Returns (fp8 dir, dequantized dir)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from moeserve.kernels.fp8_quant import dequantize_weight, quantize_weight

    src, out = Path(src), Path(out_dir)
    fp8, ref = out / "fp8", out / "dequantized"
    quantized, dequantized = {}, {}
    for key, t in load_file(str(src / "model.safetensors")).items():
        if deepseek_quantized(key, t):
            q, scale_inv = quantize_weight(t)
            quantized[key], quantized[key + "_scale_inv"] = q, scale_inv
            dequantized[key] = dequantize_weight(q, scale_inv)
        else:
            quantized[key] = dequantized[key] = t
    config = json.loads((src / "config.json").read_text())
    config.pop("quantization_config", None)
    for d, tensors, cfg in ((fp8, quantized, {**config, "quantization_config": FP8_QUANTIZATION_CONFIG}),
                            (ref, dequantized, config)):
        d.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
        (d / "config.json").write_text(json.dumps(cfg, indent=2))
        for extra in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
            if (src / extra).is_file():
                shutil.copy(src / extra, d / extra)
    return str(fp8), str(ref)
