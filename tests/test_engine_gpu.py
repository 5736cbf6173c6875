"""An Engine with CUDA graphs (and its patched model) frees every byte when the user drops it:
the pool, the captured graphs' memory pool and the FlashInfer workspaces."""

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


@pytest.mark.parametrize("cuda_graphs", [False, True], ids=["eager", "graphs"])
def test_dropped_engine_returns_its_memory(cuda_graphs):
    gc.collect()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    model = torch_cp.tiny_qwen3(seed=0, dtype=torch.bfloat16, hidden_size=256, head_dim=128,
                                num_attention_heads=4, num_key_value_heads=1).cuda()
    torch_cp.patch_model(model, backend="flashinfer")
    engine = torch_cp.Engine(model, num_pages=4096, page_size=16, cuda_graphs=cuda_graphs,
                             max_rows=8, max_pages_per_row=8)
    assert engine.run([[1, 2, 3], [4, 5]], 4)[0].ok
    pool_bytes = engine.kv_bytes
    assert torch.cuda.memory_allocated() - before >= pool_bytes
    alive = weakref.ref(engine.pool), weakref.ref(model)
    del engine, model
    gc.collect()
    torch.cuda.synchronize()
    held = [w() for w in alive if w() is not None]
    assert not held, "\n\n".join(referrers(h) for h in held)
    assert torch.cuda.memory_allocated() - before < pool_bytes // 4
