"""The random-weight default model: deterministic, and a checkpoint transformers reads as DeepSeek-V3."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from moeserve.models.default_model import build_default_model, default_config, random_model_path

FILES = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]


def _digests(directory: Path) -> dict[str, str]:
    return {name: hashlib.sha256((directory / name).read_bytes()).hexdigest() for name in FILES}


def test_two_builds_are_byte_identical(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    build_default_model(str(a))
    # The second build runs in a fresh interpreter (its own hash seeds and thread pools).
    code = f"from moeserve.models.default_model import build_default_model; build_default_model({str(b)!r})"
    subprocess.run([sys.executable, "-c", code], check=True)
    assert sorted(os.listdir(a)) == sorted(FILES)
    assert _digests(a) == _digests(b)


def test_random_model_path_builds_once_into_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MOESERVE_CACHE", str(tmp_path))
    path = Path(random_model_path())
    assert path == tmp_path / "random-model-v1"
    assert sorted(os.listdir(path)) == sorted(FILES)
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert random_model_path() == str(path)
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime
    assert os.listdir(tmp_path) == ["random-model-v1"]  # no temporary directory left behind


def test_config_is_deepseek_v3():
    cfg = json.loads((Path(random_model_path()) / "config.json").read_text())
    assert cfg["architectures"] == ["DeepseekV3ForCausalLM"]
    assert cfg["model_type"] == "deepseek_v3"
    assert cfg == default_config(cfg["vocab_size"])
    assert cfg["n_routed_experts"] % cfg["n_group"] == 0


def test_transformers_loads_it_without_missing_or_unexpected_keys():
    transformers = pytest.importorskip("transformers")
    import torch

    path = random_model_path()
    model, info = transformers.AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert type(model).__name__ == "DeepseekV3ForCausalLM"
    assert not info["missing_keys"], info["missing_keys"]
    assert not info["unexpected_keys"], info["unexpected_keys"]
    assert not info["mismatched_keys"], info["mismatched_keys"]

    # The weights are the drawn ones (not re-initialized): compare a few with the file.
    from safetensors.torch import load_file

    saved = load_file(os.path.join(path, "model.safetensors"))
    params = dict(model.named_parameters()) | dict(model.named_buffers())
    torch.testing.assert_close(params["lm_head.weight"], saved["lm_head.weight"])
    torch.testing.assert_close(params["model.layers.1.mlp.gate.e_score_correction_bias"],
                               saved["model.layers.1.mlp.gate.e_score_correction_bias"])
    torch.testing.assert_close(params["model.layers.2.self_attn.kv_b_proj.weight"],
                               saved["model.layers.2.self_attn.kv_b_proj.weight"])

    tok = transformers.AutoTokenizer.from_pretrained(path)
    ids = tok("The Tortoise and the Hare", return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert out.shape == (1, ids.shape[1] + 4)
