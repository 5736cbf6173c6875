"""Tiny MLA models (DeepSeek-V3 and GLM-4.7-Flash attention) and their prompts, shared by the MLA
family tests and the compile tests."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, DeepseekV3Config, Glm4MoeLiteConfig

# End to end (patched vs unpatched model, fp32): the attention outputs differ by ~1e-6 (above);
# through 2 layers and lm_head the last logits (|logit| < 5) differed by <= 4e-6 when measured.
# 5e-5 leaves 10x margin and stays far below the top-2 logit gaps (> 5e-3) greedy tokens rest on.
LOGIT_TOL = dict(atol=5e-5, rtol=5e-5)

def tiny_config(family: str, *, q_lora: bool = True, interleave: bool = True, yarn: bool = False,
                bias: bool = False, heads: int = 4):
    """A 2-layer MLA config (layer 0 dense MLP, layer 1 MoE) with random-weight scale 0.15."""
    kw = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
              num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=heads,
              kv_lora_rank=32, q_lora_rank=24 if q_lora else None, qk_rope_head_dim=16,
              qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2,
              n_shared_experts=1, n_group=1, topk_group=1, initializer_range=0.15,
              max_position_embeddings=256, rope_interleave=interleave, attention_bias=bias,
              pad_token_id=0, eos_token_id=None, bos_token_id=None)
    if yarn:
        kw["rope_parameters"] = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                     mscale=1.0, mscale_all_dim=1.0,
                                     original_max_position_embeddings=64)
    if family == "deepseek_v3":
        return DeepseekV3Config(first_k_dense_replace=1, **kw)
    return Glm4MoeLiteConfig(mlp_layer_types=["dense", "sparse"], **kw)


def tiny_model(config, seed: int = 0):
    """fp32 eager model with random weights; norm weights perturbed so every norm matters."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                             attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
    return model


VARIANTS = [
    ("glm4_moe_lite", dict()),
    ("glm4_moe_lite", dict(q_lora=False, interleave=False)),
    ("deepseek_v3", dict()),
    ("deepseek_v3", dict(q_lora=False, yarn=True, bias=True)),
    ("deepseek_v3", dict(interleave=False, yarn=True)),
]


def variant_id(v):
    family, kw = v
    return family + "".join(f"-{k}{int(x)}" for k, x in kw.items())



def prompts_for(config, lengths=(5, 11, 3), seed: int = 3) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, config.vocab_size, (n,), generator=gen).tolist() for n in lengths]
