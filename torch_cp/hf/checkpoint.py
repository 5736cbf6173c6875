"""A safetensors checkpoint's tensors mapped to a model's parameters, each read only in the part
a rank keeps (the files and their headers: ``checkpoint_files``).

Checkpoint keys become the model's parameter names by transformers' own rules
(``conversion_mapping.get_model_conversion_mapping`` and ``core_model_loading.rename_source_key``,
what ``from_pretrained`` applies: renamings, the base-model prefix, and the converters that fuse
per-expert MoE weights ``mlp.experts.<e>.gate_proj/up_proj/down_proj`` into the fused 3-D
``experts.gate_up_proj`` / ``experts.down_proj``). A converted parameter is a tree over checkpoint
tensors (``Stack`` for ``MergeModulelist``, ``Cat`` for ``Concatenate``); reading a shard pushes
the kept range through the tree, so each checkpoint tensor is read only in the rows/columns the
rank keeps. Other conversion operations are refused by name.

Reads copy straight from the file's memory map into the parameter's final tensor (``copy_`` into a
preallocated tensor of the target dtype and device: no intermediate copy), and a file is closed
(its map released) once the last parameter that needs it is read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import (
    Concatenate,
    MergeModulelist,
    WeightConverter,
    WeightRenaming,
    dot_natural_key,
    rename_source_key,
)

from torch_cp.hf.checkpoint_files import Leaf

Runs = list[tuple[int, int]]  # [start, stop) ranges along one dimension, in order


@dataclass(frozen=True)
class _Parts:
    """A tensor made of ``parts`` along ``dim``; it reads the files its parts read."""

    dim: int
    parts: tuple

    @property
    def files(self) -> set[str]:
        return set().union(*(p.files for p in self.parts))


@dataclass(frozen=True)
class Stack(_Parts):
    """``torch.stack(parts, dim)`` (transformers' ``MergeModulelist``)."""

    @property
    def shape(self) -> tuple[int, ...]:
        s = self.parts[0].shape
        return (*s[:self.dim], len(self.parts), *s[self.dim:])


@dataclass(frozen=True)
class Cat(_Parts):
    """``torch.cat(parts, dim)`` (transformers' ``Concatenate``)."""

    @property
    def shape(self) -> tuple[int, ...]:
        s = self.parts[0].shape
        return (*s[:self.dim], sum(p.shape[self.dim] for p in self.parts), *s[self.dim + 1:])


def _part_problems(node) -> list[str]:
    """Parts of a Stack / Cat whose shapes do not fit together."""
    if isinstance(node, Leaf):
        return []
    problems = [p for part in node.parts for p in _part_problems(part)]
    drop = node.dim if isinstance(node, Cat) else None
    shapes = {tuple(n for i, n in enumerate(p.shape) if i != drop) for p in node.parts}
    if len(shapes) > 1:
        keys = [leaf.key for leaf in _leaves(node)]
        problems.append(f"checkpoint tensors {keys[0]} .. {keys[-1]} do not fit together: "
                        f"shapes {sorted(shapes)}")
    return problems


def _leaves(node) -> list[Leaf]:
    return [node] if isinstance(node, Leaf) else [x for p in node.parts for x in _leaves(p)]


def _converted(converter: WeightConverter, sources: dict[str, list[Leaf]]):
    """The tree ``converter``'s operations build from its checkpoint tensors."""
    nodes: dict[str, object] = dict(sources)
    for op in converter.operations:
        if isinstance(op, MergeModulelist):
            nodes = {p: Stack(op.dim, tuple(v)) for p, v in nodes.items()}
        elif isinstance(op, Concatenate):
            parts = []
            for pattern in converter.source_patterns:
                value = nodes.get(pattern)
                parts += value if isinstance(value, list) else [] if value is None else [value]
            nodes = {"": Cat(op.dim, tuple(parts))}
        else:
            raise ValueError(f"conversion {type(op).__name__} of {converter.source_patterns} is "
                             f"not supported by torch_cp.from_pretrained")
    if len(nodes) != 1 or isinstance(next(iter(nodes.values())), list):
        raise ValueError(f"conversion of {converter.source_patterns} into one parameter by "
                         f"{[type(op).__name__ for op in converter.operations]} is not "
                         f"supported by torch_cp.from_pretrained")
    return next(iter(nodes.values()))


def _ignored(key: str, patterns) -> bool:
    return any(re.search(p, key) for p in patterns or ())


def _names(names: list[str], most: int = 12) -> str:
    more = f" and {len(names) - most} more" if len(names) > most else ""
    return ", ".join(names[:most]) + more


def map_checkpoint(model: nn.Module, leaves: dict[str, Leaf]
                   ) -> tuple[dict[str, object], list[str]]:
    """Parameter or persistent-buffer name of ``model`` (unsharded, e.g. on the meta device) ->
    the tree of checkpoint tensors it is read from, and the problems: keys missing from the
    checkpoint, checkpoint keys the model has no place for, shapes that differ, conversions not
    supported. Names tied to another (``lm_head.weight`` with tied embeddings) are read once."""
    state = model.state_dict()
    buffers = {n for n, _ in model.named_buffers()}
    expected = {n for n, _ in model.named_parameters()} | (buffers & state.keys())
    # What the model computes at init and never saves (RoPE's inv_freq, which older checkpoints
    # hold per layer): skipped, as transformers skips it.
    computed = {n.rpartition(".")[2] for n in buffers - state.keys()}
    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    plain: dict[str, Leaf] = {}
    converted: dict[str, tuple[WeightConverter, dict[str, list[Leaf]]]] = {}
    unexpected, problems = [], []
    for key in sorted(leaves, key=dot_natural_key):  # transformers' order: experts 0, 1, .., E-1
        name, pattern = rename_source_key(key, renamings, converters, model.base_model_prefix,
                                          state)
        if name not in state and key in state:
            name, pattern = key, None
        if name not in state:
            if not (_ignored(key, getattr(model, "_keys_to_ignore_on_load_unexpected", None))
                    or key.rpartition(".")[2] in computed):
                unexpected.append(key)
        elif pattern is None:
            if name in plain:
                problems.append(f"checkpoint keys {plain[name].key} and {key} both load into "
                                f"{name}")
            plain[name] = leaves[key]
        else:
            sources = converted.setdefault(name, (by_pattern[pattern], {}))[1]
            sources.setdefault(pattern, []).append(leaves[key])
    trees = {name: leaf for name, leaf in plain.items() if name in expected}
    for name, (converter, sources) in converted.items():
        problems += _numbering_problems(name, sources)
        try:
            trees[name] = _converted(converter, sources)
        except ValueError as e:
            problems.append(str(e))
    for names in tied_names(model):  # a tied weight saved under another of its names
        saved = next((plain[n] for n in names if n in plain), None)
        if names[0] not in trees and saved is not None:
            trees[names[0]] = saved
    missing = sorted(n for n in expected - trees.keys()
                     if not _ignored(n, getattr(model, "_keys_to_ignore_on_load_missing", None)))
    if missing:
        problems.append(f"missing from the checkpoint: {_names(missing)}")
    if unexpected:
        problems.append(f"unexpected checkpoint keys (not in the model): {_names(unexpected)}")
    for name, tree in trees.items():
        unfit = _part_problems(tree)
        problems += unfit
        if not unfit and tuple(tree.shape) != tuple(state[name].shape):
            problems.append(f"{name}: the checkpoint holds shape {list(tree.shape)}, the model "
                            f"{list(state[name].shape)}")
    return {n: t for n, t in trees.items() if n in expected}, problems


def _numbering_problems(name: str, sources: dict[str, list[Leaf]]) -> list[str]:
    """Per-module keys (``experts.<e>.gate_proj.weight``) not numbered 0 to n - 1: stacked in
    key order, they would load into other slots (transformers' loader does not check)."""
    problems = []
    for pattern, parts in sources.items():
        number = re.compile(re.escape(pattern).replace(r"\*", r"(\d+)", 1))
        found = [number.search(leaf.key) for leaf in parts]
        if "*" not in pattern or not all(found):
            continue
        got = sorted(int(m.group(1)) for m in found)
        if got != list(range(len(parts))):
            missing = sorted(set(range(len(parts))) - set(got))
            past = sorted(i for i in set(got) if i >= len(parts))
            problems.append(f"{name}: the checkpoint's {pattern} keys are numbered "
                            f"{_names([str(i) for i in got])}, not 0 to {len(parts) - 1} "
                            f"(missing {_names([str(i) for i in missing]) or 'none'}; past the "
                            f"end {_names([str(i) for i in past]) or 'none'})")
    return problems


def tied_names(model: nn.Module) -> list[list[str]]:
    """The names of each parameter held under several (tied embeddings), the first the one
    ``named_parameters`` gives."""
    names: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    return [group for group in names.values() if len(group) > 1]


def read_into(node, out: torch.Tensor, dim: int | None, runs: Runs | None, handles) -> None:
    """Copy ``node`` into ``out``: whole (``dim`` None) or only ``runs`` along ``dim``, laid end
    to end. ``handles(file)``: that file's open ``safe_open``."""
    if isinstance(node, Leaf):
        if dim is None:
            out.copy_(handles(node.file).get_tensor(node.key))
            return
        sl, pos = handles(node.file).get_slice(node.key), 0
        for a, b in runs:
            out.narrow(dim, pos, b - a).copy_(sl[(slice(None),) * dim + (slice(a, b),)])
            pos += b - a
    elif isinstance(node, Stack):
        if dim == node.dim:  # a subset of the stacked tensors
            picked = [i for a, b in runs for i in range(a, b)]
            for j, i in enumerate(picked):
                read_into(node.parts[i], out.select(dim, j), None, None, handles)
            return
        inner = None if dim is None else dim - (dim > node.dim)
        for i, part in enumerate(node.parts):
            read_into(part, out.select(node.dim, i), inner, runs, handles)
    elif dim == node.dim:  # each run from the parts it spans, in the kept order
        starts = [0]
        for part in node.parts:
            starts.append(starts[-1] + part.shape[dim])
        pos = 0
        for a, b in runs:
            for i, part in enumerate(node.parts):
                lo, hi = max(a, starts[i]), min(b, starts[i + 1])
                if lo < hi:
                    read_into(part, out.narrow(dim, pos, hi - lo), dim,
                              [(lo - starts[i], hi - starts[i])], handles)
                    pos += hi - lo
    else:
        offset = 0
        for part in node.parts:
            size = part.shape[node.dim]
            read_into(part, out.narrow(node.dim, offset, size), dim, runs, handles)
            offset += size
