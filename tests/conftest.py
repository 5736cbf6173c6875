"""Shared set-up of the suite: the helper modules (tests/helpers) importable from every folder,
tests marked ``gpu`` skipped without CUDA, one intra-op thread, and without CUDA torch_cp's
Triton kernels run in Triton's interpreter (``TRITON_INTERPRET``, read when a kernel is
defined: so before anything imports one).

The folders mirror the package: core/ (placement, plan, mesh, configuration), kv/, attention/,
state/ (hybrid models' state kernels), hf/ (patching, the cache, model.generate), models/ (the
families), engine/, graphs/ and
project/ (layering, private hooks, benchmarks, notebook, the NCCL launcher).
"""

import os
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import Phase, settings

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

HELPERS = Path(__file__).resolve().parent / "helpers"
sys.path.insert(0, str(HELPERS))

# scripts/mutants.py: a failing property only needs to fail, not to shrink to its smallest case.
settings.register_profile("mutants", phases=[Phase.explicit, Phase.reuse, Phase.generate])
if os.environ.get("TORCH_CP_MUTANTS"):
    settings.load_profile("mutants")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA: torch.cuda.is_available() is False")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    """The tests' matmuls are tiny, and on a shared 2-core machine intra-op threads only contend
    with the other tests' processes (spawned ranks set one thread too: helpers/multirank.py)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def fresh_dynamo(request):
    """Every GPU test starts with Dynamo's caches empty, as a process serving one model does:
    the tiny models' decoder layers share one code object (transformers'
    ``GradientCheckpointingLayer.__call__`` path), and the graphs of every model compiled before
    count toward its recompile limit (run 58: the 120th GPU test hit it)."""
    if "gpu" in request.keywords:
        torch._dynamo.reset()
    yield


@pytest.fixture(scope="module")
def one_rank_world(tmp_path_factory):
    """A one-rank gloo process group for the module (or the one already there): what
    shape-only meshes (``driver.shape_mesh``) need."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    store = tmp_path_factory.mktemp("store") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def shape_meshes_are_the_world(monkeypatch):
    """Validation takes a shape-only mesh (``driver.shape_mesh``) as spanning the whole world,
    so its other checks can be tested in the one-rank world (``test_validate`` checks the
    world check itself)."""
    monkeypatch.setattr("torch_cp.hf.validate.mesh_world_problems", lambda mesh: [])
