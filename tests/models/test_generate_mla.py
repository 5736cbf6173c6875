"""MLA families end to end at P = 1: a patched model generates the unpatched model's greedy tokens
and last logits, through the packed greedy driver and through its own ``model.generate`` on a
left-padded batch. (Attention-level checks: tests/models/test_patch_mla.py; P > 1:
tests/models/test_patch_mla_multirank.py.)"""

from __future__ import annotations

import pytest
import torch
from driver import greedy, hf_greedy
from mla_models import LOGIT_TOL, VARIANTS, prompts_for, tiny_config, tiny_model, variant_id

from torch_cp.hf.patch import patch_model

E2E_VARIANTS = [VARIANTS[0], VARIANTS[1], VARIANTS[3], VARIANTS[4]]


@pytest.mark.parametrize("variant", E2E_VARIANTS, ids=variant_id)
def test_patched_greedy_equals_hf_generate(variant):
    """P = 1: patch_model + the packed greedy driver give HF generate's tokens and last logits."""
    family, kw = variant
    config = tiny_config(family, **kw)
    prompts = prompts_for(config)
    want_tokens, want_logits = hf_greedy(tiny_model(config), prompts, 6)
    model = patch_model(tiny_model(config), page_size=4)
    got = greedy(model, prompts, 6)
    assert got.tokens == want_tokens
    torch.testing.assert_close(got.last_logits, want_logits, **LOGIT_TOL)


@pytest.mark.parametrize("variant", [VARIANTS[0], VARIANTS[3]], ids=variant_id)
def test_patched_hf_generate_left_padded_batch(variant):
    """P = 1: the patched model's own ``generate`` on a left-padded batch (the padded [B, S] input
    read through ``plan.token_index``) gives the unpadded per-prompt HF tokens and last logits."""
    family, kw = variant
    config = tiny_config(family, **kw)
    prompts = prompts_for(config)
    want_tokens, want_logits = hf_greedy(tiny_model(config), prompts, 6)
    model = patch_model(tiny_model(config), page_size=4)
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, prompt in enumerate(prompts):
        ids[b, width - len(prompt):] = torch.tensor(prompt)
        mask[b, width - len(prompt):] = 1
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
    assert out.sequences[:, width:].tolist() == want_tokens
    torch.testing.assert_close(out.logits[-1].float(), want_logits, **LOGIT_TOL)
