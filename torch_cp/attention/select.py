"""Choose the partial-attention backend: FlashInfer where it can run, else the torch reference."""

from __future__ import annotations

import functools
import logging

import torch

from torch_cp.attention.backend import AttentionGeometry
from torch_cp.attention.flashinfer_gqa import GQA_HEAD_DIMS  # imports no flashinfer
from torch_cp.attention.torch_ref import TorchBackend

logger = logging.getLogger("torch_cp")

BACKEND_NAMES = ("auto", "torch", "flashinfer")  # what patch_model(backend=...) accepts
FLASHINFER_DTYPES = (torch.bfloat16, torch.float16)
MLA_DIMS = (512, 64)  # kv_lora_rank, rope_dim
MIN_CAPABILITY = (8, 0)


@functools.cache
def flashinfer_import_error() -> str | None:
    """Why ``import flashinfer`` fails here, or ``None`` when it imports."""
    try:
        import flashinfer  # noqa: F401
    except Exception as error:  # ImportError, or a broken install raising on import
        return f"{type(error).__name__}: {error}"
    return None


def cuda_capability(device: torch.device) -> tuple[int, int] | None:
    """Compute capability of a CUDA device, ``None`` without a usable CUDA device."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(device)


def flashinfer_problems(geometry: AttentionGeometry, device: torch.device | str,
                        dtype: torch.dtype) -> list[str]:
    """Every reason the FlashInfer backends cannot run this geometry here (empty: they can)."""
    device = torch.device(device)
    problems = []
    if device.type != "cuda":
        problems.append(f"device {device} is not a CUDA device")
    elif not torch.cuda.is_available():
        problems.append("CUDA is not available")
    else:
        capability = cuda_capability(device)
        if capability is not None and capability < MIN_CAPABILITY:
            problems.append(f"compute capability {capability} is below {MIN_CAPABILITY}")
    error = flashinfer_import_error()
    if error is not None:
        problems.append(f"flashinfer does not import ({error})")
    if dtype not in FLASHINFER_DTYPES:
        problems.append(f"dtype {dtype} is not bfloat16 or float16")
    if geometry.kind == "gqa":
        if geometry.head_dim not in GQA_HEAD_DIMS:
            problems.append(f"GQA head_dim {geometry.head_dim} is not one of {GQA_HEAD_DIMS}")
        if geometry.head_dim_v != geometry.head_dim:
            problems.append(f"GQA head_dim_v {geometry.head_dim_v} != head_dim "
                            f"{geometry.head_dim}")
    elif geometry.kind == "mla":
        dims = (geometry.kv_lora_rank, geometry.rope_dim)
        if dims != MLA_DIMS:
            problems.append(f"MLA kv_lora_rank/rope_dim {dims} are not {MLA_DIMS}")
    else:
        problems.append(f"unknown attention kind {geometry.kind!r}")
    return problems


def _flashinfer_backend(geometry: AttentionGeometry, device: torch.device, dtype: torch.dtype):
    if geometry.kind == "gqa":
        from torch_cp.attention.flashinfer_gqa import FlashInferGQABackend as cls
    else:
        from torch_cp.attention.flashinfer_mla import FlashInferMLABackend as cls
    return cls(geometry, device, dtype=dtype)


def make_backend(name: str, geometry: AttentionGeometry, device: torch.device | str,
                 dtype: torch.dtype = torch.bfloat16):
    """The partial-attention backend ``name`` for ``geometry`` on ``device``.

    Args:
        name: ``"torch"`` (the reference), ``"flashinfer"`` (ValueError listing every reason
            when it cannot run) or ``"auto"`` (FlashInfer when it can run, else torch).
        geometry: this rank's attention shapes; dtype: query and pool dtype.
    Returns:
        A backend whose ``.name`` says which was chosen; the choice is logged on ``torch_cp``.
    """
    if name not in BACKEND_NAMES:
        raise ValueError(f"attention backend must be one of {BACKEND_NAMES}, got {name!r}")
    device = torch.device(device)
    if name == "torch":
        logger.info("attention backend: torch (requested)")
        return TorchBackend(geometry, dtype)
    problems = flashinfer_problems(geometry, device, dtype)
    if problems:
        if name == "flashinfer":
            raise ValueError("the flashinfer attention backend cannot run: "
                             + "; ".join(problems))
        logger.info("attention backend: torch (auto; flashinfer unusable: %s)",
                    "; ".join(problems))
        return TorchBackend(geometry, dtype)
    backend = _flashinfer_backend(geometry, device, dtype)
    logger.info("attention backend: flashinfer (%s; %s %s on %s)",
                "requested" if name == "flashinfer" else "auto", geometry.kind, dtype, device)
    return backend
