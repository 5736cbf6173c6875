"""The benchmarked models: Qwen3-8B's shape, an MLA model of similar size, two MoE models and
Qwen3.5 (a hybrid of gated DeltaNet and full attention), random bf16 weights built on the device
(no download), plus tiny CPU versions for ``--smoke``; and the bytes a decode step must read (and,
for a hybrid's linear-attention state, write), for the memory roofline."""

from __future__ import annotations

import torch
from torch import nn
from transformers import (
    AutoModelForCausalLM,
    DeepseekV3Config,
    Glm4MoeLiteConfig,
    Qwen3_5TextConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

from torch_cp.graphs.experts import register_fused

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
# Qwen3-30B-A3B (config.json of Qwen/Qwen3-30B-A3B): 128 experts of 768 channels, top 8.
QWEN3_30B_A3B = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                     moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
                     num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                     norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                     max_position_embeddings=40960, rope_theta=1000000.0,
                     tie_word_embeddings=False, rms_norm_eps=1e-6)
# GLM-4.7-Flash (glm4_moe_lite; transformers' config defaults are its config.json): MLA with
# kv_lora 512 / rope 64, 64 experts of 1536 channels, top 4, one shared expert, layer 0 dense.
GLM_FLASH = dict(rope_scaling=None)
# Qwen3.5 (transformers' Qwen3_5TextConfig defaults, the text model of Qwen/Qwen3.5-9B): 32 layers,
# gated DeltaNet three to one with full attention (16 q / 4 KV heads of 256, output gate, partial
# RoPE); linear attention 16 key / 32 value heads of 128, conv kernel 4; 8.95B parameters.
QWEN3_5 = dict()
SMOKE_QWEN3_5 = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     layer_types=["linear_attention", "full_attention"], num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                     linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16)
SMOKE_QWEN = dict(QWEN3_8B, vocab_size=320, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
SMOKE_MLA = dict(MLA_8B, vocab_size=320, hidden_size=64, intermediate_size=128,
                 num_hidden_layers=2, first_k_dense_replace=2, num_attention_heads=4,
                 num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=8,
                 qk_nope_head_dim=16, v_head_dim=16)


SMOKE_MOE = dict(vocab_size=320, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 num_experts=8, n_routed_experts=8, num_experts_per_tok=2, kv_lora_rank=32,
                 q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                 mlp_layer_types=["dense", "sparse"])


def config_for(name: str, smoke: bool):
    if name == "qwen3":
        return Qwen3Config(**(SMOKE_QWEN if smoke else QWEN3_8B))
    if name == "mla":
        return DeepseekV3Config(**(SMOKE_MLA if smoke else MLA_8B))
    if name == "qwen3_moe":
        fields = dict(QWEN3_30B_A3B, **(SMOKE_MOE if smoke else {}))
        fields.pop("mlp_layer_types", None)
        return Qwen3MoeConfig(**{k: v for k, v in fields.items()
                                 if k not in ("n_routed_experts", "kv_lora_rank", "q_lora_rank",
                                              "qk_rope_head_dim", "qk_nope_head_dim",
                                              "v_head_dim")})
    if name == "glm_flash":
        fields = dict(GLM_FLASH, **(SMOKE_MOE if smoke else {}))
        fields.pop("num_key_value_heads", None)
        return Glm4MoeLiteConfig(**{k: v for k, v in fields.items()
                                    if k not in ("num_experts", "head_dim")},
                                 **(dict(num_key_value_heads=4) if smoke else {}))
    if name == "qwen3_5":
        return Qwen3_5TextConfig(**(SMOKE_QWEN3_5 if smoke else QWEN3_5))
    raise ValueError(f"unknown model {name!r}: qwen3, mla, qwen3_moe, glm_flash or qwen3_5")


def build(name: str, device: torch.device, dtype: torch.dtype, smoke: bool = False,
          experts: str | None = None, layers: int | None = None):
    """Random weights drawn on ``device`` directly (N(0, initializer_range), norms at 1).
    ``experts``: a MoE model's experts implementation for torch_cp and the peers alike (default:
    in bf16 torch_cp's fused decode-sized experts ``"torch_cp_fused"`` where CUDA and Triton are,
    torch_cp's own default, else ``grouped_mm``; ``batched_mm`` in other dtypes). ``layers``:
    fewer decoder layers than the model's (its per-layer types cut to them)."""
    config = config_for(name, smoke)
    if layers is not None:
        config.num_hidden_layers = layers
        for types in ("layer_types", "mlp_layer_types"):
            if getattr(config, types, None):
                setattr(config, types, getattr(config, types)[:layers])
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if experts_of(model):  # the peers and torch_cp run the same experts (graphs/experts.py)
        fused = register_fused(torch.device(device))
        if experts is None:
            experts = (("torch_cp_fused" if fused else "grouped_mm") if dtype == torch.bfloat16
                       else "batched_mm")
        model.set_experts_implementation(experts)
    # Every system makes exactly the asked tokens: no EOS for Hugging Face's generate to fill
    # in from the model's defaults (an EOS criterion and logits processors torch_cp runs not).
    model.generation_config.eos_token_id = None
    return model.eval()


def experts_of(model) -> list[nn.Module]:
    return [m.experts for m in model.modules() if isinstance(getattr(m, "experts", None),
                                                             nn.Module)]


@torch.inference_mode()
def routed_expert_bytes(model, batch: int) -> int:
    """Bytes of routed expert weights one decode step of ``batch`` tokens reads, measured: one
    forward of ``batch`` one-token sequences through the unpatched model, counting the experts
    each MoE layer's router picks (each once per layer)."""
    experts = experts_of(model)
    if not experts:
        return 0
    picked = []
    hooks = [e.register_forward_pre_hook(lambda m, args: picked.append(args[1].unique().numel()))
             for e in experts]
    ids = torch.randint(0, model.config.vocab_size, (batch, 1),
                        generator=torch.Generator().manual_seed(batch))
    try:
        model(input_ids=ids.to(model.device), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return sum(picked) * expert_bytes(experts[0])


def expert_bytes(experts: nn.Module) -> int:
    """Bytes of one expert's weights in an experts module."""
    return ((experts.gate_up_proj[0].numel() + experts.down_proj[0].numel())
            * experts.down_proj.element_size())


@torch.inference_mode()
def generated_expert_bytes(model, sequences: list[list[int]], prompt: int, rows: int = 8) -> float:
    """Bytes of routed expert weights the decode steps that made ``sequences`` (prompt and
    generated tokens of each row, all of one length) read on average: the unpatched model over
    the sequences, ``rows`` at a time, and at each position a decode step fed (the first
    generated token to the last but one) the experts any row's router picked, once per layer.
    Against random one-token inputs (``routed_expert_bytes``), within about 1 % on the random
    models benchmarked: fewer experts for Qwen3-30B-A3B at batch 32, more at 64 and for
    GLM-4.7-Flash (helper 74's audit of runs 86 and 89)."""
    experts = experts_of(model)
    if not experts or len(sequences[0]) - prompt < 2:
        return 0.0
    picks = [[] for _ in experts]  # per layer, [rows * length, top_k] a forward
    hooks = [e.register_forward_pre_hook(lambda m, args, i=i: picks[i].append(args[1]))
             for i, e in enumerate(experts)]
    ids = torch.tensor(sequences, device=model.device)
    try:
        for start in range(0, len(sequences), rows):
            model(input_ids=ids[start:start + rows], use_cache=False, logits_to_keep=1)
    finally:
        for h in hooks:
            h.remove()
    batch, length = ids.shape
    used = 0
    for layer, e in zip(picks, experts):
        fed = torch.cat(layer).view(batch, length, -1)[:, prompt:length - 1]  # [B, steps, k]
        steps = fed.shape[1]
        hit = torch.zeros(steps, e.gate_up_proj.shape[0], dtype=torch.bool, device=fed.device)
        hit.scatter_(1, fed.transpose(0, 1).reshape(steps, -1), True)
        used += hit.sum().item() / steps
    return used * expert_bytes(experts[0])


def weight_bytes_read(model, batch: int = 1, routed_bytes: int | None = None) -> int:
    """Bytes of the weights one decode step of ``batch`` tokens reads: every parameter except an
    untied input embedding table (a step reads only ``batch`` of its rows, under 0.01 % of the
    total, left out); of MoE experts only those the step's tokens route to (``routed_bytes``,
    measured by ``routed_expert_bytes`` if None)."""
    embed = model.get_input_embeddings().weight
    tied = embed is model.get_output_embeddings().weight
    routed = {id(p) for e in experts_of(model) for p in e.parameters()}
    dense = sum(p.numel() * p.element_size() for p in model.parameters()
                if (tied or p is not embed) and id(p) not in routed)
    return dense + (routed_expert_bytes(model, batch) if routed_bytes is None else routed_bytes)


def linear_layers(config) -> int:
    """A hybrid's linear-attention (gated DeltaNet) layers: they keep a state, not a KV cache."""
    return sum(t == "linear_attention" for t in getattr(config, "layer_types", None) or ())


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    """Bytes of the smallest cache the attention needs per token, all attention layers (not a
    hybrid's linear-attention ones): K and V for GQA, the latent and the rope key for MLA."""
    size = torch.empty((), dtype=dtype).element_size()
    layers = config.num_hidden_layers - linear_layers(config)
    if getattr(config, "kv_lora_rank", None):
        return layers * (config.kv_lora_rank + config.qk_rope_head_dim) * size
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return layers * 2 * config.num_key_value_heads * head_dim * size


def state_bytes_per_request(config, dtype: torch.dtype) -> int:
    """Bytes of one request's linear-attention state, all linear layers (0 without them): the
    recurrent ``[value heads, key dim, value dim]`` matrix in float32, which a decode step reads
    and writes whole, and the conv state (the last ``K - 1`` inputs of the q, k and v channels)
    in the model's dtype."""
    layers = linear_layers(config)
    if not layers:
        return 0
    size = torch.empty((), dtype=dtype).element_size()
    hk, hv = config.linear_num_key_heads, config.linear_num_value_heads
    dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
    recurrent = hv * dk * dv * 4
    conv = (2 * hk * dk + hv * dv) * (config.linear_conv_kernel_dim - 1) * size
    return layers * (recurrent + conv)


def hf_cache_bytes_per_token(config, dtype: torch.dtype) -> int:
    """Bytes per token of Hugging Face's own cache (MLA: decompressed K and V per head)."""
    size = torch.empty((), dtype=dtype).element_size()
    if getattr(config, "kv_lora_rank", None):
        k = config.qk_nope_head_dim + config.qk_rope_head_dim
        return config.num_hidden_layers * config.num_attention_heads * (k + config.v_head_dim) \
            * size
    return kv_bytes_per_token(config, dtype)
