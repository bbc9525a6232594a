"""The host tier's copy engine (CPU worker thread) under HiRadixCache: backups complete off the caller's thread and
equal the device rows; while a backup is held at a gate its node keeps its device pages (eviction takes other
leaves first, then waits), reset waits, and the storage write follows the copy; a failed copy drops the host copy.
The randomized eviction and load-back test of test_hicache.py also runs with slow copies."""

from __future__ import annotations

import random
import threading
import time

import numpy as np
import pytest
import torch

from moeserve.kvcache import HiRadixCache, HostKVPool, PageAllocator, StorageTier
from moeserve.kvcache.copy_engine import CopyEngine
from moeserve.kvcache.hiradix_cache import WRITE_POLICIES
from moeserve.kvcache.kv_pool import MLAKVPool, kv_buffers
from moeserve.kvcache.storage.file import SUFFIX, FileStorage
from moeserve.kvcache.storage.keys import KVLayout
from tests.kvcache import test_hicache
from tests.kvcache.test_hicache import _check, _pool, _write
from tests.rank import test_hicache_engine
from tests.rank.test_hicache_engine import model_path  # noqa: F401  (the fixture)

DEADLINE_S = 10.0
HELD_S = 0.2  # how long a call is watched to still be blocked at the gate


@pytest.mark.parametrize("kind", ["mla", "mha"])
def test_backups_complete_in_the_worker_and_equal_the_device_rows(kind):
    pool = _pool(kind, 16, 2)
    for buf in kv_buffers(pool):
        buf.normal_()
    host = HostKVPool(pool, 24)
    engine = CopyEngine(host)
    rng = np.random.default_rng(0)
    jobs = []
    for _ in range(6):
        dev = rng.permutation(np.arange(2, 34))[:6].astype(np.int64)
        hs = host.alloc(6)
        jobs.append((dev, hs, engine.backup(dev, hs)))
    engine.wait_all(DEADLINE_S)
    for dev, hs, handle in jobs:
        assert handle.done() and handle.error is None
        for d, h in zip(kv_buffers(pool), host.buffers, strict=True):
            assert torch.equal(h[torch.from_numpy(hs)], d[torch.from_numpy(dev)])
    assert host.traffic.bytes_to_host == 36 * host.bytes_per_token
    engine.close()


def test_worker_threads_run_torch_single_threaded(tmp_path):
    """The copy worker and the storage writer run their torch ops with one intra-op thread (no OpenMP team of
    their own beside the forward's: core/background_thread.py), and leave the caller's setting alone."""
    pool = _pool("mla", 16, 2)
    host = HostKVPool(pool, 24)
    layout = KVLayout.of_pool(pool, "test-model")
    tier = StorageTier(FileStorage(tmp_path), host, layout.root(), "best_effort")
    seen: list[tuple[str, int]] = []
    real_put = tier.backend.put
    tier.backend.put = lambda key, page: (seen.append(("writer", torch.get_num_threads())), real_put(key, page))
    engine = CopyEngine(host)
    before = torch.get_num_threads()
    hs = host.alloc(16)
    engine.backup(np.arange(2, 18, dtype=np.int64), hs,
                  then=lambda: (seen.append(("copier", torch.get_num_threads())), tier.write(["ab" * 32], hs)))
    engine.wait_all(DEADLINE_S)
    assert tier.flush(DEADLINE_S)
    assert seen == [("copier", 1), ("writer", 1)]
    assert torch.get_num_threads() == before
    engine.close()
    tier.close()


class Gate:
    """Holds the copy engine's worker before each copy until opened."""

    def __init__(self, monkeypatch):
        self.open = threading.Event()
        self.started = threading.Event()  # the worker reached a copy
        real = CopyEngine._copy

        def held(engine, job):
            self.started.set()
            assert self.open.wait(DEADLINE_S), "the test never opened the gate"
            real(engine, job)

        monkeypatch.setattr(CopyEngine, "_copy", held)


def _insert(pool, alloc, cache, tokens) -> np.ndarray:
    slots = alloc.alloc_whole_pages(len(tokens))
    _write(pool, tokens, 0, slots)
    cache.insert(tokens, slots)
    return slots


def _in_thread(fn) -> threading.Thread:
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    return t


