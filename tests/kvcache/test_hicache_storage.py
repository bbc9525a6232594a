"""HiRadixCache over a file storage tier: host copies are written to storage, a fresh cache on fresh pools (a
restarted server) finds a prefix's pages by their tokens and loads exactly their KV, a corrupt page ends the match
there (a miss, never used), and pages of another layout root are never read."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from moeserve.kvcache import HiRadixCache, HostKVPool, PageAllocator, storage_tier
from moeserve.kvcache.kv_pool import kv_buffers
from moeserve.kvcache.storage.base import StorageBackend
from moeserve.kvcache.storage.file import SUFFIX, FileStorage
from moeserve.kvcache.storage.keys import KVLayout
from moeserve.kvcache.storage_tier import StorageTier
from tests.kvcache.test_hicache import _check, _pool, _write

PAGES = 16


def _cache(kind: str, page_size: int, directory, policy: str = "write_through", model: str = "m",
           host_pages: int = 2 * PAGES):
    pool = _pool(kind, PAGES, page_size)
    for buf in kv_buffers(pool):
        buf.normal_()
    alloc, host = PageAllocator(PAGES, page_size), HostKVPool(pool, host_pages)
    root = KVLayout.of_pool(pool, model).root()
    storage = StorageTier(FileStorage(directory), host, root, "wait_complete")
    return pool, alloc, HiRadixCache(alloc, page_size, host, policy, storage)


def _insert(pool, alloc, cache, tokens):
    slots = alloc.alloc_whole_pages(len(tokens))
    _write(pool, tokens, 0, slots)
    cache.insert(tokens, slots)


@pytest.mark.parametrize(("kind", "page_size", "policy"), [("mla", 2, "write_through"), ("mha", 4, "write_back")])
def test_a_restarted_cache_finds_its_prefixes_in_storage(tmp_path, kind, page_size, policy):
    rng = random.Random(7)
    seqs = [[rng.randrange(100) for _ in range(4 * page_size)] for _ in range(3)]
    pool, alloc, cache = _cache(kind, page_size, tmp_path, policy)
    for s in seqs:
        _insert(pool, alloc, cache, s)
    if policy == "write_back":
        cache.evict(cache.evictable_size)  # write_back: copies to host (and storage) happen at eviction
    cache.copies.wait_all()  # host copies done: their storage writes are queued (close waits for them too)
    assert cache.storage.flush(10.0)  # the writer thread put every page (a restarted server closed its tier)
    assert len(list(tmp_path.rglob("*" + SUFFIX))) == 12
    pool2, alloc2, fresh = _cache(kind, page_size, tmp_path, policy)  # new pools: nothing on device or host
    for s in seqs:
        query = s + [1] * page_size
        match = fresh.match_prefix(query)
        assert len(match.slots) == len(s) and match.storage_tokens == len(s) == match.host_tokens
        _check(pool2, s, match.slots)
        again = fresh.match_prefix(query)
        assert len(again.slots) == len(s) and again.host_tokens == 0  # on device now
    # a longer prompt sharing two pages of a stored prefix: those two pages, no more
    half = seqs[0][: 2 * page_size] + [999] * (2 * page_size)
    _, alloc3, third = _cache(kind, page_size, tmp_path, policy)
    assert len(third.match_prefix(half).slots) == 2 * page_size


def test_a_corrupt_page_is_a_miss_and_other_layouts_are_not_read(tmp_path):
    page_size = 2
    tokens = list(range(10, 18))
    pool, alloc, cache = _cache("mla", page_size, tmp_path)
    _insert(pool, alloc, cache, tokens)
    cache.copies.wait_all()
    assert cache.storage.flush(10.0)
    keys = cache._node_keys(cache.match_prefix(tokens).node)
    assert len(keys) == 4
    path = FileStorage(tmp_path).path_of(keys[2])
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF  # one flipped byte in the third page's payload
    path.write_bytes(bytes(data))
    pool2, _, fresh = _cache("mla", page_size, tmp_path)
    match = fresh.match_prefix(tokens + [0, 0])
    assert len(match.slots) == 2 * page_size  # pages 0 and 1; the corrupt page 2 ends the match
    _check(pool2, tokens, match.slots)
    assert not path.exists()  # deleted as corrupt
    _, _, other = _cache("mla", page_size, tmp_path, model="another model")
    assert len(other.match_prefix(tokens + [0, 0]).slots) == 0


def test_a_stored_chain_longer_than_the_host_pool_is_read_as_far_as_it_fits(tmp_path):
    page_size = 2
    tokens = [random.Random(4).randrange(1000) for _ in range(12 * page_size)]
    pool, alloc, cache = _cache("mla", page_size, tmp_path)
    _insert(pool, alloc, cache, tokens)
    cache.copies.wait_all()
    assert cache.storage.flush(10.0)
    pool2, _, small = _cache("mla", page_size, tmp_path, host_pages=5)  # a host pool of 5 pages, 12 stored
    match = small.match_prefix(tokens + [0, 0])
    assert len(match.slots) == 5 * page_size == match.storage_tokens
    _check(pool2, tokens[: 5 * page_size], match.slots)


class _SlowMemory(StorageBackend):
    """Pages in a dict; each read takes `delay` seconds."""

    def __init__(self, delay: float):
        super().__init__()
        self.pages: dict[str, bytes] = {}
        self.delay = delay

    def _read(self, key):
        time.sleep(self.delay)
        return self.pages.get(key)

    def _write(self, key, data):
        self.pages[key] = data
        return True

    def _delete(self, key):
        self.pages.pop(key, None)

    def _exists(self, key):
        return key in self.pages


@pytest.mark.parametrize("policy", ["wait_complete", "timeout"])
def test_timeout_policy_stops_reading_at_its_deadline(monkeypatch, policy):
    monkeypatch.setattr(storage_tier, "TIMEOUT_BASE_S", 0.05)
    monkeypatch.setattr(storage_tier, "TIMEOUT_PER_KI_TOKEN_S", 0.0)
    pool = _pool("mla", PAGES, 1)
    backend = _SlowMemory(delay=0.03)
    tokens = list(range(40, 48))
    host = HostKVPool(pool, 2 * PAGES)
    tier = StorageTier(backend, host, KVLayout.of_pool(pool, "m").root(), policy)
    slots = host.alloc(8)
    for buf in host.buffers:
        buf.normal_()
    tier.write(tier.keys(tokens), slots)
    assert tier.flush(10.0)  # read from the backend, not from the pages on their way
    pages = tier.read(tier.keys(tokens))
    if policy == "timeout":
        assert 1 <= len(pages) < 8  # it stopped after the page that crossed 50 ms
    else:
        assert len(pages) == 8
    fresh = host.alloc(len(pages))
    tier.fill(fresh, pages)
    for buf in host.buffers:
        assert torch.equal(buf[torch.from_numpy(fresh)], buf[torch.from_numpy(slots[: len(pages)])])


class _SlowWrites(_SlowMemory):
    """Puts wait for `gate` (set by the test), so pages stay on their way to the backend."""

    def __init__(self):
        super().__init__(delay=0.0)
        self.gate = threading.Event()

    def _write(self, key, data):
        assert self.gate.wait(10.0), "the test never opened the gate"
        return super()._write(key, data)


def test_writes_are_put_by_a_thread_and_read_back_while_on_their_way():
    """write returns before the backend has the pages; a read meanwhile returns exactly the written bytes, even
    after the host pages were freed and overwritten; flush and close wait for the puts (deadlines on each)."""
    pool = _pool("mla", PAGES, 2)
    backend = _SlowWrites()
    host = HostKVPool(pool, 2 * PAGES)
    tier = StorageTier(backend, host, KVLayout.of_pool(pool, "m").root(), "wait_complete")
    tokens = [random.Random(3).randrange(1000) for _ in range(12)]
    slots = host.alloc(len(tokens))
    for buf in host.buffers:
        buf.normal_()
    want = [buf[torch.from_numpy(slots)].clone() for buf in host.buffers]
    keys = tier.keys(tokens)
    tier.write(keys, slots)
    assert backend.pages == {}  # nothing put yet: the writer thread waits at the gate
    host.free(slots)
    for buf in host.buffers:
        buf.normal_()  # the host pages are rewritten: the pages on their way are copies
    pages = tier.read(keys)
    assert len(pages) == len(keys)
    fresh = host.alloc(len(tokens))
    tier.fill(fresh, pages)
    for buf, w in zip(host.buffers, want, strict=True):
        assert torch.equal(buf[torch.from_numpy(fresh)], w)
    assert not tier.flush(0.05)  # still held at the gate
    backend.gate.set()
    assert tier.flush(10.0)
    assert sorted(backend.pages) == sorted(keys)
    tier.close()
    assert not tier._writer.is_alive()


def test_writes_past_the_pending_cap_are_dropped_not_queued(monkeypatch, caplog):
    """A backend that takes no page (its writer held at a gate): the page copies waiting for it stop at the cap;
    later writes are dropped and counted (logged once), the pages kept read back exactly, and a read stops at the
    first dropped key."""
    pool = _pool("mla", PAGES, 2)
    host = HostKVPool(pool, 2 * PAGES)
    monkeypatch.setattr(storage_tier, "MAX_PENDING_BYTES", 3 * host.page_numel * host.dtype.itemsize)
    backend = _SlowWrites()
    tier = StorageTier(backend, host, KVLayout.of_pool(pool, "m").root(), "wait_complete")
    tokens = [random.Random(5).randrange(1000) for _ in range(10)]
    slots = host.alloc(len(tokens))
    for buf in host.buffers:
        buf.normal_()
    want = [buf[torch.from_numpy(slots[:6])].clone() for buf in host.buffers]
    keys = tier.keys(tokens)
    with caplog.at_level("WARNING"):
        tier.write(keys[:4], slots[:8])
        tier.write(keys[4:], slots[8:])
    assert host.traffic.storage_pages_dropped == 2 and len(tier._pending) == 3
    assert sum("slower than they come" in r.message for r in caplog.records) == 1
    assert host.traffic.bytes_to_storage == 3 * host.page_numel * host.dtype.itemsize
    backend.gate.set()
    assert tier.flush(10.0) and len(backend.pages) == 3
    pages = tier.read(keys)
    assert len(pages) == 3  # the fourth key was dropped: the chain ends there
    fresh = host.alloc(6)
    tier.fill(fresh, pages)
    for buf, w in zip(host.buffers, want, strict=True):
        assert torch.equal(buf[torch.from_numpy(fresh)], w)
    tier.write(keys[3:4], slots[6:8])  # room again: written
    assert tier.flush(10.0) and len(tier.read(keys)) == 4  # (the fifth was dropped as well)
    tier.close()


def test_a_read_of_many_keys_grows_its_rows(monkeypatch):
    """More pages than the read's first buffer: every one read back exactly, in order; a chain asked far past what
    is stored stops at the first missing key."""
    monkeypatch.setattr(storage_tier, "FIRST_ROWS", 2)
    pool = _pool("mla", PAGES, 1)
    host = HostKVPool(pool, 2 * PAGES)
    tier = StorageTier(_SlowMemory(delay=0.0), host, KVLayout.of_pool(pool, "m").root(), "wait_complete")
    tokens = [random.Random(8).randrange(1000) for _ in range(7)]
    slots = host.alloc(len(tokens))
    for buf in host.buffers:
        buf.normal_()
    tier.write(tier.keys(tokens), slots)
    assert tier.flush(10.0)
    more = tokens + [random.Random(9).randrange(1000) for _ in range(20)]
    pages = tier.read(tier.keys(more))
    assert len(pages) == 7
    fresh = host.alloc(7)
    tier.fill(fresh, pages)
    for buf in host.buffers:
        assert torch.equal(buf[torch.from_numpy(fresh)], buf[torch.from_numpy(slots)])
    tier.close()
