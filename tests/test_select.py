"""Backend selection (attention/select.py): the CPU-side logic, with FlashInfer's presence faked."""

import logging

import pytest
import torch

from torch_cp.attention import select
from torch_cp.attention.backend import AttentionGeometry
from torch_cp.attention.torch_ref import TorchBackend

GQA = AttentionGeometry("gqa", q_heads=32, kv_heads=8, head_dim=128, head_dim_v=128,
                        scale=128 ** -0.5, context_q_heads=32)
MLA = AttentionGeometry("mla", q_heads=16, kv_heads=1, head_dim=576, head_dim_v=512,
                        scale=192 ** -0.5, context_q_heads=16, rope_dim=64)


class FakeFlashInfer:
    def __init__(self, geometry, device, dtype):
        self.name, self.geometry, self.device, self.dtype = "flashinfer", geometry, device, dtype


@pytest.fixture
def flashinfer_here(monkeypatch):
    """Pretend CUDA (sm90) and FlashInfer are present; backends are built as fakes."""
    monkeypatch.setattr(select, "flashinfer_import_error", lambda: None)
    monkeypatch.setattr(select.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(select, "cuda_capability", lambda device: (9, 0))
    monkeypatch.setattr(select, "_flashinfer_backend", FakeFlashInfer)


@pytest.fixture
def flashinfer_missing(monkeypatch):
    monkeypatch.setattr(select, "flashinfer_import_error",
                        lambda: "ModuleNotFoundError: No module named 'flashinfer'")


def test_torch_is_the_reference_everywhere(caplog):
    with caplog.at_level(logging.INFO, logger="torch_cp"):
        backend = select.make_backend("torch", GQA, "cpu")
    assert isinstance(backend, TorchBackend) and backend.name == "torch"
    assert "torch (requested)" in caplog.text


def test_auto_on_cpu_falls_back_to_torch_and_logs_why(flashinfer_missing, caplog):
    with caplog.at_level(logging.INFO, logger="torch_cp"):
        backend = select.make_backend("auto", GQA, "cpu")
    assert isinstance(backend, TorchBackend) and backend.name == "torch"
    assert "torch (auto; flashinfer unusable" in caplog.text
    assert "device cpu is not a CUDA device" in caplog.text
    assert "No module named 'flashinfer'" in caplog.text


def test_flashinfer_refused_lists_every_reason(flashinfer_missing):
    bad = AttentionGeometry("gqa", q_heads=8, kv_heads=2, head_dim=96, head_dim_v=64,
                            scale=0.1, context_q_heads=8)
    with pytest.raises(ValueError) as info:
        select.make_backend("flashinfer", bad, "cpu", dtype=torch.float32)
    message = str(info.value)
    for reason in ("device cpu is not a CUDA device", "flashinfer does not import",
                   "dtype torch.float32 is not bfloat16 or float16", "GQA head_dim 96",
                   "head_dim_v 64 != head_dim 96"):
        assert reason in message, reason


def test_flashinfer_refuses_mla_dims_it_has_no_kernels_for(flashinfer_here):
    mla = AttentionGeometry("mla", q_heads=16, kv_heads=1, head_dim=320, head_dim_v=256,
                            scale=0.1, context_q_heads=16, rope_dim=64)
    with pytest.raises(ValueError, match=r"MLA kv_lora_rank/rope_dim \(256, 64\)"):
        select.make_backend("flashinfer", mla, "cuda")


def test_cuda_without_a_gpu_is_a_reason(monkeypatch, flashinfer_missing):
    monkeypatch.setattr(select.torch.cuda, "is_available", lambda: False)
    assert select.flashinfer_problems(GQA, "cuda", torch.bfloat16)[0] == "CUDA is not available"


def test_old_gpu_is_a_reason(flashinfer_here, monkeypatch):
    monkeypatch.setattr(select, "cuda_capability", lambda device: (7, 5))
    assert select.flashinfer_problems(GQA, "cuda", torch.bfloat16) == [
        "compute capability (7, 5) is below (8, 0)"]


@pytest.mark.parametrize("geometry", [GQA, MLA], ids=["gqa", "mla"])
@pytest.mark.parametrize("name", ["auto", "flashinfer"])
def test_flashinfer_chosen_when_it_can_run(flashinfer_here, caplog, geometry, name):
    assert select.flashinfer_problems(geometry, "cuda", torch.bfloat16) == []
    with caplog.at_level(logging.INFO, logger="torch_cp"):
        backend = select.make_backend(name, geometry, "cuda", dtype=torch.float16)
    assert isinstance(backend, FakeFlashInfer) and backend.name == "flashinfer"
    assert backend.geometry is geometry and backend.dtype == torch.float16
    assert backend.device == torch.device("cuda")
    assert f"attention backend: flashinfer ({'auto' if name == 'auto' else 'requested'}" \
        in caplog.text


def test_auto_with_an_unsupported_head_dim_uses_torch(flashinfer_here):
    odd = AttentionGeometry("gqa", q_heads=8, kv_heads=8, head_dim=80, head_dim_v=80,
                            scale=0.1, context_q_heads=8)
    assert select.make_backend("auto", odd, "cuda").name == "torch"


def test_unknown_name_is_a_value_error():
    with pytest.raises(ValueError, match="must be one of"):
        select.make_backend("triton", GQA, "cpu")


def test_import_error_is_reported_not_raised():
    error = select.flashinfer_import_error()
    assert error is None or "Error" in error


class Recording:
    """A backend that records what it was planned with and answers run_* with its tag."""

    name = "flashinfer"
    geometry = GQA

    def __init__(self, tag):
        self.tag, self.planned = tag, []

    def plan(self, plan):
        self.planned.append(plan)

    def run_context(self, q, pool, layer_idx):
        return self.tag

    def run_own(self, q, k, v):
        return self.tag


def test_bucketed_backend_routes_each_step_to_its_bucket():
    from types import SimpleNamespace

    from torch_cp.attention.bucketed import BucketedBackend
    from torch_cp.graphs import Bucket

    made = []

    def for_bucket(bucket, max_pages):
        made.append((bucket, max_pages))
        wide = " wide" if max_pages > 32 else ""
        return Recording(f"graph {bucket.rows}x{bucket.tokens}{wide}")

    backend = BucketedBackend(Recording("eager"), for_bucket)
    backend.add_bucket(Bucket(4, 4), max_pages=32)
    backend.add_bucket(Bucket(4, 4), max_pages=32)  # the same bucket: one backend
    backend.add_bucket(Bucket(4, 64), max_pages=32)
    backend.add_bucket(Bucket(4, 4), max_pages=96)  # another engine's wider tables: its own
    assert made == [(Bucket(4, 4), 32), (Bucket(4, 64), 32), (Bucket(4, 4), 96)]
    for graph_bucket, tag in [((4, 4, 32), "graph 4x4"), (None, "eager"),
                              ((4, 64, 32), "graph 4x64"), ((8, 8, 32), "eager"),
                              ((4, 4, 96), "graph 4x4 wide")]:
        plan = SimpleNamespace(graph_bucket=graph_bucket)
        backend.plan(plan)
        assert backend.run_context(None, None, 0) == tag and backend.run_own(None, None, None) \
            == tag
        assert backend.active.planned[-1] is plan
    assert backend.name == "flashinfer" and backend.geometry is GQA
