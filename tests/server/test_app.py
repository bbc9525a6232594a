"""The HTTP app over a FakeClient: every endpoint, the protocol conversions, bad input, disconnects, aborts."""

from __future__ import annotations

import threading

import httpx
import openai
import pytest
from server_fakes import FakeClient, serve_in_thread, sse_events
from server_fakes import wait_until as _wait_until

from moeserve.server.http.app import build_app


@pytest.fixture(autouse=True)
def _reset(fake):
    fake.token_delay = 0.0
    fake.eos_after = None
    fake.healthy = True
    fake.dead_reason = None
    yield


@pytest.fixture(scope="module")
def http(base_url):
    with httpx.Client(base_url=base_url, timeout=30) as c:
        yield c


@pytest.fixture(scope="module")
def oai(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


def expected_ids(fake, prompt_ids, n, seed=0):
    return [fake.token_at(prompt_ids, k, seed) for k in range(n)]


# ----------------------------------------------------------------------
# native /generate
def test_generate_single(http, fake, default_tokenizer):
    r = http.post("/generate", json={"text": "Hello there", "sampling_params": {"max_new_tokens": 5},
                                     "rid": "my-rid"})
    assert r.status_code == 200, r.text
    body = r.json()
    ids = default_tokenizer.encode("Hello there")
    assert body["output_ids"] == expected_ids(fake, ids, 5)
    assert body["text"] == default_tokenizer.decode(body["output_ids"])
    meta = body["meta_info"]
    assert meta["id"] == "my-rid"
    assert meta["finish_reason"] == {"type": "length", "matched": None}
    assert meta["prompt_tokens"] == len(ids) and meta["completion_tokens"] == 5
    assert "delta_text" not in body


def test_generate_batch_and_n(http, fake):
    r = http.post("/generate", json={"input_ids": [[5, 6, 7], [8, 9]],
                                     "sampling_params": [{"max_new_tokens": 2}, {"max_new_tokens": 3, "n": 2}]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [len(b["output_ids"]) for b in body] == [2, 3, 3]
    assert body[0]["output_ids"] == expected_ids(fake, [5, 6, 7], 2)
    assert body[1]["output_ids"] == expected_ids(fake, [8, 9], 3)


def test_generate_stream(http, fake):
    r = http.post("/generate", json={"input_ids": [10, 11, 12], "stream": True,
                                     "sampling_params": {"max_new_tokens": 4}})
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert len(events) == 4
    want = expected_ids(fake, [10, 11, 12], 4)
    for k, ev in enumerate(events):
        assert ev["output_ids"] == want[: k + 1]  # cumulative, as SGLang streams
    assert [ev["meta_info"]["finish_reason"] is None for ev in events] == [True, True, True, False]


def test_generate_stream_batch_has_index(http):
    r = http.post("/generate", json={"text": ["a b", "c d e"], "stream": True,
                                     "sampling_params": {"max_new_tokens": 3}})
    events = sse_events(r.text)
    assert sorted({ev["index"] for ev in events}) == [0, 1]
    assert sum(ev["meta_info"]["finish_reason"] is not None for ev in events) == 2


def test_generate_logprobs(http, fake):
    r = http.post("/generate", json={"input_ids": [20, 21], "return_logprob": True, "top_logprobs_num": 2,
                                     "return_text_in_logprobs": True, "sampling_params": {"max_new_tokens": 3}})
    meta = r.json()["meta_info"]
    toks = expected_ids(fake, [20, 21], 3)
    assert [t for _, t, _ in meta["output_token_logprobs"]] == toks
    assert all(isinstance(text, str) for _, _, text in meta["output_token_logprobs"])
    assert [len(alts) for alts in meta["output_top_logprobs"]] == [2, 2, 2]


def test_generate_stop_string(http, default_tokenizer):
    full = http.post("/generate", json={"text": "Once", "sampling_params": {"max_new_tokens": 12}}).json()
    ids = full["output_ids"]
    stop = default_tokenizer.decode(ids[4:6])
    assert stop and stop in full["text"]
    r = http.post("/generate", json={"text": "Once", "sampling_params": {"max_new_tokens": 12, "stop": stop}})
    body = r.json()
    assert body["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert body["text"] == full["text"][: full["text"].find(stop)]


# ----------------------------------------------------------------------
# OpenAI endpoints
def test_completions(http, fake, default_tokenizer):
    r = http.post("/v1/completions", json={"model": "fake-model", "prompt": "The fox", "max_tokens": 6,
                                           "temperature": 0, "top_k": 5, "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == "fake-model"
    assert body["id"].startswith("cmpl-")
    (choice,) = body["choices"]
    ids = default_tokenizer.encode("The fox")
    assert choice["text"] == default_tokenizer.decode(expected_ids(fake, ids, 6))
    assert choice["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 6, "total_tokens": len(ids) + 6,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    sp = fake.requests[-1].sampling_params
    assert sp == {"max_new_tokens": 6, "temperature": 0, "top_k": 5, "ignore_eos": True}


def test_completions_default_max_tokens_and_aliases(http, fake):
    for model in (None, "default", "/models/fake"):
        body = {"prompt": "x"} if model is None else {"prompt": "x", "model": model}
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 16


def test_completions_batch_n_and_token_prompts(http, fake):
    r = http.post("/v1/completions", json={"prompt": [[5, 6], [7, 8, 9]], "n": 2, "max_tokens": 3, "seed": 4})
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    texts = [c["text"] for c in body["choices"]]
    assert texts[0] != texts[1]  # seeded samples of one prompt differ (seed + j)
    assert body["usage"]["prompt_tokens"] == 5 and body["usage"]["completion_tokens"] == 12
    seeds = [o.sampling_params["seed"] for o in fake.requests[-4:]]
    assert sorted(seeds) == [4, 4, 5, 5]


def test_completions_logprobs(http, fake):
    r = http.post("/v1/completions", json={"prompt": [30, 31], "max_tokens": 3, "logprobs": 2})
    lp = r.json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"]) == 3
    assert lp["token_logprobs"][0] == pytest.approx(-0.5)
    assert len(lp["top_logprobs"][0]) == 2
    assert lp["text_offset"][0] == 0 and lp["text_offset"][1] == len(lp["tokens"][0])


def test_completions_stream_with_usage(http):
    r = http.post("/v1/completions", json={"prompt": "abc", "max_tokens": 5, "stream": True,
                                           "stream_options": {"include_usage": True}, "logprobs": 1})
    events = sse_events(r.text)
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 5
    chunks = events[:-1]
    assert all(ev["object"] == "text_completion" for ev in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    nonfinal = http.post("/v1/completions", json={"prompt": "abc", "max_tokens": 5}).json()
    assert "".join(ev["choices"][0]["text"] for ev in chunks) == nonfinal["choices"][0]["text"]
    assert sum(len(ev["choices"][0]["logprobs"]["tokens"]) for ev in chunks) == 5


def test_chat(http, fake, default_tokenizer):
    messages = [{"role": "developer", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}]
    r = http.post("/v1/chat/completions", json={"messages": messages, "max_completion_tokens": 4,
                                                "logprobs": True, "top_logprobs": 2})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    prompt = default_tokenizer.apply_chat_template([{"role": "system", "content": "Be brief."},
                                                    {"role": "user", "content": "Hi there"}])
    ids = default_tokenizer.encode(prompt, add_special_tokens=False)
    assert fake.requests[-1].input_ids == ids  # the template's BOS only, not a second one
    (choice,) = body["choices"]
    assert choice["message"] == {"role": "assistant",
                                 "content": default_tokenizer.decode(expected_ids(fake, ids, 4))}
    content = choice["logprobs"]["content"]
    assert len(content) == 4 and len(content[0]["top_logprobs"]) == 2
    first = expected_ids(fake, ids, 1)[0]
    assert content[0]["bytes"] == list(default_tokenizer.token_bytes(first))
    raw = default_tokenizer.token_bytes(first)
    try:
        assert content[0]["token"] == raw.decode()
    except UnicodeDecodeError:
        assert content[0]["token"] == "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def test_chat_default_max_tokens_fills_context(http, fake):
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 200
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == fake.context_length


def test_chat_stream(http):
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
                                                "stream": True, "n": 2})
    events = sse_events(r.text)
    assert all(ev["object"] == "chat.completion.chunk" for ev in events)
    firsts = events[:2]
    assert [ev["choices"][0]["delta"] for ev in firsts] == [{"role": "assistant", "content": ""}] * 2
    finals = [ev for ev in events if ev["choices"][0]["finish_reason"] is not None]
    assert sorted(ev["choices"][0]["index"] for ev in finals) == [0, 1]


def test_openai_client(oai, fake, default_tokenizer):
    models = oai.models.list()
    assert [m.id for m in models.data] == ["fake-model"]
    out = oai.completions.create(model="fake-model", prompt="Hello", max_tokens=4, n=3,
                                 extra_body={"top_k": 1, "repetition_penalty": 1.1})
    assert len(out.choices) == 3 and out.usage.completion_tokens == 12
    assert fake.requests[-1].sampling_params["repetition_penalty"] == 1.1
    chat = oai.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=5, logprobs=True, top_logprobs=1)
    assert chat.choices[0].finish_reason == "length"
    assert len(chat.choices[0].logprobs.content) == 5
    stream = oai.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "Hi"}],
                                         max_tokens=5, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == chat.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 5
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="nope", prompt="x")
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        oai.completions.create(model="fake-model", prompt="x", max_tokens=0)


def test_stop_and_eos_finish_reasons(http, fake):
    fake.eos_after = 2
    r = http.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 10})
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["matched_stop"] == 1
    assert r.json()["usage"]["completion_tokens"] == 3
    r = http.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 10, "ignore_eos": True})
    assert r.json()["usage"]["completion_tokens"] == 10
    tok = fake.token_at([5, 6], 1, 0)
    r = http.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 10, "stop_token_ids": [tok]})
    assert r.json()["choices"][0]["matched_stop"] == tok


