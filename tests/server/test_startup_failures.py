"""Start-up failures a user meets first: each is one line on stderr and a non-zero exit, before the model loads."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

from moeserve.server.http.server import port_busy_reason


def _serve(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moeserve.cli", "serve", *argv], capture_output=True, text=True,
                          timeout=120)


def _listening() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


def test_port_busy_reason_names_the_port():
    with _listening() as sock:
        port = sock.getsockname()[1]
        reason = port_busy_reason("127.0.0.1", port)
        assert reason is not None and f"127.0.0.1:{port}" in reason and "--port" in reason
        assert "address already in use" in reason  # what tests/disagg/pd_procs.py retries on
    assert port_busy_reason("127.0.0.1", port) is None  # free again once closed


def test_a_busy_port_exits_non_zero_before_the_model_loads():
    with _listening() as sock:
        port = sock.getsockname()[1]
        start = time.monotonic()
        r = _serve("--port", str(port))
        elapsed = time.monotonic() - start
    assert r.returncode != 0, r.stderr[-2000:]
    assert f":{port}" in r.stderr and "Traceback" not in r.stderr
    assert "rank" not in r.stderr.lower() and "loading" not in r.stderr.lower(), r.stderr[-2000:]
    assert elapsed < 60


@pytest.mark.parametrize("what", ["missing", "no_config"])
def test_a_wrong_model_path_is_one_line(tmp_path, what):
    path = tmp_path / "nowhere" if what == "missing" else tmp_path
    r = _serve("--model-path", str(path))
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    errors = [line for line in r.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and str(path) in errors[0], r.stderr
    assert len(r.stderr.strip().splitlines()) <= 2, r.stderr  # the error, and a short usage line
    assert ("does not exist" if what == "missing" else "config.json") in errors[0]


def test_a_bind_that_fails_after_loading_still_exits_non_zero():
    """Were the port taken between the check and the bind, uvicorn's exit is a failure too (not 'interrupted')."""
    code = ("import sys, moeserve.server.http.server as s; s.port_busy_reason = lambda host, port: None; "
            "from moeserve.cli import main; sys.exit(main(sys.argv[1:]))")
    with _listening() as sock:
        r = subprocess.run([sys.executable, "-c", code, "serve", "--port", str(sock.getsockname()[1])],
                           capture_output=True, text=True, timeout=300)
    assert r.returncode != 0, r.stderr[-2000:]
    assert "start-up failed" in r.stderr and "interrupted" not in r.stderr
