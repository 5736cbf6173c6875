"""Regional compilation of a patched model for the captured steps.

``torch.compile`` of the whole model unrolls every decoder layer into one graph, and Inductor
compiles each copy: an engine for Qwen3-8B's 36 layers took 130 s to set up on the H200, one
for the 8B MLA model more than 150 s. Compiling each decoder layer instead lets the layers share
their compiled graphs (the first layer's static shapes, the symbolic layer index, dynamic
shapes, one row specialised, and again for eager steps of fresh rows, which skip the context:
at most six, twice where a model mixes two kinds of layer, as DeepSeek's dense and MoE
layers), and both engines are ready in 15 s (BENCHMARKS.md, runs 20-22).

Two things make the layers share: the layer index, an int attribute that Dynamo would otherwise
specialise on (one graph per layer), is traced as a symbol (``allow_unspec_int_on_nn_module``);
and the pool ops take the whole pool with that index (``write_kv``, ``context_partial``), so no
graph holds a view of the pool picked by a symbolic index (with such a view, Inductor's
re-inplacing gave wrong logits in torch 2.13).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from torch_cp import compat, pdl
from torch_cp.layers import decoder_layers

# Graphs the capture may compile: up to twelve as above, and more for mixed buckets; Dynamo's
# default limit of 8 would fail the capture. Dynamo counts per code object over the process,
# and every transformers decoder layer runs the same one, so a process that compiles several
# models adds their graphs up toward it.
RECOMPILE_LIMIT = 64


@contextlib.contextmanager
def compiled_layers(model, layers: list[torch.nn.Module] | None = None) -> Iterator[None]:
    """Within the block, every decoder layer of ``model`` runs as ``torch.compile(layer,
    fullgraph=True)``; after it, as before it (eagerly, or as the user compiled it). Capture CUDA
    graphs inside it: they keep the compiled kernels. Entering it again reuses the graphs
    compiled before (Dynamo caches them by code and guards) and each layer's ``torch.compile``
    wrapper, so the engine enters it around each eager step it compiles, passing ``layers``
    (``decoder_layers(model)``, found once). On the 2-core development machine, for 36 layers,
    making the wrappers took 9 ms and walking the module tree for the layers 3 ms an entry.
    Where ``torch_cp.pdl`` is active on the layers' device, Inductor generates its kernels for
    the dependent launch too (read as it compiles: a layer compiled before keeps its kernels)."""
    layers = decoder_layers(model) if layers is None else layers
    before = [compat.compiled_call(layer) for layer in layers]
    for layer in layers:
        # What nn.Module.compile(fullgraph=True) sets, made once per layer.
        if getattr(layer, "_torch_cp_compiled_call", None) is None:
            layer._torch_cp_compiled_call = compat.compile_call(layer)
        compat.set_compiled_call(layer, layer._torch_cp_compiled_call)
    on_pdl = pdl.active(_device_of(layers))
    try:
        with compat.dynamo_layer_options(RECOMPILE_LIMIT), compat.inductor_pdl(on_pdl):
            yield
    finally:
        for layer, call in zip(layers, before):
            compat.set_compiled_call(layer, call)


def _device_of(layers: list[torch.nn.Module]) -> torch.device:
    """The device of the first parameter of ``layers`` (the CPU without any)."""
    for layer in layers:
        for p in layer.parameters():
            return p.device
    return torch.device("cpu")