# ----------------------------------------------------------------------
# other endpoints
def test_info_endpoints(http, fake):
    assert http.get("/health").status_code == 200
    assert http.get("/health_generate").status_code == 200
    for path in ("/get_server_info", "/server_info"):
        info = http.get(path).json()
        assert info["served_model_name"] == "fake-model" and info["version"]
        assert info["max_concurrent_requests"] == 4096 and info["context_length"] == 512
    for path in ("/get_model_info", "/model_info"):
        info = http.get(path).json()
        assert info["model_path"] == "/models/fake" and info["tokenizer_path"] == "/models/fake"
        assert info["is_generation"] is True and info["served_model_name"] == "fake-model"
    load = http.get("/get_load").json()
    assert load == [{"dp_rank": 0, "num_running": 0, "num_waiting": 0, "num_waiting_tokens": 0,
                     "kv_used_tokens": 0, "kv_total_tokens": 1000, "num_cached_tokens": 0}]
    r = http.post("/flush_cache")
    assert r.status_code == 200 and r.json()["success"] is True
    card = http.get("/v1/models").json()["data"][0]
    assert card["max_model_len"] == 512
    assert card["id"] == card["root"] == "fake-model"  # the served name, not the server's /models/fake
    assert http.get("/version").json()["version"]


def test_metrics(http, fake):
    http.post("/v1/completions", json={"prompt": "metrics", "max_tokens": 3, "stream": True})
    fake.last_load = [fake.last_load[0].__class__(0, 3, 2, 10, 250, 1000, 40)]
    try:
        text = http.get("/metrics").text
    finally:
        fake.last_load = [fake.last_load[0].__class__(0, 0, 0, 0, 0, 1000, 0)]
    for name in ("moeserve:time_to_first_token_seconds_bucket", "moeserve:inter_token_latency_seconds_count",
                 "moeserve:e2e_request_latency_seconds_sum", "moeserve:prompt_tokens_total",
                 "moeserve:generation_tokens_total", "moeserve:request_success_total", "moeserve:cache_hit_rate"):
        assert name in text, name
    values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line and not line.startswith("#")}
    assert values["moeserve:num_running_reqs"] == 3 and values["moeserve:num_queue_reqs"] == 2
    assert values["moeserve:token_usage"] == pytest.approx(0.25)
    assert values["moeserve:kv_cache_usage"] == pytest.approx(0.25)
    assert values["moeserve:generation_tokens_total"] >= 3
    assert 'finished_reason="length"' in text


