"""init_mesh: the device it picks, a one-rank mesh in a plain process, and what it says when the
ranks asked for need torchrun."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from torch_cp import mesh as mesh_module
from torch_cp.mesh import TORCHRUN_VARIABLES, init_mesh

ONE_RANK = """
import torch, torch.distributed as dist
from torch_cp import init_mesh, patch_model, generate
from torch_cp.tiny import tiny_qwen3
mesh = init_mesh()
assert (mesh.device_type, mesh.mesh_dim_names, tuple(mesh.shape)) == ("cpu", ("sp", "tp"), (1, 1))
assert (dist.get_backend(), dist.get_world_size(), dist.get_rank()) == ("gloo", 1, 0)
x = torch.ones(3)
dist.all_reduce(x, group=mesh.get_group("tp"))
assert x.tolist() == [1.0, 1.0, 1.0]
again = init_mesh()  # the group exists now: reused
placed = generate(patch_model(tiny_qwen3(), mesh=again), [[1, 2, 3]], 4, progress=False)
alone = generate(patch_model(tiny_qwen3()), [[1, 2, 3]], 4, progress=False)
assert placed[0].token_ids == alone[0].token_ids, (placed, alone)
dist.destroy_process_group()
print("one-rank mesh ok")
"""


@pytest.fixture
def no_torchrun(monkeypatch):
    for name in TORCHRUN_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert not dist.is_initialized()


@pytest.mark.slow  # spawns processes
def test_a_plain_cpu_process_gets_a_one_rank_mesh():
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARIABLES}
    done = subprocess.run([sys.executable, "-c", ONE_RANK], capture_output=True, text=True,
                          env={**env, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"},
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "one-rank mesh ok" in done.stdout


@pytest.mark.parametrize("tp,sp", [(2, 1), (1, 2), (2, 2)])
def test_more_ranks_without_torchrun_say_how_to_launch(no_torchrun, tp, sp):
    with pytest.raises(ValueError, match=f"launch with `torchrun --nproc-per-node {tp * sp} "):
        init_mesh(tp=tp, sp=sp)
    assert not dist.is_initialized()


def test_every_problem_is_named(no_torchrun):
    with pytest.raises(ValueError, match="tp must be an int >= 1, got 0; sp must be an int >= 1, "
                                         "got -1"):
        init_mesh(tp=0, sp=-1)
    # helper 77: a str or None was a TypeError, 2.0 advised `--nproc-per-node 2.0`, True reached
    # torch, "CPU" made a mesh patch_model refused as "on CPU but the model is on cpu"
    with pytest.raises(ValueError) as caught:
        init_mesh(tp="2", sp=2.0, device_type="CPU")
    assert str(caught.value) == ("invalid mesh: tp must be an int >= 1, got '2'; sp must be an "
                                 "int >= 1, got 2.0; device_type must be 'cuda' or 'cpu', got "
                                 "'CPU'")
    for bad in (None, True):
        with pytest.raises(ValueError, match=f"tp must be an int >= 1, got {bad}"):
            init_mesh(tp=bad)
    assert not dist.is_initialized()


def test_a_partial_torchrun_environment_is_named(no_torchrun, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match="sets RANK but not WORLD_SIZE, MASTER_ADDR, MASTER_PORT"):
        init_mesh()
    assert not dist.is_initialized()


def test_the_mesh_must_span_torchruns_world(no_torchrun, monkeypatch):
    for name, value in zip(TORCHRUN_VARIABLES, ("0", "4", "localhost", "29500")):
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=r"sp \* tp = 1 \* 2 = 2 does not match the world size 4"):
        init_mesh(tp=2)
    assert not dist.is_initialized()


@pytest.fixture
def recorded(monkeypatch, no_torchrun):
    """init_mesh's calls into torch.distributed, recorded instead of made."""
    calls = {}
    monkeypatch.setattr(dist, "init_process_group",
                        lambda backend, **kw: calls.update(backend=backend, **kw))
    monkeypatch.setattr(mesh_module, "init_device_mesh",
                        lambda device_type, shape, **kw: calls.update(device_type=device_type))
    return calls


@pytest.mark.parametrize("cuda,device_type,want", [
    (True, None, ("nccl", "cuda")), (False, None, ("gloo", "cpu")),
    (True, "cpu", ("gloo", "cpu")), (True, "cuda", ("nccl", "cuda"))])
def test_the_device_is_cuda_when_available_else_cpu(recorded, monkeypatch, cuda, device_type,
                                                    want):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    init_mesh(device_type=device_type)
    assert (recorded["backend"], recorded["device_type"]) == want
    assert (recorded["rank"], recorded["world_size"]) == (0, 1)  # the one-rank group


def test_cuda_without_cuda_is_named(no_torchrun, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="device_type 'cuda': CUDA is not available"):
        init_mesh(device_type="cuda")  # was NCCL's own RuntimeError (helper 77)


def test_under_torchrun_the_group_comes_from_the_environment(recorded, monkeypatch):
    for name, value in zip(TORCHRUN_VARIABLES, ("0", "1", "localhost", "29500")):
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    init_mesh()
    assert recorded == {"backend": "gloo", "device_type": "cpu"}  # env://, no store of ours
