"""PrefixCache: the scheduler's one view of KV kept for reuse. A tier below the device (host memory, storage)
fits behind the same calls; NoPrefixCache stands in where nothing is reused."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import NamedTuple

import numpy as np

from moeserve.kvcache.page_allocator import PageAllocator


class PrefixMatch(NamedTuple):
    slots: np.ndarray  # [matched tokens] int64 KV slots, whole pages
    node: object  # lock it while a request reads the slots (RadixCache: the deepest TreeNode matched)
    host_tokens: int = 0  # of those tokens, how many were loaded back from the host tier for this match
    storage_tokens: int = 0  # of host_tokens, how many were read from the storage tier for this match


class PrefixCache(ABC):
    """Reusable KV in whole pages. It owns the pages it holds; evict gives them back to the allocator."""

    evictable_size: int  # tokens held and unlocked
    protected_size: int  # tokens held and locked by running requests

    def __init__(self, allocator: PageAllocator, page_size: int):
        self.allocator = allocator
        self.page_size = page_size

    @abstractmethod
    def match_prefix(self, tokens: list[int]) -> PrefixMatch:
        """The longest cached prefix of tokens, in whole pages."""

    def match_len(self, tokens: list[int]) -> int:
        """How many leading tokens of tokens a match would find (for ordering the queue); moves no KV."""
        return len(self.match_prefix(tokens).slots)

    @abstractmethod
    def insert(self, tokens: list[int], slots: np.ndarray) -> int:
        """Hand over a sequence's whole pages. Returns how many leading tokens were cached already: the caller
        still owns the slots it passed for those; the cache owns the rest."""

    @abstractmethod
    def lock(self, node: object) -> None:
        """Keep a match's pages from eviction (ref counted: unlock once per lock)."""

    @abstractmethod
    def unlock(self, node: object) -> None: ...

    @abstractmethod
    def evict(self, num_tokens: int) -> int:
        """Free at least num_tokens of unlocked KV to the allocator. Returns tokens freed."""

    @abstractmethod
    def reset(self) -> None:
        """Drop every unlocked entry (flush_cache)."""

    def close(self) -> None:  # noqa: B027  (most caches hold nothing to let go of)
        """Let go of threads and copies in flight (the scheduler's close)."""

    @property
    def total_size(self) -> int:
        return self.evictable_size + self.protected_size

    def release(self, tokens: list[int], slots: np.ndarray, prefix_len: int, node: object, keep: bool) -> None:
        """A request lets go of its KV: slots [kv_len] of tokens, the first prefix_len matched under node (locked).
        With keep its whole pages are inserted; what the cache does not take goes back to the allocator."""
        own_start = prefix_len
        if keep:
            whole = len(slots) // self.page_size * self.page_size
            in_tree = self.insert(tokens[:whole], slots[:whole])
            # slots [prefix_len, in_tree) duplicate what the cache had; [in_tree, whole) now belong to it
            self.allocator.free_slots(slots[prefix_len:in_tree].tolist())
            own_start = max(whole, prefix_len)
        self.allocator.free_slots(slots[own_start:].tolist())
        if node is not None:
            self.unlock(node)


class NoPrefixCache(PrefixCache):
    """No reuse (--disable-radix-cache, PD decode): matches nothing, keeps nothing, evicts nothing."""

    evictable_size = protected_size = 0

    def match_prefix(self, tokens: list[int]) -> PrefixMatch:
        return PrefixMatch(np.zeros(0, dtype=np.int64), None)

    def insert(self, tokens: list[int], slots: np.ndarray) -> int:
        self.allocator.free_slots(slots.tolist())
        return 0

    def lock(self, node: object) -> None: pass
    def unlock(self, node: object) -> None: pass
    def evict(self, num_tokens: int) -> int: return 0
    def reset(self) -> None: pass

    def release(self, tokens: list[int], slots: np.ndarray, prefix_len: int, node: object, keep: bool) -> None:
        self.allocator.free_slots(slots[prefix_len:].tolist())  # in one call: the pages come back as one run
