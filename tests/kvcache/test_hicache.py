"""HiRadixCache over a real (CPU) device pool and host pool: every match hands out slots that hold the KV of
exactly its tokens, under eviction to host, load-back, host eviction and requests holding locks; the pages of
both pools are accounted for at the end. The KV of a token is a number derived from its whole prefix, written
where a request 'computes' it, so a page loaded into the wrong place or read after reuse shows."""

from __future__ import annotations

import random
import zlib

import numpy as np
import pytest
import torch

from moeserve.kvcache import HiRadixCache, HostKVPool, PageAllocator, make_prefix_cache
from moeserve.kvcache.hiradix_cache import WRITE_POLICIES
from moeserve.kvcache.kv_pool import MHAKVPool, MLAKVPool, kv_buffers


def _pool(kind: str, num_pages: int, page_size: int, device: str = "cpu"):
    if kind == "mla":
        return MLAKVPool(num_pages, page_size, 2, kv_lora_rank=4, qk_rope_head_dim=2, dtype=torch.float32,
                         device=device)
    return MHAKVPool(num_pages, page_size, 2, num_kv_heads=2, head_dim=3, v_head_dim=2, dtype=torch.float32,
                     device=device)


def _kv(tokens: list[int], i: int) -> float:
    """The KV value of token i: a function of tokens[:i + 1] (exact in float32)."""
    return float(zlib.crc32(np.asarray(tokens[: i + 1], dtype=np.int64).tobytes()) % (1 << 20))


def _write(pool, tokens: list[int], start: int, slots: np.ndarray) -> None:
    bufs = kv_buffers(pool)
    values = torch.tensor([_kv(tokens, i) for i in range(start, start + len(slots))], device=bufs[0].device)
    idx = torch.from_numpy(slots).to(values.device)
    for j, buf in enumerate(bufs):
        buf[idx] = (values + j).view(-1, *[1] * (buf.dim() - 1)).expand(-1, *buf.shape[1:])


def _check(pool, tokens: list[int], slots: np.ndarray) -> None:
    want = torch.tensor([_kv(tokens, i) for i in range(len(slots))])
    for j, buf in enumerate(kv_buffers(pool)):
        got = buf[torch.from_numpy(slots).to(buf.device)].flatten(1).cpu()
        assert torch.equal(got, (want + j)[:, None].expand_as(got)), "a matched slot holds another token's KV"


def _host_held(cache: HiRadixCache) -> int:
    return sum(len(n.host_value) for n in cache._nodes() if n.host_value is not None)


