"""A radix cache over two tiers: the device KV pool and a host KV pool below it (--enable-hierarchical-cache).

A node holds a device value, a host value, or both. Invariants:
  - a node on the device has every ancestor on the device; a node on neither tier is not in the tree;
  - the sizes (evictable_size, protected_size) count device tokens only: they are what the scheduler can free;
  - a locked node (lock_ref > 0) loses neither value: a match locks its path while it loads back or evicts.
Backups (device -> host) are queued to the copy engine (copy_engine.py) and complete off the scheduler's thread.
A node whose backup is in flight has host_value set and `copying` not done ("pending"): its device pages stay
allocated (eviction takes other leaves first and waits for a pending one only when nothing else is left), and
its host pages are neither read (load-back, the storage write) nor freed until the copy completed; reset and
close wait for every copy. Load-backs (host -> device, host_pool.py) gather the host rows in the scheduler's
thread: on CPU the copy is done when the match returns; on CUDA it is queued non_blocking on the compute stream
ahead of the prefill that reads it (run on one H100, 2026-12-07).

Write policies (SGLang's names): write_through copies a node to host when it enters the tree;
write_through_selective when a later match first reuses it; write_back when it is evicted from the device. Under
the write-through policies an evicted node without a host copy (the host pool was full) is dropped.
A match whose path ends on host-only nodes loads them into fresh device pages before it returns their slots; what
does not fit in the device pool stays on host and the match is shorter. The host pool evicts least recently used
host-only leaves. A finished sequence whose path meets a host-only node keeps its own pages out of the tree there
(the caller frees them): the tree's copy is loaded back by the next match instead.
With a storage tier below (storage_tier.py), every host copy made here is also written there, and a match that
goes past what device and host hold first reads the stored continuation into a new host-only node.
(The storage write of a node's pages runs in the copy engine's worker once its host copy is complete; puts
finish in the tier's writer thread from a copy of the pages: storage_tier.py.)
"""

from __future__ import annotations

import heapq
import time

import numpy as np

from moeserve.kvcache.copy_engine import CopyEngine
from moeserve.kvcache.host_pool import HostKVPool
from moeserve.kvcache.page_allocator import PageAllocator
from moeserve.kvcache.prefix_cache import PrefixMatch
from moeserve.kvcache.radix_cache import RadixCache, TreeNode
from moeserve.kvcache.storage_tier import StorageTier

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")  # --hicache-write-policy


