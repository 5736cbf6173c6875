"""model.generate on a patched model gives the unpatched model's greedy tokens (float32 tiny Qwen3),
left-padded batches included."""

import numpy as np
import pytest
import torch
from driver import left_padded

import torch_cp
from torch_cp.hf.model_generate import GenerateCache
from torch_cp.tiny import tiny_qwen3

PROMPTS = [list(range(1, 20)), [200, 3, 150, 7, 99], [42], [(5 * i) % 250 + 3 for i in range(33)]]
NEW = 10


@pytest.fixture(scope="module")
def reference():
    model = tiny_qwen3()
    ids, mask = left_padded(PROMPTS)
    padded = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    alone = [model.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False)[0, len(p):]
             for p in PROMPTS]
    return padded, torch.stack(alone)


@pytest.fixture(scope="module")
def model():
    m = torch_cp.patch_model(tiny_qwen3())
    torch_cp.install_generate(m)  # idempotent: patch_model may already have done it
    torch_cp.install_generate(m)
    return m


def test_left_padded_batch_matches_unpatched(model, reference):
    padded, alone = reference
    ids, mask = left_padded(PROMPTS)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    assert torch.equal(out, padded)
    # and the padded reference is itself the per-prompt (unpadded) answer
    assert torch.equal(out[:, ids.shape[1]:], alone)


def test_single_unpadded_prompt(model, reference):
    _, alone = reference
    out = model.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=NEW, do_sample=False)
    assert out[0, len(PROMPTS[0]):].tolist() == alone[0].tolist()


def test_an_explicit_cache_and_chunked_prefill(model, reference):
    padded, _ = reference
    ids, mask = left_padded(PROMPTS)
    cache = torch_cp.new_cache(model, batch_size=len(PROMPTS), max_length=ids.shape[1] + NEW,
                               page_size=8)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                         cache=cache)
    assert torch.equal(out, padded)
    assert cache.row_lens == [len(p) + NEW - 1 for p in PROMPTS]
    # Chunks of 4 columns: the first chunks of the short rows hold only their padding.
    out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                         prefill_chunk_size=4)
    assert torch.equal(out, padded)


def test_the_cache_made_for_generate_is_paged_and_sized_to_the_call(model):
    seen = []
    original = GenerateCache.prepare

    def spy(self, input_ids, attention_mask):
        original(self, input_ids, attention_mask)  # allocates the pools at the first forward
        seen.append((self.pool.num_pages, self.rows, tuple(input_ids.shape)))
    GenerateCache.prepare = spy
    try:
        ids, mask = left_padded(PROMPTS[:2])
        model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    finally:
        GenerateCache.prepare = original
    pages = 2 * -(-(ids.shape[1] + 3) // model.torch_cp.page_size)
    assert seen == [(pages, 2, (2, 19)), (pages, 2, (2, 1)), (pages, 2, (2, 1))]


def test_unsupported_generate_modes_raise(model):
    ids, mask = left_padded(PROMPTS[:2])
    with pytest.raises(ValueError, match="beam search"):
        model.generate(ids, attention_mask=mask, max_new_tokens=2, num_beams=2, do_sample=False)
    two = torch_cp.new_cache(model, batch_size=2, max_length=64)
    with pytest.raises(ValueError, match="beam search"):  # a cache passed in too (helper 85)
        model.generate(ids, attention_mask=mask, max_new_tokens=2, num_beams=2, cache=two)
    with pytest.raises(ValueError, match=r"the cache passed serves 2 rows, this call has 4 "):
        model.generate(ids, attention_mask=mask, max_new_tokens=2, num_return_sequences=2,
                       do_sample=True, cache=two)
    assert two.allocator.free_pages == two.pool.num_pages  # refused before any reservation
    with pytest.raises(ValueError, match="batch_size must be a positive int, got 0; max_length "
                                         "must be a positive int, got 4.0; page_size must be a "
                                         "positive int, got 0"):
        torch_cp.new_cache(model, batch_size=0, max_length=4.0, page_size=0)
    assert torch_cp.new_cache(model, np.int64(2), np.int64(4)).rows == 2  # NumPy ints are ints
    with pytest.raises(ValueError, match="output_attentions=True needs the unpatched model"):
        model.generate(ids, attention_mask=mask, max_new_tokens=2, output_attentions=True,
                       return_dict_in_generate=True)
    right = torch.tensor([[5, 6, 7, 9], [8, 9, 0, 0]])
    for chunk in (None, 2):  # generate may prefill in chunks: the whole mask is checked
        with pytest.raises(ValueError, match=r"rows \[1\] are padded on the right"):
            model.generate(right, attention_mask=torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]]),
                           max_new_tokens=2, do_sample=False, prefill_chunk_size=chunk)


