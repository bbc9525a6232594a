"""sglang-router (PyPI) in PD mode, unchanged, in front of one prefill and one decode server on the embedded model
(the zmq backend): its start-up checks pass, and /generate, /v1/completions and /v1/chat/completions through it,
streamed and not, with logprobs, give the colocated engine's greedy tokens."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx
import openai
import pytest

from moeserve.rank.sampling_params import SamplingParams
from moeserve.server.launch import free_port
from tests.disagg.pd_procs import sse_events, start_all
from tests.disagg.test_pd_server import NEW, _prompts, _reference
from tests.procs import stop_process
from tests.rank.inprocess import InProcessEngine

pytest.importorskip("sglang_router", reason="sglang-router is not installed (it is in the test extra)")
pytestmark = pytest.mark.slow


def _start_router(prefill, decode, tmp_path, tries: int = 3) -> tuple[subprocess.Popen, str]:
    """sglang-router in PD mode in front of `prefill` and `decode`, once it routes. Its ports are picked free here
    and bound by the router later, so another process may take one in between: a router that exits with "Address
    already in use" is started again on fresh ports (at most `tries` times)."""
    for attempt in range(tries):
        port = free_port()
        log = tmp_path / f"router-{port}.log"
        cmd = [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
               "--prefill", prefill.url, str(prefill.bootstrap_port), "--decode", decode.url,
               "--host", "127.0.0.1", "--port", str(port), "--worker-startup-timeout-secs", "60",
               "--prometheus-port", str(free_port())]  # not its default 29000: routers started side by side
        with open(log, "w") as f:
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        if _wait_routing(proc, url, log, last_try=attempt == tries - 1):
            return proc, url
    raise AssertionError("unreachable: the last try raises")


def _wait_routing(proc: subprocess.Popen, url: str, log, last_try: bool) -> bool:
    """True once the router routes (it does only after its checks of both workers passed); False when it exited on a
    port taken in the meantime (and this is not the last try); any other exit, or 90 s without routing, fails."""
    deadline = time.monotonic() + 90
    while True:
        if proc.poll() is not None:
            text = log.read_text()
            if "Address already in use" in text and not last_try:
                return False
            raise AssertionError(f"router exited:\n{text[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200 and httpx.post(
                    url + "/generate", json={"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 1}},
                    timeout=30).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"router never routed:\n{log.read_text()[-3000:]}")
        time.sleep(0.5)


