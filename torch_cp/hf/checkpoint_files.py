"""A safetensors checkpoint's files and their headers: every tensor's key, file, shape and dtype.

The files: ``model.safetensors``, or the shards ``model.safetensors.index.json`` lists (its
``weight_map`` says which file holds each key) where there is no single file: the order
transformers' ``from_pretrained`` looks in (a folder saved again with another shard size can
hold both). Their headers are read with ``safetensors.safe_open`` before any weight, so missing
files, files that are not safetensors (an interrupted copy) and keys the index misplaces are
named first.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from transformers.core_model_loading import dot_natural_key

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
# safetensors' names of the floating dtypes a checkpoint's weights come in
FILE_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
               "F64": torch.float64}


@dataclass(frozen=True)
class Leaf:
    """One checkpoint tensor: its key, file, shape and safetensors dtype ("BF16", "F32", ...)."""

    key: str
    file: str
    shape: tuple[int, ...]
    dtype: str = ""

    @property
    def files(self) -> set[str]:
        return {self.file}


def read_headers(path: Path) -> tuple[dict[str, Leaf], list[str]]:
    """Every tensor of the checkpoint in ``path`` (key -> Leaf) from the files' headers alone, and
    the problems found (no safetensors files, an index that is not JSON, files the index names
    that are missing or not safetensors, keys the index puts in a file that lacks them)."""
    index, single = path / INDEX, path / WEIGHTS
    if single.is_file():
        weight_map, files = None, [WEIGHTS]
    elif index.is_file():
        try:
            weight_map = json.loads(index.read_text()).get("weight_map", {})
            files = sorted(set(weight_map.values()), key=dot_natural_key)
        except (ValueError, AttributeError, TypeError) as e:
            return {}, [f"{INDEX} is not a JSON object with a weight_map of file names ({e})"]
    else:
        return {}, [f"{path} holds no safetensors checkpoint ({WEIGHTS} or {INDEX})"]
    leaves, problems, unread = {}, [], set()
    for name in files:
        if not (path / name).is_file():
            problems.append(f"{INDEX} names {name}, which is not in {path}")
            continue
        try:
            with safe_open(str(path / name), framework="pt") as f:
                for key in f.keys():
                    if weight_map is None or weight_map.get(key) == name:
                        part = f.get_slice(key)
                        leaves[key] = Leaf(key, name, tuple(part.get_shape()), part.get_dtype())
        except (SafetensorError, OSError) as e:  # a cut or corrupt file (an interrupted copy)
            problems.append(f"{name} is not a readable safetensors file ({e})")
            unread.add(name)
    if weight_map:
        lost = sorted(k for k, name in weight_map.items() if k not in leaves
                      and (path / name).is_file() and name not in unread)
        problems += [f"{INDEX} puts {k} in {weight_map[k]}, which does not hold it" for k in lost]
    return leaves, problems
