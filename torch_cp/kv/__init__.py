from torch_cp.kv.allocator import PageAllocator
from torch_cp.kv.pool import GQAPool, MLAPool

__all__ = ["GQAPool", "MLAPool", "PageAllocator"]
