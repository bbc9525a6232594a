"""A radix tree over token pages: requests with a common prefix share its KV pages.

Keys are token ids in whole pages, values the KV slots holding them. A request that matches a prefix locks the
path (lock_ref) so eviction cannot take pages it reads; finished requests insert their sequence so later ones
can reuse it. Unlocked leaves are evicted least-recently-used first when the pool runs short.
"""

from __future__ import annotations

import heapq
import itertools
from typing import TYPE_CHECKING

import numpy as np

from moeserve.kvcache.page_allocator import PageAllocator
from moeserve.kvcache.prefix_cache import PrefixCache, PrefixMatch

if TYPE_CHECKING:
    from moeserve.kvcache.copy_engine import CopyHandle


class TreeNode:
    __slots__ = ("children", "parent", "key", "value", "host_value", "copying", "lock_ref", "last_access")

    def __init__(self, key: list[int], value: np.ndarray, parent: TreeNode | None):
        self.children: dict[tuple[int, ...], TreeNode] = {}
        self.parent = parent
        self.key = key  # token ids, a whole number of pages
        self.value: np.ndarray | None = value  # [len(key)] int64 KV slots; None: not on the device (host tier)
        self.host_value: np.ndarray | None = None  # [len(key)] int64 host pool slots (hiradix_cache.py)
        self.copying: CopyHandle | None = None  # the backup to host_value, until the cache saw it complete
        self.lock_ref = 0
        self.last_access = 0


class RadixCache(PrefixCache):
    """Prefix sharing over KV pages with LRU eviction."""

    def __init__(self, allocator: PageAllocator, page_size: int):
        super().__init__(allocator, page_size)
        self._clock = itertools.count(1)
        self.reset()

    def reset(self) -> None:
        if hasattr(self, "root"):
            self.evict(self.evictable_size)
        self.root = TreeNode([], np.zeros(0, dtype=np.int64), None)
        self.root.lock_ref = 1
        self.evictable_size = 0  # tokens in unlocked nodes
        self.protected_size = 0  # tokens in locked nodes

    # ------------------------------------------------------------------
    def _page_key(self, tokens: list[int], i: int) -> tuple[int, ...]:
        return tuple(tokens[i : i + self.page_size])

    def match_prefix(self, tokens: list[int]) -> PrefixMatch:
        """Longest cached prefix of `tokens` in whole pages: (its slots, the deepest node matched)."""
        path = self._match_path(tokens)
        slots = np.concatenate([n.value for n in path]) if path else np.zeros(0, dtype=np.int64)
        return PrefixMatch(slots, path[-1] if path else self.root)

    def _match_path(self, tokens: list[int]) -> list[TreeNode]:
        """The nodes below the root whose keys make the longest cached prefix of tokens (the last one split where
        the match ends inside it); each one's access time is now."""
        ps = self.page_size
        n = len(tokens) // ps * ps
        node, pos, path = self.root, 0, []
        now = next(self._clock)
        node.last_access = now
        while pos < n:
            child = node.children.get(self._page_key(tokens, pos))
            if child is None:
                break
            common = self._common_len(child.key, tokens, pos, n)
            if common < len(child.key):
                child = self._split(child, common)
            path.append(child)
            pos += len(child.key)
            node = child
            node.last_access = now
        return path

    def _common_len(self, key: list[int], tokens: list[int], pos: int, end: int) -> int:
        """Matching length of key against tokens[pos:end], in whole pages."""
        ps = self.page_size
        limit = min(len(key), end - pos)
        i = 0
        while i + ps <= limit and key[i : i + ps] == tokens[pos + i : pos + i + ps]:
            i += ps
        return i

    def _split(self, child: TreeNode, at: int) -> TreeNode:
        """Split child's key at `at` tokens; returns the new upper node."""
        upper = TreeNode(child.key[:at], None if child.value is None else child.value[:at], child.parent)
        if child.host_value is not None:
            upper.host_value = child.host_value[:at]
            child.host_value = child.host_value[at:]
            upper.copying = child.copying  # one copy covers both halves
        upper.lock_ref = child.lock_ref
        upper.last_access = child.last_access
        assert child.parent is not None
        child.parent.children[self._page_key(child.key, 0)] = upper
        child.key = child.key[at:]
        if child.value is not None:
            child.value = child.value[at:]
        child.parent = upper
        upper.children[self._page_key(child.key, 0)] = child
        return upper

    def insert(self, tokens: list[int], slots: np.ndarray) -> int:
        """Insert a sequence (whole pages only are taken). Returns how many leading tokens were already cached:
        the caller still owns the slots it passed for that range and frees those that differ from the tree's."""
        ps = self.page_size
        n = len(tokens) // ps * ps
        node, pos = self.root, 0
        now = next(self._clock)
        while pos < n:
            key = self._page_key(tokens, pos)
            child = node.children.get(key)
            if child is None:
                new = TreeNode(list(tokens[pos:n]), np.asarray(slots[pos:n], dtype=np.int64).copy(), node)
                new.last_access = now
                node.children[key] = new
                self.evictable_size += n - pos
                self._inserted(new)
                return pos
            common = self._common_len(child.key, tokens, pos, n)
            if common < len(child.key):
                child = self._split(child, common)
            if child.value is None:  # on the host tier only: the caller's copy is not taken (it frees it all)
                return n
            child.last_access = now
            pos += len(child.key)
            node = child
        return pos

    def _inserted(self, node: TreeNode) -> None:
        """A new node took a sequence's pages (a tier below copies them here)."""

    # ------------------------------------------------------------------
    @staticmethod
    def _device_len(node: TreeNode) -> int:
        """Tokens node holds in the device pool (the sizes count only those)."""
        return len(node.key) if node.value is not None else 0

    def lock(self, node: TreeNode) -> None:  # node and its ancestors
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable_size -= self._device_len(node)
                self.protected_size += self._device_len(node)
            node.lock_ref += 1
            node = node.parent  # type: ignore[assignment]

    def unlock(self, node: TreeNode) -> None:
        while node is not self.root:
            assert node.lock_ref > 0, "unbalanced radix cache unlock"
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.evictable_size += self._device_len(node)
                self.protected_size -= self._device_len(node)
            node = node.parent  # type: ignore[assignment]

    def evict(self, num_tokens: int) -> int:
        """Free at least num_tokens of unlocked cache, least recently used leaves first. Returns tokens freed."""
        leaves = [(n.last_access, id(n), n) for n in self._leaves() if n.lock_ref == 0]
        heapq.heapify(leaves)
        freed = 0
        while freed < num_tokens and leaves:
            _, _, leaf = heapq.heappop(leaves)
            self.allocator.free_slots(leaf.value.tolist())
            freed += len(leaf.key)
            self.evictable_size -= len(leaf.key)
            parent = leaf.parent
            assert parent is not None
            del parent.children[self._page_key(leaf.key, 0)]
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(leaves, (parent.last_access, id(parent), parent))
        return freed

    def _leaves(self) -> list[TreeNode]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node is not self.root:
                out.append(node)
        return out
