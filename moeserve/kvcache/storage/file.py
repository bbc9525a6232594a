"""The `file` storage backend: one file per page in a local (or shared) directory.

    <dir>/<key[0:2]>/<key[2:4]>/<key>.kvpage

A page is written to a temporary file in its own directory and linked into place (os.link; os.replace where the
filesystem has no hard links), so a reader sees a whole page or none, two writers of one key store it once, and
several processes may share the directory. Files are not fsynced: a page torn by a crash
fails its checks and is a miss. With `max_bytes`, a write that takes the directory past it deletes the least
recently used pages (by mtime; a read touches its page) down to LOW_WATER of the cap. A restarted process finds
the pages its predecessors wrote.
"""

from __future__ import annotations

import itertools
import logging
import os
import re
import threading
import time
from pathlib import Path

import torch

from moeserve.kvcache.storage.base import StorageBackend
from moeserve.kvcache.storage.page_format import HEADER_BYTES, CorruptPage, check_parts, page_meta
from moeserve.paths import cache_root, touch

logger = logging.getLogger(__name__)

SUFFIX = ".kvpage"
TMP_PREFIX = ".tmp-"
LOW_WATER = 0.9  # eviction frees down to this fraction of max_bytes
STALE_TMP_S = 600  # a temporary file this old was left by a dead writer
_KEY = re.compile(r"[0-9a-f]{8,128}")


def default_dir() -> Path:
    return cache_root() / "kv_storage"


