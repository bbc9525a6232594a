"""ModelConfig parsing: the tiny checkpoints, released configs, defaults and errors."""

from __future__ import annotations

import json

import pytest
import torch

from moeserve.core.model_config import ModelConfig
from moeserve.kvcache.kv_pool import MHAKVPool, MLAKVPool, make_kv_pool
from tests.checkpoints import REAL_CONFIGS, write_config_only


def test_tiny_deepseek_v3(tiny_checkpoint):
    c = ModelConfig.from_pretrained(tiny_checkpoint("v3_groups"))
    assert c.architecture == "DeepseekV3ForCausalLM" and c.attention_kind == "mla"
    # transformers writes no topk_method/scoring_func: V3 means noaux_tc + sigmoid
    assert (c.topk_method, c.scoring_func, c.n_group, c.topk_group) == ("noaux_tc", "sigmoid", 4, 2)
    assert c.moe_layers == (1, 2) and c.num_experts == 16 and c.num_experts_per_tok == 4
    assert c.rope.interleaved and c.eos_token_ids == [1] and c.dtype == torch.float32
    assert (c.kv_lora_rank, c.qk_rope_head_dim, c.head_dim, c.v_head_dim) == (32, 8, 24, 16)


def test_tiny_v2_lite_and_qwen_and_mixtral(tiny_checkpoint):
    v2 = ModelConfig.from_pretrained(tiny_checkpoint("v2_lite"))
    assert (v2.topk_method, v2.scoring_func, v2.norm_topk_prob, v2.q_lora_rank) == ("greedy", "softmax", False, None)
    assert v2.rope.type == "yarn" and v2.rope.mscale_all_dim == 0.707
    qw = ModelConfig.from_pretrained(tiny_checkpoint("qwen3_moe"))
    assert qw.attention_kind == "gqa" and qw.qk_norm and qw.head_dim == 32 and qw.num_key_value_heads == 2
    assert qw.moe_layers == (1, 2) and qw.num_experts == 8 and qw.norm_topk_prob
    mx = ModelConfig.from_pretrained(tiny_checkpoint("mixtral_swa"))
    assert mx.moe_layers == (0, 1) and mx.moe_intermediate_size == 48 and mx.sliding_window == 5
    assert mx.norm_topk_prob and not mx.qk_norm and mx.head_dim == 16


def test_released_configs(tmp_path):
    v3 = ModelConfig.from_pretrained(write_config_only("DeepSeek-V3", tmp_path / "v3"))
    assert v3.moe_layers == tuple(range(3, 61)) and v3.num_mtp_layers == 1 and v3.quantization == "fp8"
    assert v3.rope.type == "yarn" and v3.rope.factor == 40 and v3.rope.original_max_position_embeddings == 4096
    assert v3.dtype == torch.bfloat16 and v3.context_length == 163840
    assert abs(v3.softmax_scale - 0.1352) < 1e-3  # 192^-0.5 * (0.1 ln 40 + 1)^2
    v2 = ModelConfig.from_pretrained(write_config_only("DeepSeek-V2-Lite", tmp_path / "v2"))
    assert abs(v2.softmax_scale - 0.1147) < 1e-3
    assert v2.eos_token_ids == [100001] and v2.moe_layers == tuple(range(1, 27))
    # 61 layers x 576 latent values x 2 bytes
    assert v3.kv_bytes_per_token(torch.bfloat16) == 61 * 576 * 2


def test_eos_from_generation_config(tmp_path):
    write_config_only("DeepSeek-V2-Lite", tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 100001, 7]}))
    assert ModelConfig.from_pretrained(tmp_path).eos_token_ids == [7, 100001]


def test_kv_pools(tiny_checkpoint):
    mla = ModelConfig.from_pretrained(tiny_checkpoint("v3_q_lora"))
    pool = make_kv_pool(mla, 10, 4, torch.float32, "cpu")
    assert isinstance(pool, MLAKVPool) and pool.get_latent(0).shape == (44, 40)
    assert pool.bytes_per_token == mla.kv_bytes_per_token(torch.float32) == 3 * 40 * 4
    gqa = ModelConfig.from_pretrained(tiny_checkpoint("qwen3_moe"))
    pool = make_kv_pool(gqa, 10, 1, torch.bfloat16, "cpu")
    assert isinstance(pool, MHAKVPool) and pool.get_kv(2)[0].shape == (11, 2, 32)
    assert pool.bytes_per_token == gqa.kv_bytes_per_token(torch.bfloat16) == 3 * 2 * 64 * 2
    assert gqa.kv_bytes_per_token(torch.bfloat16, attn_tp_size=2) == 3 * 1 * 64 * 2


def test_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ModelConfig.from_pretrained(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="config.json"):
        ModelConfig.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 8}))
    with pytest.raises(ValueError, match="LlamaForCausalLM.*DeepseekV3ForCausalLM.*MixtralForCausalLM"):
        ModelConfig.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        ModelConfig.from_pretrained(tmp_path)
    cfg = dict(REAL_CONFIGS["DeepSeek-V2-Lite"])
    del cfg["kv_lora_rank"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="kv_lora_rank"):
        ModelConfig.from_pretrained(tmp_path)
