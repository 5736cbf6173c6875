"""The one-token linear (torch_cp/gemv.py) against ``F.linear`` in float32. Without CUDA the
kernel runs in Triton's interpreter (tests/conftest.py).

Tolerance: the kernel sums in float32 (in another order than the reference: ~1e-6 relative)
and rounds once to the output dtype, so each output is within one ulp of the float32 result:
2**-7 relative in bf16, 2**-10 in fp16 (round to nearest gives half that; Triton's interpreter
truncates). A wrong row, column, bias or tail slice would miss it by far more.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

pytest.importorskip("triton", reason="the kernel is Triton (CPU: its interpreter)")
from torch_cp import gemv  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ULP = {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}


@pytest.mark.parametrize("n, k, bias, dtype, wide, prefetch", [
    (13, 100, True, torch.bfloat16, False, False),   # rows and input not multiples of the tile
    (16, 2048, False, torch.float16, False, False),  # two input slices
    (40, 1536, True, torch.bfloat16, False, False),  # a partial last slice
    (44, 1300, True, torch.bfloat16, True, False),   # the wide weights' tile, three slices
    # The loop of the dependent launch (each next slice loaded ahead), without the launch:
    (13, 100, True, torch.bfloat16, False, True),    # one partial slice
    (40, 1536, True, torch.bfloat16, False, True),   # a partial last slice
    (44, 1300, False, torch.float16, True, True),    # three slices
])
def test_one_token_equals_the_float32_linear(monkeypatch, n, k, bias, dtype, wide, prefetch):
    monkeypatch.setattr(gemv, "WIDE_ROWS", 16 if wide else 1 << 30)
    torch.manual_seed(0)
    w = (torch.randn(n, k, device=DEVICE) / k ** 0.5).to(dtype)
    b = torch.randn(n, device=DEVICE).to(dtype) if bias else None
    x = torch.randn(1, 1, k, device=DEVICE).to(dtype)
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    got = (gemv._launch(x, w, b, on_pdl=False, prefetch=True) if prefetch
           else gemv.one_token(x, w, b))
    assert got.shape == (1, 1, n) and got.dtype == dtype
    if prefetch:  # the same sums in the same order as the plain loop's
        assert torch.equal(got, gemv._launch(x, w, b, on_pdl=False, prefetch=False))
    torch.testing.assert_close(got.float(), want, rtol=ULP[dtype],
                               atol=1e-5 * want.abs().max().item())


def test_linear_is_f_linear_outside_compiled_code():
    """Eagerly (a Triton launch costs host time), for several tokens and for float32 the
    dispatcher gives ``F.linear``'s result bit for bit."""
    torch.manual_seed(0)
    w = torch.randn(24, 64, device=DEVICE, dtype=torch.bfloat16)
    for x in (torch.randn(1, 64, device=DEVICE, dtype=torch.bfloat16),
              torch.randn(3, 64, device=DEVICE, dtype=torch.bfloat16)):
        assert not gemv.applies(x, w)
        torch.testing.assert_close(gemv.linear(x, w), F.linear(x, w), atol=0, rtol=0)
    x32, w32 = torch.randn(1, 64, device=DEVICE), torch.randn(24, 64, device=DEVICE)
    torch.testing.assert_close(gemv.linear(x32, w32), F.linear(x32, w32), atol=0, rtol=0)


@pytest.mark.gpu
def test_compiled_linears_run_the_kernel_for_one_token():
    """On CUDA compiled code takes the kernel for one token (its output within an ulp of
    float32, where cuBLAS's differs by its own order) and cuBLAS for two."""
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    compiled = torch.compile(gemv.linear, fullgraph=True)
    for rows in (4096, gemv.WIDE_ROWS + 8):  # both tiles
        w = (torch.randn(rows, 4096, device="cuda") / 64).to(torch.bfloat16)
        x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
        want = F.linear(x.float(), w.float())
        compiled(x, w)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            got = compiled(x, w)
            torch.cuda.synchronize()
        assert any("_gemv" in e.key for e in prof.key_averages()), rows
        torch.testing.assert_close(got.float(), want, rtol=ULP[torch.bfloat16],
                                   atol=1e-5 * want.abs().max().item())
        two = torch.randn(2, 4096, device="cuda", dtype=torch.bfloat16)
        torch.testing.assert_close(compiled(two, w), F.linear(two, w), atol=0, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("between", [False, True])
def test_dependent_launch_in_a_captured_chain(monkeypatch, between):
    """With ``torch_cp.pdl`` on (sm90), compiled code launches the kernel through its op with
    the dependent launch. Replayed from a CUDA graph with a new input each time, a chain of
    linears, each reading what the one before wrote (directly, or through an Inductor kernel
    generated with the dependent launch too: ``between``), gives what the chain compiled without
    it gives on that input. A kernel that read its input before the one before had written it
    would see values of the previous replay (or none), unrelated to this replay's: each
    linear's 4096-wide weight takes microseconds to read, so the window is wide, and 50 replays
    of six links give it many chances. Tolerance: the same sums in the same order, so equal but
    for rounding (a bf16 ulp or two, compounded over six links); a stale input misses by the
    size of the outputs."""
    from torch_cp import compat, pdl

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the dependent launch needs sm90")
    torch.manual_seed(0)
    ws = [(torch.randn(4096, 4096, device="cuda") / 64).to(torch.bfloat16) for _ in range(6)]

    def chain(x):
        outs = []
        for w in ws:
            x = gemv.linear(x, w)
            if between:
                x = x * 0.5 + 0.1
            outs.append(x)
        return torch.stack(outs)

    plain = torch.compile(chain, fullgraph=True)
    monkeypatch.setattr(pdl, "ENABLED", True)
    launched_with = []
    options = pdl.launch_options
    monkeypatch.setattr(pdl, "launch_options", lambda on: launched_with.append(on) or options(on))
    torch._dynamo.reset()
    compiled = torch.compile(chain, fullgraph=True)
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with compat.inductor_pdl(between), torch.cuda.stream(stream):
        for _ in range(2):
            compiled(x)
        stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            got = compiled(x)
    torch.cuda.current_stream().wait_stream(stream)
    assert launched_with and all(launched_with)
    # Off, and the spy gone: Dynamo would trace it into ``plain`` and guard on the list's length
    # (a recompile a call, past Dynamo's limit: run 116).
    monkeypatch.setattr(pdl, "ENABLED", False)
    monkeypatch.setattr(pdl, "launch_options", options)
    for _ in range(50):
        x.copy_(torch.randn_like(x))
        graph.replay()
        want = plain(x)
        torch.testing.assert_close(got.float(), want.float(), rtol=2.0 ** -6,
                                   atol=2.0 ** -6 * want.abs().max().item())
