"""PageAllocator: pages freed together come back consecutive and ascending, so the KV of a later request stays in
few runs (PD transfers move one address range per run and layer); no page is ever handed out twice."""

from __future__ import annotations

import random

from moeserve.disagg.transfer.base import merge_runs
from moeserve.kvcache.page_allocator import PageAllocator


def test_freed_run_comes_back_ascending():
    alloc = PageAllocator(64, page_size=1)
    first, second = alloc.alloc_pages(10), alloc.alloc_pages(7)
    assert first == list(range(1, 11)) and second == list(range(11, 18))
    alloc.free_pages(first)
    again = alloc.alloc_pages(10)
    assert again == first
    assert len(merge_runs(again, second + alloc.alloc_pages(3))) == 1  # one range, not ten


def test_random_alloc_free_never_hands_out_a_page_twice():
    rng = random.Random()
    alloc = PageAllocator(200, page_size=4)
    held: list[list[int]] = []
    for _ in range(2000):
        if held and rng.random() < 0.45:
            alloc.free_pages(held.pop(rng.randrange(len(held))))
        else:
            pages = alloc.alloc_pages(rng.randint(1, 20))
            if pages is not None:
                held.append(pages)
        taken = [p for h in held for p in h]
        assert len(taken) == len(set(taken)) and 0 not in taken
        assert alloc.num_free_pages + len(taken) == 200