def test_uninstall_restores_the_plain_generate():
    from torch_cp.hf.model_generate import install_generate, uninstall_generate

    ref, m = tiny_qwen3(), torch_cp.patch_model(tiny_qwen3())
    install_generate(m)
    uninstall_generate(m)
    assert not m._forward_pre_hooks and "_prepare_cache_for_generation" not in m.__dict__
    torch_cp.unpatch_model(m)  # back to the Hugging Face attention: its DynamicCache works again
    ids = torch.tensor([PROMPTS[1]])
    assert torch.equal(m.generate(ids, max_new_tokens=4, do_sample=False),
                       ref.generate(ids, max_new_tokens=4, do_sample=False))


def test_unpatch_puts_back_what_the_instance_had_under_generate():
    """A wrapper set on the instance before patching is the instance's again after unpatching
    (patching replaced it, as it replaces the attention forwards)."""
    import types

    m = tiny_qwen3()
    calls = []

    def wrapped(self, *args, **kwargs):
        calls.append(len(args))
        return type(self).generate(self, *args, **kwargs)
    m.generate = wrapper = types.MethodType(wrapped, m)
    torch_cp.unpatch_model(torch_cp.patch_model(m))
    assert m.generate == wrapper and "_prepare_cache_for_generation" not in m.__dict__
    m.generate(torch.tensor([PROMPTS[1]]), max_new_tokens=2, do_sample=False)
    assert calls == [1]


def test_a_direct_forward_with_positional_mask_uses_the_plan(model):
    """model(ids, mask, cache=GenerateCache) outside generate: the hook plans from the mask too;
    the real tokens' logits equal the unpatched model's (float32, summed in another order)."""
    ref = tiny_qwen3()
    ids, mask = left_padded(PROMPTS[:2])
    cache = torch_cp.new_cache(model, batch_size=2, max_length=ids.shape[1])
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # as generate() makes them
    with torch.no_grad():
        got = model(ids, mask, position_ids=positions, cache=cache).logits
        want = ref(ids, attention_mask=mask, position_ids=positions).logits
    real = mask.bool()
    # float32 logits of magnitude ~10: 1e-4 covers reordered sums (observed ~1e-6), far below
    # the greedy gaps (> 1e-3 on these prompts' greedy paths).
    torch.testing.assert_close(got[real], want[real], rtol=1e-4, atol=1e-4)
    assert cache.row_lens == [len(p) for p in PROMPTS[:2]]


def test_use_cache_false_still_generates_the_unpatched_tokens(model, reference):
    """``use_cache=False`` (a call's argument or a checkpoint config's) is overridden: the patched
    attention runs from the paged cache, and the tokens are the uncached model's."""
    padded, _ = reference
    ids, mask = left_padded(PROMPTS)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                         use_cache=False)
    assert torch.equal(out, padded)


def test_use_cache_false_with_an_explicit_cache_still_generates_the_unpatched_tokens(
        model, reference):
    """With the caller's cache too (helper 58: transformers then fed the whole sequence at
    every step, and the cache took it all again: other tokens, silently)."""
    padded, _ = reference
    ids, mask = left_padded(PROMPTS)
    cache = torch_cp.new_cache(model, batch_size=len(PROMPTS), max_length=ids.shape[1] + NEW)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                         use_cache=False, cache=cache)
    assert torch.equal(out, padded)
    assert cache.row_lens == [len(p) + NEW - 1 for p in PROMPTS]


def test_prefill_chunks_of_padding_only_change_no_token(model):
    """A batch padded further than its longest prompt (a tokenizer's ``pad_to_multiple_of``)
    prefilled in chunks: the first chunks hold no real token in any row, and the unpatched
    model's tokens come out all the same (they were refused)."""
    ids, mask = left_padded([[0] * 9 + PROMPTS[0], PROMPTS[1]])
    mask[0, :9] = 0
    want = tiny_qwen3().generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                         prefill_chunk_size=4)
    assert torch.equal(out, want)


