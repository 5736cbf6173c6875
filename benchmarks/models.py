"""The benchmarked models: Qwen3-8B's shape and an MLA model of similar size, random bf16 weights
built on the device (no download), plus tiny CPU versions for ``--smoke``; and the bytes a decode
step must read, for the memory roofline."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, DeepseekV3Config, Qwen3Config

# Qwen3-8B (config.json of Qwen/Qwen3-8B).
QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                max_position_embeddings=40960, rope_theta=1000000.0, tie_word_embeddings=False,
                rms_norm_eps=1e-6)
# DeepSeek-V3's attention (q_lora 1536, kv_lora 512, rope 64, nope 128, v 128) at Qwen3-8B's
# width and depth with dense MLPs (first_k_dense_replace = every layer): about 8B parameters, so
# decode reads about as many weight bytes as Qwen3-8B and attention is the difference.
MLA_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288,
              moe_intermediate_size=1536, num_hidden_layers=36, first_k_dense_replace=36,
              n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=1,
              topk_group=1, num_attention_heads=32, num_key_value_heads=32, q_lora_rank=1536,
              kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
              max_position_embeddings=40960, rope_theta=10000.0, tie_word_embeddings=False,
              rope_scaling=None)
SMOKE_QWEN = dict(QWEN3_8B, vocab_size=320, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
SMOKE_MLA = dict(MLA_8B, vocab_size=320, hidden_size=64, intermediate_size=128,
                 num_hidden_layers=2, first_k_dense_replace=2, num_attention_heads=4,
                 num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=8,
                 qk_nope_head_dim=16, v_head_dim=16)


def config_for(name: str, smoke: bool):
    if name == "qwen3":
        return Qwen3Config(**(SMOKE_QWEN if smoke else QWEN3_8B))
    if name == "mla":
        return DeepseekV3Config(**(SMOKE_MLA if smoke else MLA_8B))
    raise ValueError(f"unknown model {name!r}: qwen3 or mla")


def build(name: str, device: torch.device, dtype: torch.dtype, smoke: bool = False):
    """Random weights drawn on ``device`` directly (N(0, initializer_range), norms at 1)."""
    config = config_for(name, smoke)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def weight_bytes_read(model) -> int:
    """Bytes of the weights one decode step reads: every parameter except an untied input
    embedding table, of which a step reads only its rows."""
    embed = model.get_input_embeddings().weight
    tied = embed is model.get_output_embeddings().weight
    return sum(p.numel() * p.element_size() for p in model.parameters()
               if tied or p is not embed)


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    """Bytes of the smallest cache the attention needs per token, all layers: K and V for GQA,
    the latent and the rope key for MLA."""
    size = torch.empty((), dtype=dtype).element_size()
    layers = config.num_hidden_layers
    if getattr(config, "kv_lora_rank", None):
        return layers * (config.kv_lora_rank + config.qk_rope_head_dim) * size
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return layers * 2 * config.num_key_value_heads * head_dim * size


def hf_cache_bytes_per_token(config, dtype: torch.dtype) -> int:
    """Bytes per token of Hugging Face's own cache (MLA: decompressed K and V per head)."""
    size = torch.empty((), dtype=dtype).element_size()
    if getattr(config, "kv_lora_rank", None):
        k = config.qk_nope_head_dim + config.qk_rope_head_dim
        return config.num_hidden_layers * config.num_attention_heads * (k + config.v_head_dim) \
            * size
    return kv_bytes_per_token(config, dtype)
