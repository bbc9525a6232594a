"""KV transfer over Mooncake's Transfer Engine: one-sided writes into the peer's registered KV buffers.

Each side starts one engine with P2P handshake (no metadata server: a peer's engine is reached by its session
name `host:rpc_port`), over RDMA when `--disaggregation-ib-device` names a device, else TCP, and registers its
KV buffers. `endpoint()` publishes the session name and each buffer's base address and size; `write()` turns page
runs into (local address, peer address, length) triples for every buffer and moves them with one
`batch_transfer_sync_write` call (per 4,096 ranges or 256 MiB: BATCH_RANGES, BATCH_BYTES), which returns only
once every byte is in the peer's memory or the engine gave up.

Mooncake reports failures by return code, never by exception (a write to a dead peer returns -1 at once): every
code is checked. Its sync calls release the GIL and may run from several threads at once.
"""

from __future__ import annotations

import importlib.metadata
import logging
import math
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from moeserve.disagg.transfer.base import PageRun, TransferBackend, TransferError

logger = logging.getLogger(__name__)

INSTALL_HINT = (
    "install Mooncake's Transfer Engine: `pip install mooncake-transfer-engine` on CUDA machines or "
    "`pip install mooncake-transfer-engine-non-cuda` elsewhere, and the system libraries it loads (Debian/Ubuntu: "
    "`apt-get install libibverbs1 librdmacm1 liburing2 libnuma1 libcurl4`; `make install` does both as root); "
    "or start both servers with --disaggregation-transfer-backend zmq"
)

try:
    from mooncake.engine import TransferEngine
except ImportError as e:  # the package, or a system library it links against (libibverbs.so.1, ...)
    raise ImportError(f"the mooncake KV transfer backend cannot load ({e}): {INSTALL_HINT}") from e