class HiRadixCache(RadixCache):
    """RadixCache whose evicted pages go down to a host pool and come back on a match."""

    def __init__(self, allocator: PageAllocator, page_size: int, host: HostKVPool, write_policy: str,
                 storage: StorageTier | None = None):
        self.host = host
        self.write_policy = write_policy
        self.storage = storage  # below host: every host copy made here is written there; a match reads from it
        self.copies = CopyEngine(host)
        super().__init__(allocator, page_size)

    def close(self) -> None:
        """Finish the backups in flight (and their storage writes) and stop the copy engine's worker."""
        self.copies.close()

    def reset(self) -> None:
        if hasattr(self, "root"):  # flush_cache: nothing is locked
            self.copies.wait_all()  # no copy reads a page freed below
            for node in self._nodes():
                assert node.lock_ref == 0, "reset with a locked prefix"
                if node.value is not None:
                    self.allocator.free_slots(node.value.tolist())
                if node.host_value is not None:
                    self.host.free(node.host_value)
            self.evictable_size = 0  # freed above: the base evicts nothing more
        super().reset()

    # ------------------------------------------------------------------ match
    def match_prefix(self, tokens: list[int]) -> PrefixMatch:
        path = self._match_path(tokens)
        stored = self._prefetch(path, tokens) if self.storage is not None else None
        if stored is not None:
            path.append(stored)
        if not path:
            return PrefixMatch(np.zeros(0, dtype=np.int64), self.root)
        on_device = next((i for i, n in enumerate(path) if n.value is None), len(path))
        assert all(n.value is None for n in path[on_device:]), "a device node below a host-only one"
        self.lock(path[-1])  # backups may evict host-only leaves and load-back device leaves: not these
        try:
            if self.write_policy == "write_through_selective":
                for node in path[:on_device]:
                    if node.host_value is None:
                        self._backup(node)
            loaded = self._load_back(path[on_device:])
        finally:
            self.unlock(path[-1])
        path = path[: on_device + loaded]
        host_tokens = sum(len(n.key) for n in path[on_device:])
        storage_tokens = len(stored.key) if stored is not None and stored in path else 0
        slots = np.concatenate([n.value for n in path]) if path else np.zeros(0, dtype=np.int64)
        return PrefixMatch(slots, path[-1] if path else self.root, host_tokens, storage_tokens)

    def _prefetch(self, path: list[TreeNode], tokens: list[int]) -> TreeNode | None:
        """Read the stored pages that continue path (the tree's match of tokens) into host pages: a new host-only
        node below path's end, or None when storage has none (or the host pool has no room). A chain longer than
        the host pool can take is read as far as it fits."""
        assert self.storage is not None
        ps = self.page_size
        start, end = sum(len(n.key) for n in path), len(tokens) // ps * ps
        if end - start < ps:
            return None
        parent = path[-1] if path else self.root
        keys = self.storage.keys(tokens[:end])[start // ps :]
        self.lock(parent)  # making host room must not evict the path
        try:
            pages = self.storage.read(keys[: self.host.num_pages])
            host_slots = self._host_alloc(len(pages) * ps) if len(pages) else None
            if host_slots is None and len(pages):  # what the host pool could free: its free pages now
                pages = pages[: self.host.allocator.num_free_pages]
                host_slots = self.host.alloc(len(pages) * ps) if len(pages) else None
            if host_slots is None:
                return None
            self.storage.fill(host_slots, pages)
        finally:
            self.unlock(parent)
        node = TreeNode(list(tokens[start : start + len(pages) * ps]), None, parent)
        node.host_value = host_slots
        node.last_access = next(self._clock)
        parent.children[self._page_key(node.key, 0)] = node
        return node

    def match_len(self, tokens: list[int]) -> int:
        return sum(len(n.key) for n in self._match_path(tokens))

    def _load_back(self, nodes: list[TreeNode]) -> int:
        """Give host-only nodes (a path's tail) device pages and copy them in; returns how many leading nodes
        got them (those that fit the device pool after eviction)."""
        if not nodes:
            return 0
        start = time.perf_counter()
        self.lock(nodes[-1])  # the whole path: neither its device part nor its host part may be evicted now
        try:
            need = sum(len(n.key) for n in nodes) // self.page_size
            short = need - self.allocator.num_free_pages
            if short > 0:
                self.evict(short * self.page_size)
            pages_left, count = self.allocator.num_free_pages, 0
            for node in nodes:
                pages_left -= len(node.key) // self.page_size
                if pages_left < 0:
                    break
                count += 1
            for node in nodes[:count]:
                slots = self.allocator.alloc_whole_pages(len(node.key))
                assert slots is not None
                self._settle(node, wait=True)  # host-only: its backup completed before eviction; make sure
                assert node.host_value is not None, "a host-only node whose host copy failed"
                self.host.load(node.host_value, slots)
                node.value = slots
                self.protected_size += len(node.key)  # locked until the unlock below
        finally:
            self.unlock(nodes[-1])
        self.host.traffic.load_back_seconds += time.perf_counter() - start
        return count

    # ------------------------------------------------------------------ insert
    def _inserted(self, node: TreeNode) -> None:
        if self.write_policy == "write_through":
            self._backup(node)

    def _backup(self, node: TreeNode) -> bool:
        """Give a device node a host copy (evicting host-only leaves for room); False when the host pool is full of
        what it may not evict."""
        assert node.value is not None and node.host_value is None
        host_slots = self._host_alloc(len(node.key))
        if host_slots is None:
            return False
        then = None
        if self.storage is not None:  # keys now (the tree is the scheduler's); the write once the copy is done
            storage, keys = self.storage, self._node_keys(node)

            def then() -> None:
                storage.write(keys, host_slots)

        node.host_value = host_slots
        node.copying = self.copies.backup(node.value, host_slots, then)
        return True

    def _settle(self, node: TreeNode, wait: bool) -> bool:
        """Whether node has no backup in flight (waiting for it with wait). A completed backup is forgotten;
        a failed one drops the host copy (the node keeps its device pages)."""
        handle = node.copying
        if handle is None:
            return True
        if not handle.done():
            if not wait:
                return False
            handle.wait()
        node.copying = None
        if handle.error is not None and node.host_value is not None:
            self.host.free(node.host_value)
            node.host_value = None
        return True

    def _host_alloc(self, num_tokens: int) -> np.ndarray | None:
        """Host slots for num_tokens (whole pages), evicting host-only leaves for room; None when it cannot."""
        host_slots = self.host.alloc(num_tokens)
        if host_slots is None:
            self._evict_host(num_tokens - self.host.allocator.num_free_pages * self.page_size)
            host_slots = self.host.alloc(num_tokens)
        return host_slots

    def _node_keys(self, node: TreeNode) -> list[str]:
        """The storage keys of node's pages (they chain over every token from the root)."""
        assert self.storage is not None
        parts, n = [], node
        while n is not self.root:
            parts.append(n.key)
            n = n.parent  # type: ignore[assignment]
        tokens = [t for key in reversed(parts) for t in key]
        return self.storage.keys(tokens)[-(len(node.key) // self.page_size) :]

    # ------------------------------------------------------------------ eviction
    def _device_leaf(self, node: TreeNode) -> bool:
        return (node is not self.root and node.value is not None and node.lock_ref == 0
                and all(c.value is None for c in node.children.values()))

    def evict(self, num_tokens: int) -> int:
        """Free at least num_tokens of unlocked device pages, least recently used device leaves first; each keeps
        its host copy or leaves the tree. Under write_back the victims' copies are made now: all queued first, then
        waited for together, and only then are their device pages freed. Returns device tokens freed."""
        heap = [(n.last_access, id(n), n) for n in self._nodes() if self._device_leaf(n)]
        heapq.heapify(heap)
        freed = 0
        pending: list[TreeNode] = []  # leaves whose backup is in flight, least recently used first
        backing: list[tuple[TreeNode, np.ndarray]] = []  # write_back victims and their device slots, copy queued
        while freed < num_tokens:
            if heap:
                _, _, node = heapq.heappop(heap)
                if not self._settle(node, wait=False):
                    pending.append(node)  # evicted only if nothing else frees enough
                    continue
            elif pending:  # nothing else is left: one whose copy completed meanwhile, else wait for the oldest
                node = next((n for n in pending if n.copying is None or n.copying.done()), pending[0])
                pending.remove(node)
                self._settle(node, wait=True)
            else:
                break
            backed = False
            if node.host_value is None and self.write_policy == "write_back":
                backed = self._backup(node)
                if not backed and backing:  # host room may be held by the copies in flight: settle them, retry
                    self._finish_backing(backing)
                    backed = self._backup(node)
            slots, node.value = node.value, None
            assert slots is not None
            freed += len(node.key)
            self.evictable_size -= len(node.key)
            parent = node.parent
            assert parent is not None
            if backed:  # host-only now, its copy in flight: the device pages stay until it is done (below)
                backing.append((node, slots))
            else:
                self.allocator.free_slots(slots.tolist())
                if node.host_value is None:
                    self._drop(node)
            if self._device_leaf(parent):
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        self._finish_backing(backing)
        return freed

    def _finish_backing(self, backing: list[tuple[TreeNode, np.ndarray]]) -> None:
        """Wait for the write_back victims' copies, then free their device slots (emptying the list); a node whose
        copy failed leaves the tree."""
        for node, slots in backing:
            self._settle(node, wait=True)
            self.allocator.free_slots(slots.tolist())
            if node.host_value is None and self._attached(node):  # the copy failed (or an ancestor left the tree)
                self._drop(node)
        backing.clear()

    def _attached(self, node: TreeNode) -> bool:
        """Whether node is still in the tree (not under a node _drop took out)."""
        while node is not self.root:
            parent = node.parent
            if parent is None or parent.children.get(self._page_key(node.key, 0)) is not node:
                return False
            node = parent
        return True

    def _evict_host(self, num_tokens: int) -> int:
        """Drop at least num_tokens of host-only, unlocked leaves, least recently used first."""
        def candidate(n: TreeNode) -> bool:  # (a write_back victim's copy in flight: evict() settles it)
            return (n is not self.root and n.value is None and not n.children and n.lock_ref == 0
                    and n.copying is None)

        heap = [(n.last_access, id(n), n) for n in self._nodes() if candidate(n)]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            freed += len(node.key)
            self._drop(node)
            if candidate(parent):
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    def _drop(self, node: TreeNode) -> None:
        """Take a node off the device (done already) and out of the tree, with the host-only subtree below it."""
        stack = [node]
        while stack:
            n = stack.pop()
            assert n.lock_ref == 0 and n.value is None, "dropping a locked or device-resident node"
            if n.host_value is not None:
                self._settle(n, wait=True)  # (a write_back victim's copy in flight: its host pages are not free yet)
                if n.host_value is not None:
                    self.host.free(n.host_value)
                n.host_value = None
            stack.extend(n.children.values())
        assert node.parent is not None
        del node.parent.children[self._page_key(node.key, 0)]

    def _nodes(self) -> list[TreeNode]:
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    @property
    def host_tokens(self) -> int:
        """Tokens held on the host tier (with or without a device copy)."""
        return (self.host.num_pages - self.host.allocator.num_free_pages) * self.page_size
