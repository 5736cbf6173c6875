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
    """Kernels that record what they were planned with and answer run_* with their tag."""

    def __init__(self, tag):
        self.tag, self.planned = tag, []

    def plan(self, plan):
        self.planned.append(plan)

    def run_context(self, q, caches, layer_idx):
        return self.tag

    def run_own(self, q, k, v):
        return self.tag


def test_flashinfer_backend_routes_each_step_to_its_buckets_kernels():
    """The FlashInfer backends keep one kernel set per bucket (and one for eager steps) and
    plan each step on the set of its bucket; a bucket never added is an error, not a silent
    fall-back to kernels that no captured graph replays."""
    from types import SimpleNamespace

    from torch_cp.attention.flashinfer_common import FlashInferBackend
    from torch_cp.plan import Bucket

    made = []

    class Fake(FlashInferBackend):
        def make_kernels(self, bucket):
            made.append(bucket)
            return Recording("eager" if bucket is None else f"graph {bucket}")

    backend = Fake(GQA, "cpu", torch.bfloat16)
    narrow, mixed, wide = Bucket(4, 4, 32), Bucket(4, 64, 32), Bucket(4, 4, 96)
    for bucket in (narrow, narrow, mixed, wide):  # adding a bucket twice makes one set
        backend.add_bucket(bucket)
    assert made == [None, narrow, mixed, wide]
    for bucket in (narrow, None, mixed, wide):
        plan = SimpleNamespace(bucket=bucket)
        backend.plan(plan)
        tag = "eager" if bucket is None else f"graph {bucket}"
        assert backend.run_context(None, None, 0) == tag == backend.run_own(None, None, None)
        assert backend._kernels[bucket].planned[-1] is plan
    with pytest.raises(ValueError, match="add_bucket"):
        backend.plan(SimpleNamespace(bucket=Bucket(8, 8, 64)))
    assert backend.name == "flashinfer" and backend.geometry is GQA


def test_the_workspace_grows_with_the_gqa_group_only_where_it_must():
    """FlashInfer's split-KV scratch for 2 * SMs / kv_heads work items of 128 query rows per
    query head: Qwen3-8B's shape fits the default 128 MiB; GLM-4-32B's 48 query heads over 2 KV
    heads (tensor-core decode pads a graph's batch to 132 items on 132 SMs, 198 MiB at tile 64)
    do not, and get the bound. MLA keeps the default."""
    from torch_cp.attention.flashinfer_common import WORKSPACE_BYTES, workspace_bytes

    assert workspace_bytes(GQA, sms=132) == WORKSPACE_BYTES
    glm = AttentionGeometry("gqa", q_heads=48, kv_heads=2, head_dim=128, head_dim_v=128,
                            scale=128 ** -0.5, context_q_heads=48)
    assert workspace_bytes(glm, sms=132) == 48 * 132 * 128 * 129 * 4 > 48 * 132 * 64 * 128 * 4
    assert workspace_bytes(MLA, sms=132) == WORKSPACE_BYTES


def test_a_staged_buffer_is_never_an_inference_tensor():
    """Made during a step under ``torch.inference_mode`` (every engine step), a staged buffer was
    an inference tensor, which a later step of the same shape outside it (a ``model.generate``
    turn) could not copy into (helper 93)."""
    from torch_cp.attention.flashinfer_common import staged

    with torch.inference_mode():
        buffer = staged(None, torch.arange(4))
    assert not buffer.is_inference()
    assert staged(buffer, torch.arange(4) + 1) is buffer
    assert buffer.tolist() == [1, 2, 3, 4]
