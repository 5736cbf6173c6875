"""Fixtures the engine tests share."""

import pytest

import torch_cp


@pytest.fixture(scope="module")
def model():
    """The tiny random Qwen3, patched at P = 1 (one per test module: engines over it share it)."""
    return torch_cp.patch_model(torch_cp.tiny_qwen3())
