"""The loader: sharded checkpoints, dummy weights, bf16, and clear errors for checkpoints that do not fit."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from moeserve.args import ServerArgs
from moeserve.core.model_config import ModelConfig
from moeserve.models.loader import build_model, load_model
from tests.checkpoints import write_config_only
from tests.models.harness import Runner, random_tokens


def _state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_sharded_equals_single_file(tiny_checkpoint):
    sharded = tiny_checkpoint("v3_groups", sharded=True)
    assert len(list(__import__("pathlib").Path(sharded).glob("*.safetensors"))) > 1
    a = load_model(ServerArgs(model_path=tiny_checkpoint("v3_groups")), "cpu", show_progress=False)[0]
    b = load_model(ServerArgs(model_path=sharded), "cpu", show_progress=False)[0]
    sa, sb = _state(a), _state(b)
    assert sa.keys() == sb.keys()
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], atol=0, rtol=0, msg=k)


def test_fused_expert_layout(tiny_checkpoint):
    path = tiny_checkpoint("mixtral")
    model, config = load_model(ServerArgs(model_path=path), "cpu", show_progress=False)
    ckpt = load_file(f"{path}/model.safetensors")
    experts = model.model.layers[1].block_sparse_moe.experts
    inter = config.moe_intermediate_size
    for e in range(config.num_experts):
        p = f"model.layers.1.block_sparse_moe.experts.{e}"
        torch.testing.assert_close(experts.w13[e, :inter], ckpt[f"{p}.w1.weight"], atol=0, rtol=0)
        torch.testing.assert_close(experts.w13[e, inter:], ckpt[f"{p}.w3.weight"], atol=0, rtol=0)
        torch.testing.assert_close(experts.w2[e], ckpt[f"{p}.w2.weight"], atol=0, rtol=0)


def test_dummy_from_config_alone(tmp_path):
    path = write_config_only("DeepSeek-V2-Lite", tmp_path)
    config = ModelConfig.from_pretrained(path)
    # the real shapes, on meta: 15.7B parameters
    model = build_model(config, None, torch.device("meta"), torch.bfloat16)
    assert abs(sum(p.numel() for p in model.parameters()) / 15.7e9 - 1) < 0.01
    layer = model.model.layers[1]
    assert layer.mlp.experts.w13.shape == (64, 2 * 1408, 2048) and layer.mlp.experts.w2.shape == (64, 2048, 1408)
    assert layer.self_attn.kv_b_proj.weight.shape == (16 * 256, 512)
    assert layer.mlp.shared_experts.gate_up_proj.shape == (2 * 2 * 1408, 2048)
    assert model.model.layers[0].mlp.gate_up_proj.shape == (2 * 10944, 2048)


def test_dummy_weights_small_model(tiny_checkpoint, tmp_path):
    shutil.copy(f"{tiny_checkpoint('v3_groups')}/config.json", tmp_path / "config.json")  # no weights
    args = ServerArgs(model_path=str(tmp_path), load_format="dummy", random_seed=3)
    a, config = load_model(args, "cpu", show_progress=False)
    b, _ = load_model(args, "cpu", show_progress=False)
    c, _ = load_model(ServerArgs(model_path=str(tmp_path), load_format="dummy", random_seed=4), "cpu",
                      show_progress=False)
    sa, sb, sc = _state(a), _state(b), _state(c)
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["model.embed_tokens.weight"], sc["model.embed_tokens.weight"])
    assert torch.equal(sa["model.layers.1.input_layernorm.weight"], torch.ones(config.hidden_size))
    w = sa["model.layers.1.self_attn.q_b_proj.weight"]
    assert 0.015 < w.std() < 0.025
    runner = Runner(str(tmp_path), load_format="dummy")
    logits = runner.extend([("a", random_tokens(9, seed=0))])
    assert torch.isfinite(logits).all()


def test_bf16_load(tiny_checkpoint):
    path = tiny_checkpoint("v3_q_lora")
    ours = Runner(path, dtype="bfloat16")
    params = dict(ours.model.named_parameters())
    assert params["model.layers.1.self_attn.kv_b_proj.weight"].dtype == torch.bfloat16
    assert params["model.layers.1.mlp.experts.w13"].dtype == torch.bfloat16
    assert params["model.layers.1.mlp.gate.weight"].dtype == torch.float32  # the router stays fp32
    assert params["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    tokens = random_tokens(12, seed=0)
    lo = ours.extend([("a", tokens)])
    hi = Runner(path).extend([("a", tokens)])
    assert lo.dtype == torch.float32 and torch.isfinite(lo).all()
    # most rows close: bf16 rounding may flip a near-tie of the MoE router's top-k, and that row's logits then
    # differ by the experts' outputs (a tie rounded one way on the expanded extend, another on the absorbed one)
    close = (lo - hi).abs().amax(-1) < 0.1 * hi.abs().max()
    assert close.float().mean() > 0.8, close
    assert (lo.argmax(-1) == hi.argmax(-1)).float().mean() > 0.8


def _edited(src: str, dst, edit) -> str:
    shutil.copytree(src, dst)
    tensors = load_file(f"{dst}/model.safetensors")
    edit(tensors)
    save_file(tensors, f"{dst}/model.safetensors", metadata={"format": "pt"})
    return str(dst)


def test_missing_unexpected_misshaped(tiny_checkpoint, tmp_path):
    src = tiny_checkpoint("v3_q_lora")
    key = "model.layers.1.self_attn.kv_b_proj.weight"

    missing = _edited(src, tmp_path / "missing", lambda t: t.pop(key))
    with pytest.raises(ValueError, match=rf"missing tensor '{key}' \(expected shape \(128, 32\)\)"):
        load_model(ServerArgs(model_path=missing), "cpu", show_progress=False)

    extra = _edited(src, tmp_path / "extra", lambda t: t.update({"model.layers.1.mlp.surprise": torch.ones(3, 4)}))
    with pytest.raises(ValueError, match=r"unexpected tensor 'model.layers.1.mlp.surprise' \(shape \(3, 4\)\)"):
        load_model(ServerArgs(model_path=extra), "cpu", show_progress=False)

    def reshape(t):
        t[key] = torch.ones(120, 32)

    bad = _edited(src, tmp_path / "bad", reshape)
    with pytest.raises(ValueError, match=rf"'{key}' has shape \(120, 32\) in the checkpoint, expected \(128, 32\)"):
        load_model(ServerArgs(model_path=bad), "cpu", show_progress=False)

    expert = "model.layers.2.mlp.experts.3.up_proj.weight"
    no_expert = _edited(src, tmp_path / "no_expert", lambda t: t.pop(expert))
    with pytest.raises(ValueError, match=rf"missing tensor '{expert}' \(expected shape \(32, 64\)\)"):
        load_model(ServerArgs(model_path=no_expert), "cpu", show_progress=False)


def test_skipped_tensors_load_silently(tiny_checkpoint, tmp_path):
    """MTP layers (model.layers.{num_hidden_layers}) and rotary inv_freq buffers are skipped."""
    src = tiny_checkpoint("v3_q_lora")

    def add(t):
        t["model.layers.3.self_attn.q_a_proj.weight"] = torch.ones(32, 64)  # 3 layers: layer 3 is MTP
        t["model.layers.3.eh_proj.weight"] = torch.ones(64, 128)
        t["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)

    path = _edited(src, tmp_path / "mtp", add)
    tokens = random_tokens(6, seed=1)
    torch.testing.assert_close(Runner(path).extend([("a", tokens)]), Runner(src).extend([("a", tokens)]),
                               atol=0, rtol=0)


def test_path_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(ServerArgs(model_path=str(tmp_path / "absent")), "cpu")
    write_config_only("DeepSeek-V2-Lite", tmp_path)
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        load_model(ServerArgs(model_path=str(tmp_path), dtype="float32"), "cpu")


def test_dummy_tensor_does_not_depend_on_the_dtype():
    """A checkpoint tensor's dummy value in bf16 is its float32 value rounded (torch's normal_ alone draws another
    sequence in bf16 than in float32 at 1,000 values): a tensor one reader holds in float32 (the router's weight) and
    another in the model's dtype (bench one-batch's checkpoint for transformers) is the same tensor."""
    from moeserve.models.loader import dummy_tensor

    for shape in [(1000,), (16, 250), (7,)]:
        f32 = dummy_tensor("model.layers.1.mlp.gate.weight", shape, torch.float32, torch.device("cpu"), 5)
        bf16 = dummy_tensor("model.layers.1.mlp.gate.weight", shape, torch.bfloat16, torch.device("cpu"), 5)
        assert bf16.dtype == torch.bfloat16 and torch.equal(bf16, f32.bfloat16())
        assert 0.015 < f32.std() < 0.025
