"""Hands out KV pages and turns them into token slots; page 0 is the scratch page and is never handed out."""

from __future__ import annotations

import numpy as np


class PageAllocator:
    """A free list of pages 1..num_pages. Slot s is token s % page_size of page s // page_size."""

    def __init__(self, num_pages: int, page_size: int):
        self.num_pages = num_pages
        self.page_size = page_size
        self._free: list[int] = list(range(num_pages, 0, -1))  # pop() hands out low pages first

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    def alloc_pages(self, n: int) -> list[int] | None:
        """n pages, or None (and nothing taken) when fewer are free."""
        if n > len(self._free):
            return None
        if n == 0:
            return []
        pages = self._free[-n:]
        del self._free[-n:]
        return pages[::-1]

    def free_pages(self, pages: list[int]) -> None:
        # The free list's tail is handed out next, last page first: pushing a freed run in reverse hands it out
        # again in ascending order, so a later request's pages stay consecutive (one KV transfer range per run
        # instead of one per page).
        self._free.extend(reversed(pages))

    def alloc_whole_pages(self, num_tokens: int) -> np.ndarray | None:
        """The slots [num_tokens] int64 of num_tokens // page_size new pages (num_tokens a multiple of page_size),
        or None (and nothing taken) when fewer are free."""
        ps = self.page_size
        assert num_tokens % ps == 0
        pages = self.alloc_pages(num_tokens // ps)
        if pages is None:
            return None
        return (np.asarray(pages, dtype=np.int64)[:, None] * ps + np.arange(ps, dtype=np.int64)).reshape(-1)

    def pages_needed(self, cur_len: int, n: int) -> int:
        """Pages a sequence of cur_len tokens (its last page partly filled) needs to grow by n tokens."""
        ps = self.page_size
        return (cur_len + n + ps - 1) // ps - (cur_len + ps - 1) // ps

    def extend_slots(self, cur_len: int, last_slot: int, n: int) -> list[int] | None:
        """Slots for n more tokens of a sequence of cur_len tokens whose last token sits in last_slot.

        Fills the rest of the last page first, then new pages. None when pages run out.
        """
        ps = self.page_size
        room = (-cur_len) % ps if cur_len else 0
        take = min(room, n)
        slots = list(range(last_slot + 1, last_slot + 1 + take))
        pages = self.alloc_pages(self.pages_needed(cur_len, n))
        if pages is None:
            return None
        if ps == 1:  # page p is slot p: no loop over a prompt's thousands of pages
            slots.extend(pages)
            return slots
        for p in pages:
            slots.extend(range(p * ps, p * ps + ps))
        return slots[:n]

    def free_slots(self, slots: list[int]) -> None:
        """Free the pages of a sequence's own slots: a page is freed through the slot at its start.

        The caller passes whole sequences' tails starting at a page boundary, so each page appears with its
        first slot exactly once.
        """
        ps = self.page_size
        self.free_pages([s // ps for s in slots if s % ps == 0])