# ----------------------------------------------------------------------
# aborts and disconnects
@pytest.mark.parametrize("path,body", [
    ("/generate", {"text": "slow", "stream": True, "sampling_params": {"max_new_tokens": 400}}),
    ("/v1/completions", {"prompt": "slow", "stream": True, "max_tokens": 400}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "slow"}], "stream": True, "max_tokens": 400}),
])
def test_disconnect_mid_stream_aborts(base_url, fake, path, body):
    fake.token_delay = 0.02
    before = len(fake.requests)
    with httpx.Client(base_url=base_url, timeout=30) as c, c.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: "))
    _wait_until(lambda: len(fake.requests) > before and not fake.running)
    rid = fake.requests[-1].rid
    assert rid in fake.aborted


def test_disconnect_non_streaming_aborts(base_url, fake):
    fake.token_delay = 0.02
    before = len(fake.requests)
    with pytest.raises(httpx.ReadTimeout), httpx.Client(base_url=base_url, timeout=0.3) as c:
        c.post("/v1/completions", json={"prompt": "slow", "max_tokens": 400})
    _wait_until(lambda: len(fake.requests) > before and not fake.running)
    assert fake.requests[-1].rid in fake.aborted


def test_abort_request_ends_the_stream(base_url, http, fake):
    fake.token_delay = 0.02
    result = {}

    def run():
        with httpx.Client(base_url=base_url, timeout=30) as c:
            result["r"] = c.post("/generate", json={"text": "x", "rid": "to-abort", "stream": True,
                                                    "sampling_params": {"max_new_tokens": 400}})

    t = threading.Thread(target=run)
    t.start()
    _wait_until(lambda: "to-abort" in fake.running)
    r = http.post("/abort_request", json={"rid": "to-abort"})
    assert r.status_code == 200 and r.json() == {"aborted": ["to-abort"]}
    t.join(timeout=10)
    events = sse_events(result["r"].text)
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    assert "to-abort" in fake.aborted
    _wait_until(lambda: not fake.running)
    assert http.post("/abort_request", json={}).status_code == 400


