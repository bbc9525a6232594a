"""The built-in KV transfer backend over ZeroMQ (TCP), for machines where Mooncake cannot be installed.

A write is one multipart message to the decode rank's receiver: a signed JSON header (message id, window, runs)
and one frame per run and buffer holding that run's bytes, sent without copying from prefill's pool. The
receiver thread checks that every destination page lies in the window decode opened for the request, copies the
frames into its buffers and acknowledges; write() returns after the acknowledgement. A write that timed out may
still be in flight: once decode closed the window, the receiver drops it, so it never lands in pages another
request owns.
"""

from __future__ import annotations

import json
import logging
import threading
import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import zmq

from moeserve.disagg.messages import sign
from moeserve.disagg.transfer.base import PageRun, TransferBackend, TransferError
from moeserve.disagg.transfer.staging import HostStaging

logger = logging.getLogger(__name__)


def _flat_bytes(buf: torch.Tensor) -> torch.Tensor:
    """[num_slots * row_bytes] uint8 view of a contiguous buffer."""
    return buf.view(-1).view(torch.uint8)


class ZmqBackend(TransferBackend):
    """Sender and receiver in one object: prefill calls write(); decode publishes endpoint() and receives."""

    name = "zmq"
    refuses_late_writes = True

    def __init__(self, buffers: Sequence[torch.Tensor], page_size: int, host: str = "127.0.0.1",
                 api_key: str | None = None, ib_device: str | None = None):
        super().__init__(buffers, page_size)
        if ib_device:
            raise ValueError("--disaggregation-ib-device selects an RDMA device for mooncake; the zmq backend uses "
                             "TCP: leave it out")
        self.host = host
        self.api_key = api_key
        self.ctx = zmq.Context()
        self._flat = [_flat_bytes(b) for b in self.buffers]
        self._windows: dict[str, set[int]] = {}
        self._lock = threading.Lock()  # the windows, against the receiver's copies
        self._local = threading.local()  # each sending thread's sockets, by peer address
        self._senders: list[zmq.Socket] = []
        self._closed = False
        self._receiver: threading.Thread | None = None
        self._addr: str | None = None
        self._device = self.buffers[0].device if self.buffers and self.buffers[0].is_cuda else None
        self._recv_staging: HostStaging | None = None  # the receiver thread's (GPU pools)

    # ------------------------------------------------------------------ decode side
    def endpoint(self) -> dict[str, Any]:
        if self._addr is None:
            sock = self.ctx.socket(zmq.ROUTER)
            sock.setsockopt(zmq.LINGER, 0)
            port = sock.bind_to_random_port("tcp://*" if self.host not in ("127.0.0.1", "localhost")
                                            else f"tcp://{self.host}")
            self._addr = f"tcp://{self.host}:{port}"
            self._receiver = threading.Thread(target=self._receive_loop, args=(sock,), name="pd-zmq-recv",
                                              daemon=True)
            self._receiver.start()
        return {"backend": self.name, "addr": self._addr, "page_bytes": self.page_bytes}

    def open_window(self, window: str, pages: Sequence[int]) -> None:
        with self._lock:
            self._windows[window] = set(pages)

    def close_window(self, window: str) -> None:
        with self._lock:  # the receiver copies under this lock: after it, no copy of this window runs or starts
            self._windows.pop(window, None)

    def _receive_loop(self, sock: zmq.Socket) -> None:
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        while not self._closed:
            if not poller.poll(100):
                continue
            try:
                ident, mac, header, *frames = sock.recv_multipart(copy=False)
            except ValueError:
                continue  # too few frames: not ours
            except zmq.ZMQError:
                return
            msg_id, reply = self._apply(mac.bytes, header.bytes, frames)
            try:
                sock.send_multipart([ident.bytes, msg_id, reply])
            except zmq.ZMQError:
                return
        sock.close(linger=0)

    def _apply(self, mac: bytes, header: bytes, frames: list[zmq.Frame]) -> tuple[bytes, bytes]:
        """Check and copy one write; (message id, b"ok" or the error)."""
        if self.api_key is not None and mac != sign(header, self.api_key):
            return b"", b"bad signature"
        try:
            h = json.loads(header)
            msg_id, window = h["id"].encode(), h["window"]
            runs = [PageRun(*r) for r in h["runs"]]
        except (ValueError, KeyError, TypeError) as e:
            return b"", f"bad header: {e}".encode()
        nbuf = len(self._flat)
        if len(frames) != len(runs) * nbuf:
            return msg_id, f"expected {len(runs) * nbuf} frames, got {len(frames)}".encode()
        with self._lock:
            allowed = self._windows.get(window)
            if allowed is None:
                return msg_id, b"window closed (the request was freed or cancelled)"
            if any(not allowed.issuperset(range(r.dst_page, r.dst_page + r.num_pages)) for r in runs):
                return msg_id, b"destination pages outside the request's window"
            pairs = []
            for i, r in enumerate(runs):
                for b in range(nbuf):
                    pb = self.page_bytes[b]
                    src = np.frombuffer(frames[i * nbuf + b].buffer, dtype=np.uint8)
                    if src.size != r.num_pages * pb:
                        return msg_id, b"frame size does not match the run"
                    pairs.append((self._flat[b][r.dst_page * pb : (r.dst_page + r.num_pages) * pb], src))
            if self._device is None:
                for dst, src in pairs:
                    dst.numpy()[:] = src
            else:
                if self._recv_staging is None:
                    self._recv_staging = HostStaging(self._device)
                self._recv_staging.to_device(pairs)
        return msg_id, b"ok"

    # ------------------------------------------------------------------ prefill side
    def write(self, peer: dict[str, Any], runs: Sequence[PageRun], timeout_s: float) -> int:
        if not runs:
            return 0
        addr = peer["addr"]
        sock = self._sender(addr)
        msg_id = uuid.uuid4().hex
        header = json.dumps({"id": msg_id, "window": peer["window"],
                             "runs": [[r.src_page, r.dst_page, r.num_pages] for r in runs]}).encode()
        frames: list[Any] = [sign(header, self.api_key), header]
        parts = [flat[r.src_page * pb : (r.src_page + r.num_pages) * pb]
                 for r in runs for flat, pb in zip(self._flat, self.page_bytes, strict=True)]
        nbytes = sum(p.numel() for p in parts)
        if self._device is None:
            frames += [p.numpy() for p in parts]
        else:  # this thread's pinned buffer: reused only after the acknowledgement, when zmq has sent it all
            staging = getattr(self._local, "staging", None)
            if staging is None:
                staging = self._local.staging = HostStaging(self._device)
            frames += staging.to_host(parts)
        sock.send_multipart(frames, copy=False)
        if not sock.poll(int(timeout_s * 1000)):
            self._drop_sender(addr)  # whatever is still queued goes; the window guards decode's pages
            raise TransferError(f"no acknowledgement from {addr} within {timeout_s:g} s")
        while True:
            got_id, reply = sock.recv_multipart()
            if got_id == msg_id.encode():
                break
            if not sock.poll(int(timeout_s * 1000)):  # an earlier write's late answer: wait for ours
                self._drop_sender(addr)
                raise TransferError(f"no acknowledgement from {addr} within {timeout_s:g} s")
        if reply != b"ok":
            raise TransferError(f"the decode rank refused the write: {reply.decode(errors='replace')}")
        return nbytes

    def _sender(self, addr: str) -> zmq.Socket:
        socks = self._local.__dict__.setdefault("socks", {})
        sock = socks.get(addr)
        if sock is None:
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(addr)
            socks[addr] = sock
            with self._lock:
                self._senders.append(sock)
        return sock

    def _drop_sender(self, addr: str) -> None:
        sock = self._local.__dict__.get("socks", {}).pop(addr, None)
        if sock is not None:
            with self._lock:
                if sock in self._senders:
                    self._senders.remove(sock)
            sock.close(linger=0)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._receiver is not None:
            self._receiver.join(1.0)
        with self._lock:
            for s in self._senders:
                s.close(linger=0)
            self._senders.clear()
        if self._receiver is None or not self._receiver.is_alive():
            self.ctx.term()
