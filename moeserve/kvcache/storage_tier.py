"""The tier below the host pool: host pages written to a storage backend (kvcache/storage/) by content key, and
read back into host pages on a match that goes past what device and host hold.

A page is stored as one tensor: its rows of every host buffer, flattened and concatenated in kv_buffers' order.
Keys chain from the layout's root over the sequence's whole pages (storage/keys.py), so a page names its prefix.
Reads and writes run synchronously in the scheduler's thread (every prefetch policy waits for the pages it reads;
timeout stops reading at a deadline).
"""

from __future__ import annotations

import time

import numpy as np
import torch

from moeserve.kvcache.host_pool import HostKVPool
from moeserve.kvcache.storage.base import StorageBackend
from moeserve.kvcache.storage.keys import page_keys

PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")  # --hicache-storage-prefetch-policy
# timeout: a prefetch stops reading after this base plus this much per 1,024 tokens asked for
TIMEOUT_BASE_S = 0.5
TIMEOUT_PER_KI_TOKEN_S = 0.25


class StorageTier:
    """A storage backend holding host pages under keys chained from `root`."""

    def __init__(self, backend: StorageBackend, host: HostKVPool, root: str, prefetch_policy: str):
        self.backend = backend
        self.host = host
        self.page_size = host.page_size
        self.root = root
        self.prefetch_policy = prefetch_policy

    def keys(self, tokens: list[int], after: str | None = None) -> list[str]:
        """Keys of the whole pages of tokens, which follow the page keyed `after` (None: tokens start the
        sequence)."""
        return page_keys(after or self.root, tokens, self.page_size)

    def write(self, keys: list[str], host_slots: np.ndarray) -> None:
        """Store the host pages at host_slots [len(keys) * page_size] under keys."""
        ps = self.page_size
        for i, key in enumerate(keys):
            page = self._page(host_slots[i * ps : (i + 1) * ps])
            self.backend.put(key, page)
            self.host.traffic.bytes_to_storage += page.numel() * page.element_size()

    def read(self, keys: list[str]) -> list[torch.Tensor]:
        """The stored pages of the leading keys, up to the first miss (absent or corrupt) or, with the timeout
        policy, the deadline."""
        count = self.backend.batch_exists(keys)
        deadline = None
        if self.prefetch_policy == "timeout":
            deadline = time.monotonic() + TIMEOUT_BASE_S + TIMEOUT_PER_KI_TOKEN_S * count * self.page_size / 1024
        pages = []
        want = self.host.page_numel
        for key in keys[:count]:
            page = self.backend.get(key)
            if page is None or page.dtype != self.host.dtype or page.numel() != want:
                break
            pages.append(page.reshape(-1))
            self.host.traffic.bytes_from_storage += page.numel() * page.element_size()
            if deadline is not None and time.monotonic() > deadline:
                break
        return pages

    def fill(self, host_slots: np.ndarray, pages: list[torch.Tensor]) -> None:
        """Write pages (from read) into the host pages at host_slots [len(pages) * page_size]."""
        ps = self.page_size
        for i, page in enumerate(pages):
            idx = torch.from_numpy(host_slots[i * ps : (i + 1) * ps])
            offset = 0
            for buf in self.host.buffers:
                n = ps * buf[0].numel()
                buf.index_copy_(0, idx, page[offset : offset + n].view(ps, *buf.shape[1:]))
                offset += n

    def _page(self, host_slots: np.ndarray) -> torch.Tensor:
        idx = torch.from_numpy(host_slots)
        return torch.cat([buf.index_select(0, idx).reshape(-1) for buf in self.host.buffers])

    def close(self) -> None:
        self.backend.close()
