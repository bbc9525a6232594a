"""Real PD servers for tests: start a prefill or decode `moeserve serve` in its own process group (so kill -9
takes its ranks too), and post a request to both sides at once as sglang-router does."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx

from moeserve.server.launch import free_port
from tests.procs import wait_healthy

PD_FLAGS = ["--disaggregation-transfer-backend", "zmq", "--page-size", "4", "--chunked-prefill-size", "16",
            "--max-total-tokens", "4096", "--dtype", "float32"]


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    log: Path
    bootstrap_port: int | None

    def kill9(self) -> None:
        """SIGKILL the server and its ranks at once (no clean-up runs anywhere)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                pass
        self.kill9()


def start(mode: str, tmp: Path, *extra: str, timeout: float = 180, attempts: int = 3) -> Server:
    """A PD server of `mode`, healthy. free_port() only finds a port that is free now: a server that lost it to
    another process before binding (servers starting side by side) is started again on fresh ports."""
    for attempt in range(attempts):
        try:
            return _start(mode, tmp, *extra, timeout=timeout)
        except BaseException as e:
            if attempt + 1 == attempts or "address already in use" not in str(e):
                raise
    raise AssertionError("unreachable")


def start_all(tmp: Path, *sides: tuple[str, ...]) -> list[Server]:
    """Several PD servers at once, each side (mode, *flags), all healthy, in the order given. A start-up waits
    on process spawns and health polls as much as on the CPU, so side by side they take less than one after
    another. If one fails, the others are killed."""
    with ThreadPoolExecutor(len(sides)) as pool:
        futs = [pool.submit(start, mode, tmp, *flags) for mode, *flags in sides]
    errors = [f.exception() for f in futs if f.exception() is not None]
    if errors:
        for f in futs:
            if f.exception() is None:
                f.result().kill9()
        raise errors[0]
    return [f.result() for f in futs]


def _start(mode: str, tmp: Path, *extra: str, timeout: float) -> Server:
    port = free_port()
    boot = free_port() if mode == "prefill" else None
    cmd = [sys.executable, "-m", "moeserve.cli", "serve", "--port", str(port), "--disaggregation-mode", mode,
           *PD_FLAGS, *extra]
    if boot is not None:
        cmd += ["--disaggregation-bootstrap-port", str(boot)]
    log = tmp / f"{mode}-{port}.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    server = Server(proc, url, log, boot)
    try:
        wait_healthy(proc, url, log, timeout)
    except BaseException:
        server.kill9()
        raise
    return server


def pd_body(prefill: Server, body: dict, room: int | None = None) -> dict:
    return {**body, "bootstrap_host": "127.0.0.1", "bootstrap_port": prefill.bootstrap_port,
            "bootstrap_room": random.getrandbits(63) if room is None else room}


def pd_post(prefill: Server, decode: Server, path: str, body: dict, timeout: float = 120) -> tuple[httpx.Response,
                                                                                                   httpx.Response]:
    """POST the same body (with the bootstrap fields) to both sides at once; (prefill's, decode's) responses."""
    body = pd_body(prefill, body)
    with ThreadPoolExecutor(2) as pool:
        fp = pool.submit(_post, prefill.url + path, body, timeout)
        fd = pool.submit(_post, decode.url + path, body, timeout)
        return fp.result(), fd.result()


def _post(url: str, body: dict, timeout: float) -> httpx.Response:
    try:
        return httpx.post(url, json=body, timeout=timeout)
    except httpx.HTTPError as e:  # the side was killed: an answer of its own kind
        return httpx.Response(599, text=f"{type(e).__name__}: {e}")


def sse_events(resp: httpx.Response) -> list[dict]:
    """The JSON events of an SSE body (without [DONE])."""
    out = []
    for line in resp.text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[6:]))
    return out
