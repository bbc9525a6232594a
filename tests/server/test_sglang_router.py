"""sglang-router (PyPI, regular mode) in front of one colocated moeserve server on the embedded model.

The router passes its start-up checks (/health, /server_info, /model_info), and the bodies it re-serializes (it
adds SGLang's own fields: return_hidden_states, continue_final_message, log_metrics, ...; chat's max_tokens
becomes max_completion_tokens) are served: the greedy text through the router equals the direct answer, with the
official openai client, streamed and not. A field asking for what moeserve cannot do is a 400 through the router.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import openai
import pytest

from moeserve.server.launch import free_port
from tests.procs import stop_process

pytest.importorskip("sglang_router", reason="sglang-router is not installed (pip install sglang-router; it is in "
                                            "the test extra)")
pytestmark = pytest.mark.slow

GREEDY = {"temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server_url(server) -> str:
    """conftest's shared server on the embedded model (the flags it adds change nothing for these requests)."""
    return server["url"]


@pytest.fixture(scope="module")
def router(server_url, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("router") / "router.log"
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", server_url, "--host", "127.0.0.1",
           "--port", str(port), "--worker-startup-timeout-secs", "60"]
    with open(log, "w") as log_file:
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_routing(proc, url, log)
        yield url
    finally:
        stop_process(proc)


def _wait_routing(proc: subprocess.Popen, url: str, log) -> None:
    # The router answers only once its start-up checks of the worker passed: a request through it proves both.
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, f"router exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
        try:
            r = httpx.post(f"{url}/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 1}},
                           timeout=5)
            if r.status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"router never routed:\n{log.read_text()[-3000:]}"
        time.sleep(0.3)


def _clients(server_url: str, router: str) -> list[openai.OpenAI]:
    return [openai.OpenAI(base_url=u + "/v1", api_key="none", max_retries=0, timeout=60)
            for u in (server_url, router)]


def test_generate_through_router(server_url, router):
    body = {"text": "Call me Ishmael.", "sampling_params": {"max_new_tokens": 12, **GREEDY}}
    direct, routed = (httpx.post(u + "/generate", json=body, timeout=60) for u in (server_url, router))
    assert direct.status_code == routed.status_code == 200, routed.text
    assert routed.json()["output_ids"] == direct.json()["output_ids"]
    assert routed.json()["text"] == direct.json()["text"]
    assert len(routed.json()["output_ids"]) == 12

    with httpx.stream("POST", router + "/generate", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["text"] == direct.json()["text"]  # the last chunk holds the whole text


def test_completions_through_router(server_url, router):
    prompt = "It was the best of times,"
    direct, routed = (c.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0, logprobs=2,
                                           extra_body={"ignore_eos": True}) for c in _clients(server_url, router))
    assert routed.choices[0].text == direct.choices[0].text
    assert routed.choices[0].logprobs.tokens == direct.choices[0].logprobs.tokens
    assert routed.usage.completion_tokens == 10

    _, via = _clients(server_url, router)
    stream = via.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0, stream=True,
                                    extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in stream) == direct.choices[0].text


def test_chat_through_router(server_url, router):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a story."}]
    # The router sends max_tokens on as max_completion_tokens, and adds continue_final_message: false.
    direct, routed = (c.chat.completions.create(model="tiny", messages=messages, max_tokens=9, temperature=0,
                                                extra_body={"ignore_eos": True})
                      for c in _clients(server_url, router))
    assert routed.choices[0].message.content == direct.choices[0].message.content
    assert routed.usage.completion_tokens == 9

    _, via = _clients(server_url, router)
    stream = via.chat.completions.create(model="tiny", messages=messages, max_tokens=9, temperature=0, stream=True,
                                         extra_body={"ignore_eos": True}, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == direct.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 9


def test_continue_final_message_through_router(server_url, router):
    messages = [{"role": "user", "content": "Name a sea."}, {"role": "assistant", "content": "The sea is"}]
    extra = {"ignore_eos": True, "continue_final_message": True}
    direct, routed = (c.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0,
                                                extra_body=extra) for c in _clients(server_url, router))
    assert routed.choices[0].message.content == direct.choices[0].message.content
    # Continuing the message is another prompt than a new assistant turn after it.
    new_turn = _clients(server_url, router)[0].chat.completions.create(
        model="tiny", messages=messages, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    assert new_turn.usage.prompt_tokens != direct.usage.prompt_tokens


@pytest.mark.parametrize("path, body", [
    ("/generate", {"text": "x", "return_hidden_states": True}),
    ("/generate", {"text": "x", "background": True}),
    ("/generate", {"text": "x", "return_entropy": True}),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2, "return_hidden_states": True}),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                              "return_hidden_states": True}),
])
def test_unsupported_sglang_field_is_400_through_router(router, path, body):
    r = httpx.post(router + path, json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert next(k for k in body if k not in ("text", "prompt", "messages", "model", "max_tokens")) in r.text
