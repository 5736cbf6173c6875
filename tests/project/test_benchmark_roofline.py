"""The MoE roofline from a run's own tokens (``benchmarks.models.generated_expert_bytes``): one
forward over the generated sequences counts the experts that the decode steps routed to,
checked against a real decode, one cached step at a time, counting each step's experts."""

from __future__ import annotations

import torch

from benchmarks import models


@torch.inference_mode()
def test_generated_expert_bytes_equal_what_a_cached_decode_routes():
    model = models.build("qwen3_moe", torch.device("cpu"), torch.float32, smoke=True)
    assert model.generation_config.eos_token_id is None, "no EOS for the peers to stop at"
    prompt, new = 6, 5
    ids = torch.randint(1, model.config.vocab_size, (3, prompt),
                        generator=torch.Generator().manual_seed(0))
    out = model(input_ids=ids, use_cache=True)
    cache, token = out.cache, out.logits[:, -1].argmax(-1, keepdim=True)
    sequences, per_step = torch.cat([ids, token], dim=1), []
    experts = models.experts_of(model)
    for _ in range(new - 1):  # the decode steps: each feeds the last generated token
        picked = []
        hooks = [e.register_forward_pre_hook(
            lambda m, args, picked=picked: picked.append(args[1].unique())) for e in experts]
        out = model(input_ids=token, cache=cache, use_cache=True)
        for h in hooks:
            h.remove()
        per_step.append(sum(p.numel() for p in picked))
        cache, token = out.cache, out.logits[:, -1].argmax(-1, keepdim=True)
        sequences = torch.cat([sequences, token], dim=1)
    want = sum(per_step) / len(per_step) * models.expert_bytes(experts[0])
    got = models.generated_expert_bytes(model, sequences.tolist(), prompt, rows=2)
    assert got == want
    assert models.generated_expert_bytes(model, sequences[:, :prompt + 1].tolist(), prompt) == 0
