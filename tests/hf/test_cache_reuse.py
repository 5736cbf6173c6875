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
from torch_cp.layers import decoder_layers

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
    held = _tensors(cache)
    before = [t.clone() for t in held]
    free = cache.allocator.free_pages
    for suffix, want in zip(SUFFIXES, scratch):
        copied = copy.deepcopy(cache)
        assert copied.runtime is cache.runtime
        assert not {t.untyped_storage().data_ptr() for t in _tensors(copied)} & {
            t.untyped_storage().data_ptr() for t in held}
        _assert_same(_generate(model, torch.tensor([PREFIX + suffix]), cache=copied), want)
    assert all(torch.equal(t, b) for t, b in zip(held, before))  # bitwise: copies wrote their own
    assert (cache.row_lens, cache.allocator.free_pages) == ([len(PREFIX)], free)
    _assert_same(_generate(model, torch.tensor([PREFIX + SUFFIXES[1]]), cache=cache), scratch[1])


def _tensors(cache) -> list[torch.Tensor]:
    """A cache's pool and state pool tensors."""
    return list(cache.pool.tensors) + (cache.state.tensors if cache.state is not None else [])


def test_a_copy_shares_the_model_with_its_cache_only(pair):
    """The runtime is shared with the copied cache, not handed to a model copied beside it:
    that copy is refused, as the model alone is."""
    _, model = pair
    cache = torch_cp.new_cache(model, 1, 8)
    with pytest.raises(ValueError, match="cannot be deep-copied"):
        copy.deepcopy([cache, model])


def test_forwards_in_chunks_of_a_left_padded_batch_take_each_rows_positions(pair):
    """Direct forwards of 4 columns at a time: the second row's first chunk is its padding
    alone, its third chunk too, after real tokens; each real token's logits are those of its
    row run alone, unpadded, by the unpatched model (the positions counted from the columns
    were off by a chunk)."""
    ref, model = pair
    rows = [PREFIX[:16], [0] * 4 + PREFIX[16:19] + [0] * 5 + PREFIX[19:23]]
    mask = torch.tensor([[1] * 16, [0] * 4 + [1] * 3 + [0] * 5 + [1] * 4])
    ids = torch.tensor(rows)
    cache = torch_cp.new_cache(model, 2, 16)
    with torch.no_grad():
        got = torch.cat([model(ids[:, s:s + 4], attention_mask=mask[:, :s + 4], cache=cache).logits
                         for s in range(0, 16, 4)], 1)
        for r, row in enumerate(rows):
            real = [t for t, m in zip(row, mask[r].tolist()) if m]
            want = ref(torch.tensor([real])).logits[0]
            torch.testing.assert_close(got[r][mask[r].bool()], want, **TOL)


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


@pytest.mark.parametrize("made", ["by generate", "grown", "copied"])
def test_a_cache_made_under_inference_mode_serves_a_turn_outside_it(pair, made):
    """Its pool, state pool and page tables were inference tensors, which the next turn,
    outside ``torch.inference_mode``, could not write (transformers' own cache can): the cache
    generate makes, one grown by the first turn, a copy."""
    ref, model = pair
    small = torch_cp.new_cache(model, 1, 4) if made == "grown" else None
    with torch.inference_mode():
        first = model.generate(torch.tensor([PREFIX]), max_new_tokens=4, do_sample=False,
                               return_dict_in_generate=True, cache=small)
        cache = first.past_key_values
        if made == "copied":
            cache = copy.deepcopy(cache)
    whole = torch.cat([first.sequences, torch.tensor([SUFFIXES[1]])], 1)
    _assert_same(_generate(model, whole, cache=cache), _generate(ref, whole))


def test_a_direct_forward_takes_its_arguments_by_position(pair):
    """``model(ids, mask, position_ids, cache=...)``: the hook named only the first two, and the
    call failed with two values for ``input_ids``."""
    ref, model = pair
    ids = torch.tensor([PREFIX[:9]])
    mask, positions = torch.ones_like(ids), torch.arange(9)[None]
    cache = torch_cp.new_cache(model, 1, 9)
    with torch.no_grad():
        got = model(ids, mask, positions, cache=cache).logits
        want = ref(ids, mask, positions).logits
    torch.testing.assert_close(got, want, **TOL)


def test_a_cache_whose_forward_raised_is_refused_and_a_new_one_serves(pair, scratch, monkeypatch):
    """A forward that raised left the cache counting its tokens as cached, though the layers
    after the fault never wrote them: the same call retried with it gave other tokens, no error
    (helper 112). The cache is refused by name now (a hybrid's earlier layers moved their state
    too: nothing to roll back), and a new one gives the unpatched model's tokens."""
    _, model = pair
    layer = decoder_layers(model)[-1]
    wrapped = layer.forward

    def failing(*args, **kwargs):
        monkeypatch.setattr(layer, "forward", wrapped)  # once
        raise RuntimeError("planted fault")
    monkeypatch.setattr(layer, "forward", failing)
    ids = torch.tensor([PREFIX + SUFFIXES[0]])
    cache = torch_cp.new_cache(model, 1, len(PREFIX) + 8)
    with pytest.raises(RuntimeError, match="planted fault"):
        _generate(model, ids, cache=cache)
    with pytest.raises(ValueError, match="last forward raised"):
        _generate(model, ids, cache=cache)
    with pytest.raises(ValueError, match="last forward raised"), torch.no_grad():
        model(ids, cache=cache)
    _assert_same(_generate(model, ids, cache=torch_cp.new_cache(model, 1, len(PREFIX) + 8)),
                 scratch[0])