@pytest.mark.parametrize("policy", WRITE_POLICIES)
@pytest.mark.parametrize(("kind", "page_size"), [("mla", 1), ("mha", 4), ("mla", 2)])
def test_matches_hold_their_tokens_kv_under_eviction_and_load_back(policy, kind, page_size, device="cpu"):
    rng = random.Random(f"{policy}{kind}{page_size}")
    device_pages, host_pages = 24, 40
    pool = _pool(kind, device_pages, page_size, device)
    for buf in kv_buffers(pool):  # garbage where nothing was computed
        buf.normal_()
    alloc = PageAllocator(device_pages, page_size)
    host = HostKVPool(pool, host_pages)
    cache = make_prefix_cache(True, alloc, page_size, host, policy)
    assert isinstance(cache, HiRadixCache)
    bases = [[rng.randrange(50) for _ in range(rng.randrange(4, 20))] for _ in range(5)]
    active: list[tuple[list[int], np.ndarray, int, object]] = []
    host_hits = 0
    for _ in range(300):
        if active and (rng.random() < 0.5 or len(active) > 3):
            tokens, slots, prefix_len, node = active.pop(rng.randrange(len(active)))
            cache.release(tokens, slots, prefix_len, node, keep=rng.random() < 0.9)
            continue
        tokens = rng.choice(bases) + [rng.randrange(50) for _ in range(rng.randrange(1, 16))]
        usable = (len(tokens) - 1) // page_size * page_size
        match = cache.match_prefix(tokens[:usable])
        cache.lock(match.node)
        _check(pool, tokens, match.slots)
        host_hits += match.host_tokens
        prefix = len(match.slots)
        need = alloc.pages_needed(prefix, len(tokens) - prefix)
        if need > alloc.num_free_pages:
            cache.evict((need - alloc.num_free_pages) * page_size)
        last = int(match.slots[-1]) if prefix else -1
        new = alloc.extend_slots(prefix, last, len(tokens) - prefix)
        if new is None:
            cache.release(tokens, match.slots, prefix, match.node, keep=False)
            continue
        new = np.asarray(new, dtype=np.int64)
        _write(pool, tokens, prefix, new)
        active.append((tokens, np.concatenate([match.slots, new]), prefix, match.node))
    for tokens, slots, prefix_len, node in active:
        cache.release(tokens, slots, prefix_len, node, keep=True)
    assert host_hits > 0, "no match was served from the host tier"
    assert cache.protected_size == 0
    assert alloc.num_free_pages * page_size + cache.evictable_size == device_pages * page_size
    assert host.allocator.num_free_pages * page_size + _host_held(cache) == host_pages * page_size
    cache.reset()
    assert alloc.num_free_pages == device_pages and host.allocator.num_free_pages == host_pages


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("policy", WRITE_POLICIES)
@pytest.mark.parametrize(("kind", "page_size"), [("mla", 1), ("mha", 4)])
def test_cuda_matches_hold_their_tokens_kv_under_eviction_and_load_back(policy, kind, page_size):
    """The randomized workload above over a CUDA device pool: the copies run on the side stream into pinned host
    pages, and write_back's eviction queues every victim's copy before its one wait."""
    test_matches_hold_their_tokens_kv_under_eviction_and_load_back(policy, kind, page_size, device="cuda")


def test_write_back_copies_at_eviction_and_a_match_loads_back():
    pool = _pool("mla", 8, 2)
    alloc, host = PageAllocator(8, 2), HostKVPool(pool, 16)
    cache = HiRadixCache(alloc, 2, host, "write_back")
    a = [5, 6, 7, 8, 9, 10]
    slots = alloc.alloc_whole_pages(6)
    _write(pool, a, 0, slots)
    cache.insert(a, slots)
    assert host.traffic.bytes_to_host == 0  # write_back: nothing copied yet
    assert cache.evict(6) == 6 and alloc.num_free_pages == 8
    assert host.traffic.bytes_to_host == 6 * host.bytes_per_token
    # the freed device pages get other KV before the match
    junk = alloc.alloc_whole_pages(16)
    _write(pool, [1] * 16, 0, junk)
    alloc.free_slots(junk.tolist())
    match = cache.match_prefix(a + [11, 12])
    assert len(match.slots) == 6 and match.host_tokens == 6
    _check(pool, a, match.slots)
    assert cache.evictable_size == 6 and host.traffic.bytes_to_device == 6 * host.bytes_per_token
    assert len(cache.match_prefix(a).slots) == 6 and cache.match_prefix(a).host_tokens == 0  # on device again


