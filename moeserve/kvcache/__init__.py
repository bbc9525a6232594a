"""KV memory: the device pool (kv_pool.py), its pages, each request's slots, and the prefix cache over them."""

from moeserve.kvcache.hiradix_cache import HiRadixCache
from moeserve.kvcache.host_pool import HostKVPool
from moeserve.kvcache.page_allocator import PageAllocator
from moeserve.kvcache.prefix_cache import NoPrefixCache, PrefixCache
from moeserve.kvcache.radix_cache import RadixCache
from moeserve.kvcache.storage_tier import StorageTier


def make_prefix_cache(reuse: bool, allocator: PageAllocator, page_size: int, host: HostKVPool | None = None,
                      write_policy: str = "write_through", storage: StorageTier | None = None) -> PrefixCache:
    """The scheduler's prefix cache, chosen once: a NoPrefixCache where nothing is reused, a HiRadixCache over
    the device pool and a host pool (and storage below it), or a RadixCache over the device pool alone."""
    if not reuse:
        return NoPrefixCache(allocator, page_size)
    if host is not None:
        return HiRadixCache(allocator, page_size, host, write_policy, storage)
    return RadixCache(allocator, page_size)