def _check_prompt_logprobs(url: str, prompts: list[list[int]], sp: dict) -> None:
    """input_token_logprobs through the router (prefill's prepended to decode's empty list), streamed and not,
    from position 0 and from the middle: the colocated engine's token ids and logprobs."""
    from moeserve.models.default_model import default_model_path

    eng = InProcessEngine(model_path=default_model_path(), dtype="float32", page_size=4, chunked_prefill_size=16)
    params = SamplingParams(max_new_tokens=NEW, temperature=0.0, ignore_eos=True)
    for stream in (False, True):
        for ids, first in zip(prompts, (0, len(prompts[1]) // 2), strict=True):
            want = eng.run([ids], params, return_logprob=True, logprob_start_len=first)[0]
            body = {"input_ids": ids, "sampling_params": sp, "return_logprob": True, "logprob_start_len": first,
                    "stream": stream}
            r = httpx.post(url + "/generate", json=body, timeout=120)
            assert r.status_code == 200, r.text
            events = sse_events(r) if stream else [r.json()]
            for ev in events:  # every streamed chunk carries the whole list
                got = ev["meta_info"]["input_token_logprobs"]
                assert [t for _, t, _ in got] == ids[first:]
                assert [lp for lp, _, _ in got] == pytest.approx(want["input_logprobs"], abs=1e-4)  # None at 0
            assert events[-1]["output_ids"] == want["output_ids"]


def test_sglang_router_pd(tmp_path):
    prompts = _prompts(4, 9)
    ref = _reference(prompts)
    prefill, decode = start_all(tmp_path, ("prefill",), ("decode",))
    router = None
    try:
        router, url = _start_router(prefill, decode, tmp_path)
        sp = {"max_new_tokens": NEW, "temperature": 0.0, "ignore_eos": True}
        for i, ids in enumerate(prompts[:2]):
            r = httpx.post(url + "/generate", json={"input_ids": ids, "sampling_params": sp, "return_logprob": True},
                           timeout=120)
            assert r.status_code == 200, r.text
            assert r.json()["output_ids"] == ref[i]["output_ids"]
            lps = [x[0] for x in r.json()["meta_info"]["output_token_logprobs"]]
            assert lps == pytest.approx(ref[i]["logprobs"], abs=1e-4)
        r = httpx.post(url + "/generate", json={"input_ids": prompts[2], "sampling_params": sp, "stream": True},
                       timeout=120)
        assert sse_events(r)[-1]["output_ids"] == ref[2]["output_ids"]
        _check_prompt_logprobs(url, prompts[:2], sp)

        oai = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        # (the router's own body parser takes text prompts only on /v1/completions)
        c = oai.completions.create(model="default", prompt="Once upon a time", max_tokens=NEW, temperature=0,
                                   extra_body={"ignore_eos": True})
        direct = httpx.post(url + "/generate", json={"text": "Once upon a time", "sampling_params": sp}, timeout=120)
        with pytest.raises(openai.BadRequestError, match="echo with logprobs is not supported by a PD pair"):
            oai.completions.create(model="default", prompt="Once upon a time", max_tokens=1, echo=True, logprobs=1)
        assert c.choices[0].finish_reason == "length" and c.choices[0].text == direct.json()["text"]
        msgs = [{"role": "user", "content": "Tell me about the sea."}]
        whole = oai.chat.completions.create(model="default", messages=msgs, max_tokens=NEW, temperature=0,
                                            extra_body={"ignore_eos": True})
        streamed = oai.chat.completions.create(model="default", messages=msgs, max_tokens=NEW, temperature=0,
                                               stream=True, extra_body={"ignore_eos": True})
        text = "".join(ch.choices[0].delta.content or "" for ch in streamed if ch.choices)
        assert text == whole.choices[0].message.content and text
    finally:
        if router is not None:
            stop_process(router)
        prefill.stop()
        decode.stop()


def test_sglang_router_pd_nextn(tmp_path):
    """Both servers with --speculative-algorithm NEXTN (prefill drafts over the prompt and sends the draft KV and
    h_{L-1}; decode drafts and verifies): /generate and the openai client's chat completion through the router give
    the plain colocated engine's greedy tokens, and decode reports its verify rounds."""
    from moeserve.models.default_model import default_model_path
    from moeserve.text.tokenizer import load_tokenizer

    spec = ("--speculative-algorithm", "NEXTN", "--speculative-num-steps", "2")
    prompts = _prompts(3, 12)
    ref = _reference(prompts)
    prefill, decode = start_all(tmp_path, ("prefill", *spec), ("decode", *spec))
    router = None
    try:
        router, url = _start_router(prefill, decode, tmp_path)
        sp = {"max_new_tokens": NEW, "temperature": 0.0, "ignore_eos": True}
        for ids, want in zip(prompts, ref, strict=True):
            r = httpx.post(url + "/generate", json={"input_ids": ids, "sampling_params": sp}, timeout=120)
            assert r.status_code == 200, r.text
            assert r.json()["output_ids"] == want["output_ids"]
            assert 1 <= r.json()["meta_info"]["spec_verify_ct"] <= NEW - 1

        path = default_model_path()
        tok = load_tokenizer(path)
        msgs = [{"role": "user", "content": "Tell me about the sea."}]
        ids = tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=True), add_special_tokens=False)
        eng = InProcessEngine(model_path=path, dtype="float32", page_size=4, chunked_prefill_size=16)
        want = eng.run([ids], SamplingParams(max_new_tokens=NEW, temperature=0.0, ignore_eos=True))[0]
        oai = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        whole = oai.chat.completions.create(model="default", messages=msgs, max_tokens=NEW, temperature=0,
                                            extra_body={"ignore_eos": True})
        assert whole.usage.completion_tokens == NEW
        assert whole.choices[0].message.content == tok.decode(want["output_ids"])
    finally:
        if router is not None:
            stop_process(router)
        prefill.stop()
        decode.stop()
