"""Heartbeats between the two sides, on a thread of each rank: which peers have gone silent.

Each PD rank runs one Heartbeat with its own socket (its address travels in the registration and in `dest`).
Every `interval_s` it pings the peers the rank has live requests with, and it answers every ping with a pong at
once, so a peer is heard from even while its scheduler runs a long step; any message counts as a sign of life.
A watched peer silent for `dead_after_s` is reported dead once; the rank then fails (decode) or drops (prefill)
its requests with that peer. A kill -9 stops the thread with the process, so silence means the process is gone
(or cut off), not that it is busy.
"""

from __future__ import annotations

import threading
import time

from moeserve.disagg.control import ControlChannel


class Heartbeat:
    """Pings watched peers and answers pings, on its own thread; `watch` says which peers died."""

    def __init__(self, bind_host: str, advertise_host: str, api_key: str | None, interval_s: float,
                 dead_after_s: float):
        self.interval_s = interval_s
        self.dead_after_s = dead_after_s
        self.channel = ControlChannel(bind_host, advertise_host, api_key)
        self.addr = self.channel.addr
        self._watched: set[str] = set()
        self._heard: dict[str, float] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="pd-heartbeat", daemon=True)
        self._thread.start()

    def watch(self, addrs: set[str]) -> list[str]:
        """Watch exactly `addrs` from now on (a new one gets a full dead_after_s); returns the watched peers that
        are dead, each once (they are no longer watched)."""
        now = time.monotonic()
        with self._lock:
            for a in addrs - self._watched:
                self._heard[a] = now
            for a in self._watched - addrs:
                self._heard.pop(a, None)
            dead = [a for a in addrs if now - self._heard[a] > self.dead_after_s]
            for a in dead:
                del self._heard[a]
            self._watched = set(addrs) - set(dead)
        return dead

    def _run(self) -> None:
        last_ping = 0.0
        while not self._closed:
            if self.channel.sock.poll(min(50, int(self.interval_s * 1000))):
                for msg in self.channel.recv_all():
                    sender = msg.get("from")
                    if not isinstance(sender, str):
                        continue
                    with self._lock:
                        if sender in self._heard:
                            self._heard[sender] = time.monotonic()
                    if msg["kind"] == "ping":
                        self.channel.send(sender, {"kind": "pong", "from": self.addr})
            now = time.monotonic()
            if now - last_ping >= self.interval_s:
                last_ping = now
                with self._lock:
                    peers = list(self._watched)
                for a in peers:
                    self.channel.send(a, {"kind": "ping", "from": self.addr})
        self.channel.close()

    def close(self) -> None:
        self._closed = True
        self._thread.join(1.0)
