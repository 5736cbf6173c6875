"""MoE experts that a CUDA graph can hold.

transformers 5 runs a MoE block's experts through ``config._experts_implementation``
(``@use_experts_implementation``): ``"eager"`` loops over the experts a step routes to, which
needs their ids on the host (``nonzero``, ``tolist``), so a capture fails inside CUDA
(cudaErrorStreamCaptureInvalidated) and ``torch.compile(fullgraph=True)`` cannot trace it.
``"grouped_mm"`` (one grouped GEMM over tokens sorted by expert, offsets counted on the device)
and ``"batched_mm"`` (each token's experts gathered, one batched GEMM) stay on the device, with
one exception: ``grouped_mm`` is captured only with bf16 weights (with fp32 it copies from the
host inside the capture on the H200, eager or compiled).

What can be captured, how exact and how fast each is: ``benchmarks/experts.py`` (BENCHMARKS.md,
"MoE models under CUDA graphs"); which is picked: ``PREFERRED``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from torch_cp import compat

log = logging.getLogger("torch_cp")

# By measurement on the H200 (BENCHMARKS.md, "MoE models under CUDA graphs"; Qwen3-30B-A3B and
# GLM-4.7-Flash blocks, bf16, replayed from a graph): at one token torch_cp's fused kernels
# (graphs/fused_experts.py; CUDA and Triton only) ran the block in 0.070 / 0.13 ms against
# grouped_mm's 0.112 / 0.166 with their first tiles (run 53), the tiles picked since halve their
# part (run 54), and a Qwen3-30B-A3B decode step at batch 1 takes 5.21 ms against 6.75 (runs 55,
# 40); they are more exact (fp32 up to SiLU(gate) * up), run graphs/grouped_experts.py's kernels
# up to MAX_GROUPED_PAIRS (0.26-0.31 ms at 32 and 64 tokens against grouped_mm's 0.45-0.51, run
# 76), and grouped_mm (bf16) or batched_mm above. grouped_mm takes 0.49-0.58 ms at 32 and 64
# tokens against batched_mm's 1.6-3.1 ms (which copies every token's experts); batched_mm is the
# one left where grouped_mm cannot be captured (weights other than bf16).
PREFERRED = ("torch_cp_fused", "grouped_mm", "batched_mm")


def register_fused(device: torch.device) -> bool:
    """Register torch_cp's fused experts with transformers (``"torch_cp_fused"``, for
    ``model.set_experts_implementation``) where they can run, CUDA with Triton; whether they
    can."""
    if device.type != "cuda":
        return False
    try:
        from torch_cp.graphs import fused_experts  # noqa: F401  (registers on import)
    except ImportError:  # no Triton
        return False
    return True


# Whether patch_model installs the router kernel (graphs/fused_router.py) on CUDA; off, the
# routers stay transformers'. On since runs 64-66 (docs/gpu-runs.md): the MoE GPU tests passed
# through it, eager, captured and compiled, except glm4_moe's compiled replay, which fails the
# same with it off (runs 66-68); Qwen3-30B-A3B's replayed batch-1 step fell from 4.21 to 3.86 ms.
# Not yet run over NCCL.
KERNEL_ROUTERS = True


def kernel_routers(model: nn.Module, device: torch.device) -> list[tuple[nn.Module, Callable]]:
    """The MoE routers of ``model`` that torch_cp's router kernel computes
    (graphs/fused_router.py), each with its forward through the kernel; none off CUDA, without
    Triton (the CPU keeps transformers' routers) or while ``KERNEL_ROUTERS`` is off."""
    if device.type != "cuda" or not KERNEL_ROUTERS:
        return []
    try:
        from torch_cp.graphs import fused_router
    except ImportError:  # no Triton
        return []
    return [(r, fused_router.fused_forward(r)) for r in fused_router.routers(model)]


# torch's grouped GEMM (transformers' ``grouped_mm`` experts, torch_cp's ``sorted_experts``)
# takes operands whose rows are a multiple of 16 bytes only ("strides should be multiple of 16
# bytes"). A TP shard of the intermediate channels can break that where the whole model kept it:
# 12 float32 channels over tp = 2 are rows of 24 bytes (helper 106).
GROUPED_MM_ROW_BYTES = 16


def grouped_mm_fits(experts: nn.Module) -> bool:
    """Whether torch's grouped GEMM takes ``experts``: its hidden and intermediate sizes (the
    rows of its weights and of the activations between them) multiples of 16 bytes."""
    size = experts.down_proj.element_size()
    return all(n * size % GROUPED_MM_ROW_BYTES == 0 for n in _hidden_inter(experts))


def available(name: str, device: torch.device) -> bool:
    """Whether implementation ``name`` can be chosen on ``device``."""
    return name != "torch_cp_fused" or register_fused(device)


def moe_blocks(model: nn.Module) -> list[nn.Module]:
    """Every MoE block of ``model`` (modules with an ``experts`` child)."""
    return [m for m in model.modules() if isinstance(getattr(m, "experts", None), nn.Module)]


def experts_modules(model: nn.Module) -> list[nn.Module]:
    """The ``experts`` of every MoE block of ``model``."""
    return [m.experts for m in moe_blocks(model)]


def _dispatches(experts: nn.Module) -> bool:
    """Whether ``experts`` runs through transformers' experts implementations."""
    try:
        return hasattr(experts, "is_concatenated") and bool(compat.experts_implementation(experts))
    except AttributeError:
        return False


def capturable(name: str | None, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether transformers' experts implementation ``name`` stays on the device (so a CUDA graph
    can hold it, eager or compiled) for weights of ``dtype`` on ``device``. On the CPU, where
    nothing is captured, whether it runs without transformers' experts loop."""
    if name in ("batched_mm", "torch_cp_fused"):  # the latter falls back to one that can
        return True
    if name != "grouped_mm":
        return False
    if device.type == "cuda":  # measured on the H200: fp32 grouped_mm copies from the host
        return dtype == torch.bfloat16 and torch.cuda.get_device_capability(device) >= (8, 0)
    return True


def experts_problems(model: nn.Module) -> list[str]:
    """Why the MoE experts of ``model`` cannot be made capturable (empty when they can)."""
    fixed = sorted({type(e).__name__ for e in experts_modules(model) if not _dispatches(e)})
    if not fixed:
        return []
    return [f"the MoE experts of this model ({', '.join(fixed)}) have no transformers experts "
            f"implementation to switch to, and their own forward may not be capturable in a "
            f"CUDA graph: run with cuda_graphs=False"]


def capturable_experts(model: nn.Module) -> str | None:
    """Make every MoE block of ``model`` run experts a CUDA graph can capture, before any capture.

    An implementation that cannot be captured is switched to the first of ``PREFERRED`` that
    can (``model.set_experts_implementation``), logged once. Returns the implementation switched
    to, or None when nothing changed (no MoE block, or one already capturable). ValueError
    (``experts_problems``) when the experts do not dispatch through transformers'
    implementations.
    """
    problems = experts_problems(model)
    if problems:
        raise ValueError("; ".join(problems))
    experts = experts_modules(model)
    if not experts:
        return None
    param = experts[0].down_proj
    dtype, device = param.dtype, param.device
    current = {compat.experts_implementation(e) for e in experts}
    if all(capturable(name, dtype, device) for name in current):
        return None
    fit = all(map(grouped_mm_fits, experts))
    choice = next(n for n in PREFERRED if available(n, device) and capturable(n, dtype, device)
                  and (fit or n != "grouped_mm"))
    _switch(model, experts, choice, getattr(model, "torch_cp", None))
    log.warning("torch_cp: MoE experts implementation %s cannot be captured in a CUDA graph "
                "with %s weights; switched to %r (model.set_experts_implementation)",
                "/".join(sorted(map(repr, current))), str(dtype).removeprefix("torch."), choice)
    return choice


def avoid_unfit_grouped_mm(model: nn.Module, runtime) -> str | None:
    """Switch the MoE experts of ``model`` from ``grouped_mm`` to ``batched_mm`` where torch's
    grouped GEMM cannot take their shapes (``grouped_mm_fits``), logged once, recording the
    implementations before in ``runtime`` for ``unpatch_model``; patch_model calls it after TP
    sharding. Returns the implementation switched to, or None when nothing changed."""
    experts = [e for e in experts_modules(model) if _dispatches(e)]
    unfit = [e for e in experts
             if compat.experts_implementation(e) == "grouped_mm" and not grouped_mm_fits(e)]
    if not unfit:
        return None
    _switch(model, experts, "batched_mm", runtime)
    down = unfit[0].down_proj
    log.warning("torch_cp: grouped_mm takes MoE experts whose rows are multiples of %d bytes, "
                "and these (%s hidden x %s intermediate channels on this rank, %s) are not; "
                "switched to 'batched_mm' (model.set_experts_implementation)",
                GROUPED_MM_ROW_BYTES, *_hidden_inter(unfit[0]),
                str(down.dtype).removeprefix("torch."))
    return "batched_mm"


def _hidden_inter(experts: nn.Module) -> tuple[int, int]:
    """The hidden and intermediate sizes of ``experts`` (this rank's, under TP)."""
    down = experts.down_proj
    return (down.shape[2], down.shape[1]) if getattr(experts, "is_transposed", False) \
        else (down.shape[1], down.shape[2])


def _switch(model: nn.Module, experts: list[nn.Module], choice: str, runtime) -> None:
    """Set ``choice`` on ``model`` and ``experts``, first recording in ``runtime`` (if any, and
    not recorded yet) what they had."""
    if runtime is not None and runtime.experts_before is None:
        runtime.experts_before = (model.config._experts_implementation,
                                  [(e.config, compat.experts_implementation(e)) for e in experts])
    compat.set_experts_implementation(model, experts, choice)


def restore_experts(model: nn.Module, before: tuple) -> None:
    """Put back the experts implementations ``capturable_experts`` or ``avoid_unfit_grouped_mm``
    recorded (``unpatch_model``)."""
    model_choice, configs = before
    model.set_experts_implementation(model_choice)
    for config, name in configs:
        config._experts_implementation = name
