"""KV-cache sizing: bytes per rank from the pool geometry (what context parallelism saves), and
the pages a batch of requests needs."""

from __future__ import annotations

import torch

from torch_cp.placement import page_size_problems


def _per_slot_elements(model_or_config) -> tuple[int, int, torch.dtype]:
    """(layers, cache elements of one token slot of one layer, dtype) of one unplaced rank."""
    runtime = getattr(model_or_config, "torch_cp", None)
    if runtime is not None:
        g = runtime.geometry
        per_slot = 2 * g.kv_heads * g.head_dim if g.kind == "gqa" else g.kv_lora_rank + g.rope_dim
        return runtime.num_layers, per_slot, runtime.dtype
    config = getattr(model_or_config, "config", model_or_config)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    dtype = getattr(model_or_config, "dtype", None)
    if not isinstance(dtype, torch.dtype):
        dtype = getattr(config, "dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.removeprefix("torch."))
    if getattr(config, "kv_lora_rank", None):
        per_slot = config.kv_lora_rank + config.qk_rope_head_dim
    else:
        head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads)
        per_slot = 2 * config.num_key_value_heads * head_dim
    layer_types = getattr(config, "layer_types", None)
    layers = (sum(t != "linear_attention" for t in layer_types) if layer_types
              else config.num_hidden_layers)
    return layers, per_slot, dtype


def kv_bytes_per_rank(model_or_config, tokens: int, partners: int = 1, page_size: int = 16) -> int:
    """Bytes of paged KV one rank holds for ``tokens`` tokens of context when ``partners`` ranks
    stripe every page between them (P = ``partners``).

    Args:
        model_or_config: a patched model (its per-rank geometry, layers and pool dtype), or an
            unpatched model / config (all KV heads on one rank).
        tokens: context length of one sequence; it occupies ``ceil(tokens / page_size)`` pages.
        partners: P; ``page_size`` must be a multiple of it.
        page_size: logical page size in tokens.
    Returns:
        ``layers * pages * (page_size // P) * bytes per token slot``.
    """
    problems = []
    if tokens < 0:
        problems.append(f"tokens must be >= 0, got {tokens}")
    if partners < 1:
        problems.append(f"partners must be >= 1, got {partners}")
    else:
        problems += page_size_problems(page_size, partners)
    if problems:
        raise ValueError("; ".join(problems))
    layers, per_slot, dtype = _per_slot_elements(model_or_config)
    pages = -(-tokens // page_size)
    element = torch.empty((), dtype=dtype).element_size()
    return layers * pages * (page_size // partners) * per_slot * element


def lifetime_pages(prompt, max_new_tokens: int, page_size: int) -> int:
    """Pages a request holds at most (its last generated token is never cached)."""
    return -(-max(len(prompt) + max_new_tokens - 1, 1) // page_size)


def pool_bytes_per_page(runtime, page_size: int) -> int:
    """Bytes one logical page of ``runtime``'s pool takes on this rank, every layer."""
    return runtime.new_pool(1, page_size).bytes // 2  # one page plus the sink page


def default_num_pages(runtime, prompts, news, page_size: int) -> int:
    """Pages for every request's whole lifetime, capped by 90% of free memory on CUDA."""
    need = sum(lifetime_pages(p, n, page_size) for p, n in zip(prompts, news))
    need = max(need, 1)
    device = torch.device(runtime.device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        need = max(1, min(need, int(0.9 * free) // pool_bytes_per_page(runtime, page_size)))
    return need
