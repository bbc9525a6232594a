"""The offline Engine (worker process + ZeroMQ) and `moeserve generate`: outputs, streaming, clear errors."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest

import moeserve
from tests.checkpoints import build_checkpoint
from tests.rank.test_generation import NEW_TOKENS, _prompts, hf_greedy


@pytest.fixture(scope="module")
def v3_dir(tmp_path_factory):
    return build_checkpoint("v3_q_lora", tmp_path_factory.mktemp("v3"))


@pytest.fixture(scope="module")
def engine(v3_dir):
    eng = moeserve.Engine(model_path=v3_dir, skip_tokenizer_init=True, page_size=4)
    yield eng
    eng.shutdown()


def test_batch_generate_matches_transformers(engine):
    prompts = _prompts(11, [4, 19, 33])
    params = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    assert [o["output_ids"] for o in outs] == hf_greedy("v3_q_lora", prompts)
    for o, p in zip(outs, prompts, strict=True):
        meta = o["meta_info"]
        assert meta["prompt_tokens"] == len(p) and meta["completion_tokens"] == NEW_TOKENS
        assert meta["finish_reason"] == {"type": "length"}


def test_stream_and_async(engine):
    prompt = _prompts(12, [9])[0]
    params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    chunks = list(engine.generate(input_ids=prompt, sampling_params=params, stream=True))
    streamed = [t for c in chunks for t in c["delta_ids"]]
    assert streamed == hf_greedy("v3_q_lora", [prompt], NEW_TOKENS)[0][:8]
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"

    async def run():
        whole = await engine.async_generate(input_ids=prompt, sampling_params=params)
        parts = [c async for c in await engine.async_generate(input_ids=prompt, sampling_params=params,
                                                              stream=True)]
        return whole, parts

    whole, parts = asyncio.run(run())
    assert whole["output_ids"] == streamed == parts[-1]["output_ids"]


def test_seeded_sampling_repeats_and_logprobs(engine):
    prompt = _prompts(13, [6])[0]
    params = {"max_new_tokens": 12, "temperature": 1.0, "seed": 1234, "ignore_eos": True}
    a = engine.generate(input_ids=prompt, sampling_params=params, return_logprob=True, top_logprobs_num=3)
    b = engine.generate(input_ids=[prompt, _prompts(14, [20])[0]], sampling_params=params)[0]
    assert a["output_ids"] == b["output_ids"]
    lps = a["meta_info"]["output_token_logprobs"]
    tops = a["meta_info"]["output_top_logprobs"]
    assert len(lps) == 12 and len(tops) == 12 and all(len(t) == 3 for t in tops)
    assert all(lp <= 0 and tok == out for (lp, tok, _), out in zip(lps, a["output_ids"], strict=True))


def test_bad_inputs_raise_clearly(engine):
    from moeserve.server.tokenizer_manager import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="max_new_tokens"):
        engine.generate(input_ids=[5, 6], sampling_params={"max_new_tokens": -1})
    with pytest.raises(InvalidRequestError, match="context length"):
        engine.generate(input_ids=list(range(2, 400)), sampling_params={"max_new_tokens": 200})
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        engine.generate(input_ids=[5, 10**6])
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.generate(input_ids=[])
    # still serving
    assert len(engine.generate(input_ids=[5, 6], sampling_params={"max_new_tokens": 2})["output_ids"]) == 2


def test_bad_model_paths(tmp_path):
    with pytest.raises((FileNotFoundError, ValueError), match="config.json|does not exist|not found"):
        moeserve.Engine(model_path=str(tmp_path / "missing"))
    cfg = tmp_path / "llama"
    cfg.mkdir()
    (cfg / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        moeserve.Engine(model_path=str(cfg))
    with pytest.raises(TypeError, match="did you mean page_size"):
        moeserve.Engine(model_path=str(cfg), page_sise=4)


def test_mismatched_checkpoint_fails_at_load(tmp_path):
    d = build_checkpoint("mixtral", tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["hidden_size"] = 96
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(RuntimeError, match="shape"):
        moeserve.Engine(model_path=d, skip_tokenizer_init=True)


def test_generate_cli_on_default_model():
    out = subprocess.run(
        [sys.executable, "-m", "moeserve.cli", "generate", "--prompt", "The quick brown fox", "--max-new-tokens",
         "6", "--json"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout)
    assert result["meta_info"]["completion_tokens"] >= 1 and isinstance(result["text"], str)


def test_generate_cli_bad_flag_is_a_usage_error():
    out = subprocess.run([sys.executable, "-m", "moeserve.cli", "generate", "--prompt", "x", "--page-size", "0"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--page-size must be >= 1" in out.stderr


def test_abort_ends_generate(engine):
    async def run():
        agen = engine.client.generate(__import__("moeserve.server.tokenizer_manager", fromlist=["GenerateInput"]).GenerateInput(
            input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 400, "ignore_eos": True}, rid="to-abort",
            stream=True))
        first = await agen.__anext__()
        await engine.client.abort("to-abort")
        rest = [c async for c in agen]
        return first, rest

    first, rest = asyncio.run_coroutine_threadsafe(run(), engine._loop).result(timeout=60)
    assert rest and rest[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(rest[-1]["output_ids"]) < 400
