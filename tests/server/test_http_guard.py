"""The HTTP server against clients that misbehave (docs/reliability.md): a disconnect in the middle of a body is a
quiet 400-class close (no 500, no traceback), slow headers and a stalled body are closed at their deadlines, the
routes open with --api-key are exactly /health and /metrics (or none), and a PD server's overload is a 429 with
Retry-After (sglang-router's "try later")."""

from __future__ import annotations

import logging
import socket
import time

import httpx
import pytest
from server_fakes import FakeClient, serve_in_thread

from moeserve.server.http.app import build_app
from moeserve.server.http.read_guard import guarded_protocol

HEADER_S, READ_S = 0.5, 0.5


@pytest.fixture(scope="module")
def guarded_url(fake):
    with serve_in_thread(build_app(fake), http=guarded_protocol(HEADER_S, READ_S)) as url:
        yield url


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    return sock


def _closed_within(sock: socket.socket, seconds: float) -> float:
    """Seconds until the server closed `sock` (it reads EOF), asserting it did within `seconds`."""
    start = time.monotonic()
    sock.settimeout(seconds)
    try:
        while sock.recv(4096):
            pass
    except TimeoutError:
        pytest.fail(f"the server kept the connection open for {seconds} s")
    except ConnectionResetError:
        pass
    return time.monotonic() - start


def test_disconnect_mid_body_is_quiet(guarded_url, caplog):
    with caplog.at_level(logging.INFO):
        for _ in range(5):
            sock = _connect(guarded_url)
            sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000\r\n\r\n{\"text\": \"abc")
            sock.close()
        time.sleep(0.5)
        assert httpx.get(guarded_url + "/health", timeout=10).status_code == 200
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info], caplog.text


def test_slow_headers_and_stalled_body_are_closed(guarded_url):
    slowloris = _connect(guarded_url)
    slowloris.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
    for _ in range(3):  # a header line every 0.2 s: never idle, never done
        time.sleep(0.2)
        try:
            slowloris.sendall(b"X-a: b\r\n")
        except OSError:
            break
    assert _closed_within(slowloris, 5) < 5
    stalled = _connect(guarded_url)
    stalled.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"te")
    assert _closed_within(stalled, 5) < 5
    # a well-behaved client on a kept-alive connection is served
    with httpx.Client(base_url=guarded_url, timeout=10) as c:
        for _ in range(2):
            assert c.post("/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 2}}).status_code == 200


@pytest.mark.parametrize("all_routes", [False, True])
def test_routes_open_with_api_key(default_tokenizer, all_routes):
    from fastapi.testclient import TestClient

    client = FakeClient(default_tokenizer, api_key="sekret")
    client.server_args.api_key_all_routes = all_routes
    with TestClient(build_app(client)) as c:
        for path in ("/openapi.json", "/docs", "/redoc", "/version", "/get_server_info", "/get_load",
                     "/v1/models", "/health_generate"):
            assert c.get(path).status_code == 401, path
            assert c.get(path, headers={"Authorization": "Bearer sekret"}).status_code == 200, path
        for path in ("/health", "/metrics"):
            assert c.get(path).status_code == (401 if all_routes else 200), path


def test_pd_overload_is_429_with_retry_after(default_tokenizer):
    client = FakeClient(default_tokenizer, max_concurrent_requests=1)
    client.server_args.disaggregation_mode = "decode"
    client.token_delay = 0.02
    with serve_in_thread(build_app(client)) as url, httpx.Client(base_url=url, timeout=30) as c:
        with c.stream("POST", "/generate", json={"text": "x", "stream": True,
                                                 "sampling_params": {"max_new_tokens": 300}}) as r:
            lines = r.iter_lines()  # NOTE: closing this iterator would close the connection
            assert next(lines).startswith("data: ")
            busy = c.post("/generate", json={"text": "y"})
            assert busy.status_code == 429 and busy.headers["retry-after"] == "1", busy.text
            assert busy.json()["error"]["code"] == "overloaded"
