"""The HTTP app over a FakeClient, for issue 16's fixes: request ids, metrics of disconnects, /openapi.json, and how
the server ends (the drain on SIGTERM, a dead engine)."""

from __future__ import annotations

import signal
import threading
import time

import httpx
import pytest
from server_fakes import FakeClient, serve_in_thread, sse_events, wait_until

from moeserve.server.http.app import build_app

_wait_until = wait_until


@pytest.fixture(autouse=True)
def _reset(fake):
    fake.token_delay = 0.0
    fake.eos_after = None
    yield


@pytest.fixture(scope="module")
def http(base_url):
    with httpx.Client(base_url=base_url, timeout=30) as c:
        yield c


def _abort_count(http) -> float:
    for line in http.get("/metrics").text.splitlines():
        if line.startswith("moeserve:request_success_total{") and 'finished_reason="abort"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_disconnects_count_as_aborted_requests(base_url, http, fake):
    fake.token_delay = 0.02
    before = _abort_count(http)
    with httpx.Client(base_url=base_url, timeout=30) as c, c.stream(
            "POST", "/v1/completions", json={"prompt": "slow", "stream": True, "max_tokens": 400}) as r:
        next(line for line in r.iter_lines() if line.startswith("data: "))
    with pytest.raises(httpx.ReadTimeout), httpx.Client(base_url=base_url, timeout=0.3) as c:
        c.post("/generate", json={"text": "slow", "sampling_params": {"max_new_tokens": 400}})
    _wait_until(lambda: not fake.running and _abort_count(http) == before + 2)


def test_reused_rid_while_streaming_is_duplicate_rid(base_url, http, fake):
    fake.token_delay = 0.02
    with httpx.Client(base_url=base_url, timeout=30) as c, c.stream(
            "POST", "/generate", json={"text": "x", "rid": "twice", "stream": True,
                                       "sampling_params": {"max_new_tokens": 300}}) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        for path, body in (("/generate", {"text": "y", "rid": "twice"}),
                           ("/v1/completions", {"prompt": "y", "rid": "twice", "max_tokens": 2})):
            again = http.post(path, json=body)
            assert again.status_code == 400, again.text
            assert again.json()["error"]["code"] == "duplicate_rid" and again.json()["error"]["param"] == "rid"
    _wait_until(lambda: not fake.running)
    ok = http.post("/generate", json={"text": "y", "rid": "twice", "sampling_params": {"max_new_tokens": 2}})
    assert ok.status_code == 200 and ok.json()["meta_info"]["finish_reason"]["type"] == "length"


def test_openapi_documents_bodies_and_errors(http):
    doc = http.get("/openapi.json").json()
    schemas = doc["components"]["schemas"]
    for path, model in (("/generate", "GenerateRequest"), ("/v1/completions", "CompletionRequest"),
                        ("/v1/chat/completions", "ChatCompletionRequest"), ("/abort_request", "AbortRequest")):
        op = doc["paths"][path]["post"]
        assert op["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/" + model)
        assert model in schemas
        for status in ("400", "404", "413", "503"):
            assert op["responses"][status]["content"]["application/json"]["schema"]["$ref"].endswith(
                "/ErrorResponse"), (path, status)
    assert "ChatMessage" in schemas and "422" not in doc["paths"]["/generate"]["post"]["responses"]
    ids = [op["operationId"] for ops in doc["paths"].values() for op in ops.values()]
    assert len(ids) == len(set(ids))
    sp = schemas["GenerateRequest"]["properties"]["sampling_params"]["anyOf"][0]
    assert {"max_new_tokens", "temperature", "top_p", "stop"} <= set(sp["properties"])
    r = http.get("/health")
    assert r.headers["content-type"] == "application/json" and r.json() == {"status": "ok"}


def _serve_with_drain(fake, shutdown_timeout: float):
    from moeserve.server.http.server import _Server

    app = build_app(fake)
    holder: dict = {}
    ctx = serve_in_thread(app, _Server, holder)

    class _Ctx:
        def __enter__(self):
            self.url = ctx.__enter__()
            self.server = holder["server"]
            self.server.moeserve_ctx = app.state.ctx
            self.server.shutdown_timeout = shutdown_timeout
            return self

        def __exit__(self, *exc):
            return ctx.__exit__(*exc)

    return _Ctx()


def _post_in_thread(url, path, body, result, key):
    def run():
        with httpx.Client(base_url=url, timeout=30) as c:
            result[key] = c.post(path, json=body)

    t = threading.Thread(target=run)
    t.start()
    return t


def test_shutdown_ends_streams_with_an_error(default_tokenizer):
    """Stopped at once (no drain): a stream in flight ends at once with an in-band 503 error, not a finish."""
    fake = FakeClient(default_tokenizer)
    fake.token_delay = 0.05
    lines: list[str] = []

    def run(url):
        with httpx.Client(base_url=url, timeout=30) as c, c.stream(
                "POST", "/generate", json={"text": "x", "stream": True,
                                           "sampling_params": {"max_new_tokens": 400}}) as r:
            lines.extend(r.iter_lines())

    with _serve_with_drain(fake, shutdown_timeout=0) as srv:
        t = threading.Thread(target=run, args=(srv.url,))
        t.start()
        _wait_until(lambda: lines)  # the stream has started
        start = time.monotonic()
        srv.server.handle_exit(signal.SIGTERM, None)
        t.join(timeout=10)
        assert time.monotonic() - start < 3  # not the close timeout
    events = sse_events("\n\n".join(line for line in lines if line))
    assert events[-1]["error"]["code"] == "shutting_down" and "shutting down" in events[-1]["error"]["message"]
    assert all("error" not in e for e in events[:-1])


def test_sigterm_drains(default_tokenizer):
    """SIGTERM: new requests and /health get 503, a request in flight that fits the timeout finishes with 200,
    one that does not ends with a 503 error at the timeout (never a 200 with what it had so far)."""
    fake = FakeClient(default_tokenizer)
    fake.token_delay = 0.05
    result: dict = {}
    with _serve_with_drain(fake, shutdown_timeout=2.0) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        short = _post_in_thread(srv.url, "/v1/completions", {"prompt": "short", "max_tokens": 10}, result, "short")
        long = _post_in_thread(srv.url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                                 "max_tokens": 400}, result, "long")
        _wait_until(lambda: len(fake.running) == 2)
        start = time.monotonic()
        srv.server.handle_exit(signal.SIGTERM, None)
        busy = c.post("/generate", json={"text": "late"})
        assert busy.status_code == 503 and busy.json()["error"]["code"] == "shutting_down"
        assert c.get("/health").status_code == 503
        short.join(timeout=10)
        long.join(timeout=10)
        took = time.monotonic() - start
    assert result["short"].status_code == 200 and result["short"].json()["usage"]["completion_tokens"] == 10
    r = result["long"]
    assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down", r.text
    assert "--shutdown-timeout 2" in r.json()["error"]["message"]
    assert 1.9 < took < 5, took


def test_a_dead_engine_stops_the_server_with_exit_code_1(default_tokenizer):
    fake = FakeClient(default_tokenizer)
    with _serve_with_drain(fake, shutdown_timeout=20.0) as srv:
        fake.healthy = False
        fake.dead_reason = "rank 1 (pid 1) was killed by signal 9 (SIGKILL)"
        _wait_until(lambda: srv.server.should_exit, timeout=2)
        assert srv.server.exit_code == 1
