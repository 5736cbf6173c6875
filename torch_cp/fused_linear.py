"""Linears that read the same input, run as one GEMM.

In a decode step at batch 1 every weight GEMM is a matrix-vector product bound by reading its
weight, and cuBLAS reads small weights slower than large ones: on the H200, Qwen3-8B's k/v
projections (8 MB each) at 1.6 TB/s against 3.2-3.8 TB/s for q/o and the MLP (run 24,
BENCHMARKS.md "Where a decode step goes"). So the linears of one module that read the same
input (an attention's q/k/v, MLA's query and latent projections, a DeltaNet layer's input
projections, an MLP's gate and up) run as one GEMM over their weights concatenated, as vLLM's
``QKVParallelLinear`` and gpt-fast's ``wqkv`` do, with one launch instead of two to four.

The concatenated weight is the storage: each linear's weight (and bias) becomes a view of its
rows, so the memory, the modules and their state-dict entries stay as they were, and weights
copied in later (``load_state_dict``) reach the GEMM; replaced (``load_state_dict(assign=True)``,
set by hand), the fused weight is made from them again (``fuse_replaced``: at the load of a whole
module, and when an engine, ``generate`` or ``new_cache`` starts; not in an engine already
running, whose CUDA graphs hold the old weight). The model is patched after it is moved and
loaded, as ``patch_model`` asks (the engine refuses a model cast or moved after:
``runtime_to_run``); moved or cast after all the same, the linears become views of the converted
fused weight again (``FusedLinear._apply``).
``unpatch_model`` gives each linear its own storage back. Linears that are not plain
``nn.Linear`` of one dtype and device, or that carry hooks, run one by one.

For inference: the GEMM reads the fused weight, so no gradient reaches the linears' weights. A
state dict of a patched model holds views of one storage: ``save_pretrained`` saves it (it
clones shared tensors), ``safetensors.torch.save_file`` refuses it; unpatch first.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from torch_cp import gemv
from torch_cp.layers import forward_source

# The input projections of the modules torch_cp's families run, in the order their forwards
# unpack them; a module takes the first group whose linears it has.
IN_PROJECTIONS = (
    ("q_proj", "k_proj", "v_proj"),                                      # GQA, gated attention
    ("q_proj", "kv_a_proj_with_mqa"),                                     # MLA without q LoRA
    ("q_a_proj", "kv_a_proj_with_mqa"),                                   # MLA with q LoRA
    ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"),               # Qwen3.5 DeltaNet
    ("in_proj_qkvz", "in_proj_ba"),                                       # Qwen3-Next DeltaNet
)
# transformers' gated MLP, the same line in every family that has gate_proj and up_proj
# (whitespace removed, as ``forward_source`` gives it).
GATED_MLP_LINE = "self.down_proj(self.act_fn(self.gate_proj(x))*self.up_proj(x))"


def fusable(linears: Sequence[nn.Module], meta: bool = False) -> bool:
    """Whether ``linears`` can share one concatenated weight: plain ``nn.Linear`` (no subclass,
    tensor subclass or hook: quantised, LoRA, offloaded and sharded-tensor weights run one by
    one) over the same input size, dtype and device (the meta device only if ``meta``), all
    with a bias or none."""
    if len(linears) < 2 or any(type(m) is not nn.Linear for m in linears):
        return False
    first = linears[0].weight
    return all(
        type(m.weight) is nn.Parameter and m.weight.is_contiguous()
        and m.weight.device == first.device and m.weight.dtype == first.dtype
        and (meta or m.weight.device.type != "meta")
        and m.in_features == linears[0].in_features
        and (m.bias is None) == (linears[0].bias is None)
        and (m.bias is None or (type(m.bias) is nn.Parameter and m.bias.is_contiguous()
                                and m.bias.dtype == first.dtype
                                and m.bias.device == first.device))
        and not (m._forward_hooks or m._forward_pre_hooks or hasattr(m, "_hf_hook"))
        for m in linears)


class FusedLinear(nn.Module):
    """``linears`` reading one input x [..., in]: ``forward(x)`` returns their outputs in order,
    from one GEMM where ``fusable``, else from each linear."""

    def __init__(self, linears: Sequence[nn.Linear]):
        super().__init__()
        self.sizes = [m.out_features for m in linears]
        self.fused = fusable(linears)
        self.linears = list(linears)  # a plain list: their parent module owns them
        if not self.fused:
            return
        names = ("weight", "bias") if linears[0].bias is not None else ("weight",)
        # Every concatenation allocated before any linear is re-pointed: one out of memory
        # then leaves the linears as they were.
        joined = {name: _joined(linears, name) for name in names}
        for name, (whole, copied) in joined.items():
            if copied:
                _rebind(linears, name, whole)
        self.register_buffer("weight", joined["weight"][0], persistent=False)
        self.register_buffer("bias", joined["bias"][0] if "bias" in joined else None,
                             persistent=False)
        # Registered after the linears (its parent's last child), so it loads after them.
        self.register_load_state_dict_post_hook(_fuse_replaced)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if not self.fused:
            return tuple(m(x) for m in self.linears)
        return gemv.linear(x, self.weight, self.bias).split(self.sizes, dim=-1)

    def _apply(self, fn, recurse=True):
        """``model.to`` / ``.cuda()`` / ``.half()`` after patching: each part was converted apart
        (the linears are this module's siblings, converted before it); the linears become views
        of the converted fused weight again, so they keep sharing one storage."""
        super()._apply(fn, recurse)
        if self.fused:
            for name in ("weight", "bias"):
                whole = getattr(self, name)
                if whole is not None:
                    _rebind(self.linears, name, whole)
        return self

    @torch.inference_mode(False)  # parameters, never inference tensors (as in _fuse_replaced)
    def unfuse(self) -> None:
        """Give each linear its own storage again (``unpatch_model``: safetensors will not save
        views of one storage)."""
        if self.fused:
            for m in self.linears:
                for name in ("weight", "bias"):
                    p = getattr(m, name)
                    if p is not None:
                        setattr(m, name, _parameter_like(p, p.detach().clone()))


def fuse_replaced(model: nn.Module) -> None:
    """Make every fused weight of ``model`` from its linears' parameters again where they were
    replaced (``load_state_dict(assign=True)`` on a linear, a parameter set by hand); where the
    new ones cannot share a weight (another dtype or device), run the linears one by one. The
    engine, ``generate`` and ``new_cache`` call it (``runtime_to_run``); a fused module's load
    hook does after a load of the whole module."""
    for module in model.modules():
        if isinstance(module, FusedLinear):
            _fuse_replaced(module)


# Outside inference mode (``generate`` may run under it): a weight made there would be an
# inference tensor, which a later ``load_state_dict`` refuses.
@torch.inference_mode(False)
def _fuse_replaced(fused: FusedLinear, incompatible_keys=None) -> None:
    if not fused.fused:
        return
    if not fusable(fused.linears):
        fused.fused, fused.weight, fused.bias = False, None, None
        return
    for name in ("weight", "bias"):
        whole = getattr(fused, name)
        if whole is None:
            continue
        parts = [getattr(m, name) for m in fused.linears]
        now = _consecutive(parts)
        if now is None or now.data_ptr() != whole.data_ptr() or now.shape != whole.shape:
            setattr(fused, name, _concatenate(fused.linears, name))


def _concatenate(linears: Sequence[nn.Linear], name: str) -> torch.Tensor:
    """One tensor of the linears' ``name`` tensors; each linear's becomes a view of its rows
    (they already are when ``torch_cp.from_pretrained`` read them into ``fused_storage``)."""
    whole, copied = _joined(linears, name)
    if copied:
        _rebind(linears, name, whole)
    return whole


def _joined(linears: Sequence[nn.Linear], name: str) -> tuple[torch.Tensor, bool]:
    """The linears' ``name`` tensors as one, and whether it is a copy (else their storage)."""
    parts = [getattr(m, name) for m in linears]
    whole = _consecutive(parts)
    if whole is not None:
        return whole, False
    return torch.cat([p.detach() for p in parts]), True


def _rebind(linears: Sequence[nn.Linear], name: str, whole: torch.Tensor) -> None:
    """Each linear's ``name`` parameter becomes its rows of ``whole``, keeping the parameter's
    attributes (``requires_grad``, the TP shard record)."""
    offset = 0
    for m in linears:
        old = getattr(m, name)
        setattr(m, name, _parameter_like(old, whole[offset:offset + old.shape[0]]))
        offset += old.shape[0]


def _parameter_like(old: nn.Parameter, data: torch.Tensor) -> nn.Parameter:
    """A parameter over ``data`` with ``old``'s ``requires_grad`` and attributes."""
    new = nn.Parameter(data, requires_grad=old.requires_grad)
    new.__dict__.update(old.__dict__)
    return new


def _consecutive(parts: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The tensor of which ``parts`` are consecutive rows in order, if they are, else None."""
    storage, start = parts[0].untyped_storage(), parts[0].storage_offset()
    offset = start
    for p in parts:
        if p.untyped_storage().data_ptr() != storage.data_ptr() or p.storage_offset() != offset:
            return None
        offset += p.numel()
    rows = sum(p.shape[0] for p in parts)
    return parts[0].detach().new_empty(0).set_(storage, start, (rows, *parts[0].shape[1:]))


def fusion_groups(model: nn.Module, meta: bool = False) -> list[list[nn.Linear]]:
    """The groups of linears of ``model`` that ``patch_model`` runs as one GEMM where
    ``fusable``: every module's ``IN_PROJECTIONS`` group and every gated MLP's gate and up."""
    groups = [[m.gate_proj, m.up_proj] for m in gated_mlps(model)]
    groups += filter(None, map(_in_projections, model.modules()))
    return [g for g in groups if fusable(g, meta)]


def fused_storage(model: nn.Module, device: torch.device) -> dict[int, torch.Tensor]:
    """For a loader, by ``id`` of each (meta) weight and bias of ``fusion_groups``: its place in
    one empty tensor per group on ``device``. Read into those places, the fused linears share a
    storage before ``patch_model`` runs, which then copies nothing (a copy would add a group's
    bytes to the load's peak, and the freed originals stay resident in the CPU allocator)."""
    places = {}
    for group in fusion_groups(model, meta=True):
        for name in ("weight", "bias"):
            parts = [getattr(m, name) for m in group]
            if parts[0] is None:
                continue
            whole = torch.empty((sum(p.shape[0] for p in parts), *parts[0].shape[1:]),
                                dtype=parts[0].dtype, device=device)
            places.update(zip(map(id, parts), whole.split([p.shape[0] for p in parts])))
    return places


def fuse_in_projections(module: nn.Module) -> FusedLinear | None:
    """Give ``module`` (an attention or DeltaNet module) ``cp_in``, its first ``IN_PROJECTIONS``
    group as one ``FusedLinear``; None when it has none of them."""
    linears = _in_projections(module)
    if linears is None:
        return None
    module.cp_in = FusedLinear(linears)
    return module.cp_in


def _in_projections(module: nn.Module) -> list[nn.Module] | None:
    """The linears of ``module``'s first ``IN_PROJECTIONS`` group it has, else None."""
    for names in IN_PROJECTIONS:
        linears = [getattr(module, n, None) for n in names]
        if all(isinstance(m, nn.Module) for m in linears):
            return linears
    return None


def gated_mlps(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` whose forward is transformers' gated MLP over ``gate_proj`` and
    ``up_proj`` (dense decoder MLPs and shared experts)."""
    return [m for m in model.modules()
            if all(hasattr(m, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn"))
            and GATED_MLP_LINE in forward_source(type(m))]


def fuse_gate_up(mlp: nn.Module):
    """Give a ``gated_mlps`` module ``cp_gate_up`` and return its forward over it (the caller
    installs it and keeps the original, as for the attention forwards)."""
    mlp.cp_gate_up = FusedLinear([mlp.gate_proj, mlp.up_proj])

    def forward(x: torch.Tensor) -> torch.Tensor:
        gate, up = mlp.cp_gate_up(x)
        return mlp.down_proj(mlp.act_fn(gate) * up)

    return forward
