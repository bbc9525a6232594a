"""Reliability under load, against a real server on the embedded model over loopback: 512 requests at
concurrency 128, streamed and not, on the three generation endpoints: none lost, none truncated, none duplicated,
every greedy output the same as the one served alone; and /health answers in under 100 ms while maximal requests
(bodies at the 64 MiB limit) are refused."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from moeserve.server.http.json_body import MAX_BODY_BYTES
from tests.reliability.harness import record, start_server

pytestmark = pytest.mark.slow

# Four times the concurrency: the running batch (--max-running-requests 128) fills, drains and refills while
# requests finish and new ones arrive, and every (endpoint, streamed, prompt, length) combination of _job (period
# 6) comes about 85 times. More requests repeat these same scheduler paths (2,000 took 42 s on 2 cores).
NUM_REQUESTS = 512
CONCURRENCY = 128
PROMPTS = ["The Fox and the Grapes.", "Slow and steady", "It is a truth universally acknowledged", "def add(a, b):",
           "Call me Ishmael.", "Once upon a time"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("load"), "--max-running-requests", "128")
    yield srv
    srv.stop()


def _job(i: int) -> dict:
    """Request i of the load: endpoint, streamed or not, prompt, length (1 to 6 tokens), its own rid."""
    return {"rid": f"load-{i}", "kind": ("generate", "completions", "chat")[i % 3], "stream": (i // 3) % 2 == 1,
            "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 1 + i % 6}


def _body(job: dict) -> tuple[str, dict]:
    greedy = {"temperature": 0, "ignore_eos": True}
    if job["kind"] == "generate":
        return "/generate", {"text": job["prompt"], "rid": job["rid"], "stream": job["stream"],
                             "sampling_params": {"max_new_tokens": job["max_tokens"], **greedy}}
    body = {"model": "default", "rid": job["rid"], "stream": job["stream"], "max_tokens": job["max_tokens"],
            **greedy}
    if job["stream"]:
        body["stream_options"] = {"include_usage": True}
    if job["kind"] == "completions":
        return "/v1/completions", {**body, "prompt": job["prompt"]}
    return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": job["prompt"]}]}


def _events(text: str) -> tuple[list[dict], bool]:
    lines = [line for line in text.split("\n\n") if line.strip()]
    done = bool(lines) and lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines if line.startswith("data: {")], done


def _outcome(job: dict, status: int, text: str) -> dict:
    """What one response says: its text, token count, finish reason, id, and whether the stream was whole."""
    if status != 200:
        return {"status": status, "error": text[:300]}
    if not job["stream"]:
        body = json.loads(text)
        if job["kind"] == "generate":
            meta = body["meta_info"]
            return {"status": 200, "text": body["text"], "tokens": meta["completion_tokens"],
                    "finish": meta["finish_reason"]["type"], "id": meta["id"], "whole": True}
        choice = body["choices"][0]
        text_out = choice["message"]["content"] if job["kind"] == "chat" else choice["text"]
        return {"status": 200, "text": text_out, "tokens": body["usage"]["completion_tokens"],
                "finish": choice["finish_reason"], "id": body["id"], "whole": True}
    events, done = _events(text)
    if job["kind"] == "generate":
        last = events[-1] if events else {}
        meta = last.get("meta_info", {})
        finishes = [e["meta_info"]["finish_reason"] for e in events if e.get("meta_info", {}).get("finish_reason")]
        return {"status": 200, "text": last.get("text"), "tokens": meta.get("completion_tokens"),
                "finish": finishes[-1]["type"] if len(finishes) == 1 else None, "id": meta.get("id"),
                "whole": done and len(finishes) == 1 and not any("error" in e for e in events)}
    pieces, finishes, usage = [], [], None
    for e in events:
        usage = e.get("usage") or usage
        for ch in e.get("choices", []):
            pieces.append((ch.get("delta") or {}).get("content") or "" if job["kind"] == "chat" else ch["text"])
            if ch.get("finish_reason"):
                finishes.append(ch["finish_reason"])
    ids = {e.get("id") for e in events}
    return {"status": 200, "text": "".join(pieces), "tokens": (usage or {}).get("completion_tokens"),
            "finish": finishes[0] if len(finishes) == 1 else None, "id": ids.pop() if len(ids) == 1 else None,
            "whole": done and len(finishes) == 1 and usage is not None and not any("error" in e for e in events)}


async def _run_load(url: str, jobs: list[dict]) -> list[dict]:
    limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=CONCURRENCY)
    sem = asyncio.Semaphore(CONCURRENCY)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
        async def one(job: dict) -> dict:
            path, body = _body(job)
            async with sem:
                try:
                    r = await client.post(path, json=body)
                    return _outcome(job, r.status_code, r.text)
                except httpx.HTTPError as e:
                    return {"status": None, "error": f"{type(e).__name__}: {e}"}

        return await asyncio.gather(*(one(job) for job in jobs))


def test_load_512_requests_at_concurrency_128(server):
    jobs = [_job(i) for i in range(NUM_REQUESTS)]
    # the reference: each (endpoint, prompt) served alone, greedy, at the longest length
    reference = {}
    for kind in ("generate", "completions", "chat"):
        for prompt in PROMPTS:
            job = {"rid": f"ref-{kind}-{prompt}", "kind": kind, "stream": False, "prompt": prompt, "max_tokens": 6}
            path, body = _body(job)
            r = httpx.post(server.url + path, json=body, timeout=60)
            reference[kind, prompt] = _outcome(job, r.status_code, r.text)
    start = time.monotonic()
    results = asyncio.run(_run_load(server.url, jobs))
    took = time.monotonic() - start

    lost = [(j["rid"], r) for j, r in zip(jobs, results, strict=True) if r["status"] != 200]
    truncated = [j["rid"] for j, r in zip(jobs, results, strict=True)
                 if r["status"] == 200 and (not r["whole"] or r["tokens"] != j["max_tokens"] or r["finish"] != "length")]
    generate_ids = [r.get("id") for j, r in zip(jobs, results, strict=True) if j["kind"] == "generate"]
    duplicated = len(generate_ids) - len(set(generate_ids))
    wrong_id = [j["rid"] for j, r in zip(jobs, results, strict=True)
                if j["kind"] == "generate" and r.get("id") != j["rid"]]
    openai_ids = [r.get("id") for j, r in zip(jobs, results, strict=True) if j["kind"] != "generate"]
    duplicated += len(openai_ids) - len(set(openai_ids))
    differs = []
    for j, r in zip(jobs, results, strict=True):
        ref = reference[j["kind"], j["prompt"]]
        if r["status"] == 200 and not ref["text"].startswith(r["text"]):
            differs.append(j["rid"])
    record("load_requests", NUM_REQUESTS)
    record("load_concurrency", CONCURRENCY)
    record("load_seconds", round(took, 1))
    record("load_lost", len(lost))
    record("load_truncated", len(truncated))
    record("load_duplicated", duplicated)
    assert not lost, lost[:5]
    assert not truncated, truncated[:5]
    assert duplicated == 0 and not wrong_id, wrong_id[:5]
    assert not differs, differs[:5]
    load = httpx.get(server.url + "/get_load").json()
    assert all(x["num_running"] == 0 and x["kv_used_tokens"] == 0 for x in load), load


def _maximal_bodies(server) -> list[tuple[str, bytes]]:
    """Bodies just under the 64 MiB limit that the server must refuse: a text prompt, a chat message, token ids."""
    room = MAX_BODY_BYTES - 1024
    text = ("All work and no play makes Jack a dull boy. " * (room // 45 + 1))[:room]
    ids = "5, " * (room // 3)
    return [
        ("/generate", b'{"text": "' + text.encode() + b'"}'),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "' + text.encode() + b'"}]}'),
        ("/v1/completions", b'{"prompt": [' + ids[:-2].encode() + b"]}"),
    ]


_SEND = """
import os, socket, sys, time
os.nice(10)  # the client must not take the CPU from the server it measures (two cores)
host, port, path, body_file = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
body = open(body_file, "rb").read()
head = (f"POST {path} HTTP/1.1\\r\\nHost: {host}\\r\\nContent-Type: application/json\\r\\n"
        f"Content-Length: {len(body)}\\r\\nConnection: close\\r\\n\\r\\n").encode()
