"""PrefixCache's release and NoPrefixCache (--disable-radix-cache, PD decode): the same page accounting as the
radix cache, with nothing kept."""

import numpy as np
import pytest

from moeserve.kvcache import PageAllocator, make_prefix_cache
from moeserve.kvcache.prefix_cache import NoPrefixCache
from moeserve.kvcache.radix_cache import RadixCache


def test_factory_chooses_once():
    alloc = PageAllocator(8, 2)
    assert isinstance(make_prefix_cache(True, alloc, 2), RadixCache)
    assert isinstance(make_prefix_cache(False, alloc, 2), NoPrefixCache)


@pytest.mark.parametrize("page_size", [1, 4])
def test_no_prefix_cache_keeps_nothing(page_size):
    alloc = PageAllocator(16, page_size)
    cache = NoPrefixCache(alloc, page_size)
    toks = list(range(10))
    slots = np.array(alloc.extend_slots(0, -1, len(toks)))
    match = cache.match_prefix(toks)
    assert len(match.slots) == 0
    cache.lock(match.node)
    cache.release(toks, slots, 0, match.node, keep=True)
    assert alloc.num_free_pages == 16
    assert cache.evict(100) == 0 and cache.total_size == 0
    again = alloc.extend_slots(0, -1, len(toks))
    assert again == slots.tolist()  # freed in one run: handed out again in the same order


@pytest.mark.parametrize("keep", [True, False])
def test_radix_release_accounts_every_page(keep):
    ps = 2
    alloc = PageAllocator(32, ps)
    cache = RadixCache(alloc, ps)
    toks = list(range(9))
    cache.release(toks, np.array(alloc.extend_slots(0, -1, 9)), 0, None, keep=True)  # 4 whole pages kept
    match = cache.match_prefix(toks)
    slots, node = match.slots, match.node
    cache.lock(node)
    tail = alloc.extend_slots(len(slots), int(slots[-1]), 9 - len(slots))
    cache.release(toks, np.concatenate([slots, tail]), len(slots), node, keep=keep)
    assert cache.protected_size == 0 and cache.evictable_size == 8
    assert alloc.num_free_pages + cache.total_size // ps == 32
