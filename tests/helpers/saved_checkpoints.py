"""Checkpoints written with ``save_pretrained`` for the from_pretrained tests: a tiny Qwen3 (tied
embeddings, one KV head, q/k/v and o_proj biases; one file), a tiny DeepSeek-V3 (MLA, MoE experts
stored per expert as Hugging Face checkpoints hold them; several files and an index) and, for
``big=True``, a 59 MB Qwen3 in files of at most 4 MB; and the hybrids: a tiny Qwen3-Next (MoE)
and a tiny multimodal Qwen3.5 (``Qwen3_5ForConditionalGeneration``: its text model's keys are
``model.language_model.*``, beside a vision tower torch_cp never loads)."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers
from driver import HYBRID, TINY
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


def qwen3_next():
    return tiny_gqa("qwen3_next", num_key_value_heads=1)


def qwen3_5_multimodal():
    """The multimodal Qwen3.5 with a one-block vision tower; AutoModelForCausalLM reads its
    text model alone (``Qwen3_5ForCausalLM``)."""
    text = {k: v for k, v in {**TINY, **HYBRID}.items() if not k.endswith("token_id")}
    config = transformers.Qwen3_5Config(
        text_config=dict(text, num_key_value_heads=1),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                           out_hidden_size=TINY["hidden_size"]))
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = transformers.Qwen3_5ForConditionalGeneration(config).eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.copy_(1 + 0.2 * torch.randn_like(p))
    return model


def save_checkpoints(root: Path, big: bool = False) -> dict[str, str]:
    """name -> checkpoint folder under ``root``."""
    paths = {name: str(root / name) for name in ("qwen3", "deepseek_v3", "big", "qwen3_next",
                                                 "qwen3_5")}
    qwen3().save_pretrained(paths["qwen3"])
    qwen3_next().save_pretrained(paths["qwen3_next"])
    qwen3_5_multimodal().save_pretrained(paths["qwen3_5"])
    deepseek_v3().save_pretrained(paths["deepseek_v3"], max_shard_size="40KB")
    if big:
        with torch.random.fork_rng():
            torch.manual_seed(0)
            model = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3Config(**BIG))
        model.save_pretrained(paths["big"], max_shard_size="4MB")
    return paths
