"""Process helpers for tests that start servers: waiting for one to be healthy, the processes it spawned, whether
one still lives, and a clean SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path


def free_port_block(n: int) -> int:
    """A port p with p .. p + n - 1 free on 127.0.0.1 (checked, not reserved): a multi-node server's
    --dist-init-addr port, whose next ports its ZeroMQ sockets take."""
    import socket

    from moeserve.server.launch import free_port

    for _ in range(50):
        p = free_port()
        socks = []
        try:
            for i in range(n):
                s = socket.socket()
                s.bind(("127.0.0.1", p + i))
                socks.append(s)
            return p
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port block")


def descendants(pid: int) -> set[int]:
    """Every process below pid (children, grandchildren, ...), read from /proc."""
    found: set[int] = set()
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except FileNotFoundError:
            continue
        for t in tasks:
            try:
                children = Path(f"/proc/{p}/task/{t}/children").read_text().split()
            except FileNotFoundError:
                continue
            for c in map(int, children):
                if c not in found:
                    found.add(c)
                    todo.append(c)
    return found


def stop_process(proc: subprocess.Popen, timeout: float = 10) -> None:
    """SIGTERM, then SIGKILL after `timeout` seconds: a helper process (router, Mooncake master) never outlives its
    test."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=timeout)


def alive(pid: int) -> bool:
    """True while pid runs (a zombie counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def wait_healthy(proc: subprocess.Popen, url: str, log: Path, timeout: float) -> None:
    """Poll url/health until it answers 200; fail (killing the server) if it exits or does not come up in time."""
    import httpx
    import pytest

    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            pytest.fail(f"server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"server did not start:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)


def sigterm_leaves_nothing(proc: subprocess.Popen, workers: set[int], log: Path, timeout: float) -> None:
    """SIGTERM the server: it must exit 0 within timeout and leave none of `workers` alive (they are killed)."""
    import pytest

    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"server did not stop on SIGTERM:\n{log.read_text()[-3000:]}")
    deadline = time.monotonic() + 10
    while any(alive(p) for p in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    orphans = [p for p in workers if alive(p)]
    for p in orphans:
        os.kill(p, signal.SIGKILL)
    assert not orphans, f"processes left after SIGTERM: {orphans}"
    assert proc.returncode == 0, log.read_text()[-3000:]