# ----------------------------------------------------------------------
# bad input never hurts the server
LONG = "word " * 1000
DEEP = b"[" * 1000 + b"]" * 1000  # RecursionError in json's parser: was a 500
BAD_REQUESTS = [
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "metadata": {"a": ' + DEEP + b"}}",
     400, "nested"),
    ("/v1/completions", b'{"prompt": "x", "user": ' + DEEP + b"}", 400, "nested"),
    ("/generate", b'{"text": "x", "sampling_params": {"a": ' + DEEP + b"}}", 400, "nested"),
    ("/abort_request", b'{"rid": ' + DEEP + b"}", 400, "nested"),
    ("/generate", {"text": ["x"] * 1024, "sampling_params": {"n": 2}}, 400, "exceeds 1024"),
    ("/generate", {"input_ids": [[5, 6]] * 9, "sampling_params": {"n": 128}}, 400, "exceeds 1024"),
    # (path, raw body or JSON, status, words the message must contain)
    ("/v1/completions", b'{"prompt": "x",', 400, "not valid JSON"),
    ("/v1/chat/completions", b'{"messages": [}', 400, "not valid JSON"),
    ("/generate", b"{'text': 'single quotes'}", 400, "not valid JSON"),
    ("/v1/completions", b"", 400, "empty"),
    ("/v1/completions", b"[1, 2]", 400, "JSON object"),
    ("/v1/completions", b'{"prompt": "\xff\xfe bad"}', 400, "UTF-8"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udc00"}]}', 400, "surrogate"),
    ("/v1/completions", b'{"prompt": "x", "temperature": NaN}', 400, "NaN"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"prompt": "x", "n": 1.5}, 400, "n"),
    ("/v1/completions", {"prompt": 5}, 400, "prompt"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "role"),
    ("/generate", {"text": "x", "sampling_params": "greedy"}, 400, "sampling_params"),
    ("/v1/completions", {"prompt": "x", "max_tokenz": 3}, 400, "max_tokenz"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "functions": []}, 400, "functions"),
    ("/generate", {"text": "x", "sampling_param": {}}, 400, "sampling_param"),
    ("/generate", {"text": "x", "sampling_params": {"max_tokens": 3}}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": ""}, 400, "empty"),
    ("/v1/completions", {"prompt": []}, 400, "empty"),
    ("/v1/completions", {"prompt": [[]]}, 400, "empty"),
    ("/generate", {"text": ""}, 400, "empty"),
    ("/generate", {"input_ids": []}, 400, "empty"),
    ("/generate", {}, 400, "text or input_ids"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/completions", {"prompt": LONG}, 400, "context length"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}]}, 400, "context length"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 10**6}, 400, "context length"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}, 400,
     "max_completion_tokens"),
    ("/generate", {"text": "x", "sampling_params": {"max_new_tokens": 10**6}}, 400, "context length"),
    ("/v1/completions", {"prompt": "x", "n": 129}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n"),
    ("/generate", {"text": "x", "sampling_params": {"n": 1000}}, 400, "n"),
    ("/v1/completions", {"prompt": [1, 2, -1]}, 400, "vocabulary"),
    ("/v1/completions", {"prompt": [1, 2, 10**9]}, 400, "vocabulary"),
    ("/generate", {"input_ids": [[1, 2], [3, 10**6]]}, 400, "vocabulary"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4o"}, 404, "gpt-4o"),
    ("/v1/chat/completions", {"model": "other", "messages": [{"role": "user", "content": "x"}]}, 404, "other"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "top_k": 0}, 400, "top_k"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True,
                              "top_logprobs": 21}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400,
     "logprobs"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, 400, "stop"),
    ("/v1/completions", {"prompt": "x", "stop": 5}, 400, "stop"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [-1]}, 400, "stop_token_ids"),
    ("/v1/completions", {"prompt": "x", "echo": True, "stream": True}, 400, "echo"),
    ("/v1/completions", {"prompt": "x", "suffix": "y"}, 400, "suffix"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 10}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tool"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "json_object"}}, 400, "response_format"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, 400, "image_url"),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "x"}]}, 400, "tool"),
    ("/generate", {"text": ["a", "b"], "rid": ["same", "same"]}, 400, "unique"),
    ("/generate", {"text": ["a", "b"], "sampling_params": [{}]}, 400, "sampling_params"),
    ("/generate", {"text": "a", "input_ids": [1]}, 400, "not both"),
    ("/abort_request", {"rid": 5}, 400, "rid"),
]


