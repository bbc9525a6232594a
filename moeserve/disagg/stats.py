"""Counters of one side's PD requests, carried in LoadOut to /metrics and /get_server_info."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class TransferStats:
    """Requests per state now, and cumulative KV transfers: bytes, seconds from start to acknowledgement (a
    request's latency, queueing included), and (prefill) seconds spent inside the backend's writes (the sum over
    writes, which may overlap: bytes / write_seconds is the rate one write moves at)."""

    mode: str
    state_names: tuple[str, ...]
    states: dict[str, int] = field(default_factory=dict)
    transfers: int = 0
    transfer_bytes: int = 0
    transfer_seconds: float = 0.0
    write_seconds: float = 0.0
    failed: int = 0
    failures: dict[str, int] = field(default_factory=dict)  # cause -> requests failed or cancelled

    def on_failure(self, cause: str) -> None:
        self.failed += 1
        self.failures[cause] = self.failures.get(cause, 0) + 1

    def on_transfer(self, nbytes: int, seconds: float) -> None:
        self.transfers += 1
        self.transfer_bytes += nbytes
        self.transfer_seconds += seconds

    def to_json(self) -> dict[str, Any]:
        return {"mode": self.mode, "states": {s: self.states.get(s, 0) for s in self.state_names},
                "transfers": self.transfers, "transfer_bytes": self.transfer_bytes,
                "transfer_seconds": round(self.transfer_seconds, 6), "write_seconds": round(self.write_seconds, 6),
                "failed": self.failed, "failures": dict(self.failures)}
