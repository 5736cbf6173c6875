"""Every check ``patch_model`` runs before it allocates or modifies anything; all at once.

``mode="auto"`` resolves here: SP mode when the mesh has sp > 1, else TP mode. When context
parallelism cannot run in the mode chosen but would in the other, the problem says so.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from torch_cp.agreement import agree_over, described, fingerprint
from torch_cp.attention.select import BACKEND_NAMES, flashinfer_problems
from torch_cp.layers import attention_modules, decoder_mlps, linear_modules
from torch_cp.mesh import AXES, context_parallel_problems, mesh_world_problems
from torch_cp.models import Family, family_for
from torch_cp.placement import ContextParallel, page_size_problems
from torch_cp.runtime import model_dtype_device
from torch_cp.state.kernels import fla_available
from torch_cp.tp import mlp_problems
from torch_cp.values import plain_int

MODES = ("auto", "tp", "sp")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# RoPE whose frequencies follow each forward's longest position: a prompt prefilled in chunks, or
# a step that packs a short row with longer ones, would cache keys at other frequencies than the
# unpatched model's one call on the prompt alone.
SEQ_LEN_ROPE = ("dynamic", "longrope")


@dataclass(frozen=True)
class PatchSettings:
    """What validation resolved (``mode``: "tp" or "sp", never "auto"); ``patch_model`` builds
    from it."""

    family: Family
    context_parallel: bool
    mode: str
    backend: str
    page_size: int
    tp: int
    sp: int
    dtype: torch.dtype
    device: torch.device


def backend_problems(name: str, family: Family | None, config, dtype: torch.dtype | None,
                     device: torch.device | None) -> list[str]:
    """Unknown backend names; for ``"flashinfer"``, every reason it cannot run this model here."""
    if name not in BACKEND_NAMES:
        return [f"backend must be one of {', '.join(BACKEND_NAMES)}, got {name!r}"]
    if name != "flashinfer" or family is None or device is None:
        return []
    # What FlashInfer checks (head dims, dtype, device) does not depend on the TP split.
    geometry = family.geometry(config, 1, ContextParallel.single())
    return [f"backend 'flashinfer': {p}" for p in flashinfer_problems(geometry, device, dtype)]


def _mesh_sizes(mesh, problems: list[str]) -> tuple[int | None, int | None]:
    if mesh is None:
        return 1, 1
    if not isinstance(mesh, DeviceMesh):
        problems.append(f"mesh must be a DeviceMesh (torch_cp.init_mesh) or None, got "
                        f"{type(mesh).__name__}")
        return None, None
    if tuple(mesh.mesh_dim_names or ()) != AXES:
        problems.append(f"mesh axes must be named {AXES}, got {mesh.mesh_dim_names}")
        return None, None
    return mesh.size(AXES.index("tp")), mesh.size(AXES.index("sp"))


def _layer_problems(model: nn.Module, family: Family) -> list[str]:
    layers = [m.layer_idx for m in attention_modules(model, family.attention_classes)]
    hybrid = hasattr(family, "linear_classes")
    expected = (family.attention_layers(model.config) if hybrid
                else list(range(len(layers))))
    problems = []
    if not layers or layers != expected:
        problems.append(f"expected {'/'.join(family.attention_classes)} modules with layer "
                        f"indices {_ranges(expected) if hybrid else '0..n-1'}, found {layers}")
    if hybrid:
        linear = [m.layer_idx for m in linear_modules(model, family)]
        wanted = sorted(set(range(len(model.config.get_text_config().layer_types)))
                        - set(expected))
        if linear != wanted:
            problems.append(f"expected {'/'.join(family.linear_classes)} modules at layers "
                            f"{_ranges(wanted)}, found {linear}")
    return problems


def rope_problems(config) -> list[str]:
    """Why ``config``'s RoPE cannot run from a paged cache (``SEQ_LEN_ROPE``)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if not isinstance(params, dict):
        return []
    nested = [p for p in params.values() if isinstance(p, dict)]  # per layer type
    kinds = {p.get("rope_type", p.get("type")) for p in nested or [params]}
    return [f"rope_type {kind!r} takes its frequencies from each forward's longest position, "
            f"which chunked prefill and rows packed into one step change (tokens would differ "
            f"from the unpatched model's); torch_cp takes default, linear, yarn and llama3 RoPE"
            for kind in SEQ_LEN_ROPE if kind in kinds]


def _ranges(indices: list[int]) -> str:
    if not indices:
        return "none"
    return ", ".join(map(str, indices)) if len(indices) <= 8 else (
        f"{', '.join(map(str, indices[:8]))}, ... ({len(indices)} layers)")