@pytest.mark.parametrize("path,body,status,words", BAD_REQUESTS)
def test_bad_request_then_good_one(http, path, body, status, words):
    if isinstance(body, bytes):
        r = http.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = http.post(path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert set(err) == {"message", "type", "param", "code"}
    assert words.lower() in err["message"].lower(), err["message"]
    if isinstance(body, dict) and words in body:  # a bad field is named as the error's param
        assert err["param"] and words in err["param"], err
    ok = http.post("/v1/completions", json={"prompt": "still alive", "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_wrong_method_and_path(http):
    r = http.get("/v1/completions")
    assert r.status_code == 405 and "not allowed" in r.json()["error"]["message"]
    r = http.post("/v1/embeddings", json={})
    assert r.status_code == 404 and "no such endpoint" in r.json()["error"]["message"]


def test_dead_engine(http, fake):
    fake.healthy = False
    fake.dead_reason = "worker rank0 exited with code -9"
    r = http.get("/health")
    assert r.status_code == 503 and "rank0" in r.json()["error"]["message"]
    assert http.get("/health_generate").status_code == 503
    r = http.post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 503 and "rank0" in r.json()["error"]["message"]


def test_engine_dies_mid_stream(base_url, fake):
    fake.token_delay = 0.02
    with httpx.Client(base_url=base_url, timeout=30) as c, c.stream(
            "POST", "/v1/completions", json={"prompt": "x", "max_tokens": 200, "stream": True}) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        fake.dead_reason = "worker died"
        rest = [line for line in lines if line]
    # The fake checks dead_reason only at the start; the stream itself still ends with [DONE].
    assert rest[-1] == "data: [DONE]"


# ----------------------------------------------------------------------
# server options
def test_api_key(default_tokenizer):
    from fastapi.testclient import TestClient

    app = build_app(FakeClient(default_tokenizer, api_key="sekret"))
    with TestClient(app) as c:
        r = c.post("/v1/completions", json={"prompt": "x"})
        assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
        assert c.post("/v1/completions", json={"prompt": "x"},
                      headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert c.post("/v1/completions", json={"prompt": "x"},
                      headers={"Authorization": "Bearer sekret"}).status_code == 200
        assert c.get("/health").status_code == 200
        assert c.get("/metrics").status_code == 200


def test_max_concurrent_requests(default_tokenizer):
    fake = FakeClient(default_tokenizer, max_concurrent_requests=1)
    fake.token_delay = 0.02
    with serve_in_thread(build_app(fake)) as url, httpx.Client(base_url=url, timeout=30) as c:
        with c.stream("POST", "/generate", json={"text": "x", "stream": True,
                                                 "sampling_params": {"max_new_tokens": 300}}) as r:
            lines = r.iter_lines()  # NOTE: closing this iterator would close the connection
            assert next(lines).startswith("data: ")
            busy = c.post("/generate", json={"text": "y"})
            assert busy.status_code == 503 and "max-concurrent-requests" in busy.json()["error"]["message"]
        _wait_until(lambda: not fake.running)
        assert c.post("/generate", json={"text": "y", "sampling_params": {"max_new_tokens": 1}}).status_code == 200


def test_no_tokenizer():
    from fastapi.testclient import TestClient

    fake = FakeClient(None)
    with TestClient(build_app(fake)) as c:
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 400 and "tokenizer" in r.json()["error"]["message"]
        r = c.post("/generate", json={"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}})
        assert r.status_code == 200 and r.json()["text"] == ""
        assert c.get("/get_model_info").json()["tokenizer_path"] is None


@pytest.mark.parametrize("path,body,field", [
    ("/v1/completions", {"prompt": "x", "max_tokens": 10**6}, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 10**6},
     "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 10**6}, "max_tokens"),
    ("/generate", {"text": "x", "sampling_params": {"max_new_tokens": 10**6}}, "max_new_tokens"),
])
def test_a_context_overflow_from_max_tokens_names_it(http, fake, path, body, field):
    err = http.post(path, json=body).json()["error"]
    assert err["param"] == field and err["code"] == "context_length_exceeded", err
    assert err["message"].startswith(f"{field} 1000000 ") and "prompt" not in err["message"].split(":")[0], err
    assert f"context length is {fake.context_length}" in err["message"]


def test_a_prompt_far_over_the_context_is_refused_in_tokens(http, fake):
    for body in ({"prompt": "word " * 100_000}, {"prompt": "w" * (fake.validator.max_prompt_chars + 1)}):
        err = http.post("/v1/completions", json=body).json()["error"]
        assert err["code"] == "context_length_exceeded", err
        message = err["message"]
        assert f"context length of {fake.context_length} tokens" in message and "bytes" not in message, err
