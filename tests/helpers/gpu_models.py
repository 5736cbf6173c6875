"""The tiny models of the GPU tests (on FlashInfer's prebuilt head dims) and the bf16 near-tie
bound."""

from __future__ import annotations

import torch
from transformers import (
    AutoModelForCausalLM,
    DeepseekV3Config,
    Glm4MoeConfig,
    Glm4MoeLiteConfig,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
    Qwen3MoeConfig,
    Qwen3NextConfig,
)

from torch_cp import tiny_qwen3


def qwen3(dtype, kv_heads: int = 1):
    # hidden 256 / head_dim 128 keeps the FlashInfer kernels on the prebuilt set.
    return tiny_qwen3(seed=0, dtype=dtype, hidden_size=256, head_dim=128,
                      num_attention_heads=4, num_key_value_heads=kv_heads)


PROMPT_LENGTHS = (3, 17, 40, 70)  # the GPU tests' prompts: one short, some over a page
NEW_TOKENS = 24


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(1, 300, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def tokens(results) -> list[list[int]]:
    """Every result's tokens; each request must have run."""
    assert all(r.ok for r in results), [r.error for r in results]
    return [list(r.token_ids) for r in results]


def assert_equal_but_near_ties(model, want_streams, have_streams, prompt_ids=None) -> None:
    """Greedy streams of ``prompt_ids`` (default ``prompts()``) from one bf16 model computed in
    other orders (another attention kernel, TP sums, grouped experts, fused layers, cached KV and
    state checkpoints): equal, or split where the
    unpatched ``model``'s two candidates are within ``near_tie``, or where one expert choice its
    routers make at a near-tie, made the other way, gives the other token
    (``router_flip_explains``; never for a dense model)."""
    for prompt, want, have in zip(prompt_ids or prompts(), want_streams, have_streams):
        if want == have:
            continue
        d = next(i for i, (x, y) in enumerate(zip(want, have)) if x != y)
        ids = torch.tensor([prompt + want[:d]], device="cuda")
        with torch.inference_mode():
            logits = model(ids).logits[0, -1]
        from router_ties import router_flip_explains

        a, b = logits[want[d]].float().item(), logits[have[d]].float().item()
        assert near_tie(abs(a - b), max(abs(a), abs(b))) or \
            router_flip_explains(model, ids, have[d]), (prompt, d, a, b)


def spy_dependent_launches(monkeypatch) -> dict[str, set]:
    """Turns ``torch_cp.pdl`` on and records where it acts: the modules whose kernels were
    launched with the dependent launch (``"kernels"``: ``gemv``, ``triton_decode``,
    ``write_kernel``, ``fused_router``, ``fused_experts``) and whether the compiled layers
    generated Inductor's kernels for it (``"inductor"``), so a test of it cannot pass with
    nothing launched so."""
    import sys

    from torch_cp import compat, pdl

    seen = {"kernels": set(), "inductor": set()}
    options, inductor = pdl.launch_options, compat.inductor_pdl

    def launch_options(on):
        if on and not torch.compiler.is_compiling():
            seen["kernels"].add(sys._getframe(1).f_globals["__name__"].rsplit(".", 1)[-1])
        return options(on)

    def inductor_pdl(on):
        seen["inductor"].add(on)
        return inductor(on)

    monkeypatch.setattr(pdl, "ENABLED", True)
    monkeypatch.setattr(pdl, "launch_options", launch_options)
    monkeypatch.setattr(compat, "inductor_pdl", inductor_pdl)
    return seen


def dependent_launch_kernels(rows: int, gqa: bool, moe: bool) -> set[str]:
    """The modules (as ``spy_dependent_launches`` names them) whose kernels a captured step of
    ``rows`` rows must launch with the dependent launch: the router and the fused experts of an
    MoE model, the pool write of a GQA model (these tests' GQA models rotate halves: with
    ``ROTATE_IN_ONE_KERNEL`` the pool's norms, RoPE and write kernel; MLA's pool is written by
    indexing), and at one row the one-token linears and, for GQA, the Triton decode."""
    from torch_cp.kv import pool

    kernels = {"fused_router", "fused_experts"} if moe else set()
    if gqa:
        kernels.add("rotate_kernel" if pool.ROTATE_IN_ONE_KERNEL else "write_kernel")
    if rows == 1:
        kernels |= {"gemv", "triton_decode"} if gqa else {"gemv"}
    return kernels


# kv_lora_rank 512 / rope 64: FlashInfer's prebuilt MLA kernels.
MLA = dict(vocab_size=320, hidden_size=256, intermediate_size=512, moe_intermediate_size=64,
           num_hidden_layers=2, num_attention_heads=16, num_key_value_heads=16,
           kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=64,
           v_head_dim=64, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
           n_group=1, topk_group=1, initializer_range=0.15, max_position_embeddings=512,
           pad_token_id=0, eos_token_id=None, bos_token_id=None)
# Qwen3-MoE and GLM-4-MoE attention on head_dim 128 with one KV head (TP mode at tp = 2), eight
# experts of 64 channels, top 2.
GQA_MOE = dict(vocab_size=320, hidden_size=256, intermediate_size=512, moe_intermediate_size=64,
               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, head_dim=128,
               num_experts_per_tok=2, initializer_range=0.15, max_position_embeddings=512,
               pad_token_id=0, eos_token_id=None, bos_token_id=None)


def _random(config, dtype):
    """Weights drawn in bf16, then cast to ``dtype`` with the buffers (so the rotary inv_freq is
    bf16 too: these models passed the MoE GPU runs so; ``mla`` keeps its fp32 inv_freq)."""
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval().to(dtype)


def mla():
    """DeepSeek-V3 attention with dense MLPs (first_k_dense_replace = every layer)."""
    config = DeepseekV3Config(**dict(MLA, n_routed_experts=4), first_k_dense_replace=2)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()


def deepseek_mla(dtype):
    return mla().to(dtype)


def qwen3_moe(dtype):
    return _random(Qwen3MoeConfig(**GQA_MOE, num_experts=8, norm_topk_prob=True), dtype)


def glm4_moe(dtype):
    return _random(Glm4MoeConfig(**GQA_MOE, n_routed_experts=8, n_shared_experts=1, n_group=1,
                                 topk_group=1, first_k_dense_replace=1, use_qk_norm=True), dtype)


def glm4_moe_lite(dtype):
    return _random(Glm4MoeLiteConfig(**MLA, mlp_layer_types=["dense", "sparse"]), dtype)


def deepseek_v3(dtype):
    return _random(DeepseekV3Config(**MLA, first_k_dense_replace=1), dtype)


# Every MoE family (layer 0 dense where the family has dense layers, layer 1 MoE).
MOE_MODELS = {"qwen3_moe": qwen3_moe, "glm4_moe": glm4_moe, "glm4_moe_lite": glm4_moe_lite,
              "deepseek_v3": deepseek_v3}
MODELS = {"qwen3": qwen3, "mla": deepseek_mla, **MOE_MODELS}


# Hybrids (gated DeltaNet layers around a full-attention one; the state index, pool index and
# decoder layer index all differ): full attention as GQA_MOE's (4 q / 1 KV head of 128, FlashInfer's
# prebuilt kernels), linear attention 2 key / 4 value heads of 128 (the real models' head size,
# so flash-linear-attention's Triton kernels run on the shapes they are tuned for), conv kernel 4.
HYBRID = dict(vocab_size=320, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
              layer_types=["linear_attention", "full_attention", "linear_attention"],
              num_attention_heads=4, num_key_value_heads=1, head_dim=128,
              linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=128,
              linear_value_head_dim=128, linear_conv_kernel_dim=4, initializer_range=0.15,
              max_position_embeddings=512, pad_token_id=0, eos_token_id=None, bos_token_id=None)
# Every layer MoE: eight experts of 64 channels, top 2, and the gated shared expert.
HYBRID_MOE = dict(HYBRID, moe_intermediate_size=64, shared_expert_intermediate_size=64,
                  num_experts=8, num_experts_per_tok=2)


def qwen3_5(dtype):
    return _random(Qwen3_5TextConfig(**HYBRID), dtype)


def qwen3_5_moe(dtype):  # every layer MoE: no intermediate_size
    fields = {k: v for k, v in HYBRID_MOE.items() if k != "intermediate_size"}
    return _random(Qwen3_5MoeTextConfig(**fields), dtype)


def qwen3_next(dtype):
    return _random(Qwen3NextConfig(**HYBRID_MOE, norm_topk_prob=True, decoder_sparse_step=1,
                                   mlp_only_layers=[]), dtype)


# Not in MODELS: the whole-step graph harness (graph_harness.py) has no state pool.
HYBRID_MODELS = {"qwen3_5_text": qwen3_5, "qwen3_5_moe_text": qwen3_5_moe,
                 "qwen3_next": qwen3_next}


def near_tie(gap: float, magnitude: float) -> bool:
    """bf16 streams may split only where the unpatched model's two candidate logits are within a
    few bf16 ulps of each other: 2^-5 of the logit, i.e. 4-8 ulps (an ulp is 2^-8 to 2^-7 of a
    bf16 value). TP sharding sums each layer's output in a bf16 all-reduce and the partner merge
    adds partials in another order than one GPU, about an ulp per layer; observed on 2 H200s: the
    MLA model at tp = 2 split two of four streams at gaps 0.125 and 0.094 on logits of 5.2 and
    6.7 (4 and 3 ulps; 0.024 and 0.014 of the logit). fp32 gives P = 1's tokens exactly, which
    is the exactness check."""
    return gap <= 2 ** -5 * magnitude
