"""An Engine (with or without CUDA graphs) and its patched model are freed when the user drops
them: the pool, the captured graphs' memory and the FlashInfer workspaces. FlashInfer keeps a
32 MiB buffer of its own for the process once its kernels have run, so the check is that a
second engine leaves nothing behind that the first did not."""

from __future__ import annotations

import gc
import importlib.util
import weakref

import pytest
import torch

import torch_cp

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None, reason="needs FlashInfer"),
]


def referrers(obj) -> str:
    return "\n".join(f"{type(r).__name__}: {str(r)[:160]}" for r in gc.get_referrers(obj))


def allocated() -> int:
    gc.collect()
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def run_and_drop(cuda_graphs: bool) -> int:
    """Generate with a fresh patched model and engine, drop both; returns the pool's bytes."""
    model = torch_cp.tiny_qwen3(seed=0, dtype=torch.bfloat16, hidden_size=256, head_dim=128,
                                num_attention_heads=4, num_key_value_heads=1).cuda()
    torch_cp.patch_model(model, backend="flashinfer")
    engine = torch_cp.Engine(model, num_pages=4096, page_size=16, cuda_graphs=cuda_graphs,
                             max_rows=8, max_pages_per_row=8)
    assert engine.run([[1, 2, 3], [4, 5]], 4)[0].ok
    pool_bytes = engine.kv_bytes
    alive = weakref.ref(engine.pool), weakref.ref(model)
    del engine, model
    gc.collect()
    held = [w() for w in alive if w() is not None]
    assert not held, "\n\n".join(referrers(h) for h in held)
    return pool_bytes


@pytest.mark.parametrize("cuda_graphs", [False, True], ids=["eager", "graphs"])
def test_dropped_engine_returns_its_memory(cuda_graphs):
    run_and_drop(cuda_graphs)  # FlashInfer's own process-wide buffers are allocated once here
    before = allocated()
    for _ in range(2):
        pool_bytes = run_and_drop(cuda_graphs)
    assert allocated() - before < pool_bytes // 64, "dropped engines left memory allocated"


def test_free_memory_counts_the_blocks_torch_caches():
    """``mem_get_info`` does not count what torch's caching allocator holds unused, which it
    gives back to allocate a pool: a pool the size of one just dropped was refused as not
    fitting (helper 118). A GiB allocated and dropped leaves the free memory as it was."""
    from types import SimpleNamespace

    from torch_cp.engine import memory

    device = SimpleNamespace(device=torch.device("cuda"))
    before = memory._free_bytes(device)
    block = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    assert memory._free_bytes(device) < before - 2**29
    del block  # cached, not freed
    assert torch.cuda.memory_reserved() - torch.cuda.memory_allocated() >= 2**30
    assert abs(memory._free_bytes(device) - before) < 2**25
