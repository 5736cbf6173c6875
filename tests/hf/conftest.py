"""What the hf tests share: a one-rank gloo world for meshes that only need shapes."""

from __future__ import annotations

import pytest
import torch.distributed as dist


@pytest.fixture(scope="module")
def one_rank_world(tmp_path_factory):
    """A one-rank gloo process group for the module (or the one already there)."""
    if dist.is_initialized():
        yield
        return
    store = tmp_path_factory.mktemp("store") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
