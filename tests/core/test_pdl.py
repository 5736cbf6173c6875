"""Where torch_cp launches its kernels as dependent launches (torch_cp/pdl.py). The launches
themselves run on the GPU only (tests/core/test_gemv.py's captured chain)."""

from __future__ import annotations

import torch

from torch_cp import pdl
from torch_cp.graphs import compile as regional
from torch_cp.tiny import tiny_qwen3


def test_only_on_a_cuda_device_of_sm90_when_on(monkeypatch):
    monkeypatch.setattr(pdl, "ENABLED", True)
    assert not pdl.active(torch.zeros(1)) and not pdl.active(torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(pdl, "INTERPRETED", False)
    assert pdl.active(torch.device("cuda:0")) and pdl.active("cuda")
    monkeypatch.setattr(pdl, "INTERPRETED", True)  # Triton's interpreter has no such launch
    assert not pdl.active("cuda")
    monkeypatch.setattr(pdl, "INTERPRETED", False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert not pdl.active("cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(pdl, "ENABLED", False)
    assert not pdl.active("cuda")
    assert pdl.launch_options(True) == {"launch_pdl": True} and pdl.launch_options(False) == {}


def test_compiled_layers_ask_inductor_for_it_where_active(monkeypatch):
    import torch._inductor.config as inductor_config

    model = tiny_qwen3()
    before = inductor_config.triton.enable_pdl
    seen = []
    monkeypatch.setattr(pdl, "active", lambda where: seen.append(torch.device(where)) or True)
    with regional.compiled_layers(model):
        assert inductor_config.triton.enable_pdl is True
    assert inductor_config.triton.enable_pdl == before and seen == [torch.device("cpu")]
    monkeypatch.setattr(pdl, "active", lambda where: False)
    with regional.compiled_layers(model):
        assert inductor_config.triton.enable_pdl == before
