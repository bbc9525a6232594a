"""The control messages between a decode rank and a prefill rank, as signed JSON over ZeroMQ.

JSON, not pickle: these sockets listen on the network, and unpickling a stranger's bytes runs their code. With
--api-key every message carries an HMAC-SHA256 of its body under the key, so a stranger can neither tell a prefill
rank where to write KV pages nor tell a decode rank that a transfer is done.

decode -> prefill: `dest` (write the prompt's KV into these pages, then report), `cancel` (stop; acknowledge).
prefill -> decode: `done` (every page written; the first token, its logprobs, cached_tokens), `failed` (the
transfer stopped: an error, a cancellation or an abort; every write this rank started for the room has returned).
Both ways, between the ranks' heartbeat threads (liveness.py): `ping`, answered by `pong`.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import Any

KINDS = ("dest", "cancel", "ping", "done", "failed", "pong")


class BadMessage(ValueError):
    """A message that is not JSON, not signed with the shared key, or of an unknown kind."""


def encode(msg: dict[str, Any], key: str | None) -> list[bytes]:
    """[mac, body] frames of one message; mac is empty without a key."""
    assert msg.get("kind") in KINDS, msg
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
