"""Linears of one token (a matrix-vector product) in one Triton kernel, in compiled steps.

At batch 1 a decode step is mostly the reading of its weights, and cuBLAS reads them well below
the copy bandwidth where the weight is small or its rows long. Run 102 (one H200, BENCHMARKS.md,
`python -m benchmarks.gemv`), microseconds a linear with the weight out of L2, ``F.linear``
(cuBLAS) against this kernel at its tiles: Qwen3-8B's o 13.1 / 10.6 and down 30.5 / 25.3
(roofline 7.9 and 23.8), q/k/v 15.0 / 14.6, gate/up 48.1 / 47.6; Qwen3-30B-A3B's o 9.4 / 7.4,
q/k/v 7.9 / 7.7, router 4.8 / 2.5.

Each program sums ``ROWS`` rows of the weight over the whole input in slices (``TILE``), in
float32, as cuBLAS does, then adds the bias and rounds once; so a weight is read as hundreds of
independent strips. (Splitting the input dimension over programs, with the last program to
finish summing the parts in a fixed order, was slower at every shape of run 102.)

It runs only in code ``torch.compile`` traces (the compiled layers a captured step replays),
where Inductor launches it. Called eagerly, a Triton launch from Python costs more host time than
cuBLAS's, and an eager step at batch 1 waits on the host; in an eager graph capture the first
launch would also load the kernel inside the capture. Elsewhere, and for more than one token,
float32, a weight that is not row-major, a gradient wanted or autocast on, ``F.linear``. With
``torch_cp.pdl`` on, the kernel goes behind an op (Inductor launches a Triton kernel it traces
without launch options) and starts as a dependent launch, loading its first slice of weights
before the kernel that writes its input has ended: 3.27 -> 3.00 ms a Qwen3-30B-A3B step at one
token with Inductor's kernels launched so too (run 113).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import nn
from torch.nn import functional as F

from torch_cp import pdl
from torch_cp.layers import decoder_layers
from torch_cp.pdl import pdl_release, pdl_wait  # by name: Inductor copies them (pdl.py)

ROWS = 8  # weight rows a program sums
# (input features a program reads at a time, warps): at most 4096 rows the wider slice keeps
# more bytes in flight from the fewer programs (Qwen3-8B's o 10.6 against 11.7 us, down 25.3
# against 29.4); from WIDE_ROWS rows (640 programs, about five an H200 SM) the narrower one is
# as fast or faster (q/k/v 14.6 against 15.1, gate/up 47.6 against 48.5; run 102).
TILE = (1024, 8)
WIDE_TILE = (512, 4)
WIDE_ROWS = 5120
ENABLED = True  # off: every linear through F.linear (benchmarks time cuBLAS beside it)
DTYPES = (torch.bfloat16, torch.float16)


@triton.jit
def _gemv(x_ptr, w_ptr, b_ptr, out_ptr, N, K, w_sn, HAS_BIAS: tl.constexpr,
          ROWS: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
          PREFETCH: tl.constexpr, PDL: tl.constexpr):
    n = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    n_ok = n < N
    acc = tl.zeros([ROWS], tl.float32)
    if PREFETCH:
        # The first slice of weights before the wait (no kernel writes weights), each next
        # slice loaded while this one is summed (PDL: launched as a dependent launch).
        rows = w_ptr + n.to(tl.int64)[:, None] * w_sn
        k = tl.arange(0, BLOCK_K)
        w = tl.load(rows + k[None, :], mask=n_ok[:, None] & (k < K)[None, :], other=0.0)
        pdl_wait(PDL)
        pdl_release(PDL)
        for k0 in range(0, K, BLOCK_K):
            x = tl.load(x_ptr + k0 + k, mask=k0 + k < K, other=0.0)
            nxt = k0 + BLOCK_K + k
            w_next = tl.load(rows + nxt[None, :], mask=n_ok[:, None] & (nxt < K)[None, :],
                             other=0.0)
            acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], 1)
            w = w_next
    else:
        pdl_wait(PDL)  # every program waits, even where nothing is loaded before (pdl.py)
        pdl_release(PDL)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            rows = w_ptr + n.to(tl.int64)[:, None] * w_sn + k[None, :]
            if EVEN_K:
                w = tl.load(rows, mask=n_ok[:, None], other=0.0)
                x = tl.load(x_ptr + k)
            else:
                w = tl.load(rows, mask=n_ok[:, None] & (k < K)[None, :], other=0.0)
                x = tl.load(x_ptr + k, mask=k < K, other=0.0)
            acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], 1)
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + n, acc.to(out_ptr.dtype.element_ty), mask=n_ok)


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, on_pdl: bool,
            prefetch: bool | None = None) -> torch.Tensor:
    """The kernel: with the dependent launch (``on_pdl``), and with the weights' first slice
    loaded first (``prefetch``, by default with the dependent launch; apart, a test's)."""
    n, k = weight.shape
    out = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    block_k, warps = WIDE_TILE if n >= WIDE_ROWS else TILE
    block_k = min(block_k, triton.next_power_of_2(k))
    _gemv[(triton.cdiv(n, ROWS),)](
        x, weight, bias if bias is not None else weight, out, n, k, weight.stride(0),
        HAS_BIAS=bias is not None, ROWS=ROWS, BLOCK_K=block_k, EVEN_K=k % block_k == 0,
        PREFETCH=on_pdl if prefetch is None else prefetch, PDL=on_pdl, num_warps=warps,
        **pdl.launch_options(on_pdl))
    return out


# Inductor launches a Triton kernel that compiled code calls without launch options; behind an
# op, the kernel is launched from here (as the graph is captured), with them.
@torch.library.custom_op("torch_cp::one_token_linear", mutates_args=())
def _one_token_pdl(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
                   ) -> torch.Tensor:
    return _launch(x, weight, bias, on_pdl=True)


@_one_token_pdl.register_fake
def _(x, weight, bias):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def one_token(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
              ) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for x [..., K] holding one token, by the kernel (with the
    dependent launch where ``torch_cp.pdl`` is active, through an op).

    Args:
        x: [..., K], one token (``x.numel() == K``), its last dim contiguous.
        weight: [N, K] row-major, x's dtype; bias: [N] or None.
    Returns:
        [..., N] in x's dtype.
    """
    if pdl.active(x):
        return _one_token_pdl(x, weight, bias)
    return _launch(x, weight, bias, on_pdl=False)


def applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether ``linear`` runs the kernel: one token of bf16 or fp16 on CUDA, a row-major
    weight of its dtype (a contiguous bias of its rows), in compiled code (see the module's
    docstring), where no gradient is wanted (the kernel records none) and autocast is off (it
    would pick another dtype)."""
    return (ENABLED and x.is_cuda and x.dtype in DTYPES and weight.dtype == x.dtype
            and weight.dim() == 2 and x.shape[-1] == weight.shape[1]
            and x.numel() == weight.shape[1] and x.stride(-1) == 1 and weight.stride(1) == 1
            and (bias is None or (bias.dtype == x.dtype and bias.shape == weight.shape[:1]
                                  and bias.stride(0) == 1))
            and torch.compiler.is_compiling() and not torch.is_autocast_enabled("cuda")
            and not (torch.is_grad_enabled() and (
                x.requires_grad or weight.requires_grad
                or (bias is not None and bias.requires_grad))))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
           ) -> torch.Tensor:
    """``F.linear(x, weight, bias)``: through ``one_token`` where it ``applies``."""
    if applies(x, weight, bias):
        return one_token(x, weight, bias)
    return F.linear(x, weight, bias)


def plain_linears(model: nn.Module) -> list[nn.Linear]:
    """The decoder layers' ``nn.Linear`` modules (not the LM head, read at the copy bandwidth
    already) whose forward ``patch_model`` may replace by ``linear``: exactly ``nn.Linear``,
    with a plain weight, no hook and no forward of its own set on it (quantised, LoRA and
    offloaded linears keep theirs)."""
    return [m for layer in decoder_layers(model) for m in layer.modules()
            if type(m) is nn.Linear and type(m.weight) is nn.Parameter and "forward" not in vars(m)
            and not (m._forward_hooks or m._forward_pre_hooks or hasattr(m, "_hf_hook"))]


def forward_of(module: nn.Linear):
    """A forward for ``module`` through ``linear`` (the caller installs it and keeps the
    original, as for the attention forwards)."""
    def forward(x: torch.Tensor) -> torch.Tensor:
        return linear(x, module.weight, module.bias)

    return forward
