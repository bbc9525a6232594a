"""MLA's two projections of x (q_proj or q_a_proj, and kv_a_proj_with_mqa) run as one GEMM over one matrix whose
views the two layers' parameters become: plain weights, and FP8 ones whose q rows are whole 128-blocks (one
quantization of x then). Parity with transformers (test_parity.py) runs through it."""

from __future__ import annotations

import json

import pytest
import torch

from tests.models.harness import Runner, random_tokens

PROMPTS = [("a", random_tokens(7, 1)), ("b", random_tokens(12, 2))]


def _attns(runner: Runner) -> list:
    return [layer.self_attn for layer in runner.model.model.layers]


def _check_views(a, names: tuple[str, ...]) -> None:
    first = a.q_proj if a.q_lora_rank is None else a.q_a_proj
    fused = a._qkv_a.__self__  # the fused layer behind the bound matmul
    for name in names:
        whole, q, kv = getattr(fused, name), getattr(first, name), getattr(a.kv_a_proj_with_mqa, name)
        assert whole.shape[0] == q.shape[0] + kv.shape[0]
        assert q.data_ptr() == whole.data_ptr() and kv.data_ptr() == whole[q.shape[0]:].data_ptr()


def _unfused(runner: Runner) -> Runner:
    for a in _attns(runner):
        a._qkv_a = None  # the two layers' own GEMMs
    return runner


@pytest.mark.parametrize("name", ["v2_lite", "v3_groups"])  # q_proj (no q_lora) and q_a_proj
def test_fused_projection_is_views_and_equals_the_two(tiny_checkpoint, name):
    runner = Runner(tiny_checkpoint(name))
    for a in _attns(runner):
        _check_views(a, ("weight",))
    plain = _unfused(Runner(tiny_checkpoint(name)))
    torch.testing.assert_close(runner.extend(PROMPTS), plain.extend(PROMPTS), atol=1e-5, rtol=1e-5)


def test_fp8_fuses_on_whole_blocks(fp8_checkpoint, tmp_path):
    """The tiny FP8 checkpoint's q_a_proj has 160 rows (a partial scale block): its layers keep their GEMMs. With
    q_lora_rank 128 (dummy FP8 weights) the weights and their scale blocks concatenate, and the logits are the
    two layers'."""
    assert all(a._qkv_a is None for a in _attns(Runner(fp8_checkpoint[0])))
    config = json.loads(open(f"{fp8_checkpoint[0]}/config.json").read())
    config["q_lora_rank"] = 128
    (tmp_path / "config.json").write_text(json.dumps(config))
    fused = Runner(str(tmp_path), load_format="dummy", random_seed=5)
    for a in _attns(fused):
        _check_views(a, ("weight", "weight_scale_inv"))
    plain = _unfused(Runner(str(tmp_path), load_format="dummy", random_seed=5))
    torch.testing.assert_close(fused.extend(PROMPTS), plain.extend(PROMPTS), atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("q_lora_rank", [None, 128])
def test_fused_on_cuda(fp8_checkpoint, tmp_path, q_lora_rank):
    """The block-FP8 GEMM over the fused weights (with a partial last block: 128 + 160 rows), in bf16 on CUDA."""
    config = json.loads(open(f"{fp8_checkpoint[0]}/config.json").read())
    config["q_lora_rank"] = q_lora_rank
    if q_lora_rank is None:
        config.pop("quantization_config")  # plain weights, q_proj
    (tmp_path / "config.json").write_text(json.dumps(config))
    runs = []
    for fuse in (True, False):
        r = Runner(str(tmp_path), load_format="dummy", random_seed=5, dtype="bfloat16", device="cuda")
        assert all(a._qkv_a is not None for a in _attns(r))
        runs.append((r if fuse else _unfused(r)).extend(PROMPTS))
    torch.testing.assert_close(runs[0], runs[1], atol=3e-2, rtol=3e-2)
