"""patch_model: validate, pick the family, shard for TP, swap the attention forwards.

After patching, the model's forward takes ``cache=PagedKVCache`` (``past_key_values=`` in
earlier transformers 5 releases; with a step plan) and
attends through ``ContextParallelAttention`` over the placed paged pool. The model's own weights
are used in place; with ``tp > 1`` they are cut to this rank's shards, which cannot be undone.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from torch_cp import compat, gemv
from torch_cp.agreement import together
from torch_cp.attention.exchange import Exchange
from torch_cp.attention.module import ContextParallelAttention
from torch_cp.attention.select import make_backend
from torch_cp.fused_linear import FusedLinear, fuse_gate_up, fuse_in_projections, gated_mlps
from torch_cp.graphs.experts import (
    avoid_unfit_grouped_mm,
    experts_modules,
    kernel_routers,
    register_fused,
    restore_experts,
)
from torch_cp.hf import model_generate
from torch_cp.hf.forward import patched_forward, patched_linear_forward
from torch_cp.hf.validate import PatchSettings, mesh_spans_world, validate_patch
from torch_cp.layers import attention_modules, decoder_mlps, linear_modules
from torch_cp.mesh import AXES, kv_head_replicas, partner_placement
from torch_cp.placement import ContextParallel
from torch_cp.runtime import ModelRuntime, runtime_of
from torch_cp.state.kernels import fla_available
from torch_cp.state.layer import LinearStateLayer
from torch_cp.tp import row_parallel, shard_mlp

log = logging.getLogger("torch_cp")

_ABSENT = object()


def linear_kernels(backend_name: str) -> str:
    """A hybrid model's linear-attention kernels: flash-linear-attention's beside FlashInfer
    (when installed: validation requires it for ``backend="flashinfer"``), else transformers'
    torch ones (the reference)."""
    return "fla" if backend_name == "flashinfer" and fla_available() else "torch"


def shard_model(model: nn.Module, s: PatchSettings, mesh) -> None:
    """Cut the attention heads (the family's ``shard_attention``) and every MLP/MoE block to this
    TP rank's shards, in place (``s.tp > 1``). On a meta model nothing is allocated: each sharded
    parameter only records the part it keeps (``torch_cp.tp.shard_of``), which
    ``torch_cp.from_pretrained`` then reads from the checkpoint."""
    tp_rank, group = mesh.get_local_rank(AXES[1]), mesh.get_group(AXES[1])
    layout = kv_head_replicas(s.family.kv_heads(model.config), s.tp)
    for attn in attention_modules(model, s.family.attention_classes):
        s.family.shard_attention(attn, tp_rank, s.tp, layout)
        row_parallel(attn, "o_proj", group)
    for mod in linear_modules(model, s.family):
        s.family.shard_linear(mod, tp_rank, s.tp)
        row_parallel(mod, "out_proj", group)
    for mlp in decoder_mlps(model):
        shard_mlp(mlp, tp_rank, s.tp, group)


def patch_model(model: nn.Module, context_parallel: bool = False, mesh=None, mode: str = "auto",
                backend: str = "torch", page_size: int = 16) -> nn.Module:
    """Patch a Hugging Face Qwen, GLM or DeepSeek-V3 model in place to attend over a placed
    paged KV pool.

    Args:
        model: a transformers model of a supported ``config.model_type`` (see
            ``torch_cp.models.SUPPORTED_MODEL_TYPES``), fp32/bf16/fp16.
        context_parallel: stripe the pool over the ranks that share a KV head.
        mesh: ``torch_cp.init_mesh(tp=, sp=)`` (axes ("sp", "tp")) or None (one rank).
        mode: ``"tp"`` (partners: TP ranks sharing a KV head, tp > kv_heads), ``"sp"``
            (partners: the SP ranks; heads split over TP alone) or ``"auto"``: SP mode when the
            mesh has sp > 1, else TP mode. The mode chosen is the placement's
            (``model.torch_cp.placement.mode``).
        backend: ``"torch"``, ``"flashinfer"`` or ``"auto"``.
        page_size: logical page size of the pools this model will use; a multiple of P.
    Returns:
        ``model``, with ``model.torch_cp`` (a ``ModelRuntime``) and each attention module's
        ``cp_attention``. Its forward then needs ``cache=PagedKVCache(...)`` with a
        step plan (``model.generate`` makes one itself, see ``torch_cp.hf.model_generate``).
        Linears that read one input (q/k/v, gate/up) run as one GEMM, their weights views of one
        storage (``torch_cp.fused_linear``): move and load the model before patching it.
    Raises:
        ValueError naming every problem, before anything is allocated or modified; also when
        the model is already patched. Under torchrun every rank of the mesh raises it alike,
        naming another rank's problems, or the settings, model dtype or config that differ
        between ranks (every rank patches the same model alike). An error while patching (out
        of memory) puts back every forward and fused weight, and under torchrun is raised on
        every rank (``agreement.together``); a model whose weights were already cut to TP
        shards then cannot be patched again (load it again).
    """
    s = validate_patch(model, context_parallel=context_parallel, mesh=mesh, mode=mode,
                       backend=backend, page_size=page_size)
    return patch_validated(model, s, mesh)


def patch_validated(model: nn.Module, s: PatchSettings, mesh, shard: bool = True) -> nn.Module:
    """``patch_model`` after ``validate_patch`` gave ``s``: placement, TP sharding (unless
    ``shard=False``: the model was sharded already), runtime and the patched forwards."""
    family = s.family
    if compat.hub_kernels_off(model):
        log.warning("torch_cp.patch_model: turned transformers' kernels-hub layers off "
                    "(use_kernels=False): a change of their mode would replace the forwards "
                    "torch_cp installs")
    placement = (partner_placement(mesh, s.mode, family.kv_heads(model.config))
                 if s.context_parallel else ContextParallel.single())
    exchange = Exchange(placement)
    tp_rank = mesh.get_local_rank(AXES[1]) if mesh is not None else 0
    tp_group = mesh.get_group(AXES[1]) if s.tp > 1 else None
    geometry = family.geometry(model.config, s.tp, placement)
    made: list[ModelRuntime] = []  # the runtime, once made: what a failure below undoes

    # Allocates (backend workspace, fused and sharded weights), no collective. Outside inference
    # mode: weights made under it are inference tensors, which a later load_state_dict (or any
    # in-place write outside it) refuses.
    @torch.inference_mode(False)
    def patch() -> ModelRuntime:
        attn_backend = make_backend(s.backend, geometry, s.device, s.dtype)
        attns = attention_modules(model, family.attention_classes)
        linears = linear_modules(model, family)
        if s.tp > 1 and shard:
            model._torch_cp_sharded = s.tp  # one-way: refused again should this call fail
            shard_model(model, s, mesh)
        runtime = ModelRuntime(placement, exchange, attn_backend, geometry, len(attns), s.dtype,
                               s.device, s.page_size, s.tp, tp_rank, tp_group, family)
        made.append(runtime)
        for pool_layer, attn in enumerate(attns):  # the pool's layers: the attention layers only
            fuse_in_projections(attn)
            attn.cp_attention = ContextParallelAttention(pool_layer, attn_backend, exchange)
            _replace_forward(runtime, attn, patched_forward(family, attn))
        if linears:
            runtime.linear = family.linear_geometry(model.config, s.tp)
            runtime.linear_kernels = linear_kernels(attn_backend.name)
        for state_layer, mod in enumerate(linears):
            fuse_in_projections(mod)
            mod.cp_state = LinearStateLayer(state_layer, runtime.linear_kernels)
            _replace_forward(runtime, mod, patched_linear_forward(family, mod))
        for mlp in gated_mlps(model):
            _replace_forward(runtime, mlp, fuse_gate_up(mlp))
        if experts_modules(model):
            register_fused(s.device)  # so "torch_cp_fused" can be set by name
            avoid_unfit_grouped_mm(model, runtime)  # a TP shard may be rows it cannot take
        for linear in gemv.plain_linears(model):
            _replace_forward(runtime, linear, gemv.forward_of(linear))
        for router, forward in kernel_routers(model, s.device):
            _replace_forward(runtime, router, forward)
        return runtime

    try:  # on every rank or on none: one rank out of memory alone left the others waiting
        runtime = together(mesh_spans_world(mesh, s.context_parallel), s.device, "patch_model",
                           patch)
    except BaseException:
        if made:
            _restore(model, made.pop(), failed=True)  # popped: the backend's workspace freed
        raise
    model.torch_cp = runtime
    model_generate.install_generate(model)
    return model


def _replace_forward(runtime: ModelRuntime, module: nn.Module, forward) -> None:
    """Install ``forward`` on ``module``, keeping the forward it had for ``unpatch_model``."""
    runtime.originals.append((module, module.__dict__.get("forward", _ABSENT)))
    module.forward = forward


def unpatch_model(model: nn.Module) -> nn.Module:
    """Restore the original attention forwards of a model patched without TP sharding.

    Raises ValueError if the model is not patched, or if it was sharded over tp > 1: sharding is
    one-way (the other ranks' weights are gone), so reload the model instead.
    """
    runtime = runtime_of(model)
    if runtime.tp > 1:
        raise ValueError(f"the model was sharded over tp = {runtime.tp}: TP sharding is one-way, "
                         f"reload the model instead of unpatching it")
    _restore(model, runtime)
    model_generate.uninstall_generate(model)
    del model.torch_cp
    return model


def _restore(model: nn.Module, runtime: ModelRuntime, failed: bool = False) -> None:
    """Put back each forward ``runtime`` replaced, and unfuse every fused weight (a patch that
    ``failed`` may have fused a module's before replacing its forward; out of memory then, the
    linears unfusing would copy stay views of their fused weight, their values alike), and the
    experts implementations switched."""
    for module, original in reversed(runtime.originals):
        del module.forward
        if original is not _ABSENT:
            module.forward = original
    if runtime.experts_before is not None:
        restore_experts(model, runtime.experts_before)
    fused_groups = []
    for module in model.modules():
        for name in ("cp_attention", "cp_state", "cp_in", "cp_gate_up"):
            module.__dict__.pop(name, None)
            if isinstance(fused := module._modules.pop(name, None), FusedLinear):
                fused_groups.append(fused)
    for fused in fused_groups:
        try:
            fused.unfuse()
        except torch.OutOfMemoryError:
            if not failed:
                raise