def test_caches_and_modes_the_paged_attention_cannot_serve_are_refused(model):
    from transformers import DynamicCache

    ids, mask = left_padded(PROMPTS[:2])
    with pytest.raises(ValueError, match="takes a cache made by torch_cp.new_cache"):
        model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False,
                       cache=DynamicCache())
    with pytest.raises(ValueError, match="guidance_scale"):
        model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False,
                       guidance_scale=1.5)
    with pytest.raises(ValueError, match="no real token"):
        model.generate(ids, attention_mask=torch.zeros_like(mask), max_new_tokens=2,
                       do_sample=False)


def test_a_direct_forward_without_position_ids_takes_the_plans(model):
    """model(ids, cache=PagedKVCache) after begin_step(plan), rows of different contexts packed
    in one [1, N] input: each row's positions come from the plan, not from one offset for all."""
    from torch_cp.kv import PageAllocator
    from torch_cp.plan import build_step_plan

    ref = tiny_qwen3()
    prompts = [PROMPTS[1], PROMPTS[2] + [7, 8]]
    allocator = PageAllocator(8, model.torch_cp.page_size)
    cache = torch_cp.PagedKVCache.for_model(model, 8)

    def step(q_lens, ctx_lens, ids):
        for r, (q, c) in enumerate(zip(q_lens, ctx_lens)):
            allocator.reserve(r, q + c)
        cache.begin_step(build_step_plan(
            q_lens, ctx_lens, [allocator.table_tensor(r) for r in range(2)],
            page_size=cache.pool.page_size, sink_page=cache.pool.sink_page,
            placement=model.torch_cp.placement, device=torch.device("cpu")))
        with torch.no_grad():
            return model(torch.tensor([ids]), cache=cache).logits[0]

    prefill = step([len(p) for p in prompts], [0, 0], sum(prompts, []))
    last = [len(prompts[0]) - 1, len(prompts[0]) + len(prompts[1]) - 1]
    nxt = [int(prefill[i].argmax()) for i in last]
    decode = step([1, 1], [len(p) for p in prompts], nxt)
    with torch.no_grad():
        want = torch.stack([ref(torch.tensor([p + [t]])).logits[0, -1]
                            for p, t in zip(prompts, nxt)])
    # float32, summed in another order (observed ~2e-6); a wrong rotation differs by ~0.5.
    torch.testing.assert_close(decode, want, rtol=1e-4, atol=1e-4)


def test_a_model_transformers_kernelized_keeps_its_patch_through_train_and_eval(tmp_path,
                                                                                 caplog):
    """From transformers 5.25 (with the kernels package) ``from_pretrained`` turns the kernels
    hub's layers on, and a change of their mode (``train()`` / ``eval()``) re-kernelizes, which
    dropped torch_cp's forwards on the hub-decorated linear-attention layers (``generate`` then
    failed): ``patch_model`` turns them off, says so, and the tokens stay the unpatched ones."""
    import logging

    from transformers import AutoModelForCausalLM

    from torch_cp.tiny import tiny_qwen3_5

    tiny_qwen3_5().save_pretrained(tmp_path)
    prompt = torch.tensor([PROMPTS[0]])
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    want = reference.generate(prompt, max_new_tokens=NEW, do_sample=False)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    kernelized = getattr(model, "use_kernels", False)
    with caplog.at_level(logging.WARNING, logger="torch_cp"):
        torch_cp.patch_model(model)
    assert not getattr(model, "use_kernels", False)
    assert any("kernels-hub" in r.getMessage() for r in caplog.records) == kernelized
    model.train()
    model.eval()
    assert torch.equal(model.generate(prompt, max_new_tokens=NEW, do_sample=False), want)



def _conversation(m, ids, mask):
    """Three turns of ``m.generate``, each given the last one's cache and the whole conversation
    with the user's next turn appended: each turn's sequences, the last turn's attention mask
    and its cache."""
    replies = [(4, [3, 4, 5, 6, 7, 8]), (9, list(range(60, 90)))]  # new tokens, next user turn
    assert max(ids.max(), 89) < m.config.vocab_size
    out = m.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False,
                     return_dict_in_generate=True)
    turns = [out.sequences]
    for new, user in replies:
        seq = torch.cat([out.sequences, torch.tensor([user] * ids.shape[0])], 1)
        mask = torch.cat([mask, torch.ones(ids.shape[0], seq.shape[1] - mask.shape[1],
                                           dtype=mask.dtype)], 1)
        out = m.generate(seq, attention_mask=mask, cache=_cache_of(out), max_new_tokens=new,
                         do_sample=False, return_dict_in_generate=True)
        turns.append(out.sequences)
    return turns, mask, _cache_of(out)


