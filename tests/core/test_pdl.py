"""Where torch_cp launches its kernels as dependent launches (torch_cp/pdl.py). The launches
themselves run on the GPU only (tests/core/test_gemv.py's captured chain; here, where
Inductor's kernels generated for it wait)."""

from __future__ import annotations

import pytest
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


def test_the_ops_trace_to_what_the_kernels_give():
    """The kernels behind ops for the dependent launch trace with fake tensors (as compiled
    code sees them) to the shapes and dtypes the kernels give launched without it."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from torch_cp import gemv
    from torch_cp.graphs import fused_experts as fe
    from torch_cp.graphs import fused_router as fr

    def traced(fn, *args):
        graph = make_fx(fn, tracing_mode="fake")(*args)
        (node,) = [n for n in graph.graph.nodes if n.op == "call_function"
                   and str(n.target).startswith("torch_cp.")]
        vals = node.meta["val"]
        return [(v.shape, v.dtype) for v in (vals if isinstance(vals, tuple) else (vals,))]

    def real(*outs):
        return [(t.shape, t.dtype) for t in outs]

    x, w = torch.randn(1, 64, dtype=torch.bfloat16), torch.randn(24, 64, dtype=torch.bfloat16)
    assert traced(lambda x, w: gemv._one_token_pdl(x, w, None), x, w) == real(
        gemv._launch(x, w, None, on_pdl=False))
    logits = torch.randn(3, 16, dtype=torch.bfloat16)
    softmax = fr.Routing("softmax", 4, True)
    assert traced(lambda t: fr._route_pdl(t, None, "softmax", 4, True, 1, 1, 1.0), logits) == (
        real(*fr._launch(softmax, logits, None, on_pdl=False)))
    logits, bias = torch.randn(3, 16), torch.zeros(16)
    sigmoid = fr.Routing("sigmoid", 4, True, 4, 2, 2.5)
    assert traced(lambda t, b: fr._route_pdl(t, b, "sigmoid", 4, True, 4, 2, 2.5),
                  logits, bias) == real(*fr._launch(sigmoid, logits, bias, on_pdl=False))
    x, ids, weights = torch.randn(2, 32), torch.randint(0, 8, (4,)), torch.rand(4)
    gate_up, down = torch.randn(8, 48, 32), torch.randn(8, 32, 24)
    tiles = fe.Tiles(16, 32, 4)
    assert traced(lambda *a: fe._pairs_pdl(*a, 2, 16, 32, 4, 16, 32, 4),
                  x, gate_up, down, ids, weights) == real(
        fe._pairs(x, gate_up, down, ids, weights, 2, tiles, tiles, on_pdl=False))


@torch.library.custom_op("torch_cp_test::two_results", mutates_args=())
def _two_results(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x * 2, x + 1


@_two_results.register_fake
def _(x):
    return torch.empty_like(x), torch.empty_like(x)


@pytest.mark.gpu
def test_inductor_kernels_wait_before_their_first_access():
    """Inductor's kernels generated for the dependent launch (``compat.inductor_pdl``) wait
    before their first load and store: after a custom op of two results (which Inductor splits
    into nodes of their own) whose first result a kernel reads, and for a kernel that only
    stores. A load before the wait could read what a kernel still running writes."""
    from torch._inductor.utils import run_and_get_code

    from torch_cp import compat

    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the dependent launch needs sm90")

    def fn(x, y):
        a, b = _two_results(x)
        return torch.relu(a) * y, b.sum(), torch.zeros(64, device=x.device)

    torch._dynamo.reset()
    x, y = torch.randn(4096, device="cuda"), torch.randn(4096, device="cuda")
    with compat.inductor_pdl(True):
        _, (code, *_) = run_and_get_code(torch.compile(fn, fullgraph=True), x, y)
    torch._dynamo.reset()
    kernels = [k for k in code.split("async_compile.triton(")[1:] if "gdc_launch" in k
               or "'launch_pdl': True" in k]
    assert kernels, code
    for kernel in kernels:
        body = kernel[kernel.index("def triton_"):]
        first = min(i for i in (body.find("tl.load("), body.find("tl.store(")) if i >= 0)
        assert 0 <= body.find("gdc_wait()") < first, kernel
