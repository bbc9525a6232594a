"""A real DP-attention + EP server: `moeserve serve --tp-size 2 --enable-dp-attention --dp-size 2
--moe-a2a-backend all2all` on the embedded default model, driven with the official openai client.

16 concurrent greedy chat completions (threads) must each equal the single-rank in-process run of the same prompt
ids (the chat template applied as the server applies it); the DP controller must have sent requests to both
attention groups (GET /get_load: one entry per group, each group's radix cache holds tokens afterwards); each rank
logs its memory line at start. SIGTERM stops the server with no process left.
"""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from moeserve.rank.sampling_params import SamplingParams
from moeserve.server.launch import free_port
from tests.procs import descendants, sigterm_leaves_nothing, wait_healthy
from tests.rank.inprocess import InProcessEngine

pytestmark = pytest.mark.slow

NEW_TOKENS = 12
NUM_REQUESTS = 16
TOPICS = ["the sea", "a fox", "winter", "the moon", "bread", "a river", "old clocks", "the wind", "a lantern",
          "tortoises", "rain", "a garden", "the hare", "mountains", "a letter", "a candle"]


def _messages(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Tell me about {TOPICS[i]}."}]


def test_dp_attention_server_concurrent_openai(tmp_path):
    from moeserve.models.default_model import default_model_path
    from moeserve.text.tokenizer import load_tokenizer

    model_path = default_model_path()  # built before the server starts (the server builds the same directory)
    port = free_port()
    log = tmp_path / "server.log"
    cmd = [sys.executable, "-m", "moeserve.cli", "serve", "--tp-size", "2", "--enable-dp-attention", "--dp-size",
           "2", "--moe-a2a-backend", "all2all", "--port", str(port)]
    with open(log, "w") as log_file:
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    workers: set[int] = set()
    try:
        # the reference while the server starts: one rank in this process, the same prompt ids, greedy
        tok = load_tokenizer(model_path)
        prompt_ids = [tok.encode(tok.apply_chat_template(_messages(i), add_generation_prompt=True),
                                 add_special_tokens=False) for i in range(NUM_REQUESTS)]
        ref_eng = InProcessEngine(model_path=model_path, dtype="float32")
        refs = [r["output_ids"] for r in ref_eng.run(
            prompt_ids, SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))]
        del ref_eng

        wait_healthy(proc, url, log, 60)
        workers = descendants(proc.pid)
        text = log.read_text()
        for rank in (0, 1):
            assert f"Memory: rank {rank}/2 (EP rank {rank}/2)" in text, text[-3000:]
        assert "8 of 16 experts in each of 3 MoE layers" in text and "EP dispatch buffers" in text

        loads = httpx.get(f"{url}/get_load", timeout=10).json()
        assert sorted(x["dp_rank"] for x in loads) == [0, 1], loads
        assert all(x["num_cached_tokens"] == 0 for x in loads), loads

        oai = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)

        def ask(i: int):
            return oai.chat.completions.create(model=model_path, messages=_messages(i), max_tokens=NEW_TOKENS,
                                               temperature=0, extra_body={"ignore_eos": True})

        with ThreadPoolExecutor(NUM_REQUESTS) as pool:
            outs = list(pool.map(ask, range(NUM_REQUESTS)))
        for i, out in enumerate(outs):
            (choice,) = out.choices
            assert choice.finish_reason == "length", (i, choice)
            assert out.usage.prompt_tokens == len(prompt_ids[i]) and out.usage.completion_tokens == NEW_TOKENS
            assert choice.message.content == tok.decode(refs[i], skip_special_tokens=True), (i, TOPICS[i])

        loads = httpx.get(f"{url}/get_load", timeout=10).json()
        assert len(loads) == 2, loads
        # both groups prefilled some of the prompts: each group's radix cache holds tokens now
        assert all(x["num_cached_tokens"] > 0 for x in loads), loads
        assert all(x["num_running"] == 0 and x["num_waiting"] == 0 for x in loads), loads
    finally:
        workers |= descendants(proc.pid)
        sigterm_leaves_nothing(proc, workers, log, timeout=30)