def _cache_of(out):
    """The output's cache: ``cache`` from transformers 5.25, ``past_key_values`` before."""
    return out.get("cache", out.get("past_key_values"))


def test_a_conversation_continues_from_the_cache_of_its_last_turn(model):
    """Hugging Face's multi-turn pattern: the next turn's ``generate`` takes the last one's
    cache, sized for that turn, and grows it (it was refused past its pages: helper 85); the
    tokens are the unpatched model's continuing from its own cache, so the pages cached before
    kept their KV."""
    ids, mask = left_padded(PROMPTS[:2])
    want, _, _ = _conversation(tiny_qwen3(), ids, mask)
    got, whole_mask, cache = _conversation(model, ids, mask)  # the mask of the last input
    for w, g in zip(want, got):
        assert torch.equal(g, w)
    assert isinstance(cache, GenerateCache)
    # sized for the last call's max_length: all but its last token is ever fed
    assert cache.pool.num_pages == 2 * -(-(got[-1].shape[1] - 1) // model.torch_cp.page_size)
    # every turn fed only its new columns: each row cached its real tokens but the last one
    real = whole_mask.sum(1) + got[-1].shape[1] - whole_mask.shape[1]
    assert cache.row_lens == [int(n) - 1 for n in real]


def test_a_next_turn_of_new_tokens_only_grows_the_cache_as_it_needs(model):
    """Hugging Face's other form of a next turn: ``input_ids`` the new tokens alone, the mask
    the whole conversation's; its max_length counts this call's tokens only, so the prefill
    grows the pool (helper 88: refused). The tokens are the unpatched model's."""
    ids, mask = left_padded(PROMPTS[:2])
    outs = {}
    for name, m in (("unpatched", tiny_qwen3()), ("patched", model)):
        first = m.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False,
                           return_dict_in_generate=True)
        user = torch.tensor([list(range(60, 90))] * 2)
        whole = torch.cat([mask, torch.ones(2, 3 + user.shape[1], dtype=mask.dtype)], 1)
        # the last generated token was never fed: it leads the new input
        new = torch.cat([first.sequences[:, -1:], user], 1)
        outs[name] = m.generate(new, attention_mask=whole, cache=_cache_of(first),
                                max_new_tokens=4, do_sample=False)
    assert torch.equal(outs["patched"], outs["unpatched"])


@pytest.mark.parametrize("marked, why", [
    ([20, 7], "a cached column cannot be masked out afterwards"),
    ([21, 8], "a column cached as padding cannot be marked real afterwards")])
def test_a_mask_that_marks_cached_columns_otherwise_is_refused(model, marked, why):
    """The pool attends every cached token and nothing else: a next turn whose mask zeros a
    column the cache holds as real (a row's padding after its EOS, as ``seq != pad`` makes it)
    would silently give other tokens than Hugging Face's cache, which masks it (helper 88); one
    that marks real a column cached as padding (never written) is refused too, each naming why."""
    ids, mask = left_padded(PROMPTS[:2])
    first = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False,
                           return_dict_in_generate=True)
    cache = _cache_of(first)
    seq = torch.cat([first.sequences, torch.tensor([[5, 6]] * 2)], 1)
    whole = torch.ones_like(seq)
    whole[:, : ids.shape[1]] = mask
    if marked[0] < 21:
        whole[0, ids.shape[1]] = 0  # row 0's first generated token, cached as real
    else:
        whole[1, 0] = 1  # row 1's first column, cached as padding
    with pytest.raises(ValueError, match=rf"holds \[21, 7\] real tokens a row in its first 21 "
                                         rf"columns; the attention mask marks \[{marked[0]}, "
                                         rf"{marked[1]}\]: {why}"):
        model.generate(seq, attention_mask=whole, cache=cache, max_new_tokens=2)
    assert cache.row_lens == [21, 7]  # refused before anything was planned


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_5_text"])
def test_a_conversation_continues_on_the_mla_pool_and_a_hybrid_model(family):
    """The same for the MLA latent pool and a hybrid model (its state slots stay the rows')."""
    import mla_models
    from driver import tiny_model

    def build():
        if family == "deepseek_v3":
            return mla_models.tiny_model(mla_models.tiny_config(family))
        return tiny_model(family)
    ids, mask = left_padded([[t % 128 for t in p] for p in PROMPTS[:2]])  # their vocab: 128
    want, _, _ = _conversation(build(), ids, mask)
    got, _, _ = _conversation(torch_cp.patch_model(build()), ids, mask)
    for w, g in zip(want, got):
        assert torch.equal(g, w)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5_text"])
