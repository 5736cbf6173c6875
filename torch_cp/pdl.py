"""Programmatic dependent launch (sm90): a kernel's programs start while the kernel before it
finishes, and wait for it only where they first read what it wrote.

A batch-1 decode layer is a chain of small kernels, and each pays its launch and its first trip
to memory after the one before has ended: about 2.5 us of a one-token linear's 7.4 (Qwen3-30B-
A3B's o, run 102; its weight alone takes 3.9 at the copy bandwidth). Launched with
``launch_pdl``, a kernel whose predecessor has let it start (``pdl_release``) runs its prologue
early: the one-token linears load their first slice of weights, which no kernel writes, then
``pdl_wait`` for the predecessor to end and its writes to be visible, and read their input. The
Triton decode and its merge, the pool write, the router and the fused experts only wait (they
read nothing before that no kernel writes). Kernels that compiled code calls go behind ops
(``torch_cp::one_token_linear``, ``::route``, ``::fused_expert_pairs``), since Inductor launches
the Triton kernels it traces without launch options.

Every program of a kernel launched this way calls ``pdl_wait`` before it reads anything an earlier
kernel wrote and before it ends: a kernel that ended early would let its own successor start
before the kernel two back had finished. Kernels launched without it (cuBLAS, FlashInfer, the
copies) start as before, after their predecessor has ended.

On by default on sm90 (runs 114-119: -9 % a Qwen3-30B-A3B step at one token, 3.03 against
3.33 ms; -4.5 % GLM-4.7-Flash's, -1 % Qwen3-8B's; every GPU test passed with it, run 117;
BENCHMARKS.md): ``TORCH_CP_PDL=0`` in the environment, or ``ENABLED = False`` (a benchmark's
``--kernel torch_cp.pdl.ENABLED=False``), turns it off for torch_cp's own kernels and for
Inductor's kernels in the compiled layers (``triton.enable_pdl``, each made to wait before its
first access: ``compat.inductor_pdl``).

Kernels import ``pdl_wait`` and ``pdl_release`` by name: where compiled code traces a kernel
(launched without the dependent launch), Inductor copies its source and the Triton functions it
names into the code it generates, but not a module (a kernel that called ``pdl.wait`` failed
there: ``NameError: 'pdl' is not defined``, run 114); ``tests/core/test_kernels_in_inductor.py``
checks every kernel.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

ENABLED = os.environ.get("TORCH_CP_PDL", "1") != "0"  # read at each launch
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def active(where: torch.Tensor | torch.device) -> bool:
    """Whether a kernel launched on this tensor's (or on this) device now takes the dependent
    launch: on, a CUDA device of compute capability 9 or more, and not Triton's interpreter."""
    device = where.device if isinstance(where, torch.Tensor) else torch.device(where)
    return (ENABLED and device.type == "cuda" and not INTERPRETED
            and torch.cuda.get_device_capability(device)[0] >= 9)


def launch_options(on: bool) -> dict:
    """The Triton launch options for a kernel launched with (``on``) or without it."""
    return {"launch_pdl": True} if on else {}


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Until the kernel before has ended and its writes are visible (with ``PDL``)."""
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def pdl_release(PDL: tl.constexpr):
    """Lets the next kernel's programs start (with ``PDL``); they still wait for this one."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
