"""Helpers of the reliability suite: real `moeserve serve` processes on the embedded model, loopback clients, and
the figures the suite reports (docs/reliability.md quotes them).

Every server listens on 127.0.0.1 only; every load is bounded in count and time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from moeserve.server.launch import free_port
from tests.procs import alive, descendants, wait_healthy

FIGURES: dict[str, object] = {}


def record(name: str, value: object) -> None:
    """One figure of the suite: printed (pytest -s shows it) and, with MOESERVE_RELIABILITY_FIGURES=FILE, kept
    in FILE as JSON."""
    FIGURES[name] = value
    print(f"RELIABILITY {name} = {value}", flush=True)
    out = os.environ.get("MOESERVE_RELIABILITY_FIGURES")
    if out:
        path = Path(out)
        figures = json.loads(path.read_text()) if path.exists() else {}
        figures[name] = value
        path.write_text(json.dumps(figures, indent=2, sort_keys=True) + "\n")


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    log: Path
    workers: set[int] = field(default_factory=set)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_exit(self, timeout: float) -> int | None:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self) -> None:
        """Whatever state it is in: SIGKILL the server and its workers (the tests' own processes only)."""
        for pid in [self.proc.pid, *self.workers]:
            if alive(pid):
                try:
                    os.kill(pid, 9)
                except ProcessLookupError:
                    pass
        self.proc.wait(timeout=10)


def start_server(tmp_path: Path, *args: str, new_session: bool = False, timeout: float = 180) -> Server:
    """`moeserve serve` on the embedded model with `args`, healthy, its rank processes known."""
    from moeserve.models.default_model import default_model_path

    default_model_path()  # built before the server starts, so the timeout is for serving
    port = free_port()
    log = tmp_path / f"server-{port}.log"
    cmd = [sys.executable, "-m", "moeserve.cli", "serve", "--host", "127.0.0.1", "--port", str(port), *args]
    with open(log, "w") as log_file:
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=new_session)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(proc, url, log, timeout)
    return Server(proc, url, log, rank_pids(proc.pid))


def rank_pids(server_pid: int) -> set[int]:
    """The server's rank processes (multiprocessing's spawned children), not its resource tracker."""
    ranks = set()
    for pid in descendants(server_pid):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except FileNotFoundError:
            continue
        if b"spawn_main" in cmdline:
            ranks.add(pid)
    return ranks


def wait_gone(pids: set[int], timeout: float) -> set[int]:
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return {p for p in pids if alive(p)}
