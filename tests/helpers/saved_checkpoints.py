"""Checkpoints written with ``save_pretrained`` for the from_pretrained tests: a tiny Qwen3 (tied
embeddings, one KV head, q/k/v and o_proj biases; one file), a tiny DeepSeek-V3 (MLA, MoE experts
stored per expert as Hugging Face checkpoints hold them; several files and an index) and, for
``big=True``, a 59 MB Qwen3 in files of at most 4 MB."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers
from driver import tiny_model as tiny_gqa
from mla_models import tiny_config as mla_config
from mla_models import tiny_model as tiny_mla

# 4 layers, hidden 512, MLP 2048, a small vocabulary so the replicated embeddings stay small.
BIG = dict(vocab_size=256, hidden_size=512, intermediate_size=2048, num_hidden_layers=4,
           num_attention_heads=8, num_key_value_heads=2, head_dim=64, tie_word_embeddings=False)


def qwen3():
    return tiny_gqa("qwen3", num_key_value_heads=1, tie_word_embeddings=True,
                    attention_bias=True)


def deepseek_v3():
    """Twelve experts: checkpoint keys ``experts.10`` .. ``experts.11`` sort before
    ``experts.2`` as strings, so stacking them in string order would show."""
    config = mla_config("deepseek_v3", bias=True)
    config.n_routed_experts = 12
    return tiny_mla(config)


def save_checkpoints(root: Path, big: bool = False) -> dict[str, str]:
    """name -> checkpoint folder under ``root``."""
    paths = {name: str(root / name) for name in ("qwen3", "deepseek_v3", "big")}
    qwen3().save_pretrained(paths["qwen3"])
    deepseek_v3().save_pretrained(paths["deepseek_v3"], max_shard_size="40KB")
    if big:
        with torch.random.fork_rng():
            torch.manual_seed(0)
            model = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3Config(**BIG))
        model.save_pretrained(paths["big"], max_shard_size="4MB")
    return paths
