"""End to end: a real `moeserve serve` process on the embedded default model, driven over HTTP.

One server for the whole module (it takes seconds to start); the official openai client for the OpenAI API,
httpx for the native endpoints. Greedy outputs are checked against transformers' DeepseekV3ForCausalLM and
against each other (streamed vs not, concurrent vs sequential); the server must stop with no worker left.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.slow

GREEDY = {"temperature": 0.0, "ignore_eos": True}


def generate(http, **body) -> dict:
    r = http.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _wait_idle(http, timeout=30.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        load = http.get("/get_load").json()
        if all(x["num_running"] == 0 and x["num_waiting"] == 0 and x["kv_used_tokens"] == 0 for x in load):
            return load
        assert time.monotonic() < deadline, f"server not idle: {load}"
        time.sleep(0.1)


# ----------------------------------------------------------------------
def test_startup_log_and_info(server, http):
    assert f"at {server['url']}" in server["log"].read_text()
    assert len(server["workers"]) >= 1
    info = http.get("/get_model_info").json()
    assert info["model_path"] == server["model_path"] and info["tokenizer_path"] == server["model_path"]
    assert info["served_model_name"] == "tiny" and info["is_generation"] is True
    assert http.get("/model_info").json() == info
    sinfo = http.get("/get_server_info").json()
    assert sinfo["port"] == int(server["url"].rsplit(":", 1)[1]) and sinfo["version"]
    assert http.get("/server_info").json()["served_model_name"] == "tiny"
    assert http.get("/health").status_code == 200
    assert http.get("/health_generate").status_code == 200
    assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["tiny"]


def test_greedy_matches_transformers(http, server):
    transformers = pytest.importorskip("transformers")
    import torch

    model = transformers.AutoModelForCausalLM.from_pretrained(server["model_path"], dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(server["model_path"])
    for prompt in ("The Tortoise and the Hare",):
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            ref = model.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1]:].tolist()
        out = generate(http, text=prompt, sampling_params={"max_new_tokens": 8, **GREEDY})
        assert out["output_ids"] == ref, prompt
        assert out["text"] == tok.decode(ref, skip_special_tokens=True)
        assert out["meta_info"]["prompt_tokens"] == ids.shape[1]


def test_generate_native(http):
    single = generate(http, text="Call me Ishmael.", sampling_params={"max_new_tokens": 8, **GREEDY},
                      return_logprob=True, top_logprobs_num=3, rid="e2e-rid")
    meta = single["meta_info"]
    assert meta["id"] == "e2e-rid" and meta["completion_tokens"] == 8
    assert meta["finish_reason"]["type"] == "length"
    assert [t for _, t, _ in meta["output_token_logprobs"]] == single["output_ids"]
    for (lp, t, _), alts in zip(meta["output_token_logprobs"], meta["output_top_logprobs"], strict=True):
        assert alts[0][1] == t and alts[0][0] == pytest.approx(lp, abs=1e-4)  # greedy: the top-1 token

    batch = generate(http, text=["Call me Ishmael.", "It was the best of times"],
                     sampling_params={"max_new_tokens": 8, **GREEDY})
    assert batch[0]["output_ids"] == single["output_ids"]
    again = generate(http, input_ids=[[0] + [5, 6, 7]], sampling_params={"max_new_tokens": 3, "n": 2, **GREEDY})
    assert len(again) == 2 and again[0]["output_ids"] == again[1]["output_ids"]

    r = http.post("/generate", json={"text": "Call me Ishmael.", "stream": True,
                                     "sampling_params": {"max_new_tokens": 8, **GREEDY}})
    events = [json.loads(line[6:]) for line in r.text.split("\n\n") if line.startswith("data: {")]
    assert r.text.rstrip().endswith("data: [DONE]")
    assert events[-1]["output_ids"] == single["output_ids"] and events[-1]["text"] == single["text"]
    assert sum(ev["meta_info"]["finish_reason"] is not None for ev in events) == 1


def test_openai_completions(oai, http):
    prompt = "It was the best of times"
    ref = generate(http, text=prompt, sampling_params={"max_new_tokens": 8, **GREEDY})
    out = oai.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0,
                                 extra_body={"ignore_eos": True}, logprobs=2)
    (choice,) = out.choices
    assert choice.text == ref["text"] and choice.finish_reason == "length"
    assert out.usage.completion_tokens == 8 and out.usage.prompt_tokens == ref["meta_info"]["prompt_tokens"]
    assert out.usage.total_tokens == out.usage.prompt_tokens + 8
    assert len(choice.logprobs.tokens) == 8
    for lp, top in zip(choice.logprobs.token_logprobs, choice.logprobs.top_logprobs, strict=True):
        assert max(top.values()) == pytest.approx(lp, abs=1e-4)

    stream = oai.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0, stream=True,
                                    extra_body={"ignore_eos": True}, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref["text"]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 8

    many = oai.completions.create(model="tiny", prompt=[prompt, "Call me"], max_tokens=5, n=3, temperature=0)
    assert len(many.choices) == 6 and [c.index for c in many.choices] == list(range(6))
    assert len({c.text for c in many.choices[:3]}) == 1  # greedy: the same three times
    sampled = oai.completions.create(model="tiny", prompt=prompt, max_tokens=8, n=4, temperature=1.0, seed=3)
    assert len({c.text for c in sampled.choices}) > 1
    again = oai.completions.create(model="tiny", prompt=prompt, max_tokens=8, n=4, temperature=1.0, seed=3)
    assert [c.text for c in again.choices] == [c.text for c in sampled.choices]  # seeded: reproducible


def test_openai_stop_strings(oai, http):
    prompt = "The Lion and the Mouse."
    full = generate(http, text=prompt, sampling_params={"max_new_tokens": 24, **GREEDY})["text"]
    start = next(i for i in range(3, len(full) - 3) if "\ufffd" not in full[i:i + 3] and full[i:i + 3].strip())
    stop = full[start:start + 3]
    out = oai.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0, stop=[stop],
                                 extra_body={"ignore_eos": True})
    assert out.choices[0].text == full[: full.find(stop)]
    assert out.choices[0].finish_reason == "stop"
    stream = oai.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0, stop=stop,
                                    stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in stream) == full[: full.find(stop)]


def test_openai_chat(oai, server):
    from moeserve.text.tokenizer import load_tokenizer

    tok = load_tokenizer(server["model_path"])
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Count to three."}]
    out = oai.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=10, temperature=0,
                                      extra_body={"ignore_eos": True}, logprobs=True, top_logprobs=2)
    (choice,) = out.choices
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    prompt_ids = tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
    assert out.usage.prompt_tokens == len(prompt_ids) and out.usage.completion_tokens == 10
    assert len(choice.logprobs.content) == 10
    assert all(c.top_logprobs[0].logprob == pytest.approx(c.logprob, abs=1e-4) for c in choice.logprobs.content)

    stream = oai.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                         stream=True, extra_body={"ignore_eos": True},
                                         stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content
    assert chunks[-1].usage.total_tokens == out.usage.total_tokens

    many = oai.chat.completions.create(model="tiny", messages=messages, max_tokens=4, n=3, temperature=0)
    assert len(many.choices) == 3 and len({c.message.content for c in many.choices}) == 1


def test_bad_requests_on_the_real_engine(http, oai):
    cases = [
        ({"prompt": "word " * 5000, "max_tokens": 4}, "context length"),
        ({"prompt": [1, 2, 99999], "max_tokens": 4}, "vocabulary"),
        ({"prompt": "x", "max_tokens": 10**6}, "context length"),
        ({"prompt": "x", "top_p": 2.0}, "top_p"),
        ({"prompt": "x", "max_tokens": 4, "repetition_penalty": 0}, "repetition_penalty"),
    ]
    for body, words in cases:
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 400, r.text
        assert words in r.json()["error"]["message"]
        ok = oai.completions.create(model="tiny", prompt="still serving", max_tokens=2)
        assert ok.usage.completion_tokens >= 1
    r = http.post("/generate", content=b'{"text": "\xc3\x28"}')
    assert r.status_code == 400
    _wait_idle(http)


def test_disconnect_frees_the_request(server, http):
    body = {"text": "A long story:", "stream": True, "sampling_params": {"max_new_tokens": 3000, **GREEDY}}
    with httpx.Client(base_url=server["url"], timeout=60) as c, c.stream("POST", "/generate", json=body) as r:
        lines = r.iter_lines()
        got = 0
        for line in lines:
            got += line.startswith("data: ")
            if got == 3:
                break
    _wait_idle(http)


def test_abort_request(server, http):
    import threading

    result = {}

    def run():
        with httpx.Client(base_url=server["url"], timeout=120) as c:
            result["out"] = c.post("/generate", json={"text": "abort me", "rid": "e2e-abort",
                                                      "sampling_params": {"max_new_tokens": 3000, **GREEDY}})

    t = threading.Thread(target=run)
    t.start()
    deadline = time.monotonic() + 30
    while http.get("/get_load").json()[0]["num_running"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert http.post("/abort_request", json={"rid": "e2e-abort"}).json() == {"aborted": ["e2e-abort"]}
    t.join(timeout=60)
    out = result["out"].json()
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert out["meta_info"]["completion_tokens"] < 3000
    _wait_idle(http)


def test_concurrent_streams_match_sequential(server, http):
    """64 concurrent streamed requests of mixed lengths: each equals its sequential greedy result."""
    prompts = ["The Fox and the Grapes.", "Slow and steady", "It is a truth universally acknowledged",
               "def add(a, b):"]
    max_len = 12
    reference = {p: generate(http, text=p, sampling_params={"max_new_tokens": max_len, **GREEDY})
                 for p in prompts}
    jobs = [(prompts[i % len(prompts)], 1 + (i * 5) % max_len) for i in range(64)]

    async def stream_one(client: httpx.AsyncClient, prompt: str, n: int) -> dict:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        texts, finishes, usage = [], [], None
        async with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ev = json.loads(line[6:])
                if ev.get("usage"):
                    usage = ev["usage"]
                for ch in ev["choices"]:
                    texts.append(ch["text"])
                    finishes.append(ch["finish_reason"])
        return {"text": "".join(texts), "finishes": [f for f in finishes if f], "usage": usage}

    async def run_all() -> list[dict]:
        limits = httpx.Limits(max_connections=100)
        async with httpx.AsyncClient(base_url=server["url"], timeout=300, limits=limits) as client:
            return await asyncio.gather(*(stream_one(client, p, n) for p, n in jobs))

    results = asyncio.run(run_all())
    from moeserve.text.tokenizer import load_tokenizer

    tok = load_tokenizer(server["model_path"])
    for (prompt, n), res in zip(jobs, results, strict=True):
        want = tok.decode(reference[prompt]["output_ids"][:n])
        assert res["text"] == want, (prompt, n)
        assert res["finishes"] == ["length"]
        assert res["usage"]["completion_tokens"] == n
    load = _wait_idle(http)
    assert all(x["kv_used_tokens"] == 0 for x in load)
    metrics = http.get("/metrics").text
    assert "moeserve:token_usage" in metrics
    values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
              if line and not line.startswith("#")}
    assert values["moeserve:num_running_reqs"] == 0
    assert values["moeserve:generation_tokens_total"] >= sum(n for _, n in jobs)
    assert values["moeserve:time_to_first_token_seconds_count"] >= 64


@pytest.mark.parametrize("backend,dataset", [("openai", "random"), ("moeserve", "generated-shared-prefix")])
def test_bench_serving_against_the_server(server, http, tmp_path, capsys, backend, dataset):
    from moeserve.bench import serving

    out = tmp_path / "bench.json"
    rc = serving.main(["--base-url", server["url"], "--backend", backend, "--dataset", dataset,
                       "--num-prompts", "8", "--random-input-len", "32", "--random-output-len", "6",
                       "--random-range-ratio", "1.0", "--gsp-num-groups", "2", "--gsp-prompts-per-group", "4",
                       "--gsp-system-prompt-len", "48", "--gsp-question-len", "8", "--gsp-output-len", "6",
                       "--output-file", str(out), "--disable-tqdm"])
    assert rc == 0, capsys.readouterr().out
    summary = json.loads(out.read_text())["summary"]
    assert summary["completed"] == 8 and summary["failed"] == 0
    assert summary["total_output_tokens"] == 48 and summary["output_len_mismatches"] == 0
    assert summary["output_throughput"] > 0 and summary["itl_ms"]["mean"] > 0
    _wait_idle(http)


def test_flush_cache(http):
    _wait_idle(http)
    r = http.post("/flush_cache")
    assert r.status_code == 200 and r.json()["success"] is True
    assert all(x["num_cached_tokens"] == 0 for x in http.get("/get_load").json())


def test_expert_distribution_endpoints(http):
    """start, generate, stop, dump: the dump counts each routed token once per MoE layer (4 experts each)."""
    import torch

    assert http.post("/flush_cache").json()["success"]  # no prefix-cache hits from earlier tests
    assert http.post("/start_expert_distribution_record").json()["success"]
    prompts = [[905, 6, 7, 8, 9, 10, 11], [912, 13, 14]]
    for ids in prompts:
        generate(http, input_ids=ids, sampling_params={"max_new_tokens": 4, "temperature": 0, "ignore_eos": True})
    assert http.post("/stop_expert_distribution_record").json()["success"]
    r = http.post("/dump_expert_distribution_record", json={"name": "e2e_dump.pt"})
    assert r.status_code == 200, r.text
    assert r.json()["path"].endswith("/expert_distribution/e2e_dump.pt")
    dump = Path(r.json()["path"])
    counts = torch.load(dump)["logical_count"]
    dump.unlink()
    assert counts.shape == (1, 3, 16)  # the embedded model: 3 MoE layers, 16 experts
    # a prompt token the prefix cache already held is not routed again; these prompts share no prefix
    assert counts.sum(-1).tolist() == [[sum(len(p) + 4 - 1 for p in prompts) * 4] * 3]
    for name in ("../escape.pt", "/tmp/x.pt", ".hidden", 3):
        bad = http.post("/dump_expert_distribution_record", json={"name": name})
        assert bad.status_code == 400, (name, bad.text)



def test_prompt_logprobs_match_transformers(http, server):
    transformers = pytest.importorskip("transformers")
    import torch

    model = transformers.AutoModelForCausalLM.from_pretrained(server["model_path"], dtype=torch.float32)
    out = generate(http, text="import os\nimport sys\n", return_logprob=True, logprob_start_len=0,
                   top_logprobs_num=2, sampling_params={"max_new_tokens": 1, **GREEDY})
    meta = out["meta_info"]
    lps = meta["input_token_logprobs"]
    ids = [t for _, t, _ in lps]
    assert len(ids) == meta["prompt_tokens"] and lps[0][0] is None and meta["input_top_logprobs"][0] == []
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    for i in range(1, len(ids)):
        assert abs(lps[i][0] - ref[i - 1, ids[i]].item()) < 1e-3, i
        assert [t for _, t, _ in meta["input_top_logprobs"][i]] == ref[i - 1].topk(2).indices.tolist()
    tail = generate(http, input_ids=ids, return_logprob=True, logprob_start_len=3,
                    sampling_params={"max_new_tokens": 0})["meta_info"]["input_token_logprobs"]
    assert [t for _, t, _ in tail] == ids[3:]
    assert [lp for lp, _, _ in tail] == pytest.approx([lp for lp, _, _ in lps[3:]], abs=1e-5)
    bad = http.post("/generate", json={"input_ids": ids, "return_logprob": True, "logprob_start_len": len(ids)})
    assert bad.status_code == 400 and "logprob_start_len" in bad.text


def test_completions_echo_scores_the_prompt(http, oai):
    """lm-evaluation-harness's log-likelihood request: token ids, echo, logprobs=1, max_tokens=0."""
    ids = generate(http, text="def f(x):\n    return x", return_logprob=True, logprob_start_len=0,
                   sampling_params={"max_new_tokens": 0})["meta_info"]["input_token_logprobs"]
    prompt = [t for _, t, _ in ids]
    r = oai.completions.create(model="tiny", prompt=prompt, echo=True, logprobs=1, max_tokens=0, temperature=0)
    lp = r.choices[0].logprobs
    assert r.choices[0].text.endswith("def f(x):\n    return x") and r.usage.completion_tokens == 0
    assert lp.token_logprobs[0] is None and len(lp.token_logprobs) == len(prompt)
    assert lp.token_logprobs[1:] == pytest.approx([x for x, _, _ in ids[1:]], abs=1e-5)
    assert all(len(top) == 1 and max(top.values()) >= t for top, t in zip(lp.top_logprobs[1:], lp.token_logprobs[1:],
                                                                          strict=True))
    # with generated tokens too: the prompt's entries, then the output's
    r = oai.completions.create(model="tiny", prompt="import os", echo=True, logprobs=0, max_tokens=3, temperature=0)
    assert r.choices[0].text.startswith("import os") and len(r.choices[0].logprobs.tokens) == 3 + 3
    for body, word in (({"echo": True, "stream": True}, "stream"), ({"max_tokens": 0}, "echo")):
        bad = http.post("/v1/completions", json={"prompt": "x", **body})
        assert bad.status_code == 400 and word in bad.text, bad.text
