"""End to end on one GPU: torch_cp.generate with FlashInfer and CUDA graphs gives the reference
backend's greedy tokens (Qwen3 and an MLA model), and P processes over gloo on one GPU give the
tokens of P = 1."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.distributed as dist
from multirank import run_ranks
from transformers import AutoModelForCausalLM, DeepseekV3Config

import torch_cp

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None,
                       reason="needs FlashInfer"),
]

PROMPT_LENGTHS = (3, 17, 40, 70)
NEW_TOKENS = 24


def qwen3():
    # head_dim 128 keeps FlashInfer on its prebuilt kernels; 1 KV head allows TP mode at tp = 2.
    return torch_cp.tiny_qwen3(seed=0, dtype=torch.bfloat16, hidden_size=256, head_dim=128,
                               num_attention_heads=4, num_key_value_heads=1)


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


MODELS = {"qwen3": qwen3, "mla": mla}


def prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(1, 300, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def tokens(results):
    assert all(r.ok for r in results), [r.error for r in results]
    return [list(r.token_ids) for r in results]


@pytest.mark.parametrize("name", list(MODELS))
def test_flashinfer_with_graphs_matches_the_reference_backend(name):
    reference = torch_cp.patch_model(MODELS[name]().cuda(), backend="torch")
    expected = tokens(torch_cp.generate(reference, prompts(), NEW_TOKENS, progress=False))
    fast = torch_cp.patch_model(MODELS[name]().cuda(), backend="flashinfer")
    assert fast.torch_cp.backend.name == "flashinfer"
    engine = torch_cp.Engine(fast, num_pages=64, page_size=16, cuda_graphs=True,
                             max_pages_per_row=8)
    got = tokens(engine.run(prompts(), NEW_TOKENS))
    assert engine.replayed_steps >= NEW_TOKENS - 2, "decode steps replay from CUDA graphs"
    assert got == expected


def _generate_on_ranks(rank: int, world: int, mode: str):
    torch.cuda.set_device(0)
    mesh = torch_cp.init_mesh(tp=world if mode == "tp" else 1, sp=world if mode == "sp" else 1,
                              device_type="cuda")
    model = torch_cp.patch_model(qwen3().cuda(), context_parallel=True, mesh=mesh, mode=mode,
                                 backend="flashinfer")
    records = []
    model.torch_cp.exchange.records = records
    out = tokens(torch_cp.generate(model, prompts(), NEW_TOKENS, progress=False))
    assert dist.get_backend() == "gloo"
    return out, [(r.op, r.shape, str(r.dtype)) for r in records]


@pytest.mark.parametrize("mode", ["tp", "sp"])
def test_two_processes_on_one_gpu_match_one(mode):
    single = torch_cp.patch_model(qwen3().cuda(), backend="flashinfer")
    expected = tokens(torch_cp.generate(single, prompts(), NEW_TOKENS, progress=False))
    per_rank = run_ranks(2, _generate_on_ranks, mode)
    for rank, (got, _) in enumerate(per_rank):
        assert got == expected, f"rank {rank}"
    assert per_rank[0][1] and per_rank[0][1] == per_rank[1][1], "partners in lockstep"
