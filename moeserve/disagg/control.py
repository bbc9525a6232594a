"""ControlChannel: one rank's ZeroMQ endpoint for the control messages of PD disaggregation (messages.py).

Each rank binds one PULL socket; it sends through one PUSH socket per peer address, never blocking: a message to a
peer that is gone is dropped once its queue is full (the heartbeat notices the peer, not the sender).
"""

from __future__ import annotations

import logging
import socket
from typing import Any

import zmq

from moeserve.disagg.messages import BadMessage, ReplayGuard, decode, encode

logger = logging.getLogger(__name__)

SEND_HWM = 10_000  # messages queued per peer before new ones are dropped


def advertised_host(bind_host: str, peer_host: str | None = None) -> str:
    """The address peers reach this machine at: the bind host, or for a wildcard bind the interface that routes
    to peer_host (no packet is sent). With no peer known (one node: the other server of the pair may be on another
    machine) a wildcard bind advertises the interface of the default route, so a decode server elsewhere can reach
    it; only a machine without any route gets the loopback address."""
    if bind_host not in ("0.0.0.0", "::", ""):
        return bind_host
    if peer_host in ("localhost", "127.0.0.1"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((peer_host or "10.255.255.255", 9))  # a UDP connect picks the route and sends nothing
            return s.getsockname()[0]
        except OSError:
            pass
    try:
        found = socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"
    return "127.0.0.1" if found.startswith("127.") else found


class ControlChannel:
    """A bound PULL socket (`addr`) and PUSH sockets to peers; messages are dicts (messages.py)."""

    def __init__(self, bind_host: str, advertise_host: str, api_key: str | None):
        self.api_key = api_key
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.PULL)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port(f"tcp://{bind_host}")
        self.addr = f"tcp://{advertise_host}:{port}"
        self._peers: dict[str, zmq.Socket] = {}
        self.replays = ReplayGuard() if api_key is not None else None  # unsigned messages prove nothing anyway

    def send(self, addr: str, msg: dict[str, Any]) -> bool:
        """Queue msg for the peer at addr; False when its queue is full (the peer does not read)."""
        sock = self._peers.get(addr)
        if sock is None:
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, SEND_HWM)
            sock.connect(addr)
            self._peers[addr] = sock
        try:
            sock.send_multipart(encode(msg, self.api_key), flags=zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False

    def recv_all(self) -> list[dict[str, Any]]:
        """Every message waiting now (none blocks); malformed, unsigned, stale or replayed ones are logged and
        dropped."""
        out = []
        while True:
            try:
                frames = self.sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return out
            try:
                msg = decode(frames, self.api_key)
                if self.replays is not None:
                    self.replays.check(msg)
                out.append(msg)
            except BadMessage as e:
                logger.warning("dropped a PD control message: %s", e)

    def forget(self, addr: str) -> None:
        """Close the socket to a peer declared dead (a restarted peer gets a fresh one)."""
        sock = self._peers.pop(addr, None)
        if sock is not None:
            sock.close(linger=0)

    def close(self) -> None:
        for s in self._peers.values():
            s.close(linger=0)
        self._peers.clear()
        self.sock.close(linger=0)