def hybrid_backend_problems(name: str, family: Family | None) -> list[str]:
    """A hybrid model beside FlashInfer runs its linear attention with flash-linear-attention."""
    if name == "flashinfer" and hasattr(family, "linear_classes") and not fla_available():
        return ["backend 'flashinfer' runs a hybrid model's linear-attention layers with "
                "flash-linear-attention's kernels, which are not installed: pip install "
                "fla-core==0.6.0 (torch_cp's gpu extra), or backend='torch'"]
    return []


def resolve_mode(mode: str, sp: int) -> str:
    """``"auto"``: SP mode when the mesh has sp > 1, else TP mode; an explicit mode as given."""
    return ("sp" if sp > 1 else "tp") if mode == "auto" else mode


def _mode_problems(kv_heads: int, mode: str, tp: int, sp: int, page_size) -> list[str]:
    problems = context_parallel_problems(mode, kv_heads, tp, sp)
    if problems or page_size_problems(page_size, 1):
        return problems  # a page size that is no positive int is reported once, above
    partners, who = (tp // kv_heads, "TP ranks sharing a KV head") if mode == "tp" else (
        sp, "SP ranks")
    return [f"{p} ({who})" for p in page_size_problems(page_size, partners)]


def _context_parallel_problems(kv_heads: int, mode: str, tp: int, sp: int, page_size) -> list[str]:
    """Why context parallelism cannot run in ``mode`` (resolved) here, with the other mode
    suggested where that one would run."""
    chosen = resolve_mode(mode, sp)
    problems = _mode_problems(kv_heads, chosen, tp, sp, page_size)
    if not problems:
        return []
    other = "sp" if chosen == "tp" else "tp"
    if mode == "auto":
        problems[0] += f" (mode='auto' chose {chosen.upper()} mode: the mesh has sp = {sp})"
    other_works = not _mode_problems(kv_heads, other, tp, sp, page_size) and (
        other == "sp" or tp % kv_heads == 0)
    if other_works:
        problems[0] += (f"; {other.upper()} mode would work on this mesh: mode={other!r} "
                        f"(--mode {other} on the command line)")
    return problems


def validate_patch(model: nn.Module, *, context_parallel: bool, mesh, mode: str, backend: str,
                   page_size: int, device: torch.device | None = None) -> PatchSettings:
    """Check every ``patch_model`` argument against the model; ValueError naming every problem
    (under torchrun on every rank of the mesh alike, with the arguments that differ between
    ranks: ``agree_on_model``).

    ``device``: where the model's weights will be (``from_pretrained`` validates a model on the
    meta device before loading anything); by default where its parameters are.
    """
    page_size = plain_int(page_size)
    settings, problems = patch_problems(model, context_parallel=context_parallel, mesh=mesh,
                                        mode=mode, backend=backend, page_size=page_size,
                                        device=device)
    agree_on_model(model, "patch_model", mesh, device, [
        "cannot patch the model:\n  - " + "\n  - ".join(problems)] if problems else [],
        context_parallel=context_parallel, mode=mode, backend=backend, page_size=page_size)
    return settings


def agree_on_model(model, call: str, mesh, device: torch.device | None, problems: list[str],
                   **arguments) -> None:
    """Raise ``problems`` on every rank of ``mesh`` alike (``torch_cp.agreement``), with the
    other ranks' problems, or name the ``arguments``, model dtype or config (its public keys)
    that differ between them: a rank patched otherwise than its partners would hang in, or
    corrupt, their collectives. Gathers where the mesh is the whole world of more than one rank
    (a mesh that is not is refused: ``mesh_world_problems``), and
    where a rank of such a world asks for context parallelism with no mesh (refused, on every
    rank). A rank given no mesh and no context parallelism runs alone and gathers nothing: if
    its partners were given a mesh, they wait for it."""
    spans = mesh_spans_world(mesh, bool(arguments.get("context_parallel")))
    dtype, own = (model_dtype_device(model) if spans and isinstance(model, nn.Module)
                  else (None, None))

    def digest() -> dict[str, str]:
        config = getattr(model, "config", None)
        public = _public(config.to_dict() if hasattr(config, "to_dict") else {})
        return fingerprint(**arguments, dtype=dtype,
                           config=json.dumps(described(public), sort_keys=True, default=str),
                           mesh=None if mesh is None else (
                               tuple(mesh.mesh.shape), mesh.mesh_dim_names, mesh.device_type))
    agree_over(spans, own if device is None else device, call, problems, digest)


