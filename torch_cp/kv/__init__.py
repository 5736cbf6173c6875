from torch_cp.kv.allocator import PageAllocator
from torch_cp.kv.pool import GQAPool, MLAPool
from torch_cp.kv.prefix_cache import CacheState, PrefixCachingAllocator, page_key, page_keys

__all__ = ["CacheState", "GQAPool", "MLAPool", "PageAllocator", "PrefixCachingAllocator",
           "page_key", "page_keys"]