class FileStorage(StorageBackend):
    """Pages as files under `path` (default: default_dir()), at most `max_bytes` of them (None: no cap)."""

    def __init__(self, path: str | os.PathLike | None = None, max_bytes: int | None = None):
        super().__init__()
        if max_bytes is not None and max_bytes <= 0:
            raise ValueError(f"the file storage's max_bytes must be positive, got {max_bytes}")
        self.root = Path(path) if path else default_dir()
        self._root = str(self.root)
        self._dirs: set[str] = set()  # page directories this process made or saw
        self._tmp_ids = itertools.count()
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"cannot use {self.root} for KV storage: {e}") from None
        if not os.access(self.root, os.W_OK | os.X_OK):
            raise ValueError(f"cannot use {self.root} for KV storage: not writable")
        self.max_bytes = max_bytes
        self._size_lock = threading.Lock()  # guards _used
        self._evict_lock = threading.Lock()  # one evicting thread at a time
        self._used = sum(size for _, _, size in self._scan())
        logger.info("KV storage: %s holds %.1f MiB of pages%s", self.root, self._used / 2**20,
                    f" (cap {max_bytes / 2**20:.1f} MiB)" if max_bytes else "")

    def path_of(self, key: str) -> Path:
        return Path(self._path(key))

    def _path(self, key: str) -> str:
        """The page's path as a string: the per-page calls below use os on strings, not pathlib (a page's
        write cost 0.5 ms of CPU through pathlib and mkstemp, beside the forward it shares the cores with)."""
        if not _KEY.fullmatch(key):
            raise ValueError(f"a storage key is lowercase hex, got {key!r}")
        return f"{self._root}/{key[:2]}/{key[2:4]}/{key}{SUFFIX}"

    @property
    def used_bytes(self) -> int:
        """Bytes of pages in the directory as this process counts them (exact after an eviction scan)."""
        with self._size_lock:
            return self._used

    # ------------------------------------------------------------------
    # the backend's bytes
    def _read(self, key: str) -> bytearray | None:
        path = self._path(key)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            data = bytearray(os.fstat(fd).st_size)
            n = os.readv(fd, [data])
        finally:
            os.close(fd)
        touch(path)  # recently used: evicted last
        return data if n == len(data) else data[:n]

    def read_into(self, key: str, out: torch.Tensor) -> bool:
        """The page's bytes read straight into out: header and meta into a small buffer, the payload into out's
        memory, in one readv; then checked. A file of another size or meta (a page of another layout, a truncated
        one) takes the base's path, which tells those apart."""
        meta = page_meta(out.dtype, out.shape)
        head = bytearray(HEADER_BYTES + len(meta))
        payload = memoryview(out.view(torch.uint8).numpy())
        path = self._path(key)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            self._count_read(None)
            return False
        try:
            whole = os.fstat(fd).st_size == len(head) + len(payload)
            n = os.readv(fd, [head, payload]) if whole else -1
        finally:
            os.close(fd)
        if n != len(head) + len(payload) or head[HEADER_BYTES:] != meta:
            return super().read_into(key, out)
        try:
            check_parts(key, head, payload)
        except CorruptPage as e:
            self._on_corrupt(key, str(e))
            self._count_read(None)
            return False
        touch(path)  # recently used: evicted last
        self._count_read(n)
        return True

    def _exists(self, key: str) -> bool:
        return os.path.isfile(self._path(key))

    def _write(self, key: str, data: bytes) -> bool:
        path = self._path(key)
        if os.path.exists(path) or (self.max_bytes is not None and len(data) > self.max_bytes):
            return False
        directory = os.path.dirname(path)
        # a name no other writer uses (process, thread, count), made exclusively
        tmp = f"{directory}/{TMP_PREFIX}{os.getpid()}-{threading.get_native_id()}-{next(self._tmp_ids)}{SUFFIX}"
        fd = self._create(directory, tmp)
        try:
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
            finally:
                os.close(fd)
            try:
                os.link(tmp, path)  # atomic, and never over a page another writer put meanwhile
            except FileExistsError:
                return False
            except OSError:  # a filesystem without hard links: replace (the same bytes, counted twice)
                os.replace(tmp, path)
        finally:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
        with self._size_lock:
            self._used += len(data)
            over = self.max_bytes is not None and self._used > self.max_bytes
        if over:
            self._evict()
        return True

    def _create(self, directory: str, tmp: str) -> int:
        """Open tmp for writing, new; its directory made first if this process has not seen it (or it is gone)."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
        if directory not in self._dirs:
            os.makedirs(directory, exist_ok=True)
            self._dirs.add(directory)
        try:
            return os.open(tmp, flags, 0o600)
        except FileNotFoundError:  # removed by someone else since
            os.makedirs(directory, exist_ok=True)
            return os.open(tmp, flags, 0o600)

    def _delete(self, key: str) -> None:
        path = self.path_of(key)
        try:
            size = path.stat().st_size
            path.unlink()
        except FileNotFoundError:
            return
        with self._size_lock:
            self._used -= size

    # ------------------------------------------------------------------
    # size cap
    def _scan(self) -> list[tuple[float, Path, int]]:
        """(mtime, path, size) of every page file; stale temporary files are removed on the way."""
        out = []
        now = time.time()
        for dirpath, _, names in os.walk(self.root):
            for name in names:
                path = Path(dirpath) / name
                try:
                    st = path.stat()
                    if name.startswith(TMP_PREFIX):
                        if now - st.st_mtime > STALE_TMP_S:
                            path.unlink()
                    elif name.endswith(SUFFIX):
                        out.append((st.st_mtime, path, st.st_size))
                except FileNotFoundError:
                    continue  # deleted by another thread or process meanwhile
        return out

    def _evict(self) -> None:
        """Delete the least recently used pages until the directory holds at most LOW_WATER * max_bytes."""
        assert self.max_bytes is not None
        if not self._evict_lock.acquire(blocking=False):
            return  # another thread is evicting
        try:
            files = sorted(self._scan(), key=lambda f: f[0])
            used = sum(size for _, _, size in files)
            target = int(self.max_bytes * LOW_WATER)
            freed = 0
            for _, path, size in files:
                if used - freed <= target:
                    break
                try:
                    path.unlink()
                    freed += size
                except FileNotFoundError:
                    freed += size  # gone already
            with self._size_lock:
                self._used = used - freed
            logger.debug("KV storage: evicted %.1f MiB from %s", freed / 2**20, self.root)
        finally:
            self._evict_lock.release()
