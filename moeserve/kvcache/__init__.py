"""KV memory: the device pool (kv_pool.py), its pages, each request's slots, and the prefix cache over them."""

from moeserve.kvcache.page_allocator import PageAllocator
from moeserve.kvcache.prefix_cache import NoPrefixCache, PrefixCache
from moeserve.kvcache.radix_cache import RadixCache


def make_prefix_cache(reuse: bool, allocator: PageAllocator, page_size: int) -> PrefixCache:
    """The scheduler's prefix cache, chosen once: a RadixCache, or a NoPrefixCache where nothing is reused."""
    return (RadixCache if reuse else NoPrefixCache)(allocator, page_size)