t = time.perf_counter()
with socket.create_connection((host, port)) as s:
    s.sendall(head)
    try:
        s.sendall(body)
    except (BrokenPipeError, ConnectionResetError):
        pass  # refused before the whole body was read
    reply = b""
    while chunk := s.recv(65536):
        reply += chunk
status = reply.split(b" ", 2)[1].decode()
print(status, round(time.perf_counter() - t, 2), reply.split(b"\\r\\n\\r\\n", 1)[-1][:100].decode())
"""


def _send_in_child(url: str, path: str, body_file: Path) -> subprocess.Popen:
    """POST a body from another process (a plain socket, at low priority), so that this process's /health poller
    measures the server, not the client."""
    host, port = url.removeprefix("http://").split(":")
    return subprocess.Popen([sys.executable, "-c", _SEND, host, port, path, str(body_file)], stdout=subprocess.PIPE,
                            text=True)


def _health_during(server, files: list[tuple[str, Path]]) -> tuple[list[float], list[tuple[str, str]]]:
    """/health latencies (polled every 10 ms) while each body is sent and refused, and what each got."""
    latencies: list[float] = []
    stop = threading.Event()

    def poll_health():
        with httpx.Client(base_url=server.url, timeout=10) as c:
            while not stop.is_set():
                t = time.perf_counter()
                assert c.get("/health").status_code == 200
                latencies.append(time.perf_counter() - t)
                time.sleep(0.01)

    poller = threading.Thread(target=poll_health)
    poller.start()
    refused = []
    try:
        time.sleep(0.2)
        for path, body_file in files:
            child = _send_in_child(server.url, path, body_file)
            out, _ = child.communicate(timeout=180)
            refused.append((path, out.strip()))
        time.sleep(0.2)
    finally:
        stop.set()
        poller.join(timeout=30)
    return latencies, refused


def test_health_stays_fast_while_maximal_requests_are_refused(server, tmp_path):
    files = []
    for i, (path, body) in enumerate(_maximal_bodies(server)):
        files.append((path, tmp_path / f"body{i}.json"))
        files[-1][1].write_bytes(body)
    # NOTE: up to three attempts: a stall of the server repeats every time, while another process taking both
    # cores of the machine for a moment does not
    worsts = []
    for _ in range(3):
        latencies, refused = _health_during(server, files)
        for path, out in refused:
            assert out.startswith("400 "), (path, out)
        assert len(latencies) > 10
        worsts.append(round(max(latencies) * 1000, 1))
        if worsts[-1] < 100:
            break
    record("health_polls_during_maximal_requests", len(latencies))
    record("health_worst_ms_during_maximal_requests", worsts[-1])
    if len(worsts) > 1:
        record("health_worst_ms_earlier_attempts", worsts[:-1])
    record("maximal_request_refused_s", [float(out.split()[1]) for _, out in refused])
    assert worsts[-1] < 100, (worsts, refused)
