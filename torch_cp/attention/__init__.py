from torch_cp.attention.backend import AttentionBackend, AttentionGeometry
from torch_cp.attention.exchange import CollectiveRecord, Exchange
from torch_cp.attention.module import ContextParallelAttention
from torch_cp.attention.partial import Partial, merge_partials, merge_two
from torch_cp.attention.torch_ref import TorchBackend, dense_partial

__all__ = [
    "AttentionBackend",
    "AttentionGeometry",
    "CollectiveRecord",
    "ContextParallelAttention",
    "Exchange",
    "Partial",
    "TorchBackend",
    "dense_partial",
    "merge_partials",
    "merge_two",
]
