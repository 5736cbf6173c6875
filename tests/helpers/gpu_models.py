"""The tiny models of the GPU tests (on FlashInfer's prebuilt head dims) and the bf16 near-tie
bound."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, DeepseekV3Config

from torch_cp import tiny_qwen3


def qwen3(dtype, kv_heads: int = 1):
    # hidden 256 / head_dim 128 keeps the FlashInfer kernels on the prebuilt set.
    return tiny_qwen3(seed=0, dtype=dtype, hidden_size=256, head_dim=128,
                      num_attention_heads=4, num_key_value_heads=kv_heads)


def mla():
    # kv_lora_rank 512 / rope 64: FlashInfer's prebuilt MLA kernels. Dense MLPs only: the
    # eager MoE experts loop of transformers synchronises with the host and cannot be captured.
    config = DeepseekV3Config(
        vocab_size=320, hidden_size=256, intermediate_size=512, moe_intermediate_size=64,
        num_hidden_layers=2, first_k_dense_replace=2, num_attention_heads=16,
        num_key_value_heads=16, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64,
        qk_nope_head_dim=64, v_head_dim=64, n_routed_experts=4, num_experts_per_tok=2,
        n_group=1, topk_group=1, initializer_range=0.15, max_position_embeddings=512,
        pad_token_id=0, eos_token_id=None, bos_token_id=None)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()


def deepseek_mla(dtype):
    return mla().to(dtype)


MODELS = {"qwen3": qwen3, "mla": deepseek_mla}


def near_tie(gap: float, magnitude: float) -> bool:
    """bf16 streams may split only where the unpatched model's two candidate logits are within a
    few bf16 ulps of each other: 2^-5 of the logit, i.e. 4-8 ulps (an ulp is 2^-8 to 2^-7 of a
    bf16 value). TP sharding sums each layer's output in a bf16 all-reduce and the partner merge
    adds partials in another order than one GPU, about an ulp per layer; observed on 2 H200s: the
    MLA model at tp = 2 split two of four streams at gaps 0.125 and 0.094 on logits of 5.2 and
    6.7 (4 and 3 ulps; 0.024 and 0.014 of the logit). fp32 gives P = 1's tokens exactly, which
    is the exactness check."""
    return gap <= 2 ** -5 * magnitude
