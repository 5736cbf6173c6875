"""Hugging Face's ways of reusing a cache, on a patched model (float32 tiny models of the GQA
pool, the MLA latent pool and a hybrid model): a prompt's cache filled by a plain forward and
then generated from, deep copies of a cache reused for several continuations (a conversation
branched), and ``generate(inputs_embeds=...)``. Each gives the unpatched model's tokens and
logits (helper 91: the forward's positions were shifted by its own length, a copy was refused
naming the model, and embeddings were refused)."""

from __future__ import annotations

import copy

import mla_models
import pytest
import torch
from driver import tiny_model

import torch_cp

FAMILIES = ["qwen3", "deepseek_v3", "qwen3_5_text"]
PREFIX = [(7 * i) % 120 + 3 for i in range(23)]  # vocabularies of 128 and up
SUFFIXES = [[5, 9, 11, 2], [77, 1, 8, 60, 33, 4, 19, 90, 6]]
NEW = 6
# float32 logits summed in another order (observed ~1e-6); a wrong position or a stale state
# differs by more than 0.1.
TOL = dict(rtol=1e-4, atol=1e-4)


def _build(family: str):
    if family == "deepseek_v3":
        return mla_models.tiny_model(mla_models.tiny_config(family))
    return tiny_model(family)


def _generate(model, ids, **kwargs):
    out = model.generate(ids, max_new_tokens=NEW, do_sample=False, return_dict_in_generate=True,
                         output_logits=True, **kwargs)
    return out.sequences, torch.stack(out.logits)


def _assert_same(got, want):
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1], **TOL)


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request):
    """(unpatched, patched) copies of one tiny model."""
    model = _build(request.param)
    return copy.deepcopy(model), torch_cp.patch_model(model)


@pytest.fixture(scope="module")
def scratch(pair):
    """The unpatched model's answer to each whole prompt (prefix + suffix), from scratch."""
    ref, _ = pair
    return [_generate(ref, torch.tensor([PREFIX + s])) for s in SUFFIXES]


def test_a_prompt_cache_filled_by_a_forward_and_copied_for_each_continuation(pair, scratch):
    """Hugging Face's prompt reuse: forward the shared prefix into a cache once, deep-copy it
    for each continuation. The copies hold their own pool (and state): the first continuation
    leaves the second's, and the original's, as they were."""
    _, model = pair
    cache = torch_cp.new_cache(model, 1, len(PREFIX))
    with torch.no_grad():
        model(torch.tensor([PREFIX]), cache=cache)
    for suffix, want in zip(SUFFIXES, scratch):
        copied = copy.deepcopy(cache)
        assert copied.runtime is cache.runtime and copied.pool is not cache.pool
        _assert_same(_generate(model, torch.tensor([PREFIX + suffix]), cache=copied), want)
    assert cache.row_lens == [len(PREFIX)]
    _assert_same(_generate(model, torch.tensor([PREFIX + SUFFIXES[1]]), cache=cache), scratch[1])


def test_a_conversation_branched_by_copying_its_cache(pair):
    """``generate`` once, then continue two ways from copies of the returned cache: each is the
    unpatched model's answer to its whole conversation."""
    ref, model = pair
    first = model.generate(torch.tensor([PREFIX]), max_new_tokens=4, do_sample=False,
                           return_dict_in_generate=True)
    for suffix in SUFFIXES:
        whole = torch.cat([first.sequences, torch.tensor([suffix])], 1)
        got = _generate(model, whole, cache=copy.deepcopy(first.past_key_values))
        _assert_same(got, _generate(ref, whole))


def test_generate_from_inputs_embeds(pair):
    ref, model = pair
    ids = torch.tensor([PREFIX, [3] * 7 + PREFIX[:16]])
    mask = torch.tensor([[1] * 23, [0] * 7 + [1] * 16])
    with torch.no_grad():
        embeds = ref.get_input_embeddings()(ids)
    got = _generate(model, None, inputs_embeds=embeds, attention_mask=mask)
    _assert_same(got, _generate(ref, None, inputs_embeds=embeds, attention_mask=mask))


def test_a_cache_made_under_inference_mode_serves_a_turn_outside_it(pair):
    """Its pool, state pool and page tables were inference tensors, which the next turn,
    outside ``torch.inference_mode``, could not write (transformers' own cache can)."""
    ref, model = pair
    with torch.inference_mode():
        first = model.generate(torch.tensor([PREFIX]), max_new_tokens=4, do_sample=False,
                               return_dict_in_generate=True)
    whole = torch.cat([first.sequences, torch.tensor([SUFFIXES[1]])], 1)
    _assert_same(_generate(model, whole, cache=first.past_key_values), _generate(ref, whole))
