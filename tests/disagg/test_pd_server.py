"""PD disaggregation with real servers over HTTP, on the embedded model and the zmq backend.

Unequal parallelism: prefill runs 2 ranks with DP attention (two attention groups, EP over both), decode 1 rank.
Concurrent greedy requests (native and OpenAI, streamed and not, with logprobs) equal the colocated engine's
tokens; the DP group on the prefill side is chosen by load, or by data_parallel_rank; /get_server_info shows the
mode and /metrics the per-state and transfer series; a request without bootstrap fields gets a clear 400.
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from moeserve.rank.sampling_params import SamplingParams
from tests.disagg.pd_procs import pd_post, sse_events, start_all
from tests.rank.inprocess import InProcessEngine

pytestmark = pytest.mark.slow

NEW = 8


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 400) for _ in range(rng.randrange(5, 60))] for _ in range(n)]


def _reference(prompts: list[list[int]]) -> list[dict]:
    from moeserve.models.default_model import default_model_path

    eng = InProcessEngine(model_path=default_model_path(), dtype="float32", page_size=4, chunked_prefill_size=16)
    return eng.run(prompts, SamplingParams(max_new_tokens=NEW, temperature=0.0, ignore_eos=True),
                   return_logprob=True)


def test_pd_servers_unequal_parallelism(tmp_path):
    prompts = _prompts(10, 5)
    ref = _reference(prompts)
    prefill, decode = start_all(tmp_path, ("prefill", "--tp-size", "2", "--enable-dp-attention", "--dp-size", "2",
                                           "--moe-a2a-backend", "all2all"), ("decode",))
    try:
        sp = {"max_new_tokens": NEW, "temperature": 0.0, "ignore_eos": True}

        def native(i: int):
            body = {"input_ids": prompts[i], "sampling_params": sp, "return_logprob": True, "stream": i % 2 == 1}
            return pd_post(prefill, decode, "/generate", body)

        with ThreadPoolExecutor(len(prompts)) as pool:
            answers = list(pool.map(native, range(len(prompts))))
        for i, (p, d) in enumerate(answers):
            assert p.status_code == 200 and d.status_code == 200, (p.text, d.text)
            out = sse_events(d)[-1] if i % 2 else d.json()
            assert out["output_ids"] == ref[i]["output_ids"], i
            lps = [x[0] for x in out["meta_info"]["output_token_logprobs"]]
            assert lps == pytest.approx(ref[i]["logprobs"], abs=1e-4)

        # OpenAI completions through both sides, streamed: the same tokens as /generate
        p, d = pd_post(prefill, decode, "/v1/completions", {"prompt": prompts[0], "max_tokens": NEW,
                                                            "temperature": 0, "ignore_eos": True, "stream": True})
        assert p.status_code == 200 and d.status_code == 200
        assert sse_events(d)[-1]["choices"][0]["finish_reason"] == "length"

        # the prefill side's two attention groups both took requests (chosen by load); data_parallel_rank pins one
        loads = httpx.get(prefill.url + "/get_load", timeout=10).json()
        before = {x["dp_rank"]: x["disagg"]["transfers"] for x in loads}
        assert sorted(before) == [0, 1] and all(v > 0 for v in before.values()), loads
        for _ in range(2):
            p, d = pd_post(prefill, decode, "/generate", {"input_ids": prompts[1], "sampling_params": sp,
                                                          "data_parallel_rank": 1})
            assert d.json()["output_ids"] == ref[1]["output_ids"]
        after = {x["dp_rank"]: x["disagg"]["transfers"] for x in httpx.get(prefill.url + "/get_load").json()}
        assert after == {0: before[0], 1: before[1] + 2}

        info = httpx.get(decode.url + "/get_server_info").json()
        assert info["disaggregation_mode"] == "decode"
        assert info["internal_states"][0]["disagg"]["transfers"] == len(prompts) + 3
        metrics = httpx.get(decode.url + "/metrics").text
        assert 'moeserve:pd_requests{model_name="default",side="decode",state="transferring"} 0.0' in metrics
        assert "moeserve:pd_transfer_bytes_total" in metrics
        assert "moeserve:pd_transfer_write_seconds_total" in httpx.get(prefill.url + "/metrics").text

        r = httpx.post(decode.url + "/generate", json={"input_ids": prompts[0], "sampling_params": sp})
        assert r.status_code == 400 and "bootstrap_room" in r.text
    finally:
        prefill.stop()
        decode.stop()
