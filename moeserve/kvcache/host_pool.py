"""The host tier's KV memory: the device pool's buffers, same layout, in host memory (pinned on CUDA).

Buffer i here mirrors `kv_buffers(device_pool)[i]` (MLA: one latent buffer per layer; GQA: K then V per layer), then
those of the speculative draft's own pool where there is one (its MTP layer's KV, at the same slots), with its own
slots in whole pages and its own page allocator. Copies are by slot lists, every buffer in one call:
device -> host backups run off the scheduler's thread (copy_engine.py), host -> device loads here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from moeserve.kvcache.kv_pool import KVPool, kv_buffers
from moeserve.kvcache.page_allocator import PageAllocator


@dataclass
class TierTraffic:
    """What the host tier moved, since start (the Prometheus counters read it)."""

    bytes_to_host: int = 0  # counted when a backup completes (copy_engine.py's worker thread)
    bytes_to_device: int = 0
    load_back_seconds: float = 0.0  # the scheduler's time in load-backs (CUDA: launching the copies)
    bytes_to_storage: int = 0  # with a storage tier (storage_tier.py)
    bytes_from_storage: int = 0
    storage_pages_dropped: int = 0  # writes the storage tier dropped: its writer was too far behind


def device_buffers(device_pool: KVPool, draft_pool: KVPool | None) -> list[torch.Tensor]:
    """The device buffers a host page mirrors: the target's, then the draft's (one dtype: a stored page is one
    tensor)."""
    out = kv_buffers(device_pool)
    if draft_pool is not None:
        if draft_pool.page_size != device_pool.page_size or draft_pool.dtype != device_pool.dtype:
            raise ValueError(f"the draft's KV pool ({draft_pool.dtype}, pages of {draft_pool.page_size}) differs from "
                             f"the target's ({device_pool.dtype}, {device_pool.page_size}): the hierarchical cache "
                             "copies both as one page")
        out += kv_buffers(draft_pool)
    return out


class HostKVPool:
    """num_pages pages of the device pool's layout (and draft_pool's, at the same slots) in host memory, page 0
    unused as on the device."""

    def __init__(self, device_pool: KVPool, num_pages: int, draft_pool: KVPool | None = None):
        self.page_size = device_pool.page_size
        self.num_pages = num_pages
        self.device_buffers = device_buffers(device_pool, draft_pool)
        pin = device_pool.device.type == "cuda"
        rows = (num_pages + 1) * self.page_size
        # empty: a host page is always written (from the device) before it is read
        self.buffers = [torch.empty((rows, *b.shape[1:]), dtype=b.dtype, pin_memory=pin)
                        for b in self.device_buffers]
        self.allocator = PageAllocator(num_pages, self.page_size)
        self.bytes_per_token = sum(b[0].numel() * b.element_size() for b in self.buffers)
        self.page_numel = self.page_size * sum(b[0].numel() for b in self.buffers)  # one page, every buffer
        self.dtype = self.buffers[0].dtype
        self.traffic = TierTraffic()

    @staticmethod
    def num_pages_for(device_pool: KVPool, ratio: float, size_gb: int, draft_pool: KVPool | None = None) -> int:
        """Host pages for --hicache-size GB when > 0, else --hicache-ratio times the device pool's pages."""
        if size_gb > 0:
            per_token = device_pool.bytes_per_token + (draft_pool.bytes_per_token if draft_pool is not None else 0)
            return max(1, size_gb * (1 << 30) // (per_token * device_pool.page_size))
        return max(1, int(device_pool.num_pages * ratio))

    def report(self) -> dict[str, int | float]:
        """Tokens held and total, and the traffic since start (LoadOut.hicache, the /metrics counters)."""
        used = self.num_pages - self.allocator.num_free_pages
        return {"host_used_tokens": used * self.page_size, "host_total_tokens": self.num_pages * self.page_size,
                **dataclasses.asdict(self.traffic)}

    @property
    def total_bytes(self) -> int:
        return self.bytes_per_token * (self.num_pages + 1) * self.page_size

    def alloc(self, num_tokens: int) -> np.ndarray | None:
        """Host slots [num_tokens] for whole pages, or None when fewer pages are free."""
        return self.allocator.alloc_whole_pages(num_tokens)

    def free(self, host_slots: np.ndarray) -> None:
        self.allocator.free_slots(host_slots.tolist())

    def load(self, host_slots: np.ndarray, device_slots: np.ndarray) -> None:
        """Copy host slots [n] to device slots [n], on the device's current stream: ahead of any forward that
        reads them (the scheduler launches that later, on the same stream). The host rows are gathered now, so
        the host slots may be freed or rewritten when this returns. On CUDA the rows go through pinned staging
        buffers, copied non_blocking (run on one H100, 2026-12-07); on CPU the copy is done when this returns."""
        device = self.device_buffers[0].device
        cuda = device.type == "cuda"
        dev_idx = torch.from_numpy(device_slots).to(device)
        host_idx = torch.from_numpy(host_slots)
        for dev, host in zip(self.device_buffers, self.buffers, strict=True):
            rows = torch.empty((len(host_slots), *host.shape[1:]), dtype=host.dtype, pin_memory=cuda)
            torch.index_select(host, 0, host_idx, out=rows)
            # pinned memory goes back to torch's host allocator only after the copy that reads it completed
            dev.index_copy_(0, dev_idx, rows.to(device, non_blocking=cuda))
        self.traffic.bytes_to_device += len(host_slots) * self.bytes_per_token
