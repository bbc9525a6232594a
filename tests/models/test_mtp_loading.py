"""Loading DeepSeek's MTP layer (models/loader.py load_mtp) as published, bf16/float32 and FP8, and the refusals:
a family without MTP, a config without it, a checkpoint without its tensors, a draft checkpoint of another model."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import moeserve.args
from moeserve.args import ServerArgs
from moeserve.core.forward_batch import ForwardMode
from moeserve.core.model_config import ModelConfig
from moeserve.kernels.fp8_quant import FP8_DTYPE
from moeserve.layers.weights import model_weight_specs
from moeserve.models.loader import load_model, load_mtp
from moeserve.models.mtp import mtp_config, mtp_layer_prefix
from moeserve.server.startup import load_model_config
from tests.checkpoints import REAL_CONFIGS, build_checkpoint
from tests.models.harness import MTPRunner, Runner, random_tokens

LAYER = "model.layers.3."  # the tiny checkpoints have 3 main layers
COPIES = (LAYER + "embed_tokens.weight", LAYER + "shared_head.head.weight")


@pytest.fixture
def loop_ready(monkeypatch):
    """The speculative flags accepted, as they will be once the draft/verify loop is in the build."""
    monkeypatch.setattr(moeserve.args, "SPECULATIVE_LOOP_READY", True)


def _mtp(path: str, **args):
    target, _ = load_model(ServerArgs(model_path=path, **args), "cpu", show_progress=False)
    return target, load_mtp(ServerArgs(model_path=path, **args), target, "cpu", show_progress=False)


def _edited(src: str, dst, edit) -> str:
    shutil.copytree(src, dst)
    tensors = load_file(f"{dst}/model.safetensors")
    edit(tensors)
    save_file(tensors, f"{dst}/model.safetensors", metadata={"format": "pt"})
    return str(dst)


def test_published_layout_loads(mtp_checkpoint):
    target, mtp = _mtp(mtp_checkpoint)
    file = load_file(f"{mtp_checkpoint}/model.safetensors")
    params = dict(mtp.named_parameters())
    read = {s.key for s in model_weight_specs(mtp)}
    assert read == {k for k in file if k.startswith(LAYER)} - set(COPIES)  # the embedding and head not read
    assert len({k for k in read if ".mlp.experts." in k}) == 8 * 3
    torch.testing.assert_close(params[LAYER + "eh_proj.weight"], file[LAYER + "eh_proj.weight"], atol=0, rtol=0)
    assert mtp.target is target and not any(p is q for p in mtp.parameters() for q in target.parameters())
    assert not any(n.startswith(LAYER) for n, _ in target.named_parameters())


def test_without_the_copies_of_embedding_and_head(mtp_checkpoint, tmp_path):
    """The layer's copies of the embedding and head are not needed (a trained MTP layer may ship without them)."""
    path = _edited(mtp_checkpoint, tmp_path / "no_copies", lambda t: [t.pop(k) for k in COPIES])
    (_, mtp), (_, own) = _mtp(path), _mtp(mtp_checkpoint)
    for (name, p), (_, q) in zip(mtp.named_parameters(), own.named_parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=0, rtol=0, msg=name)


def test_config_of_published_models():
    """DeepSeek-V3's MTP layer (61) is an MoE layer, as its main layers from first_k_dense_replace on."""
    v3 = ModelConfig.from_dict(REAL_CONFIGS["DeepSeek-V3"])
    assert v3.num_mtp_layers == 1 and v3.mtp_is_moe and mtp_config(v3).moe_layers == (0,)
    assert mtp_layer_prefix(v3) == "model.layers.61" and mtp_config(v3).num_hidden_layers == 1
    assert ModelConfig.from_dict(REAL_CONFIGS["DeepSeek-V2-Lite"]).num_mtp_layers == 0


def test_fp8_layout(fp8_mtp_checkpoint):
    """FP8 as DeepSeek publishes it: the decoder layer's projections and experts e4m3 with their scales, eh_proj
    (and the copies of embedding and head) not quantized."""
    fp8, _ = fp8_mtp_checkpoint
    file = load_file(f"{fp8}/model.safetensors")
    assert file[LAYER + "eh_proj.weight"].dtype == torch.float32 and LAYER + "eh_proj.weight_scale_inv" not in file
    assert file[LAYER + "self_attn.q_a_proj.weight"].dtype == FP8_DTYPE
    _, mtp = _mtp(fp8)
    params = dict(mtp.named_parameters())
    assert params[LAYER + "eh_proj.weight"].dtype == torch.float32
    assert params[LAYER + "self_attn.q_b_proj.weight"].dtype == FP8_DTYPE
    assert params[LAYER + "mlp.experts.w13"].dtype == FP8_DTYPE
    torch.testing.assert_close(params[LAYER + "self_attn.q_b_proj.weight_scale_inv"],
                               file[LAYER + "self_attn.q_b_proj.weight_scale_inv"], atol=0, rtol=0)


