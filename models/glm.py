"""GLM, GLM-4 and GLM-4-MoE: partial RoPE (``partial_rotary_factor``); GLM and GLM-4 rotate
interleaved channel pairs, GLM-4-MoE rotates halves and has q/k RMSNorm when ``use_qk_norm``."""

from torch_cp.models.gqa import GQAFamily

FAMILY = GQAFamily(modeling={
    "glm": ("transformers.models.glm.modeling_glm", "GlmAttention"),
    "glm4": ("transformers.models.glm4.modeling_glm4", "Glm4Attention"),
    "glm4_moe": ("transformers.models.glm4_moe.modeling_glm4_moe", "Glm4MoeAttention"),
}, rotate_halves=frozenset({"glm4_moe"}))
