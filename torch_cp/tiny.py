"""A tiny random Qwen3 model (the default of the CLI, the quickstart and the tests), and a tiny
random Qwen3.5 (hybrid: gated DeltaNet layers around a full-attention one) for the quickstart.

It needs no download. One KV head (four query heads) lets TP-mode context parallelism run at
tp = 2 and 4; ``initializer_range=0.15`` keeps greedy logit gaps large enough in float32 that
greedy tokens are a stable comparison: the top-1 / top-2 logit gaps of the tests' greedy paths
stay above 1e-3 (the smallest measured 1.4e-3), far above float32 reassociation (~1e-6).
"""

from __future__ import annotations

import torch
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig, Qwen3Config, Qwen3ForCausalLM

TINY_VOCAB = 320


def tiny_qwen3_config(**overrides) -> Qwen3Config:
    """The tiny model's config; ``overrides`` replace any field."""
    fields = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=1024,
        initializer_range=0.15,
        tie_word_embeddings=False,
        rope_theta=10000.0,
    )
    fields.update(overrides)
    return Qwen3Config(**fields)


def tiny_qwen3(seed: int = 0, dtype: torch.dtype = torch.float32, **overrides) -> Qwen3ForCausalLM:
    """A small Qwen3ForCausalLM with random weights drawn from ``seed`` (global RNG untouched).

    Same seed, same weights: build it twice for a patched model and an unpatched reference.
    """
    config = tiny_qwen3_config(**overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config)
    return model.to(dtype).eval()


def tiny_qwen3_5(seed: int = 0, dtype: torch.dtype = torch.float32,
                 **overrides) -> Qwen3_5ForCausalLM:
    """A small Qwen3.5 (``qwen3_5_text``) with random weights drawn from ``seed``: three layers,
    linear, full and linear attention; the full layer like ``tiny_qwen3``'s (one KV head of 16),
    the linear ones with 2 key / 4 value heads of 16 and a conv of 4."""
    fields = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=3, layer_types=["linear_attention", "full_attention",
                                                    "linear_attention"],
                  num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                  linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                  linear_value_head_dim=16, linear_conv_kernel_dim=4,
                  max_position_embeddings=1024, initializer_range=0.15,
                  tie_word_embeddings=False)
    fields.update(overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**fields))
    return model.to(dtype).eval()


# Plain text around each message (byte tokens only), so a rendered chat holds no pad id.
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def tiny_tokenizer():
    """A byte-level tokenizer (256 byte tokens + ``<|endoftext|>`` = 256) that fits the tiny
    model's vocabulary; built offline with ``tokenizers``, no merges. Its chat template writes
    each message as ``<|role|>\ncontent\n`` and the generation prompt as ``<|assistant|>\n``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    vocab["<|endoftext|>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>", chat_template=TINY_CHAT_TEMPLATE)