def test_a_next_turn_padded_between_the_cache_and_its_tokens_is_each_rows_alone(family):
    """A next turn whose user tokens differ in length, left-padded after the cached columns
    (padding in the middle of a row): each row continues as its unpadded conversation alone on
    the unpatched model. On the hybrid model Hugging Face's own batch does not (its gated
    DeltaNet state advances over the padding: helper 101), so the reference is each row alone."""
    from driver import tiny_model

    def build():
        return tiny_qwen3() if family == "qwen3" else tiny_model(family)
    ids, mask = left_padded([[t % 128 for t in p] for p in PROMPTS[:2]])  # hybrid vocab: 128
    model = torch_cp.patch_model(build())
    first = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False,
                           return_dict_in_generate=True)
    users = [[8, 9, 10], [20, 21, 22, 23, 24]]
    width = max(map(len, users))
    seq = torch.cat([first.sequences, torch.tensor([[0] * (width - len(u)) + u for u in users])], 1)
    whole = torch.cat([mask, torch.ones(2, 3, dtype=mask.dtype),
                       torch.tensor([[0] * (width - len(u)) + [1] * len(u) for u in users])], 1)
    got = model.generate(seq, attention_mask=whole, cache=_cache_of(first), max_new_tokens=4,
                         do_sample=False)[:, seq.shape[1]:]
    reference = build()
    for row in range(2):
        alone = seq[row][whole[row].bool()][None]
        want = reference.generate(alone, attention_mask=torch.ones_like(alone), max_new_tokens=4,
                                  do_sample=False)[0, alone.shape[1]:]
        assert got[row].tolist() == want.tolist(), f"row {row}"


def _pool_spy(monkeypatch) -> list:
    """Every allocation of a generate cache's pools (its first forward's or ``new_cache``'s)."""
    from torch_cp.hf import generate_cache, model_generate

    made = []
    for module in (generate_cache, model_generate):
        real = module.new_pools
        monkeypatch.setattr(module, "new_pools",
                            lambda *a, real=real, **k: made.append(a[1:3]) or real(*a, **k))
    return made


