"""The processes of `moeserve bench pd`: moeserve servers and sglang-router, each in its own process group (so a
stop takes a server's ranks too), all stopped by the one Launcher that started them, also on failure."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moeserve.server.launch import free_port

STOP_GRACE_S = 30.0  # SIGTERM first (servers shut their ranks down), SIGKILL of the group after this


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    url: str
    log: Path

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


class Launcher:
    """Starts servers and routers with logs under `log_dir`; stop_all() ends every one still running."""

    def __init__(self, log_dir: Path, python: str = sys.executable) -> None:
        self.log_dir = log_dir
        self.python = python
        self.procs: list[Proc] = []
        log_dir.mkdir(parents=True, exist_ok=True)

    def _spawn(self, name: str, cmd: list[str], port: int) -> Proc:
        log = self.log_dir / f"{name}.log"
        with open(log, "w") as f:
            f.write(" ".join(cmd) + "\n")
            f.flush()
            popen = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        proc = Proc(name, popen, f"http://127.0.0.1:{port}", log)
        self.procs.append(proc)
        return proc

    def serve(self, name: str, flags: list[str]) -> Proc:
        """Start `moeserve serve FLAGS` on a free port (not waiting for it: see wait_healthy)."""
        port = free_port()
        return self._spawn(name, [self.python, "-m", "moeserve.cli", "serve", "--host", "127.0.0.1",
                                  "--port", str(port), *flags], port)

    def router(self, name: str, prefill: Proc, bootstrap_port: int, decode: Proc, startup_timeout_s: float,
               flags: list[str]) -> Proc:
        """sglang-router in PD mode in front of one prefill and one decode server."""
        port = free_port()
        return self._spawn(name, [self.python, "-m", "sglang_router.launch_router", "--pd-disaggregation",
                                      "--prefill", prefill.url, str(bootstrap_port), "--decode", decode.url,
                                      "--host", "127.0.0.1", "--port", str(port),
                                      "--worker-startup-timeout-secs", str(int(startup_timeout_s)), *flags], port)

    def wait_healthy(self, procs: list[Proc], timeout_s: float) -> None:
        """Until every server answers /health with 200; RuntimeError with its log's end if one exits or is late."""
        deadline = time.monotonic() + timeout_s
        waiting = list(procs)
        while waiting:
            for p in list(waiting):
                if p.popen.poll() is not None:
                    raise RuntimeError(f"{p.name} exited with {p.popen.returncode} during start-up ({p.log}):\n"
                                       f"{p.log_tail()}")
                try:
                    with urllib.request.urlopen(p.url + "/health", timeout=2) as resp:
                        if resp.status == 200:
                            waiting.remove(p)
                except OSError:
                    pass
            if waiting and time.monotonic() > deadline:
                raise RuntimeError(f"{waiting[0].name} was not healthy within {timeout_s:g} s ({waiting[0].log}):\n"
                                   f"{waiting[0].log_tail()}")
            if waiting:
                time.sleep(0.5)

    def check_alive(self) -> None:
        """RuntimeError naming the first process that has exited (a benchmark's failures then have a cause)."""
        for p in self.procs:
            if p.popen.poll() is not None:
                raise RuntimeError(f"{p.name} exited with {p.popen.returncode} ({p.log}):\n{p.log_tail()}")

    def stop_all(self) -> None:
        """SIGTERM every process group started here, then SIGKILL what is left after the grace period."""
        for p in self.procs:
            if p.popen.poll() is None:
                _signal_group(p.popen.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for p in self.procs:
            try:
                p.popen.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            _signal_group(p.popen.pid, signal.SIGKILL)  # the ranks too, if the server itself went first
            try:
                p.popen.wait(10)
            except subprocess.TimeoutExpired:
                pass
        self.procs.clear()


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def get_json(url: str, timeout_s: float = 30) -> Any:
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        return json.loads(resp.read())


def transfer_counters(url: str) -> dict[str, float]:
    """A PD server's cumulative KV transfer counters over its DP groups, from /get_server_info."""
    groups = [s["disagg"] for s in get_json(url + "/get_server_info")["internal_states"] if s.get("disagg")]
    return {k: sum(g[k] for g in groups)
            for k in ("transfers", "transfer_bytes", "transfer_seconds", "write_seconds", "failed")}