def test_quantize_at_load(mtp_checkpoint):
    _, mtp = _mtp(mtp_checkpoint, quantization="fp8")
    params = dict(mtp.named_parameters())
    assert params[LAYER + "self_attn.o_proj.weight"].dtype == FP8_DTYPE
    assert params[LAYER + "eh_proj.weight"].dtype == torch.float32


def test_dummy_weights(mtp_checkpoint):
    """--load-format dummy: the layer's random weights, the same on every load (seeded by name)."""
    logits = []
    for _ in range(2):
        draft = MTPRunner(Runner(mtp_checkpoint, load_format="dummy"))
        h = torch.randn(5, 64, generator=torch.Generator().manual_seed(3))
        logits.append(draft.step(ForwardMode.EXTEND, [("a", random_tokens(5, seed=2), h)])[0])
    assert torch.isfinite(logits[0]).all() and float(logits[0].std()) > 0
    torch.testing.assert_close(logits[0], logits[1], atol=0, rtol=0)


def test_refusals(tiny_checkpoint, tmp_path):
    # transformers writes num_nextn_predict_layers 1 for every DeepSeek-V3 config: declared, tensors absent
    with pytest.raises(ValueError, match=r"has no tensors of the multi-token-prediction layer model\.layers\.3\.\*"):
        _mtp(tiny_checkpoint("v3_q_lora"))
    none = build_checkpoint("v3_q_lora", tmp_path / "none", num_nextn_predict_layers=0)
    with pytest.raises(ValueError, match="num_nextn_predict_layers 0 .*no MTP weights"):
        _mtp(none)
    for family in ("qwen3_moe", "mixtral"):
        with pytest.raises(ValueError, match="has none"):
            _mtp(tiny_checkpoint(family))


def test_missing_and_unexpected_tensors(mtp_checkpoint, tmp_path):
    def edit(t):
        t.pop(LAYER + "hnorm.weight")
        t[LAYER + "mystery.weight"] = torch.ones(3)

    path = _edited(mtp_checkpoint, tmp_path / "edited", edit)
    with pytest.raises(ValueError) as e:
        _mtp(path)
    assert "missing tensor 'model.layers.3.hnorm.weight'" in str(e.value)
    assert "unexpected tensor 'model.layers.3.mystery.weight'" in str(e.value)


def test_draft_model_path(mtp_checkpoint, tiny_checkpoint, tmp_path, loop_ready):
    """A checkpoint of the same model holding the MTP layer drafts for a target without it; an export of the layer
    alone (SGLang's NextN) and a checkpoint of another model are refused by name."""
    target_path = tiny_checkpoint("v3_q_lora")  # the same main weights (seed 0), no MTP tensors
    args = ServerArgs(model_path=target_path, speculative_algorithm="NEXTN",
                      speculative_draft_model_path=mtp_checkpoint)
    target, _ = load_model(args, "cpu", show_progress=False)
    mtp = load_mtp(args, target, "cpu", show_progress=False)
    _, own = _mtp(mtp_checkpoint)
    for (name, p), (_, q) in zip(mtp.named_parameters(), own.named_parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=0, rtol=0, msg=name)

    nextn = tmp_path / "nextn"
    shutil.copytree(mtp_checkpoint, nextn)
    config = json.loads((nextn / "config.json").read_text())
    (nextn / "config.json").write_text(json.dumps({**config, "architectures": ["DeepseekV3ForCausalLMNextN"]}))
    with pytest.raises(ValueError, match="DeepseekV3ForCausalLMNextN .* is not read"):
        load_mtp(ServerArgs(model_path=target_path, speculative_algorithm="NEXTN",
                            speculative_draft_model_path=str(nextn)), target, "cpu")
    other = ServerArgs(model_path=target_path, speculative_algorithm="NEXTN",
                       speculative_draft_model_path=tiny_checkpoint("v3_no_q_lora"))
    with pytest.raises(ValueError, match="not a checkpoint of the target's model: q_lora_rank None"):
        load_mtp(other, target, "cpu")


def test_refused_at_start(tiny_checkpoint, mtp_checkpoint, loop_ready):
    """The server refuses before any rank starts: the family, the missing tensors."""
    load_model_config(ServerArgs(model_path=mtp_checkpoint, speculative_algorithm="NEXTN"))
    with pytest.raises(ValueError, match="has none"):
        load_model_config(ServerArgs(model_path=tiny_checkpoint("mixtral"), speculative_algorithm="EAGLE"))
    with pytest.raises(ValueError, match="no tensors of the multi-token-prediction layer"):
        load_model_config(ServerArgs(model_path=tiny_checkpoint("v3_q_lora"), speculative_algorithm="NEXTN"))
