"""torch_cp.from_pretrained: each rank loads only its own TP shards of a safetensors checkpoint.

The steps, every check before any weight is read:

1. The config (``transformers.AutoConfig``) and the model built from it with
   ``accelerate.init_empty_weights()``: parameters on the meta device (no memory), buffers real
   (the rotary ``inv_freq`` is computed in ``__init__``, not stored in checkpoints). accelerate
   re-creates each parameter on meta, which unties tied embeddings, so transformers'
   ``tie_weights()`` ties them again.
2. Everything ``patch_model`` checks (``validate_patch`` on the meta model, with the device the
   weights will go to), the checkpoint's files and keys against the model (missing, unexpected,
   shapes; ``torch_cp.hf.checkpoint``), the dtype: one ValueError naming every problem.
3. TP sharding of the meta model by ``patch_model``'s own rules (``shard_model``: the family's
   ``shard_attention`` and ``torch_cp.tp``'s MLP/MoE split). Nothing is allocated; each sharded
   parameter records which part of the full tensor it keeps (``torch_cp.tp.Shard``).
4. Each parameter read from the safetensors files (``safe_open``, ``get_slice``): a recorded
   shard only in its rows/columns, the rest (embeddings, norms, ``lm_head``, routers) whole,
   straight into a tensor of the final dtype on the final device. So a TP rank's peak memory is
   about its shard, and its parameters equal those ``patch_model`` cuts from the whole model.
5. ``patch_model``'s remaining steps (placement, runtime, patched forwards).

Why these libraries: transformers owns the model classes, the checkpoint key renaming and MoE
expert fusion (reused, so keys map exactly as its ``from_pretrained`` maps them), tying, and
``GenerationConfig``; accelerate's ``init_empty_weights`` keeps buffers real, where a
``torch.device("meta")`` block would leave ``inv_freq`` to recompute; safetensors reads a slice of
a tensor from its memory map without reading the rest. transformers' own loader cannot be used:
its tensor parallelism (DTensor ``tp_plan``) cannot hold a KV head on several ranks, which TP-mode
context parallelism needs.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import accelerate
import torch
import transformers
from safetensors import safe_open
from torch import nn

from torch_cp.agreement import together
from torch_cp.fused_linear import fused_storage
from torch_cp.hf.checkpoint import map_checkpoint, read_into, tied_names
from torch_cp.hf.checkpoint_files import FILE_DTYPES, read_headers
from torch_cp.hf.patch import patch_validated, shard_model
from torch_cp.hf.validate import (
    DTYPES,
    agree_on_model,
    argument_problems,
    mesh_spans_world,
    patch_problems,
)
from torch_cp.tp import SHARD_ATTR, shard_of

log = logging.getLogger("torch_cp")

def _dtype(dtype, config, leaves: dict, problems: list[str]) -> torch.dtype:
    """The dtype asked for. None or "auto", as transformers' default for the text model it
    builds: the text config's ``dtype`` (a multimodal checkpoint's top-level one is not read:
    ``AutoModelForCausalLM`` builds its text model from the text config alone), else the
    checkpoint's first floating tensor's, else float32."""
    if dtype is None or dtype == "auto":
        on_file = (FILE_DTYPES[leaf.dtype] for leaf in leaves.values()
                   if leaf.dtype in FILE_DTYPES)
        text = config.get_text_config() if config is not None else None
        dtype = getattr(text, "dtype", None) or next(on_file, torch.float32)
    if isinstance(dtype, str):  # "bfloat16", as config.json spells it
        dtype = getattr(torch, dtype, dtype)
    if dtype not in DTYPES:
        problems.append(f"dtype must be float32, bfloat16 or float16, got {dtype}")
        return torch.float32
    return dtype


def _device(device, mesh, problems: list[str]) -> torch.device:
    """``device``, else the mesh's (CUDA: the current device), else CUDA when available; one
    that cannot hold the weights named in ``problems`` (the CPU stands in for the checks)."""
    try:
        if device is not None:
            device = torch.device(device)
        else:
            kind = (getattr(mesh, "device_type", None)
                    or ("cuda" if torch.cuda.is_available() else "cpu"))
            device = (torch.device("cuda", torch.cuda.current_device()) if kind == "cuda"
                      and torch.cuda.is_available() else torch.device(kind))
    except (RuntimeError, TypeError) as e:
        problems.append(f"device {device!r}: {e}")
        return torch.device("cpu")
    if device.type == "meta":
        problems.append("device meta holds no weights: load onto the CPU or a GPU")
    elif device.type == "cuda" and not torch.cuda.is_available():
        problems.append(f"device {device}: CUDA is not available")
    elif device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        problems.append(f"device {device}: there are {torch.cuda.device_count()} CUDA devices")
    elif device.type not in ("cpu", "cuda"):
        problems.append(f"device {device}: the weights load onto the CPU or a CUDA device")
    else:
        return device
    return torch.device("cpu")


def _meta_model(config, dtype: torch.dtype) -> nn.Module:
    with accelerate.init_empty_weights():
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.tie_weights()
    return model.eval()


class _Files:
    """Open safetensors files, each closed (its memory map released) after its last read."""

    def __init__(self, path: Path):
        self.path, self.handles = path, {}

    def __call__(self, name: str):
        if name not in self.handles:
            self.handles[name] = safe_open(str(self.path / name), framework="pt")
        return self.handles[name]

    def close(self, name: str) -> None:
        self.handles.pop(name, None)  # the last reference: safetensors unmaps the file


def _load(model: nn.Module, trees: dict, files: _Files, device: torch.device) -> None:
    """Replace every meta parameter / buffer named in ``trees`` by its part read from the files,
    in every module that holds it (tied parameters stay one object)."""
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    places = fused_storage(model, device)
    order = sorted(trees, key=lambda n: (max(trees[n].files), n))  # roughly file by file
    last = {f: i for i, n in enumerate(order) for f in trees[n].files}
    loaded = {}
    for i, name in enumerate(order):
        old = tensors[name]
        shard = shard_of(old)
        new = places.get(id(old))
        if new is None:
            new = torch.empty(old.shape, dtype=old.dtype, device=device)
        with torch.no_grad():
            read_into(trees[name], new, shard and shard.dim, shard and shard.runs(), files)
        if isinstance(old, nn.Parameter):
            new = nn.Parameter(new, requires_grad=old.requires_grad)
            if shard is not None:
                setattr(new, SHARD_ATTR, shard)
        loaded[id(old)] = new
        for f in trees[name].files:
            if last[f] == i:
                files.close(f)
    for module in model.modules():
        for slots in (module._parameters, module._buffers):
            for key, value in slots.items():
                if value is not None and id(value) in loaded:
                    slots[key] = loaded[id(value)]


def _untie_saved_apart(model: nn.Module, leaves: dict, files: _Files) -> list[str]:
    """Untie each tied parameter (tied embeddings) that the checkpoint holds under two of its
    names with different values, as transformers' loader does (with a warning: the config's
    ``tie_word_embeddings`` is wrong); the names untied. Reads those two tensors, only then."""
    untied = []
    for names in tied_names(model):
        saved = [n for n in names if n in leaves]
        if len(saved) < 2:
            continue
        first = files(leaves[saved[0]].file).get_tensor(saved[0])
        for name in saved[1:]:
            if torch.equal(first, files(leaves[name].file).get_tensor(name)):
                continue
            owner, _, attr = name.rpartition(".")
            module = model.get_submodule(owner)
            old = getattr(module, attr)
            setattr(module, attr, nn.Parameter(torch.empty_like(old, device="meta"),
                                               requires_grad=old.requires_grad))
            getattr(model, "all_tied_weights_keys", {}).pop(name, None)
            untied.append(name)
            log.warning("torch_cp.from_pretrained: the config ties %s to %s, but the checkpoint "
                        "holds both with different values, so they are not tied (as "
                        "transformers loads it); set tie_word_embeddings=False in its config",
                        name, saved[0])
    return untied


def _loaded_problems(model: nn.Module, dtype: torch.dtype, tied: bool) -> list[str]:
    problems = [f"{n} is still on the meta device" for n, p in
                (*model.named_parameters(), *model.named_buffers()) if p.is_meta]
    if model.dtype != dtype:
        problems.append(f"the model loaded as {model.dtype}, not {dtype}")
    if tied and model.get_output_embeddings().weight is not model.get_input_embeddings().weight:
        problems.append("the tied input and output embeddings came apart")
    return problems


def _refuse(path: Path, problems: list[str], model, mesh, device, arguments: dict) -> None:
    """One ValueError naming every problem found, if any; under torchrun on every rank of the
    mesh alike, with the other ranks' problems or the arguments, dtype or config that differ
    (``agree_on_model``)."""
    agree_on_model(model, "from_pretrained", mesh, device, [
        f"cannot load {str(path)!r}:\n  - " + "\n  - ".join(problems)] if problems else [],
        **arguments)


# Outside inference mode, as transformers loads: parameters made under it are inference tensors,
# which a later load_state_dict (or any in-place write outside it) refuses.
@torch.inference_mode(False)
def from_pretrained(path: str | os.PathLike, mesh=None, mode: str = "auto",
                    context_parallel: bool = False, dtype: torch.dtype | str | None = None,
                    backend: str = "torch", page_size: int = 16, device=None) -> nn.Module:
    """Load a Hugging Face checkpoint with each rank reading only its own TP shards, then patch it.

    The same model as ``patch_model(AutoModelForCausalLM.from_pretrained(path, dtype=dtype),
    ...)``, with the same parameters on every rank, without any rank ever holding the whole
    model: its peak memory is about its shard plus the replicated parameters (embeddings, norms,
    ``lm_head``, routers). See this module's docstring for how.

    Args:
        path: a local directory with ``config.json`` and ``model.safetensors`` (or
            ``model.safetensors.index.json`` and its shards), as ``save_pretrained`` writes.
        mesh, mode, context_parallel, backend, page_size: as ``patch_model``'s.
        dtype: float32, bfloat16 or float16 (or its name); None or "auto": the checkpoint's,
            as transformers takes it (``config.dtype``, here also its text config's, else its
            first floating tensor's), float32 when it has none. Parameters the model class keeps in
            float32 (``_keep_in_fp32_modules``, e.g. MoE routers) stay float32, as transformers
            loads them.
        device: where the weights go; None: the mesh's device type (CUDA: the current device),
            without a mesh CUDA when available, else the CPU.
    Returns:
        The patched model (``model.torch_cp``), in eval mode, with the checkpoint's
        ``generation_config.json`` when it has one.
    Raises:
        ValueError naming every problem (a path without a checkpoint, everything ``patch_model``
        refuses, keys missing from the checkpoint or not in the model, shapes that differ),
        before any weight is read; under torchrun on every rank of the mesh alike (with the
        other ranks' problems, or the settings, dtype or config that differ between ranks).
        A rank that then fails to read or to hold its weights raises its error, and every other
        rank one naming it (``agreement.together``).
    """
    problems: list[str] = []
    path, device = Path(path), _device(device, mesh, problems)
    arguments = dict(mode=mode, context_parallel=context_parallel, backend=backend,
                     page_size=page_size)
    found = (path / "config.json").is_file()  # else nothing is read (AutoConfig: the Hub)
    leaves, file_problems = read_headers(path) if found else ({}, [
        "not a directory with a config.json (a local checkpoint; download one with "
        "huggingface_hub.snapshot_download)"])
    problems += file_problems
    config, model = None, None
    try:
        config = transformers.AutoConfig.from_pretrained(path) if found else None
    except Exception as e:  # noqa: BLE001 (an unknown model_type, a config not JSON, a field of
        # the wrong type: named, on every rank, rather than raised on one before its gather)
        problems.append(f"config.json: {type(e).__name__}: {e}")
    generation = None  # read before the gather: a bad file is named with the rest
    if found and (path / "generation_config.json").is_file():
        try:
            generation = transformers.GenerationConfig.from_pretrained(path)
        except Exception as e:  # noqa: BLE001 (named on every rank, as config.json's)
            problems.append(f"generation_config.json: {type(e).__name__}: {e}")
    dtype = _dtype(dtype, config, leaves, problems)
    if config is not None:
        try:
            model = _meta_model(config, dtype)
        except Exception as e:  # noqa: BLE001 (no causal LM for it, an encoder-decoder; a size
            # its layers refuse, as vocab_size -1)
            problems.append(f"{type(config).__name__} builds no causal LM: {type(e).__name__}: "
                            f"{e}")
    if model is None:  # patch_model's checks that need no model named too
        _refuse(path, problems + argument_problems(**arguments, mesh=mesh), None, mesh, device,
                arguments)
    settings, refused = patch_problems(model, context_parallel=context_parallel, mesh=mesh,
                                       mode=mode, backend=backend, page_size=page_size,
                                       device=device)
    # No tensors but readable files: map them too, so every missing key is named.
    trees, key_problems = (map_checkpoint(model, leaves) if leaves or not file_problems
                           else ({}, []))
    _refuse(path, refused + problems + key_problems, model, mesh, device, arguments)

    def load() -> None:  # no collective in it
        trees_read = (map_checkpoint(model, leaves)[0]  # the untied names read their own
                      if _untie_saved_apart(model, leaves, _Files(path)) else trees)
        tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
        if settings.tp > 1:
            shard_model(model, settings, mesh)
        _load(model, trees_read, _Files(path), device)
        incomplete = _loaded_problems(model, dtype, tied)
        if incomplete:
            raise RuntimeError("from_pretrained left the model incomplete: "
                               + "; ".join(incomplete))
        model.to(device)  # the buffers made in __init__ (rotary inv_freq)

    # Reading and allocating the weights, on every rank or on none: a rank out of memory or
    # failing to read a shard alone left the others in their first collective, for ever.
    together(mesh_spans_world(mesh, context_parallel), device, "from_pretrained", load)
    if generation is not None:
        model.generation_config = generation
    return patch_validated(model, settings, mesh, shard=False)
