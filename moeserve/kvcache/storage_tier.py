"""The tier below the host pool: host pages written to a storage backend (kvcache/storage/) by content key, and
read back into host pages on a match that goes past what device and host hold.

A page is stored as one tensor: its rows of every host buffer, flattened and concatenated in kv_buffers' order.
Keys chain from the layout's root over the sequence's whole pages (storage/keys.py), so a page names its prefix.
Writes are asynchronous: write copies each page out of the host pool (so the host page may be freed or rewritten
right after) and a writer thread puts the copies to the backend; until a put completes its page is served to reads
from that copy, so a read never misses what was written. Reads run in the scheduler's thread (every prefetch
policy waits for the pages it reads; timeout stops reading at a deadline).
"""

from __future__ import annotations

import logging
import queue
import threading
import time

import numpy as np
import torch

from moeserve.core.background_thread import background_thread
from moeserve.kvcache.host_pool import HostKVPool
from moeserve.kvcache.storage.base import StorageBackend
from moeserve.kvcache.storage.keys import page_keys

logger = logging.getLogger(__name__)

PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")  # --hicache-storage-prefetch-policy
# timeout: a prefetch stops reading after this base plus this much per 1,024 tokens asked for
TIMEOUT_BASE_S = 0.5
TIMEOUT_PER_KI_TOKEN_S = 0.25
SMALL_PAGE = 16  # pages smaller than this make a storage write per few tokens (a warning at start)
FIRST_ROWS = 32  # a read's first buffer holds this many pages; it doubles while more come
CLOSE_TIMEOUT_S = 60.0  # close waits this long for the writer thread to put what is queued
# Page copies waiting for the writer thread take at most this many bytes (and at most the host pool's size): a
# backend slower than the pages coming makes later writes drop (a later miss, never a wrong page), not memory grow.
MAX_PENDING_BYTES = 1 << 30


