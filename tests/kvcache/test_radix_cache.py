"""Radix cache and page allocator: sharing, splitting, locking, LRU eviction, page accounting."""

import random

import numpy as np
import pytest

from moeserve.kvcache.page_allocator import PageAllocator
from moeserve.kvcache.radix_cache import RadixCache


def _seq(alloc: PageAllocator, n: int) -> np.ndarray:
    slots = alloc.extend_slots(0, -1, n)
    assert slots is not None
    return np.array(slots)


@pytest.mark.parametrize("page_size", [1, 4])
def test_allocator_extend_fills_last_page_first(page_size):
    alloc = PageAllocator(16, page_size)
    a = alloc.extend_slots(0, -1, 3)
    b = alloc.extend_slots(3, a[-1], 6)
    slots = a + b
    assert len(set(slots)) == 9
    pages = {s // page_size for s in slots}
    assert len(pages) == -(-9 // page_size)
    assert 0 not in pages  # the scratch page is never handed out
    assert alloc.num_free_pages == 16 - len(pages)
    alloc.free_slots(slots)
    assert alloc.num_free_pages == 16


def test_allocator_refuses_without_taking():
    alloc = PageAllocator(2, 4)
    assert alloc.extend_slots(0, -1, 9) is None
    assert alloc.num_free_pages == 2


@pytest.mark.parametrize("page_size", [1, 2, 4])
def test_match_insert_split(page_size):
    rng = random.Random(page_size)
    alloc = PageAllocator(64, page_size)
    cache = RadixCache(alloc, page_size)
    a = [rng.randrange(100) for _ in range(16)]
    b = a[:8] + [rng.randrange(100, 200) for _ in range(8)]
    sa = _seq(alloc, 16)
    assert cache.insert(a, sa) == 0
    slots = cache.match_prefix(b).slots
    assert len(slots) == 8  # the shared prefix, whole pages
    assert np.array_equal(slots, sa[:8])
    sb = np.concatenate([slots, _seq(alloc, 8)])
    assert cache.insert(b, sb) == 8
    assert np.array_equal(cache.match_prefix(b)[0], sb)
    assert np.array_equal(cache.match_prefix(a)[0], sa)
    assert cache.evictable_size == 24


def test_partial_page_is_not_cached():
    alloc = PageAllocator(16, 4)
    cache = RadixCache(alloc, 4)
    toks = list(range(10, 20))
    cache.insert(toks, _seq(alloc, 10))
    assert len(cache.match_prefix(toks)[0]) == 8


def test_lock_protects_from_eviction_and_lru_order():
    alloc = PageAllocator(64, 1)
    cache = RadixCache(alloc, 1)
    old, new = [1, 2, 3, 4], [5, 6, 7, 8]
    cache.insert(old, _seq(alloc, 4))
    cache.insert(new, _seq(alloc, 4))
    cache.match_prefix(new)  # touch: `old` is now least recently used
    free_before = alloc.num_free_pages
    assert cache.evict(1) == 4
    assert len(cache.match_prefix(old)[0]) == 0 and len(cache.match_prefix(new)[0]) == 4
    assert alloc.num_free_pages == free_before + 4
    node = cache.match_prefix(new).node
    cache.lock(node)
    assert cache.evict(100) == 0
    assert cache.protected_size == 4 and cache.evictable_size == 0
    cache.unlock(node)
    assert cache.evict(100) == 4
    assert alloc.num_free_pages == 64


def test_random_workload_conserves_pages():
    """Insert and evict random sequences; every page is either free or in the tree, never both or neither."""
    rng = random.Random(0)
    ps = 2
    alloc = PageAllocator(200, ps)
    cache = RadixCache(alloc, ps)
    for _ in range(300):
        toks = [rng.randrange(4) for _ in range(rng.randrange(2, 20))]
        match = cache.match_prefix(toks)
        slots, node = match.slots, match.node
        n_new = len(toks) - len(slots)
        cache.lock(node)
        new = alloc.extend_slots(len(slots), int(slots[-1]) if len(slots) else -1, n_new)
        if new is None:
            cache.evict(n_new + ps)
            new = alloc.extend_slots(len(slots), int(slots[-1]) if len(slots) else -1, n_new)
        cache.unlock(node)
        if new is None:
            continue
        full = np.concatenate([slots, np.array(new, dtype=np.int64)])
        whole = len(toks) // ps * ps
        in_tree = cache.insert(toks[:whole], full[:whole])
        alloc.free_slots(full[len(slots):in_tree].tolist())
        alloc.free_slots(full[max(whole, len(slots)):].tolist())
        in_tree_pages = cache.total_size // ps
        assert in_tree_pages + alloc.num_free_pages == 200
    cache.reset()
    assert alloc.num_free_pages == 200
