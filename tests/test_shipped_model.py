"""The trained default model that ships in moeserve/models/default/: it loads, transformers reads it, its held-out
perplexity through moeserve's prompt logprobs stays below the bound stored beside it, the README's greedy samples
are still what it answers, and the training script that made it runs (a few steps, on CPU, a tiny corpus)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moeserve.models.default_heldout import perplexity, shipped_windows
from moeserve.models.default_model import SHIPPED_DIR, default_config, default_model_path, make_weights
from moeserve.rank.sampling_params import SamplingParams
from tests.rank.inprocess import InProcessEngine

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def engine():
    torch.set_num_threads(1)
    return InProcessEngine(model_path=default_model_path(), dtype="float32", chunked_prefill_size=2048)


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(SHIPPED_DIR / "tokenizer.json"))


def test_files_and_config():
    cfg = json.loads((SHIPPED_DIR / "config.json").read_text())
    assert cfg == default_config(cfg["vocab_size"]) | {"torch_dtype": "bfloat16"}
    from safetensors.torch import load_file

    weights = load_file(str(SHIPPED_DIR / "model.safetensors"))
    assert {k: v.shape for k, v in weights.items()} == {k: v.shape for k, v in make_weights(cfg).items()}
    assert weights["lm_head.weight"].dtype == torch.bfloat16
    assert weights["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert weights["model.layers.1.mlp.gate.e_score_correction_bias"].abs().max() > 0  # balanced in training
    record = json.loads((SHIPPED_DIR / "training.json").read_text())
    assert record["shipped_heldout_perplexity"] < record["unigram_perplexity"] / 10


def test_transformers_reads_it():
    transformers = pytest.importorskip("transformers")
    model, info = transformers.AutoModelForCausalLM.from_pretrained(default_model_path(), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info


def test_heldout_perplexity_below_the_stored_bound(engine):
    quality = json.loads((SHIPPED_DIR / "quality.json").read_text())
    windows = shipped_windows()
    assert len(windows) == quality["heldout_windows"]
    outs = engine.run(windows, SamplingParams(max_new_tokens=0), return_logprob=True, logprob_start_len=0)
    lps = [o["input_logprobs"][1:] for o in outs]
    assert sum(len(w) for w in lps) == quality["heldout_tokens_scored"]
    ppl = perplexity(lps)
    assert ppl < quality["heldout_perplexity_bound"], ppl
    # and it is the number transformers gets on the same file (a wrong kernel would move it)
    assert ppl == pytest.approx(quality["heldout_perplexity"]["shipped_transformers_fp32"], rel=2e-3)


def _readme_samples() -> list[dict]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    block = re.search(r"<!-- greedy samples.*?-->\n```json\n(.*?)```", text, re.S)
    assert block, "README.md lost its greedy samples block"
    return [json.loads(line) for line in block.group(1).splitlines() if line.strip()]


def test_readme_samples_are_the_greedy_answers(engine, tokenizer):
    samples = _readme_samples()
    assert len(samples) >= 3
    prompts = [tokenizer.encode(s["prompt"]).ids for s in samples]
    outs = engine.run(prompts, SamplingParams(max_new_tokens=32, temperature=0))
    for sample, out in zip(samples, outs, strict=True):
        assert tokenizer.decode(out["output_ids"], skip_special_tokens=True) == sample["completion"], sample


def test_training_script_runs_on_cpu(tmp_path):
    pytest.importorskip("transformers")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    # three small modules of the standard library; bisect.py and glob.py fall in the held-out part
    import bisect
    import colorsys
    import glob

    for mod in (bisect, colorsys, glob):
        (corpus / Path(mod.__file__).name).write_text(Path(mod.__file__).read_text())
    def train(out: Path) -> subprocess.CompletedProcess:
        cmd = [sys.executable, str(ROOT / "scripts" / "train_default_model.py"), "--device", "cpu", "--steps", "3",
               "--batch-size", "2", "--seq-len", "32", "--vocab-size", "320", "--corpus-dir", str(corpus),
               "--eval-every", "3", "--log-every", "1", "--heldout-chars", "1500", "--out", str(out)]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)

    out, again = tmp_path / "model", tmp_path / "again"
    for directory in (out, again):
        run = train(directory)
        assert run.returncode == 0, run.stderr[-2000:]
    record = json.loads((out / "training.json").read_text())
    assert record["steps_run"] == 3 and len(record["loss"]) == 3
    assert record["corpus"]["heldout_files"] == ["bisect.py", "glob.py"]
    assert record["shipped_heldout_perplexity"] == pytest.approx(record["heldout_perplexity"], rel=0.05)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg == default_config(cfg["vocab_size"]) | {"torch_dtype": "bfloat16"}
    for name in ("model.safetensors", "tokenizer.json"):  # deterministic given the seed
        assert (out / name).read_bytes() == (again / name).read_bytes(), name
