"""A minimal greedy driver for tests: one packed prefill step, then packed decode steps.

Only tests use it; ``torch_cp.generate`` is the product path. Every partner runs it with the same
prompts, so the plans differ only by placement and every rank issues the same collectives.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import transformers

from torch_cp.compat import cache_kwarg
from torch_cp.hf.cache import PagedKVCache
from torch_cp.kv import PageAllocator
from torch_cp.plan import build_step_plan

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, initializer_range=0.15,
            max_position_embeddings=512, bos_token_id=None, eos_token_id=None, pad_token_id=None)
MOE = dict(moe_intermediate_size=32, num_experts_per_tok=2)
# Hybrid: gated DeltaNet layers around a full-attention one (state and pool indices both differ
# from the decoder layer index); 2 key heads of 16, 4 value heads of 8, conv kernel 4.
HYBRID = dict(num_hidden_layers=3, layer_types=["linear_attention", "full_attention",
                                                "linear_attention"],
              linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
              linear_value_head_dim=8, linear_conv_kernel_dim=4)
HYBRID_MOE = dict(HYBRID, **MOE, num_experts=4, shared_expert_intermediate_size=32)
CONFIGS = {
    "qwen2": (transformers.Qwen2Config, {}),
    "qwen3": (transformers.Qwen3Config, {}),
    "qwen3_moe": (transformers.Qwen3MoeConfig, dict(MOE, num_experts=4, norm_topk_prob=True)),
    "glm": (transformers.GlmConfig, {}),
    "glm4": (transformers.Glm4Config, {}),
    "glm4_moe": (transformers.Glm4MoeConfig, dict(MOE, n_routed_experts=4, n_shared_experts=1,
                                                    first_k_dense_replace=1, use_qk_norm=True)),
    "qwen3_5_text": (transformers.Qwen3_5TextConfig, HYBRID),
    "qwen3_5_moe_text": (transformers.Qwen3_5MoeTextConfig, HYBRID_MOE),
    "qwen3_next": (transformers.Qwen3NextConfig, HYBRID_MOE),
}
HYBRID_TYPES = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")


PROMPTS = [[5, 7, 9, 11, 13], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4], [42],
           [100, 17, 17, 17, 64, 2, 90, 91]]
NEW_TOKENS = 6
# fp32 logits of magnitude ~1-10 that differ from the reference only by float32 reassociation
# (observed <= 3e-6), far below the smallest top-2 gap on the tests' greedy paths (>= 8e-4).
TOL = dict(atol=1e-4, rtol=1e-4)


def tiny_config(model_type: str, **overrides):
    """A 2-layer, hidden-64 config of ``model_type`` whose greedy top-2 logit gaps stay large in
    fp32 (initializer_range 0.15), with no token that stops generation."""
    cls, extra = CONFIGS[model_type]
    return cls(**copy.deepcopy({**TINY, **extra, **overrides}))  # no list shared between configs


def tiny_model(model_type: str, seed: int = 0, **overrides):
    """fp32 model of ``tiny_config(model_type, **overrides)`` with random weights, deterministic
    per ``seed``. Hugging Face initialises biases to zero, so a sharded bias (q/k/v biases split
    with their heads, o_proj's bias added once after the all-reduce) could be wrong without any
    test noticing: every bias parameter gets ``0.1 * randn`` instead, drawn after the weights.
    Norm weights start at one, so q_norm and k_norm (or any two norms) would be interchangeable:
    each gets ``1 + 0.2 * randn``, drawn after the biases.

    Hybrid models' per-head ``dt_bias`` (all ones at init) is drawn last, from a generator of its
    own (the other draws stay as they were), so a value head that took another head's decay
    would show.

    Biases per family (transformers 5): qwen2, glm, glm4 have q/k/v biases always; qwen3,
    qwen3_moe have q/k/v and o_proj biases with ``attention_bias=True`` (the only GQA configs
    with an o_proj bias); glm4_moe has q/k/v biases with ``attention_bias=True``. No MLP or
    expert has a bias (glm4_moe's router ``e_score_correction_bias`` is a buffer, left at zero).
    """
    torch.manual_seed(seed)
    config = tiny_config(model_type, **overrides)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
        decay = torch.Generator().manual_seed(seed)
        for name, p in model.named_parameters():
            if name.endswith(".dt_bias"):
                p.copy_(1 + 0.5 * torch.randn(p.shape, generator=decay))
    return model


@torch.no_grad()
def hf_greedy(model, prompts=PROMPTS, new_tokens=NEW_TOKENS
              ) -> tuple[list[list[int]], torch.Tensor]:
    """The unpatched reference, one prompt at a time: ``model.generate(do_sample=False)``'s
    generated ids and its last step's logits, [rows, vocab] float32."""
    tokens, logits = [], []
    for prompt in prompts:
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
        tokens.append(out.sequences[0, len(prompt):].tolist())
        logits.append(out.logits[-1][0].float())
    return tokens, torch.stack(logits)


@dataclass(frozen=True)
class GreedyResult:
    """tokens: the generated ids of each prompt. last_logits: [rows, vocab] float32, the logits
    the last token of each row was picked from. num_pages, kv_bytes: the pool's logical pages
    and its bytes on this rank."""

    tokens: list[list[int]]
    last_logits: torch.Tensor
    num_pages: int
    kv_bytes: int


@torch.no_grad()
def greedy(model, prompts: list[list[int]], max_new_tokens: int, num_pages: int | None = None
           ) -> GreedyResult:
    """Generate ``max_new_tokens`` greedy tokens for every prompt with a patched ``model``."""
    runtime = model.torch_cp
    page_size = runtime.page_size
    device = runtime.device
    alloc = PageAllocator(num_pages or sum(
        -(-(len(p) + max_new_tokens) // page_size) for p in prompts), page_size)
    for row, prompt in enumerate(prompts):
        assert alloc.reserve(row, len(prompt) + max_new_tokens), "not enough pages"
    tables = [alloc.table(row) for row in range(len(prompts))]
    cache = PagedKVCache.for_model(model, alloc.num_pages, state_slots=len(prompts))
    slots = None if cache.state is None else list(range(len(prompts)))  # row r: slot r

    def step(q_lens, ctx_lens, input_ids):
        plan = build_step_plan(q_lens, ctx_lens, tables, page_size=page_size,
                               sink_page=cache.pool.sink_page, placement=runtime.placement,
                               device=device, state_slots=slots,
                               sink_slot=None if slots is None else cache.state.sink_slot)
        cache.begin_step(plan)
        last = plan.qo_indptr[1:plan.num_rows + 1].long() - 1
        out = model(input_ids=input_ids.view(1, -1).to(device),
                    position_ids=plan.positions.view(1, -1), use_cache=True,
                    logits_to_keep=last, **{cache_kwarg(model): cache})
        logits = out.logits[0].float()  # [rows, vocab]
        return logits, logits.argmax(-1).tolist()

    lens = [len(p) for p in prompts]
    logits, next_ids = step(lens, [0] * len(prompts), torch.tensor(sum(prompts, [])))
    tokens = [[t] for t in next_ids]
    for _ in range(max_new_tokens - 1):
        logits, next_ids = step([1] * len(prompts), lens, torch.tensor(next_ids))
        lens = [n + 1 for n in lens]
        for row, t in enumerate(next_ids):
            tokens[row].append(t)
    return GreedyResult(tokens, logits.cpu(), alloc.num_pages, cache.pool.bytes)


def left_padded(prompts, pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``prompts`` as a left-padded ``[B, L]`` batch of ids and its attention mask."""
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    return ids, mask


def shape_mesh(sp: int, tp: int, names=("sp", "tp"), device: str = "cpu"):
    """An (sp, tp) DeviceMesh with no process groups behind it (validation reads only its
    shape); needs a process group to exist (the ``one_rank_world`` fixture)."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh(device, torch.arange(sp * tp).view(sp, tp), mesh_dim_names=names,
                      _init_backend=False)


def sampled_in_turn(engines, prompts, max_new_tokens: int, between=None) -> list[list[int]]:
    """Each engine's one request (its prompt, sampled at temperature 0.7, seed 1): the tokens,
    the engines stepped in turn through the request API, ``between()`` called after each
    engine's turn (engines sharing one model take turns with its attention backend)."""
    from torch_cp.engine.sampling import SamplingParams

    sampling = SamplingParams(temperature=0.7, seed=1)
    got = [[] for _ in engines]
    for engine, prompt in zip(engines, prompts):
        engine.submit(prompt, max_new_tokens, sampling=sampling)
    while any(engine.has_unfinished() for engine in engines):
        for i, engine in enumerate(engines):
            if engine.has_unfinished():
                got[i] += [t for out in engine.step() for t in out.token_ids]
            if between is not None:
                between()
    return got