def _write_back_chain(device_pages: int, host_pages: int):
    """A write_back cache (pages of one token) holding a = [1, 2, 3, 4] as two nodes, [1, 2] and its child [3, 4]:
    (pool, allocator, host pool, cache, a)."""
    pool = _pool("mla", device_pages, 1)
    alloc, host = PageAllocator(device_pages, 1), HostKVPool(pool, host_pages)
    cache = HiRadixCache(alloc, 1, host, "write_back")
    a = [1, 2, 3, 4]
    slots = alloc.alloc_whole_pages(4)
    _write(pool, a, 0, slots)
    cache.insert(a[:2], slots[:2])
    cache.insert(a, slots)
    return pool, alloc, host, cache, a


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))])
def test_write_back_eviction_queues_every_copy_before_waiting(monkeypatch, device):
    """The victims' copies to host go to the copy engine together, and the eviction waits once they are all queued
    (not a round trip to the copy thread per victim); each match after that still reads its own tokens' KV."""
    from moeserve.kvcache import copy_engine

    events: list[str] = []
    backup, wait = copy_engine.CopyEngine.backup, copy_engine.CopyHandle.wait
    monkeypatch.setattr(copy_engine.CopyEngine, "backup", lambda *a, **k: events.append("copy") or backup(*a, **k))
    monkeypatch.setattr(copy_engine.CopyHandle, "wait", lambda *a, **k: events.append("wait") or wait(*a, **k))
    pool = _pool("mha", 16, 2, device)
    alloc, host = PageAllocator(16, 2), HostKVPool(pool, 32)
    cache = HiRadixCache(alloc, 2, host, "write_back")
    rng = random.Random(7)
    seqs = [[rng.randrange(1, 1000) for _ in range(6)] for _ in range(4)]
    for seq in seqs:
        slots = alloc.alloc_whole_pages(6)
        _write(pool, seq, 0, slots)
        cache.insert(seq, slots)
    assert cache.evict(24) == 24 and alloc.num_free_pages == 16
    assert events[:4] == ["copy"] * 4 and events.count("copy") == 4
    junk = alloc.alloc_whole_pages(32)  # the freed device pages get other KV before the matches
    _write(pool, [3] * 32, 0, junk)
    alloc.free_slots(junk.tolist())
    for seq in seqs:
        match = cache.match_prefix(seq)
        assert match.host_tokens == 6
        _check(pool, seq, match.slots)


def test_write_back_parent_takes_the_host_room_of_its_evicted_child():
    """A write_back eviction copies a leaf to host, then its parent finds no host room (the leaf's copy, still in
    flight, holds the last pages): the leaf's copy is settled and the leaf gives way to its prefix, as a copied
    host-only leaf does. The parent stays on host, both pools' pages are accounted for."""
    pool, alloc, host, cache, a = _write_back_chain(8, 2)
    assert cache.evict(4) == 4
    assert alloc.num_free_pages == 8 and host.allocator.num_free_pages == 0
    assert cache.match_len(a) == 2 and len(cache._nodes()) == 1
    match = cache.match_prefix(a)
    assert match.host_tokens == 2
    _check(pool, a, match.slots)


def test_write_through_copies_at_insert_and_drops_what_has_no_copy():
    pool = _pool("mha", 8, 1)
    alloc, host = PageAllocator(8, 1), HostKVPool(pool, 3)
    cache = HiRadixCache(alloc, 1, host, "write_through")
    a, b = [1, 2, 3], [4, 5, 6, 7]
    for seq in (a, b):
        slots = alloc.alloc_whole_pages(len(seq))
        _write(pool, seq, 0, slots)
        cache.insert(seq, slots)
    # a filled the host pool; b's backup evicted a's host copy (host-only? no: a is on device) -> b has none
    assert cache.evict(7) == 7 and alloc.num_free_pages == 8
    assert cache.match_len(a) == 3 and cache.match_len(b) == 0  # b had no host copy: gone
    match = cache.match_prefix(a)
    _check(pool, a, match.slots)


def test_load_back_that_does_not_fit_gives_a_shorter_match():
    pool, alloc, host, cache, a = _write_back_chain(4, 8)
    cache.evict(4)
    held = alloc.alloc_whole_pages(3)  # a running request holds three of the four pages
    match = cache.match_prefix(a)
    assert len(match.slots) == 0  # the first node needs two pages
    alloc.free_slots(held[2:].tolist())
    match = cache.match_prefix(a)
    assert len(match.slots) == 2 and match.host_tokens == 2
    _check(pool, a, match.slots)
    assert cache.match_len(a) == 4  # the rest is still on host


def test_sizing_from_ratio_and_gigabytes():
    pool = _pool("mla", 10, 4)
    assert HostKVPool.num_pages_for(pool, 2.0, 0) == 20
    page_bytes = pool.bytes_per_token * 4
    assert HostKVPool.num_pages_for(pool, 2.0, 1) == (1 << 30) // page_bytes
