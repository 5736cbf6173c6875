"""Model families torch_cp can patch: one module per family (see ``torch_cp.models.base.Family``).

The registry maps each supported ``config.model_type`` to the module whose ``FAMILY`` patches it.
Modules are imported when a model of their type is patched.
"""

from __future__ import annotations

import importlib

from torch_cp.models.base import Family

FAMILY_MODULES: dict[str, str] = {
    "qwen2": "torch_cp.models.qwen",
    "qwen3": "torch_cp.models.qwen",
    "qwen3_moe": "torch_cp.models.qwen",
    "glm": "torch_cp.models.glm",
    "glm4": "torch_cp.models.glm",
    "glm4_moe": "torch_cp.models.glm",
    "glm4_moe_lite": "torch_cp.models.mla",
    "deepseek_v3": "torch_cp.models.mla",
    "qwen3_next": "torch_cp.models.hybrid",
    "qwen3_5_text": "torch_cp.models.hybrid",
    "qwen3_5": "torch_cp.models.hybrid",
    "qwen3_5_moe_text": "torch_cp.models.hybrid",
    "qwen3_5_moe": "torch_cp.models.hybrid",
}
SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(sorted(FAMILY_MODULES))


def family_for(model_type: str) -> Family:
    """The family that patches ``model_type``; ValueError naming the supported types if none."""
    if model_type not in FAMILY_MODULES:
        raise ValueError(f"model type {model_type!r} is not supported; supported types: "
                         f"{', '.join(SUPPORTED_MODEL_TYPES)}")
    module = FAMILY_MODULES[model_type]
    try:
        family = importlib.import_module(module).FAMILY
    except (ImportError, AttributeError) as e:
        raise ValueError(f"model type {model_type!r}: its family module {module} is not "
                         f"available ({e})") from e
    if model_type not in family.model_types:
        raise ValueError(f"{module}.FAMILY does not cover model type {model_type!r}")
    return family


__all__ = ["FAMILY_MODULES", "SUPPORTED_MODEL_TYPES", "Family", "family_for"]
