"""Qwen2, Qwen3 and Qwen3-MoE: RoPE over the whole head (rotate_half), q/k RMSNorm on Qwen3."""

from torch_cp.models.gqa import GQAFamily

FAMILY = GQAFamily(modeling={
    "qwen2": ("transformers.models.qwen2.modeling_qwen2", "Qwen2Attention"),
    "qwen3": ("transformers.models.qwen3.modeling_qwen3", "Qwen3Attention"),
    "qwen3_moe": ("transformers.models.qwen3_moe.modeling_qwen3_moe", "Qwen3MoeAttention"),
}, rotate_halves=frozenset({"qwen2", "qwen3", "qwen3_moe"}))