def mesh_spans_world(mesh, context_parallel: bool) -> bool:
    """Whether patching with ``mesh`` runs on every rank of a world of more than one rank (the
    mesh is the world's, or context parallelism asked for with no mesh, which is refused)."""
    world = dist.is_initialized() and dist.get_world_size() > 1
    return world and (
        mesh is None and context_parallel
        or isinstance(mesh, DeviceMesh) and mesh.mesh.numel() == dist.get_world_size())


def _public(config: dict) -> dict:
    """A config's ``to_dict()`` without what ranks that load one model may hold apart (private
    keys as ``_name_or_path``, the dtype it was loaded in, the transformers version), in nested
    configs too (Qwen3.5's ``text_config``)."""
    return {k: _public(v) if isinstance(v, dict) else v for k, v in config.items()
            if not str(k).startswith("_") and k not in ("transformers_version", "dtype",
                                                   "torch_dtype")}


def argument_problems(*, context_parallel, mesh, mode, backend, page_size) -> list[str]:
    """``patch_model``'s checks that need no model (``from_pretrained`` names them when it has
    no model to check: no checkpoint at its path)."""
    problems = [] if mode in MODES else [f"mode must be one of {', '.join(MODES)}, got {mode!r}"]
    problems += page_size_problems(page_size, 1)
    _mesh_sizes(mesh, problems)
    problems += backend_problems(backend, None, None, None, None)  # the name alone
    if not isinstance(context_parallel, bool):  # "False" from a config file is truthy
        problems.append(f"context_parallel must be True or False, got {context_parallel!r}")
    elif context_parallel and mesh is None:
        problems.append("context_parallel=True needs a mesh whose ranks share KV heads "
                        "(TP mode: tp > kv_heads; SP mode: sp >= 2)")
    return problems


def patch_problems(model: nn.Module, *, context_parallel: bool, mesh, mode: str, backend: str,
                   page_size: int, device: torch.device | None = None
                   ) -> tuple[PatchSettings | None, list[str]]:
    """``validate_patch``'s checks as (settings, problems): settings is None unless problems is
    empty. For callers that add problems of their own before raising once."""
    problems: list[str] = []
    config = getattr(model, "config", None)
    if config is None:
        return None, ["the model has no config (expected a transformers model)"]
    if hasattr(model, "torch_cp"):
        problems.append("the model is already patched (call torch_cp.unpatch_model first)")
    elif getattr(model, "_torch_cp_sharded", None):
        problems.append(f"a patch_model that failed had cut this model's weights to one of "
                        f"{model._torch_cp_sharded} TP ranks' shards: load the model again")
    family = None
    try:
        family = family_for(config.model_type)
    except ValueError as e:
        problems.append(str(e))
    problems += argument_problems(context_parallel=context_parallel, mesh=mesh, mode=mode,
                                  backend=backend, page_size=page_size)
    dtype, param_device = model_dtype_device(model)
    if device is None and param_device is not None and param_device.type == "meta":
        problems.append("the model's weights are on the meta device: load them before patching "
                        "(torch_cp.from_pretrained loads and patches a checkpoint)")
    device = param_device if device is None else device
    if dtype not in DTYPES:
        problems.append(f"dtype must be float32, bfloat16 or float16, the model has {dtype}")
    tp, sp = _mesh_sizes(mesh, [])  # its problems named above
    if tp is not None and mesh is not None and device is not None and (
            mesh.device_type != device.type):
        problems.append(f"the mesh is on {mesh.device_type} but the model is on {device.type}")

    problems += rope_problems(config.get_text_config())
    if family is not None:
        problems += _layer_problems(model, family)
        if tp is not None:
            problems += family.problems(config, tp)
            if tp > 1:
                problems += dict.fromkeys(p for mlp in decoder_mlps(model)
                                          for p in mlp_problems(mlp, tp))
    if backend in BACKEND_NAMES:  # an unknown name: named above
        problems += backend_problems(backend, family, config, dtype, device)
    problems += hybrid_backend_problems(backend, family)
    if (context_parallel is True and mesh is not None and family is not None and tp is not None
            and mode in MODES):
        problems += _context_parallel_problems(family.kv_heads(config), mode, tp, sp, page_size)
    if tp is not None and mesh is not None:  # with or without context parallelism
        problems += mesh_world_problems(mesh)
    if problems:
        return None, problems
    return PatchSettings(family, bool(context_parallel), resolve_mode(mode, sp), backend,
                         page_size, tp, sp, dtype, device), []