def test_eviction_takes_other_leaves_then_waits_for_a_pending_copy(monkeypatch):
    pool = _pool("mla", 8, 2)
    alloc, host = PageAllocator(8, 2), HostKVPool(pool, 16)
    cache = HiRadixCache(alloc, 2, host, "write_through")
    a, b = [1, 2, 3, 4], [7, 8, 9, 10]
    _insert(pool, alloc, cache, a)
    cache.copies.wait_all(DEADLINE_S)
    gate = Gate(monkeypatch)
    b_slots = _insert(pool, alloc, cache, b)  # the newer leaf, its copy held
    cache.match_prefix(a)  # a is now the more recently used: LRU alone would take b first
    assert gate.started.wait(DEADLINE_S)
    assert cache.evict(2) == 4  # a (copy done), without waiting
    assert alloc.num_free_pages == 6
    evicting = _in_thread(lambda: cache.evict(2))  # only b is left: waits for its copy
    evicting.join(HELD_S)
    assert evicting.is_alive() and alloc.num_free_pages == 6, "b's pages were freed before its copy completed"
    assert not set(b_slots[::2] // 2) & set(alloc._free)
    gate.open.set()
    evicting.join(DEADLINE_S)
    assert not evicting.is_alive() and alloc.num_free_pages == 8
    junk = alloc.alloc_whole_pages(16)  # the freed device pages get other KV
    _write(pool, [5] * 16, 0, junk)
    alloc.free_slots(junk.tolist())
    for tokens in (a, b):
        match = cache.match_prefix(tokens + [0, 0])
        assert len(match.slots) == 4 and match.host_tokens == 4
        _check(pool, tokens, match.slots)
    cache.close()


def test_reset_waits_for_copies_in_flight(monkeypatch):
    pool = _pool("mha", 8, 2)
    alloc, host = PageAllocator(8, 2), HostKVPool(pool, 16)
    cache = HiRadixCache(alloc, 2, host, "write_through")
    gate = Gate(monkeypatch)
    _insert(pool, alloc, cache, [3, 1, 4, 1, 5, 9])
    assert gate.started.wait(DEADLINE_S)
    resetting = _in_thread(cache.reset)
    resetting.join(HELD_S)
    assert resetting.is_alive() and alloc.num_free_pages == 5, "reset freed pages under a copy"
    gate.open.set()
    resetting.join(DEADLINE_S)
    assert not resetting.is_alive()
    assert alloc.num_free_pages == 8 and host.allocator.num_free_pages == 16
    assert host.traffic.bytes_to_host == 6 * host.bytes_per_token
    cache.close()


def test_the_storage_write_follows_the_copy(monkeypatch, tmp_path):
    pool = _pool("mla", 8, 2)
    for buf in kv_buffers(pool):
        buf.normal_()
    alloc, host = PageAllocator(8, 2), HostKVPool(pool, 16)
    storage = StorageTier(FileStorage(tmp_path), host, KVLayout.of_pool(pool, "m").root(), "wait_complete")
    cache = HiRadixCache(alloc, 2, host, "write_through", storage)
    gate = Gate(monkeypatch)
    tokens = [2, 7, 1, 8, 2, 8]
    _insert(pool, alloc, cache, tokens)
    assert gate.started.wait(DEADLINE_S)
    time.sleep(HELD_S)
    assert host.traffic.bytes_to_storage == 0 and storage.flush(0.05)  # nothing written before the copy
    gate.open.set()
    cache.close()  # waits for the copy and its storage write
    assert storage.flush(DEADLINE_S)
    assert len(list(tmp_path.rglob("*" + SUFFIX))) == 3
    storage.close()
    pool2 = _pool("mla", 8, 2)  # a restarted cache reads what the copies' storage writes put
    host2 = HostKVPool(pool2, 16)
    storage2 = StorageTier(FileStorage(tmp_path), host2, KVLayout.of_pool(pool2, "m").root(), "wait_complete")
    fresh = HiRadixCache(PageAllocator(8, 2), 2, host2, "write_through", storage2)
    match = fresh.match_prefix(tokens + [0])
    assert len(match.slots) == 6 and match.storage_tokens == 6
    _check(pool2, tokens, match.slots)
    fresh.close()
    storage2.close()


def test_a_failed_copy_drops_the_host_copy(monkeypatch):
    def broken(engine, job):
        raise RuntimeError("copy failed (test)")

    monkeypatch.setattr(CopyEngine, "_copy", broken)
    pool = _pool("mla", 8, 2)
    alloc, host = PageAllocator(8, 2), HostKVPool(pool, 16)
    cache = HiRadixCache(alloc, 2, host, "write_through")
    _insert(pool, alloc, cache, [4, 4, 4, 4])
    cache.copies.wait_all(DEADLINE_S)
    assert cache.evict(4) == 4  # no host copy under write_through: the node leaves the tree
    assert alloc.num_free_pages == 8 and host.allocator.num_free_pages == 16
    assert len(cache.match_prefix([4, 4, 4, 4, 0]).slots) == 0
    cache.close()


@pytest.mark.parametrize("policy", WRITE_POLICIES)
def test_matches_hold_their_kv_with_slow_copies(monkeypatch, policy):
    """test_hicache's randomized workload with every copy delayed 0-2 ms: a device page reused before its copy
    completed, or a host page read before it was written, shows as a wrong KV value."""
    rng = random.Random(policy)
    real = CopyEngine._copy

    def slow(engine, job):
        time.sleep(rng.random() * 0.002)
        real(engine, job)

    monkeypatch.setattr(CopyEngine, "_copy", slow)
    test_hicache.test_matches_hold_their_tokens_kv_under_eviction_and_load_back(policy, "mha", 2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_cuda_copies_follow_the_compute_stream(policy):
    """Each sequence's KV is written on the compute stream behind slow matrix products and inserted at once: the
    side-stream backup must read the rows written, not what was there before. Then every device page gets junk
    and each match's non_blocking load-back must bring the right rows."""
    torch.manual_seed(0)
    page_size, tokens_per_seq = 4, 16
    pool = MLAKVPool(32, page_size, 2, kv_lora_rank=256, qk_rope_head_dim=64, dtype=torch.bfloat16,
                     device="cuda")
    alloc, host = PageAllocator(32, page_size), HostKVPool(pool, 64)
    assert all(b.is_pinned() for b in host.buffers)
    cache = HiRadixCache(alloc, page_size, host, policy)
    rng = random.Random(policy)
    seqs = [[rng.randrange(1000) for _ in range(tokens_per_seq)] for _ in range(6)]
    busy = torch.randn(4096, 4096, device="cuda")
    want = []
    for tokens in seqs:
        slots = alloc.alloc_whole_pages(tokens_per_seq)
        for _ in range(8):  # keeps the compute stream busy past the insert below
            busy = busy @ busy
            busy = busy / busy.norm()
        idx = torch.from_numpy(slots).cuda()
        rows = [torch.randn(tokens_per_seq, b.shape[1], device="cuda").to(b.dtype) for b in pool.buffers]
        for buf, r in zip(pool.buffers, rows, strict=True):
            buf.index_copy_(0, idx, r)
        cache.insert(tokens, slots)
        want.append(rows)
    assert cache.evict(cache.evictable_size) == 6 * tokens_per_seq
    for buf in pool.buffers:
        buf.normal_()  # junk where the evicted pages were
    for i in rng.sample(range(6), 6):
        match = cache.match_prefix(seqs[i] + [0])
        assert len(match.slots) == tokens_per_seq and match.host_tokens == tokens_per_seq
        idx = torch.from_numpy(match.slots).cuda()
        for buf, r in zip(pool.buffers, want[i], strict=True):
            assert torch.equal(buf[idx], r), f"sequence {i}: wrong rows after the round trip"
    assert host.traffic.bytes_to_host == 6 * tokens_per_seq * host.bytes_per_token
    cache.close()


def test_64_conversations_with_aborts_and_slow_copies(monkeypatch, model_path):  # noqa: F811
    """test_hicache_engine's 64 conversations with aborts during load-back, under write_through with every backup
    delayed 1 ms: many nodes are pending while requests match, evict and load back."""
    real = CopyEngine._copy

    def slow(engine, job):
        time.sleep(0.001)
        real(engine, job)

    monkeypatch.setattr(CopyEngine, "_copy", slow)
    test_hicache_engine.test_64_conversations_with_aborts_during_load_back(model_path, policy="write_through")