class StorageTier:
    """A storage backend holding host pages under keys chained from `root`."""

    def __init__(self, backend: StorageBackend, host: HostKVPool, root: str, prefetch_policy: str):
        self.backend = backend
        self.host = host
        self.page_size = host.page_size
        self.root = root
        self.prefetch_policy = prefetch_policy
        self._pending: dict[str, torch.Tensor] = {}  # key -> page copy, until the writer thread put it
        self._page_bytes = host.bytes_per_token * host.page_size  # one stored page
        self._max_pending = max(1, min(MAX_PENDING_BYTES, host.num_pages * self._page_bytes) // self._page_bytes)
        self._dropped_logged = False
        self._lock = threading.Lock()
        self._queue: queue.Queue[tuple[str, torch.Tensor] | None] = queue.Queue()
        self._writer = background_thread(self._write_loop, "kv-storage-writer")
        self._writer.start()
        if self.page_size < SMALL_PAGE:
            logger.warning("KV storage with --page-size %d stores a page (a file, an object) every %d tokens: the "
                           "writes then compete with the forward for the CPU; --page-size %d or more is advised",
                           self.page_size, self.page_size, SMALL_PAGE)

    def keys(self, tokens: list[int], after: str | None = None) -> list[str]:
        """Keys of the whole pages of tokens, which follow the page keyed `after` (None: tokens start the
        sequence)."""
        return page_keys(after or self.root, tokens, self.page_size)

    def write(self, keys: list[str], host_slots: np.ndarray) -> None:
        """Store the host pages at host_slots [len(keys) * page_size] under keys: copied now (the host pages are
        free to go when this returns), put by the writer thread. Pages past the pending cap are dropped (counted
        in the tier's traffic, logged once): the writes of a chain stop at its first drop, since a read stops at
        the first missing key anyway."""
        with self._lock:
            room = self._max_pending - len(self._pending)
        if room < len(keys):
            self._drop(len(keys) - max(room, 0))
            keys = keys[: max(room, 0)]
        if not keys:
            return
        pages = self._pages(host_slots[: len(keys) * self.page_size])  # a copy
        for key, page in zip(keys, pages, strict=True):
            with self._lock:
                if key in self._pending:  # keys name contents: the same page is on its way
                    continue
                self._pending[key] = page
            self._queue.put((key, page))
            self.host.traffic.bytes_to_storage += self._page_bytes

    def _drop(self, pages: int) -> None:
        self.host.traffic.storage_pages_dropped += pages
        if not self._dropped_logged:
            self._dropped_logged = True
            logger.warning("KV storage: the backend takes pages slower than they come (%d pages, %.1f MiB, wait "
                           "for it); later pages are dropped until it catches up (counted in "
                           "moeserve:hicache_storage_pages_dropped, not logged again)", self._max_pending,
                           self._max_pending * self._page_bytes / 2**20)

    def _write_loop(self) -> None:
        while (item := self._queue.get()) is not None:
            key, page = item
            try:
                self.backend.put(key, page)
            except Exception:  # a page not stored is a later miss, never a wrong page
                logger.exception("KV storage: writing page %s failed", key)
            with self._lock:
                del self._pending[key]

    def flush(self, timeout_s: float) -> bool:
        """Wait until every page written so far was put (or timeout_s passed); whether it was."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if not self._pending:
                    return True
            time.sleep(0.001)
        return False

    def _read_page(self, key: str, out: torch.Tensor) -> bool:
        """One page into out: from its copy on the way to the backend, else from the backend."""
        with self._lock:
            page = self._pending.get(key)
        if page is None:
            return self.backend.read_into(key, out)  # (a put completes before its pending copy goes)
        out.copy_(page)
        return True

    def read(self, keys: list[str]) -> torch.Tensor:
        """The stored pages of the leading keys, up to the first miss (absent or corrupt) or, with the timeout
        policy, the deadline: [pages, page_numel], row i page i (as `_pages` lays it out). The rows grow as pages
        come (a long prompt asks for many keys, storage may hold few of them)."""
        deadline = None
        if self.prefetch_policy == "timeout":
            deadline = time.monotonic() + TIMEOUT_BASE_S + TIMEOUT_PER_KI_TOKEN_S * len(keys) * self.page_size / 1024
        rows = torch.empty(min(len(keys), FIRST_ROWS), self.host.page_numel, dtype=self.host.dtype)
        count = 0
        for key in keys:
            if count == len(rows):
                rows = torch.cat([rows, torch.empty_like(rows[: min(count, len(keys) - count)])])
            if not self._read_page(key, rows[count]):
                break
            count += 1
            if deadline is not None and time.monotonic() > deadline:
                break
        self.host.traffic.bytes_from_storage += count * self._page_bytes
        return rows[:count]

    def fill(self, host_slots: np.ndarray, rows: torch.Tensor) -> None:
        """Write pages (read's rows) into the host pages at host_slots [len(rows) * page_size]: one copy per
        buffer for all of them."""
        if not len(rows):
            return
        ps = self.page_size
        idx = torch.from_numpy(host_slots[: len(rows) * ps])
        offset = 0
        for buf in self.host.buffers:
            n = ps * buf[0].numel()
            buf.index_copy_(0, idx, rows[:, offset : offset + n].reshape(-1, *buf.shape[1:]))
            offset += n

    def _pages(self, host_slots: np.ndarray) -> torch.Tensor:
        """The stored form of the host pages at host_slots [pages * page_size]: [pages, page_numel], row i page i's
        rows of every buffer in turn (one gather per buffer for all the pages)."""
        idx = torch.from_numpy(host_slots)
        n = len(host_slots) // self.page_size
        return torch.cat([buf.index_select(0, idx).view(n, -1) for buf in self.host.buffers], dim=1)

    def close(self) -> None:
        """Put what is queued (at most CLOSE_TIMEOUT_S), then close the backend."""
        self._queue.put(None)
        self._writer.join(CLOSE_TIMEOUT_S)
        if self._writer.is_alive():
            logger.warning("KV storage: the writer thread did not finish in %.0f s", CLOSE_TIMEOUT_S)
        self.backend.close()
