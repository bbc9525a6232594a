"""The trained default model that ships in moeserve/models/default/: it loads, transformers reads it, its held-out
perplexity through moeserve's prompt logprobs stays below the bound stored beside it, the README's greedy samples
are still what it answers, and the training script that made it runs (a few steps, on CPU, a tiny corpus). Its MTP
module (model.layers.4, scripts/train_default_mtp.py) has DeepSeek-V3's published names and shapes, and its drafts
agree with the main model's greedy tokens far more often than a random module's do (an independent forward)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

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


def _shipped_weights() -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(SHIPPED_DIR / "model.safetensors"))


def _is_mtp(key: str, cfg: dict) -> bool:
    return key.startswith(f"model.layers.{cfg['num_hidden_layers']}.")


def test_files_and_config():
    cfg = json.loads((SHIPPED_DIR / "config.json").read_text())
    assert cfg == default_config(cfg["vocab_size"]) | {"torch_dtype": "bfloat16", "num_nextn_predict_layers": 1}
    weights = _shipped_weights()
    main = {k: v.shape for k, v in weights.items() if not _is_mtp(k, cfg)}
    assert main == {k: v.shape for k, v in make_weights(cfg | {"num_nextn_predict_layers": 0}).items()}
    assert weights["lm_head.weight"].dtype == torch.bfloat16
    assert weights["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert weights["model.layers.1.mlp.gate.e_score_correction_bias"].abs().max() > 0  # balanced in training
    record = json.loads((SHIPPED_DIR / "training.json").read_text())
    assert record["shipped_heldout_perplexity"] < record["unigram_perplexity"] / 10


def test_transformers_reads_it():
    transformers = pytest.importorskip("transformers")
    model, info = transformers.AutoModelForCausalLM.from_pretrained(default_model_path(), output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    # transformers builds no MTP layer: it reports model.layers.4.* as unexpected, and only those
    assert info["unexpected_keys"] and all(k.startswith("model.layers.4.") for k in info["unexpected_keys"]), info


# ----------------------------------------------------------------------
# the MTP module
def _published_mtp_layout(cfg: dict) -> dict[str, tuple[int, ...]]:
    """DeepSeek-V3's MTP module as its checkpoint stores it (model.layers.61 there, num_hidden_layers here): a
    full decoder layer like the main model's MoE layers, enorm, hnorm, eh_proj [H, 2H], shared_head.norm, and the
    copies of the embedding and of the head (shared_head.head)."""
    hidden, vocab, mtp, moe = (cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"],
                               cfg["first_k_dense_replace"])
    prefix = f"model.layers.{mtp}."
    block = {prefix + k[len(f"model.layers.{moe}."):]: tuple(v.shape) for k, v in make_weights(cfg).items()
             if k.startswith(f"model.layers.{moe}.")}
    return block | {prefix + "enorm.weight": (hidden,), prefix + "hnorm.weight": (hidden,),
                    prefix + "eh_proj.weight": (hidden, 2 * hidden), prefix + "shared_head.norm.weight": (hidden,),
                    prefix + "shared_head.head.weight": (vocab, hidden), prefix + "embed_tokens.weight": (vocab, hidden)}


def test_mtp_tensors_have_the_published_names_and_shapes():
    cfg = json.loads((SHIPPED_DIR / "config.json").read_text())
    weights = _shipped_weights()
    mtp = {k: tuple(v.shape) for k, v in weights.items() if _is_mtp(k, cfg)}
    assert mtp == _published_mtp_layout(cfg)
    assert len([k for k in mtp if ".mlp.experts." in k]) == 3 * cfg["n_routed_experts"]
    # the shared embedding and head are the main model's, as in DeepSeek-V3's checkpoint
    assert torch.equal(weights["model.layers.4.embed_tokens.weight"], weights["model.embed_tokens.weight"])
    assert torch.equal(weights["model.layers.4.shared_head.head.weight"], weights["lm_head.weight"])
    for key in mtp:
        router = key.endswith(("mlp.gate.weight", "e_score_correction_bias"))
        assert weights[key].dtype == (torch.float32 if router else torch.bfloat16), key
    assert weights["model.layers.4.mlp.gate.e_score_correction_bias"].abs().max() > 0  # balanced in training


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@torch.no_grad()
def _draft_agreement(model, mtp: dict[str, torch.Tensor], ids: torch.Tensor) -> float:
    """How often the MTP module's first draft equals the main model's greedy next token on ids [B, N], written
    from DeepSeek-V3's paper (h' = Block(eh_proj([enorm(emb(t_{i+1})); hnorm(h_i)])), logits = head(norm(h')))
    with transformers' decoder layer as Block; h_i is the final-normed hidden that the LM head reads (as SGLang
    feeds its NextN draft)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

    cfg = model.config
    experts = range(cfg.n_routed_experts)
    block = {k: v for k, v in mtp.items() if k.split(".")[0] in
             ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm") and ".experts." not in k}
    block["mlp.experts.gate_up_proj"] = torch.stack([
        torch.cat([mtp[f"mlp.experts.{e}.gate_proj.weight"], mtp[f"mlp.experts.{e}.up_proj.weight"]]) for e in experts])
    block["mlp.experts.down_proj"] = torch.stack([mtp[f"mlp.experts.{e}.down_proj.weight"] for e in experts])
    layer = DeepseekV3DecoderLayer(cfg, cfg.num_hidden_layers).eval()
    layer.load_state_dict(block, strict=True)

    hidden = model.model(input_ids=ids).last_hidden_state  # [B, N, H], after the final norm
    greedy = model.lm_head(hidden).argmax(-1)  # [B, N]: the main model's next token after each position
    steps, eps = ids.shape[1] - 1, cfg.rms_norm_eps
    x = F.linear(torch.cat([_rms_norm(mtp["embed_tokens.weight"][ids[:, 1:]], mtp["enorm.weight"], eps),
                            _rms_norm(hidden[:, :steps], mtp["hnorm.weight"], eps)], dim=-1), mtp["eh_proj.weight"])
    causal = torch.zeros(steps, steps).masked_fill(~torch.ones(steps, steps, dtype=torch.bool).tril(), float("-inf"))
    rope = model.model.rotary_emb(x, torch.arange(steps)[None])
    x = layer(x, attention_mask=causal[None, None], position_embeddings=rope)
    logits = F.linear(_rms_norm(x, mtp["shared_head.norm.weight"], eps), mtp["shared_head.head.weight"])
    return (logits.argmax(-1) == greedy[:, 1:]).float().mean().item()  # draft from h_i vs greedy after t_{i+1}


def test_trained_mtp_drafts_agree_with_the_main_model():
    transformers = pytest.importorskip("transformers")
    torch.set_num_threads(1)
    model = transformers.AutoModelForCausalLM.from_pretrained(default_model_path(), dtype=torch.float32).eval()
    prefix = "model.layers.4."
    trained = {k[len(prefix):]: v.float() for k, v in _shipped_weights().items() if k.startswith(prefix)}
    gen = torch.Generator().manual_seed(5)
    random = {k: (torch.ones_like(v) if "norm" in k else torch.zeros_like(v) if k.endswith("_bias")
                  else torch.randn(v.shape, generator=gen) * 0.02) for k, v in trained.items()}
    random |= {k: trained[k] for k in ("embed_tokens.weight", "shared_head.head.weight")}
    ids = torch.tensor(shipped_windows()[::12][:4])  # 4 held-out windows of 256 tokens
    got, baseline = _draft_agreement(model, trained, ids), _draft_agreement(model, random, ids)
    record = json.loads((SHIPPED_DIR / "training_mtp.json").read_text())
    assert baseline < 0.1, baseline
    assert got > 0.5 and got > baseline + 0.4, (got, baseline)
    # the figure the training run recorded over all 49 windows, within what 4 windows vary by
    assert got == pytest.approx(record["shipped_heldout_agreement"], abs=0.08), got


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
