"""The storage backend interface: pages (CPU tensors) by content-addressed key, checked on every read.

A backend moves bytes (`_read`, `_write`, `_delete`, `_exists`); this base lays pages out (page_format.py), checks
them on the way back, and counts. A page that does not check out is a miss: it is logged once, deleted, counted in
`stats()["corrupt"]`, and never handed out. All methods may be called from several threads at once.
"""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

from moeserve.kvcache.storage.page_format import CorruptPage, decode_page, encode_page

logger = logging.getLogger(__name__)


@dataclass
class StorageStats:
    bytes_read: int = 0  # stored bytes of pages that checked out
    bytes_written: int = 0
    hits: int = 0  # pages read (get, read_into) that checked out
    misses: int = 0  # pages asked for and not read (absent or corrupt)
    corrupt: int = 0  # pages that failed their checks (counted in misses too)
    puts: int = 0  # pages written (a put of a key already stored writes nothing)


class StorageBackend(ABC):
    """Pages by key. `get` returns the stored tensor or None; `read_into` reads one into a caller's tensor (the
    storage tier's path); `put` stores atomically (a reader never sees half a page); `batch_exists` says how far a
    chain of keys is stored."""

    def __init__(self) -> None:
        self._stats = StorageStats()
        self._lock = threading.Lock()  # guards _stats
        self._corrupt_logged = False

    # ------------------------------------------------------------------
    # what a backend implements
    @abstractmethod
    def _read(self, key: str) -> bytes | bytearray | None:
        """The stored bytes of `key`, or None when absent."""

    @abstractmethod
    def _write(self, key: str, data: bytes) -> bool:
        """Store `data` under `key` atomically; False when the backend declined (full, or already stored)."""

    @abstractmethod
    def _delete(self, key: str) -> None:
        """Forget `key` if stored."""

    @abstractmethod
    def _exists(self, key: str) -> bool:
        """Whether `key` is stored (its bytes are not checked)."""

    def close(self) -> None:
        """Release connections or handles; the default holds none."""
        return None

    # ------------------------------------------------------------------
    # the interface
    def batch_exists(self, keys: Sequence[str]) -> int:
        """How many leading keys of `keys` are stored: a chain's keys are looked up until the first miss."""
        for i, key in enumerate(keys):
            if not self._exists(key):
                return i
        return len(keys)

    def get(self, key: str) -> torch.Tensor | None:
        """The page stored under `key` (a CPU tensor of the dtype and shape it was put with), or None on a miss;
        a corrupt or truncated page is a miss and is deleted."""
        data = self._read(key)
        page = None
        if data is not None:
            try:
                page = decode_page(key, data)
            except CorruptPage as e:
                self._on_corrupt(key, str(e))
        self._count_read(None if page is None else len(data))
        return page

    def read_into(self, key: str, out: torch.Tensor) -> bool:
        """Read the page stored under `key` into `out` (a contiguous 1-D CPU tensor): whether it was stored,
        checked out and has out's dtype and length (a miss otherwise, out's contents then undefined). A backend
        may read the bytes straight into out (FileStorage); this default goes through `get`."""
        page = self.get(key)
        if page is None or page.dtype != out.dtype or page.numel() != out.numel():
            return False
        out.copy_(page.reshape(-1))
        return True

    def _count_read(self, nbytes: int | None) -> None:
        """Count one page read: a hit of nbytes stored bytes, or a miss (None)."""
        with self._lock:
            if nbytes is None:
                self._stats.misses += 1
            else:
                self._stats.hits += 1
                self._stats.bytes_read += nbytes

    def put(self, key: str, page: torch.Tensor) -> None:
        """Store `page` (any shape; moved to the CPU) under `key`. Keys name contents, so a key already stored is
        left as it is."""
        data = encode_page(key, page)
        if self._write(key, data):
            with self._lock:
                self._stats.puts += 1
                self._stats.bytes_written += len(data)

    def stats(self) -> dict[str, int]:
        """Counters since this backend was made: bytes_read, bytes_written, hits, misses, corrupt, puts."""
        with self._lock:
            return asdict(self._stats)

    def _on_corrupt(self, key: str, why: str) -> None:
        with self._lock:
            self._stats.corrupt += 1
            first = not self._corrupt_logged
            self._corrupt_logged = True
        if first:
            logger.warning("KV storage: page %s is corrupt (%s); deleted and treated as a miss (later corrupt pages "
                           "are counted in stats, not logged)", key, why)
        try:
            self._delete(key)
        except OSError as e:
            logger.debug("KV storage: deleting corrupt page %s failed: %s", key, e)
