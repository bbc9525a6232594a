"""Step-time model: shapes of the presets, monotonic sanity, config parsing, and the calibration."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from moeserve.eplb.tools.plan import Deployment, plan_step
from moeserve.eplb.tools.plan_calibration import CASES, run_calibration
from moeserve.eplb.tools.plan_hardware import gpu_spec
from moeserve.eplb.tools.plan_models import MODEL_PRESETS, load_model, model_from_hf_config

V3 = MODEL_PRESETS["deepseek-v3"]
H100 = gpu_spec("h100")


def decode(**kw) -> Deployment:
    return Deployment(
        **{"num_gpus": 72, "batch_per_gpu": 256, "context_len": 2000, "balancedness": 0.9, **kw}
    )


def prefill(**kw) -> Deployment:
    return Deployment(**{"num_gpus": 32, "phase": "prefill", "input_len": 2048, "balancedness": 0.9, **kw})


def test_presets_match_published_sizes() -> None:
    assert V3.total_params / 1e9 == pytest.approx(671.0, abs=1.0)
    assert V3.active_params / 1e9 == pytest.approx(36.6, abs=0.5)  # 37B activated incl. the head
    assert V3.attn_params / 1e6 == pytest.approx(187.1, abs=0.1)
    assert V3.kv_bytes_per_token_layer * V3.num_layers == 70272
    assert V3.pair_flops("decode") * V3.num_layers / 1e6 == pytest.approx(17.0, abs=0.05)
    assert MODEL_PRESETS["deepseek-v2-lite"].total_params / 1e9 == pytest.approx(15.7, abs=0.1)
    qwen = MODEL_PRESETS["qwen3-235b-a22b"]
    assert qwen.total_params / 1e9 == pytest.approx(235, abs=1.5)
    assert qwen.active_params / 1e9 == pytest.approx(22, abs=1.0)


def test_hf_configs(tmp_path) -> None:
    v3 = {
        "hidden_size": 7168,
        "num_hidden_layers": 61,
        "num_attention_heads": 128,
        "vocab_size": 129280,
        "first_k_dense_replace": 3,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "n_group": 8,
        "quantization_config": {"quant_method": "fp8"},
    }
    (tmp_path / "config.json").write_text(json.dumps(v3))
    parsed = load_model(str(tmp_path))
    assert replace(parsed, name=V3.name) == V3
    qwen = {
        "hidden_size": 4096,
        "num_hidden_layers": 94,
        "num_attention_heads": 64,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "vocab_size": 151936,
        "intermediate_size": 12288,
        "moe_intermediate_size": 1536,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }
    assert (
        replace(model_from_hf_config(qwen, "x"), name="qwen3-235b-a22b") == MODEL_PRESETS["qwen3-235b-a22b"]
    )
    mixtral = {
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 32000,
        "intermediate_size": 14336,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
    }
    m = model_from_hf_config(mixtral)
    assert m.total_params / 1e9 == pytest.approx(46.7, abs=0.3) and m.attention == "gqa"
    with pytest.raises(ValueError, match="MoE"):
        model_from_hf_config(
            {"hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 1, "vocab_size": 8}
        )
    with pytest.raises(ValueError, match="preset"):
        load_model("no-such-model")


def test_gpu_overrides() -> None:
    assert gpu_spec("H200", rdma_gbps=100.0).rdma_gbps == 100.0
    assert gpu_spec("h200", hbm_tbps=None).hbm_tbps == 4.8
    with pytest.raises(ValueError, match="unknown GPU"):
        gpu_spec("a100")


def test_breakdown_adds_up_and_reports() -> None:
    for dep in (decode(), decode(tbo=False), prefill(), prefill(tbo=False), decode(mtp_draft=1)):
        r = plan_step(V3, H100, dep)
        assert sum(r.breakdown_ms.values()) == pytest.approx(r.step_ms, rel=1e-6)
        assert r.tokens_per_s_node == pytest.approx(8 * r.tokens_per_s_gpu)
        assert r.tokens_per_s_total == pytest.approx(dep.num_gpus * r.tokens_per_s_gpu)
        assert r.memory_gb["weights"] > 0


def test_more_gpus_more_total_throughput() -> None:
    totals = [plan_step(V3, H100, decode(num_gpus=n)).tokens_per_s_total for n in (8, 16, 32, 72, 144)]
    assert totals == sorted(totals)
    totals = [plan_step(V3, H100, prefill(num_gpus=n)).tokens_per_s_total for n in (8, 16, 32, 72)]
    assert totals == sorted(totals)
    # replicas of one EP group scale exactly
    one = plan_step(V3, H100, decode(num_gpus=72)).tokens_per_s_total
    two = plan_step(V3, H100, decode(num_gpus=144, ep_size=72)).tokens_per_s_total
    assert two == pytest.approx(2 * one)


def test_worse_balance_is_slower() -> None:
    for make in (decode, prefill):
        rates = [
            plan_step(V3, H100, make(balancedness=b)).tokens_per_s_gpu for b in (1.0, 0.9, 0.7, 0.5, 0.3)
        ]
        assert rates == sorted(rates, reverse=True) and rates[0] > rates[-1] * 1.3


def test_bigger_decode_batch_until_compute_bound() -> None:
    rates = [
        plan_step(V3, H100, decode(batch_per_gpu=b, context_len=1000)).tokens_per_s_gpu
        for b in (1, 4, 16, 64, 128, 256, 512)
    ]
    assert rates == sorted(rates)
    assert rates[1] > 3 * rates[0]  # memory-bound: almost free tokens
    assert rates[-1] < 1.5 * rates[-2]  # compute and network bound: diminishing returns


def test_longer_context_and_prompts_are_slower() -> None:
    assert plan_step(V3, H100, decode(context_len=8000)).step_ms > plan_step(V3, H100, decode()).step_ms
    assert (
        plan_step(V3, H100, prefill(input_len=8192)).tokens_per_s_gpu
        < plan_step(V3, H100, prefill(input_len=1024)).tokens_per_s_gpu
    )


def test_tbo_helps_large_decode_batches_not_tiny_ones() -> None:
    big_on = plan_step(V3, H100, decode()).tokens_per_s_gpu
    big_off = plan_step(V3, H100, decode(tbo=False)).tokens_per_s_gpu
    assert big_on > 1.1 * big_off
    # at a few tokens per GPU, splitting the batch only reads the weights twice (SGLang: -27% at 32 tokens)
    tiny_on = plan_step(V3, H100, decode(batch_per_gpu=4)).tokens_per_s_gpu
    tiny_off = plan_step(V3, H100, decode(batch_per_gpu=4, tbo=False)).tokens_per_s_gpu
    assert tiny_on < tiny_off


def test_invalid_deployments() -> None:
    with pytest.raises(ValueError, match="multiple of EP"):
        plan_step(V3, H100, decode(num_gpus=72, redundant=0))
    with pytest.raises(ValueError, match="divide"):
        plan_step(V3, H100, decode(num_gpus=72, ep_size=48))
    with pytest.raises(ValueError, match="balancedness"):
        plan_step(V3, H100, decode(balancedness=1.5))


def test_memory_warning() -> None:
    r = plan_step(V3, H100, decode(batch_per_gpu=512, context_len=4000))
    assert any("exceed" in w for w in r.warnings)


def test_default_balancedness_is_simulated_and_eplb_helps() -> None:
    with_eplb = plan_step(V3, H100, decode(num_gpus=32, balancedness=None))
    without = plan_step(V3, H100, decode(num_gpus=32, balancedness=None, eplb=False))
    assert "synthetic" in with_eplb.balancedness_source
    assert 0.5 < with_eplb.balancedness <= 1.0
    assert without.balancedness < with_eplb.balancedness
    assert without.tokens_per_s_gpu < with_eplb.tokens_per_s_gpu


def test_calibration_within_stated_tolerance() -> None:
    rows = run_calibration()
    assert len(rows) == len(CASES)
    for row in rows:
        assert abs(row.error) <= row.case.tolerance, (row.case.name, row.error)
    fitted = [abs(r.error) for r in rows if r.case.fitted]
    assert sum(fitted) / len(fitted) < 0.06


def test_hf_configs_moeserve_does_not_serve() -> None:
    """Configs moeserve does not serve: Qwen2-MoE keeps its shared expert, a multimodal one its text model."""
    qwen2 = {
        "architectures": ["Qwen2MoeForCausalLM"],
        "model_type": "qwen2_moe",
        "hidden_size": 2048,
        "num_hidden_layers": 24,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "vocab_size": 151936,
        "intermediate_size": 5632,
        "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632,
        "num_experts": 60,
        "num_experts_per_tok": 4,
    }
    m = model_from_hf_config(qwen2)
    assert m.shared_params == 3 * 2048 * 5632 and m.num_experts == 60 and m.num_dense_layers == 0
    text = replace(MODEL_PRESETS["qwen3-235b-a22b"], name="vl")
    vl = {
        "architectures": ["Qwen3VLMoeForConditionalGeneration"],
        "text_config": {
            "model_type": "qwen3_vl_moe_text",
            "hidden_size": text.hidden,
            "num_hidden_layers": text.num_layers,
            "num_attention_heads": text.num_heads,
            "num_key_value_heads": text.num_kv_heads,
            "head_dim": text.head_dim,
            "vocab_size": text.vocab,
            "intermediate_size": text.dense_intermediate,
            "moe_intermediate_size": text.moe_intermediate,
            "num_experts": text.num_experts,
            "num_experts_per_tok": text.topk,
        },
    }
    assert model_from_hf_config(vl, "vl") == text
    with pytest.raises(ValueError, match="not an MoE config"):
        model_from_hf_config({**qwen2, "num_experts": 0})