# Mooncake's sync calls give up after MC_TRANSFER_TIMEOUT seconds (at least 5; read when an engine is created)
# plus one second per GiB. The default here is Mooncake's floor, not its 30 s: a stalled peer fails fast.
MIN_ENGINE_TIMEOUT_S = 5
# Mooncake's TCP transport queues at most 1,024 ranges per peer (plus 1,024 waiting up to 1 s for room) and
# rejects the rest with -1: a 61-layer write of 60 runs is already 3,660 ranges. The engine is created with room
# for 65,535 (Mooncake's ceiling) and a write goes in calls of at most BATCH_RANGES ranges, so that several
# threads writing to one peer at once stay within it. A call also holds at most BATCH_BYTES: the engine's timeout
# is per call and counts on 1 GiB/s, which a fragmented write over loopback TCP need not reach, so small calls keep
# a healthy write inside it (and timeout_s is checked between calls).
TCP_QUEUE_ENV = {"MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "65535", "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER": "65535"}
BATCH_RANGES = 4096
BATCH_BYTES = 256 << 20
_ENV_LOCK = threading.Lock()  # Mooncake reads these process-wide settings only when an engine is created


def _cuda_build() -> bool:
    """Whether the installed Mooncake is the CUDA build (the only one that reads GPU memory)."""
    try:
        importlib.metadata.distribution("mooncake-transfer-engine")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def _check_ib_devices(ib_device: str) -> None:
    root = "/sys/class/infiniband"
    present = sorted(os.listdir(root)) if os.path.isdir(root) else []
    missing = [d for d in ib_device.split(",") if d.strip() and d.strip() not in present]
    if missing:
        raise ValueError(f"--disaggregation-ib-device {ib_device}: no RDMA device {', '.join(missing)} on this "
                         f"machine (present: {', '.join(present) or 'none'}); leave the flag out to use TCP")


class MooncakeBackend(TransferBackend):
    """Both sides of Mooncake transfers over this rank's KV buffers (CPU or CUDA memory).

    host: the address peers reach this rank at (the engine's session name is host:rpc_port). api_key: accepted
    because every backend is built alike; Mooncake's data plane has no authentication of its own, the signed
    control messages are what decide whether this side writes anything. ib_device: comma-separated RDMA devices
    (RDMA transport); None: TCP. engine_timeout_s: how long one write may stall before the engine gives up
    (Mooncake's floor is 5 s; MC_TRANSFER_TIMEOUT in the environment wins when set).
    """

    name = "mooncake"

    def __init__(self, buffers: Sequence[torch.Tensor], page_size: int, host: str = "127.0.0.1",
                 api_key: str | None = None, ib_device: str | None = None,
                 engine_timeout_s: float = MIN_ENGINE_TIMEOUT_S):
        super().__init__(buffers, page_size)
        if ib_device:
            _check_ib_devices(ib_device)
        if any(b.is_cuda for b in self.buffers) and not _cuda_build():
            raise ValueError("the KV pool is in GPU memory but the installed Mooncake is the CPU build "
                             "(mooncake-transfer-engine-non-cuda): `pip install mooncake-transfer-engine` instead")
        self.protocol = "rdma" if ib_device else "tcp"
        self.host = host
        self._closed = False
        self._in_flight = 0  # writes inside the engine, which close() waits for
        self._state = threading.Condition()
        self._engine = self._start_engine(host, ib_device or "", engine_timeout_s)
        self.session = f"{host}:{self._engine.get_rpc_port()}"
        self.addrs = [b.data_ptr() for b in self.buffers]
        self.buffer_bytes = [b.numel() * b.element_size() for b in self.buffers]
        self.num_pages = [n // pb if pb else 0 for n, pb in zip(self.buffer_bytes, self.page_bytes, strict=True)]
        self._register()
        logger.info("mooncake transfer engine at %s over %s: %d KV buffers, %.1f MiB registered", self.session,
                    self.protocol, len(self.buffers), sum(self.buffer_bytes) / 2**20)

    def _start_engine(self, host: str, ib_device: str, engine_timeout_s: float) -> Any:
        # Settings already in the environment (an operator's) win over these defaults.
        settings = {"MC_TRANSFER_TIMEOUT": str(max(MIN_ENGINE_TIMEOUT_S, math.ceil(engine_timeout_s))),
                    **TCP_QUEUE_ENV}
        self.engine_timeout_s = float(os.environ.get("MC_TRANSFER_TIMEOUT", settings["MC_TRANSFER_TIMEOUT"]))
        with _ENV_LOCK:
            added = [k for k in settings if k not in os.environ]
            os.environ.update({k: settings[k] for k in added})
            try:
                engine = TransferEngine()
                rc = engine.initialize(host, "P2PHANDSHAKE", self.protocol, ib_device)  # creates the transports
            finally:
                for k in added:
                    del os.environ[k]
        if rc != 0:
            raise RuntimeError(f"Mooncake's transfer engine did not start on {host} over {self.protocol} "
                               f"(initialize returned {rc}; its log above says why)")
        return engine

    def _register(self) -> None:
        done = []
        for i, (addr, size) in enumerate(zip(self.addrs, self.buffer_bytes, strict=True)):
            if size == 0:
                continue
            rc = self._engine.register_memory(addr, size)
            if rc != 0:
                for a in done:
                    self._engine.unregister_memory(a)
                raise RuntimeError(f"Mooncake could not register KV buffer {i} ({size} bytes at {addr:#x}): "
                                   f"register_memory returned {rc}")
            done.append(addr)
        self._registered = done

    # ------------------------------------------------------------------
    def endpoint(self) -> dict[str, Any]:
        return {"backend": self.name, "session": self.session, "protocol": self.protocol, "addrs": self.addrs,
                "buffer_bytes": self.buffer_bytes, "page_bytes": self.page_bytes}

    def check_peer(self, peer: dict[str, Any]) -> None:
        if peer.get("backend") != self.name:
            raise ValueError(f"the peer uses the {peer.get('backend')!r} KV transfer backend, this side mooncake: "
                             "give both servers the same --disaggregation-transfer-backend")
        if peer.get("protocol") != self.protocol:
            raise ValueError(f"the peer's Mooncake runs over {peer.get('protocol')}, this side's over "
                             f"{self.protocol}: give both sides --disaggregation-ib-device, or neither")
        super().check_peer(peer)
        if len(peer.get("addrs", [])) != len(self.buffers) or len(peer.get("buffer_bytes", [])) != len(self.buffers):
            raise ValueError("the peer's Mooncake endpoint lists another number of KV buffers than its page_bytes")

    def write(self, peer: dict[str, Any], runs: Sequence[PageRun], timeout_s: float) -> int:
        """One batch write of every run in every buffer (see TransferBackend.write).

        The call returns only when the engine is done with the batch (bytes landed, or it gave up): abandoning it
        earlier could let bytes land after the caller freed the pages. So the bound is the engine's timeout plus
        one second per GiB for each engine call; timeout_s is checked between calls, and a write that failed after
        more than timeout_s is reported as timed out.
        """
        runs = _merge(runs)
        if not runs:
            return 0
        src, dst, lengths = self._triples(peer, runs)
        session = peer["session"]
        with self._state:
            if self._closed:
                raise TransferError("the mooncake backend is closed")
            self._in_flight += 1
        try:
            start = time.monotonic()
            rc, elapsed = 0, 0.0
            for i, j in _calls(lengths):
                if elapsed > timeout_s:  # the calls before this one are complete: stopping here is safe
                    rc = -2
                    break
                rc = self._engine.batch_transfer_sync_write(session, src[i:j], dst[i:j], lengths[i:j])
                elapsed = time.monotonic() - start
                if rc != 0:
                    break
        finally:
            with self._state:
                self._in_flight -= 1
                self._state.notify_all()
        if rc != 0:
            if elapsed >= timeout_s:
                why = f"timed out after {elapsed:.1f} s (limit {timeout_s:.1f} s)"
            elif elapsed >= self.engine_timeout_s:
                why = (f"failed after {elapsed:.1f} s: the engine's own transfer timeout fired (MC_TRANSFER_TIMEOUT "
                       f"{self.engine_timeout_s:g} s; many small page runs are slow over TCP)")
            else:
                why = f"failed after {elapsed:.2f} s: the peer is unreachable, died, or refused the write"
            raise TransferError(f"mooncake write of {sum(lengths)} bytes ({len(runs)} page runs x "
                                f"{len(self.buffers)} buffers) to {session} {why} "
                                f"(batch_transfer_sync_write returned {rc})")
        return int(sum(lengths))

    def _triples(self, peer: dict[str, Any], runs: list[PageRun]) -> tuple[list[int], list[int], list[int]]:
        """(local addresses, peer addresses, lengths) of every run in every buffer, buffer-major."""
        src_page = np.array([r.src_page for r in runs], dtype=np.int64)  # [R]
        dst_page = np.array([r.dst_page for r in runs], dtype=np.int64)
        count = np.array([r.num_pages for r in runs], dtype=np.int64)
        pb = np.array(self.page_bytes, dtype=np.int64)[:, None]  # [B, 1]
        peer_bytes = np.array(peer["buffer_bytes"], dtype=np.int64)[:, None]
        if (src_page < 0).any() or (dst_page < 0).any() or (count < 1).any():
            raise TransferError(f"invalid page runs {runs[:4]}...: pages and counts must be >= 0 and >= 1")
        if ((src_page + count)[None, :] * pb > np.array(self.buffer_bytes, dtype=np.int64)[:, None]).any():
            raise TransferError(f"a source page run ends past this side's KV pool ({self.num_pages[0]} pages)")
        if ((dst_page + count)[None, :] * pb > peer_bytes).any():
            raise TransferError("a destination page run ends past the peer's KV pool")
        src = np.array(self.addrs, dtype=np.int64)[:, None] + src_page[None, :] * pb  # [B, R]
        dst = np.array(peer["addrs"], dtype=np.int64)[:, None] + dst_page[None, :] * pb
        lengths = np.broadcast_to(count[None, :] * pb, src.shape)
        keep = lengths.reshape(-1) > 0  # a buffer of zero-byte pages has nothing to move
        return (src.reshape(-1)[keep].tolist(), dst.reshape(-1)[keep].tolist(),
                lengths.reshape(-1)[keep].tolist())

    def close(self) -> None:
        with self._state:
            if self._closed:
                return
            self._closed = True
            # Memory is unregistered only once no write reads it (each ends within the engine's timeout).
            self._state.wait_for(lambda: self._in_flight == 0)
        for addr in self._registered:
            rc = self._engine.unregister_memory(addr)
            if rc != 0:
                logger.warning("mooncake: unregister_memory(%#x) returned %d", addr, rc)
        self._registered = []
        self._engine = None


def _calls(lengths: list[int]) -> list[tuple[int, int]]:
    """[i, j) slices of the ranges, each at most BATCH_RANGES ranges and BATCH_BYTES (or one larger range)."""
    out, i, nbytes = [], 0, 0
    for k, n in enumerate(lengths):
        if k > i and (k - i == BATCH_RANGES or nbytes + n > BATCH_BYTES):
            out.append((i, k))
            i, nbytes = k, 0
        nbytes += n
    if i < len(lengths):
        out.append((i, len(lengths)))
    return out


def _merge(runs: Sequence[PageRun]) -> list[PageRun]:
    """Runs that continue each other on both sides joined into one (the caller's order kept)."""
    out: list[PageRun] = []
    for r in runs:
        last = out[-1] if out else None
        if last is not None and r.src_page == last.src_page + last.num_pages \
                and r.dst_page == last.dst_page + last.num_pages:
            out[-1] = PageRun(last.src_page, last.dst_page, last.num_pages + r.num_pages)
        else:
            out.append(r)
    return out
