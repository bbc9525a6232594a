"""The control messages between a decode rank and a prefill rank, as signed JSON over ZeroMQ.

JSON, not pickle: these sockets listen on the network, and unpickling a stranger's bytes runs their code. With
--api-key every message carries an HMAC-SHA256 of its body under the key, so a stranger can neither tell a prefill
rank where to write KV pages nor tell a decode rank that a transfer is done. The signed body holds a send time and
a nonce: a receiver drops a message older than MAX_AGE_S or one it has seen (ReplayGuard), so a captured message
cannot be replayed.

decode -> prefill: `wait` (the room waits in decode's queue: time it by decode's heartbeat), `dest` (write the prompt's KV into these pages, then report), `cancel` (stop; acknowledge).
prefill -> decode: `started` (the first write is under way: decode's transfer deadline runs from here), `done` (every page written; the sampled tokens, their logprobs, cached_tokens; with speculative decoding the hidden state the first draft reads, `pack_tensor`), `failed` (the
transfer stopped: an error, a cancellation or an abort; every write this rank started for the room has returned).
Both ways, between the ranks' heartbeat threads (liveness.py): `ping`, answered by `pong`.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
import time
from typing import Any

import torch

KINDS = ("wait", "dest", "cancel", "ping", "started", "done", "failed", "pong")
MAX_AGE_S = 60.0  # a signed message older than this (or this far ahead: clock skew) is dropped


class BadMessage(ValueError):
    """A message that is not JSON, not signed with the shared key, or of an unknown kind."""


def encode(msg: dict[str, Any], key: str | None) -> list[bytes]:
    """[mac, body] frames of one message; mac is empty without a key."""
    assert msg.get("kind") in KINDS, msg
    msg = {**msg, "ts": time.time(), "nonce": secrets.token_hex(8)}
    body = json.dumps(msg, separators=(",", ":")).encode()
    return [sign(body, key), body]


def decode(frames: list[bytes], key: str | None) -> dict[str, Any]:
    """The message of [mac, body] frames; BadMessage when it is malformed or its signature does not match."""
    if len(frames) != 2:
        raise BadMessage(f"expected 2 frames, got {len(frames)}")
    mac, body = frames
    if key is not None and not hmac.compare_digest(mac, sign(body, key)):
        raise BadMessage("bad signature (the peer runs without --api-key or with another key)")
    try:
        msg = json.loads(body)
    except ValueError as e:
        raise BadMessage(f"not JSON: {e}") from None
    if not isinstance(msg, dict) or msg.get("kind") not in KINDS:
        raise BadMessage(f"unknown message {str(msg)[:80]!r}")
    return msg


def sign(body: bytes, key: str | None) -> bytes:
    if key is None:
        return b""
    return hmac.new(key.encode(), body, hashlib.sha256).hexdigest().encode()


class ReplayGuard:
    """A receiver's memory of the nonces of the last MAX_AGE_S: a repeated or stale signed message is refused."""

    def __init__(self) -> None:
        self.seen: dict[str, float] = {}  # nonce -> send time

    def check(self, msg: dict[str, Any]) -> None:
        now = time.time()
        ts, nonce = msg.get("ts"), msg.get("nonce")
        if not isinstance(ts, (int, float)) or not isinstance(nonce, str) or abs(now - ts) > MAX_AGE_S:
            raise BadMessage(f"stale or undated message (sent at {ts}; the clocks must agree within {MAX_AGE_S:g} s)")
        if nonce in self.seen:
            raise BadMessage("a replayed message (its nonce was seen already)")
        if len(self.seen) > 1000:  # forget the nonces that have aged out
            self.seen = {n: t for n, t in self.seen.items() if now - t <= MAX_AGE_S}
        self.seen[nonce] = ts


def pack_tensor(t: torch.Tensor) -> dict[str, Any]:
    """A small tensor as JSON: its raw bytes in base64 (bf16 has no JSON or numpy form), shape and dtype."""
    t = t.detach().contiguous().cpu()
    raw = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return {"b64": base64.b64encode(raw).decode(), "shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}


def unpack_tensor(packed: dict[str, Any]) -> torch.Tensor:
    """`pack_tensor`'s tensor, on the CPU; BadMessage when the fields do not describe one."""
    try:
        dtype = getattr(torch, packed["dtype"])
        if not isinstance(dtype, torch.dtype):
            raise TypeError(packed["dtype"])
        raw = bytearray(base64.b64decode(packed["b64"], validate=True))
        shape = [int(n) for n in packed["shape"]]
        flat = torch.frombuffer(raw, dtype=dtype) if raw else torch.empty(0, dtype=dtype)
        return flat.view(shape)
    except (KeyError, TypeError, ValueError, AttributeError, RuntimeError) as e:
        raise BadMessage(f"not a packed tensor: {e}") from None