def test_settings_refused_later_in_generate_are_refused_before_the_cache_is_allocated(
        model, monkeypatch):
    """transformers checks a temperature or stop strings only after it has made the cache: a
    cache sized by a huge max_new_tokens was allocated first (helper 116). It is allocated at
    the first forward now; assisted decoding, which would crop it after a step, is refused
    with the other settings the paged cache cannot serve, in one error."""
    made = _pool_spy(monkeypatch)
    ids, mask = left_padded(PROMPTS[:2])
    huge = dict(attention_mask=mask, max_new_tokens=4_000_000)
    with pytest.raises(ValueError, match="temperature"):
        model.generate(ids, do_sample=True, temperature=0.0, **huge)
    with pytest.raises(ValueError, match="stop strings"):
        model.generate(ids, do_sample=False, stop_strings=["ab"], **huge)
    with pytest.raises(ValueError, match=r"guidance_scale .*; assisted decoding"):
        model.generate(ids, do_sample=False, prompt_lookup_num_tokens=2, guidance_scale=1.5,
                       **huge)
    assert made == []
    first = model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False,
                           return_dict_in_generate=True)
    assert made == [(2 * -(-(ids.shape[1] + 2) // model.torch_cp.page_size),
                     model.torch_cp.page_size)]
    cache = _cache_of(first)
    pages = cache.pool.num_pages
    whole = torch.cat([mask, torch.ones(2, 2, dtype=mask.dtype)], 1)
    with pytest.raises(ValueError, match="stop strings"):  # a next turn: the cache grew first
        model.generate(first.sequences, attention_mask=whole, cache=cache, do_sample=False,
                       stop_strings=["ab"], max_new_tokens=4_000_000)
    with torch.no_grad():  # nor did it at the next forward
        model(first.sequences[:, -1:], cache=cache)
    assert cache.pool.num_pages == pages


def test_a_cache_the_free_memory_cannot_hold_is_refused_before_it_is_allocated(
        model, monkeypatch):
    """``new_cache`` and ``model.generate`` allocated a pool of any size: 10**10 new tokens
    failed inside the allocator, and a pool just past the free memory would overcommit it
    (helper 116). Both now check it against the free memory first, as ``Engine`` does, and a
    conversation's cache that cannot grow for a next turn is refused and stays usable."""
    from torch_cp.engine import memory

    made = _pool_spy(monkeypatch)
    per_page = memory.pool_bytes_per_page(model.torch_cp, model.torch_cp.page_size)
    monkeypatch.setattr(memory, "_free_bytes", lambda runtime: 40 * per_page)
    ids, mask = left_padded(PROMPTS[:2])
    with pytest.raises(ValueError, match="the free memory holds at most 39 pages"):
        model.generate(ids, attention_mask=mask, max_new_tokens=10**10, do_sample=False)
    with pytest.raises(ValueError, match="the free memory holds at most 39 pages"):
        torch_cp.new_cache(model, 1, 10**10)
    assert made == []
    first = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False,
                           return_dict_in_generate=True)
    cache = _cache_of(first)
    seq = torch.cat([first.sequences, torch.tensor([[5, 6]] * 2)], 1)
    whole = torch.cat([mask, torch.ones(2, seq.shape[1] - mask.shape[1], dtype=mask.dtype)], 1)
    with pytest.raises(ValueError, match="cannot grow to"):
        model.generate(seq, attention_mask=whole, cache=cache, max_new_tokens=10**4,
                       do_sample=False)
    got = model.generate(seq, attention_mask=whole, cache=cache, max_new_tokens=3,
                         do_sample=False)
    unpatched = tiny_qwen3()
    ref = unpatched.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False,
                             return_dict_in_generate=True)
    want = unpatched.generate(seq, attention_mask=whole, cache=_cache_of(ref), max_new_tokens=3,
                              do_sample=False)
    assert torch.equal(got, want)


def test_a_next_turn_with_an_id_outside_the_vocabulary_is_refused_and_the_turn_retried(model):
    """One id past the vocabulary in a next turn raised in the embedding after the cache had
    counted the turn, so the corrected retry was refused and the conversation lost (helper
    116; on a GPU the embedding's device-side assert ends the process). The call's whole input
    is checked before its first forward, and a direct forward's before the cache plans it: the
    cache is left as it was, and the corrected turn gives the unpatched model's tokens."""
    ids, mask = left_padded(PROMPTS[:2])
    outs = {}
    for name, m in (("unpatched", tiny_qwen3()), ("patched", model)):
        first = m.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False,
                           return_dict_in_generate=True)
        user = torch.tensor([[7, 8, 9], [10, 11, 12]])
        whole = torch.cat([mask, torch.ones(2, 3 + user.shape[1], dtype=mask.dtype)], 1)
        if name == "patched":
            cache = _cache_of(first)
            held = (cache.columns, list(cache.row_lens), cache.allocator.free_pages)
            bad = user.clone()
            bad[1, 1] = m.config.vocab_size
            for chunk in (None, 2):  # prefilled in chunks: the chunk before the bad id was
                # planned and written, then refused with the cache counting it (helper 118)
                with pytest.raises(ValueError, match=r"rows \[1\] hold ids outside the "
                                                     r"model's vocabulary"):
                    m.generate(torch.cat([first.sequences, bad], 1), attention_mask=whole,
                               cache=cache, max_new_tokens=4, do_sample=False,
                               prefill_chunk_size=chunk)
                assert (cache.columns, cache.row_lens, cache.allocator.free_pages) == held
            with pytest.raises(ValueError, match="outside the model's vocabulary"), \
                    torch.no_grad():
                m(bad, cache=cache)  # a direct forward
            assert (cache.columns, cache.row_lens, cache.allocator.free_pages) == held
        outs[name] = m.generate(torch.cat([first.sequences, user], 1), attention_mask=whole,
                                cache=_cache_of(first), max_new_tokens=4, do_sample=False)
    assert torch.equal(outs["patched"], outs["unpatched"])
