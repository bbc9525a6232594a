"""Heartbeats between the two sides: which peers have been silent too long.

A side pings every peer it has live requests with every `interval_s`; any message from a peer counts as a sign of
life. A peer silent for `dead_after_s` is declared dead and its requests fail (decode) or are dropped (prefill).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class _Peer:
    last_heard: float
    last_ping: float = 0.0


class Liveness:
    """Peers by control address, each with the time it was last heard from and last pinged."""

    def __init__(self, interval_s: float, dead_after_s: float):
        self.interval_s = interval_s
        self.dead_after_s = dead_after_s
        self.peers: dict[str, _Peer] = {}

    def heard(self, addr: str, now: float) -> None:
        peer = self.peers.get(addr)
        if peer is None:
            self.peers[addr] = _Peer(now)
        else:
            peer.last_heard = now

    def watch(self, addrs: set[str], now: float) -> tuple[list[str], list[str]]:
        """Track exactly `addrs` (the peers with live requests); returns (peers to ping now, peers now dead).
        A newly watched peer gets a full dead_after_s from now."""
        for addr in list(self.peers):
            if addr not in addrs:
                del self.peers[addr]
        ping, dead = [], []
        for addr in addrs:
            peer = self.peers.setdefault(addr, _Peer(now))
            if now - peer.last_heard > self.dead_after_s:
                dead.append(addr)
                del self.peers[addr]
            elif now - peer.last_ping >= self.interval_s:
                peer.last_ping = now
                ping.append(addr)
        return ping, dead
