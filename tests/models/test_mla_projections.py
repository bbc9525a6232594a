"""MLA's two projections of x (q_proj or q_a_proj, and kv_a_proj_with_mqa) run as one GEMM over one matrix whose
views the two parameters become; FP8 layers keep theirs. Parity with transformers (test_parity.py) runs through it."""

from __future__ import annotations

import pytest
import torch

from tests.models.harness import Runner, random_tokens


@pytest.mark.parametrize("name", ["v2_lite", "v3_groups"])  # q_proj (no q_lora) and q_a_proj
def test_fused_projection_is_views_and_equals_the_two(tiny_checkpoint, name):
    runner = Runner(tiny_checkpoint(name))
    attns = [layer.self_attn for layer in runner.model.model.layers]
    for a in attns:
        first = a.q_proj if a.q_lora_rank is None else a.q_a_proj
        fused = a._qkv_a
        assert fused is not None and fused.shape[0] == first.out_features + a.kv_a_proj_with_mqa.out_features
        assert first.weight.data_ptr() == fused.data_ptr()
        assert a.kv_a_proj_with_mqa.weight.data_ptr() == fused[first.out_features:].data_ptr()
    prompts = [("a", random_tokens(7, 1)), ("b", random_tokens(12, 2))]
    fused_logits = runner.extend(prompts)
    plain = Runner(tiny_checkpoint(name))
    for layer in plain.model.model.layers:
        layer.self_attn._qkv_a = None  # the two GEMMs
    torch.testing.assert_close(fused_logits, plain.extend(prompts), atol=1e-5, rtol=1e-5)


def test_fp8_layers_keep_their_gemms(fp8_checkpoint):
    runner = Runner(fp8_checkpoint[0])
    assert all(layer.self_attn._qkv_a is None for layer in runner.model.model.layers)
