"""Prompts in the forms users hold them (token ids, tensors, text, encodings, padded batches with
their masks, chats) give the tokens of the same prompts as plain token lists, and those equal the
unpatched Hugging Face model's greedy tokens for each prompt alone (no padding anywhere)."""

import pytest
import torch

import torch_cp
from torch_cp.engine import Engine
from torch_cp.engine.requests import normalize_prompts
from torch_cp.tiny import tiny_qwen3, tiny_tokenizer

TEXTS = ["Hi", "The quick brown fox", "torch_cp packs requests"]
CHATS = [[{"role": "user", "content": "Hello!"}],
         [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why?"},
          {"role": "assistant", "content": "So."}, {"role": "user", "content": "Ok"}]]
NEW = 6


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def ids(tok):
    """TEXTS and CHATS as plain token lists."""
    texts = [tok(t, add_special_tokens=False)["input_ids"] for t in TEXTS]
    chats = [tok.apply_chat_template(c, add_generation_prompt=True, return_dict=True)["input_ids"]
             for c in CHATS]
    return {"texts": texts, "chats": chats}


@pytest.fixture(scope="module")
def reference(ids, tok):
    """The unpatched model's greedy tokens for each prompt alone, stopping at the tokenizer's
    EOS as generate does."""
    model = tiny_qwen3()
    out = {}
    for p in ids["texts"] + ids["chats"]:
        seq = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=int),
                             max_new_tokens=NEW, do_sample=False, eos_token_id=tok.eos_token_id,
                             pad_token_id=tok.pad_token_id)
        out[tuple(p)] = tuple(seq[0, len(p):].tolist())
    return out


def tokens(results):
    assert all(r.ok for r in results), [r.error for r in results]
    return [r.token_ids for r in results]


def gen(model, prompts, **kwargs):
    return tokens(torch_cp.generate(model, prompts, NEW, progress=False, **kwargs))


def test_token_lists_match_unpatched_hf(model, ids, reference):
    prompts = ids["texts"] + ids["chats"]
    assert gen(model, prompts) == [reference[tuple(p)] for p in prompts]


def test_tensors_and_text(model, tok, ids, reference):
    expected = [reference[tuple(p)] for p in ids["texts"]]
    assert gen(model, [torch.tensor(p) for p in ids["texts"]]) == expected
    assert gen(model, torch.tensor(ids["texts"][1])) == expected[1:2]  # [L]: a batch of one
    results = torch_cp.generate(model, TEXTS, NEW, tokenizer=tok, progress=False)
    assert tokens(results) == expected
    assert [r.text for r in results] == [tok.decode(list(t), skip_special_tokens=True)
                                         for t in expected]
    assert gen(model, TEXTS[2], tokenizer=tok) == expected[2:]  # one string: a batch of one


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("tensors", [None, "pt", "np"])
def test_padded_encodings_are_stripped_by_their_mask(model, tok, ids, reference, side, tensors):
    expected = [reference[tuple(p)] for p in ids["texts"]]
    tok.padding_side = side
    try:
        enc = tok(TEXTS, padding=True, return_tensors=tensors)
    finally:
        tok.padding_side = "right"
    assert 0 in list(enc["attention_mask"][0]), "the short prompt is padded"
    assert gen(model, enc) == expected  # the BatchEncoding itself
    assert gen(model, dict(enc)) == expected  # a plain dict
    assert gen(model, enc["input_ids"], attention_mask=enc["attention_mask"]) == expected


def test_single_prompt_encodings(model, tok, ids, reference):
    expected = [reference[tuple(ids["texts"][1])]]
    assert gen(model, tok(TEXTS[1])) == expected  # 1-D lists
    enc = tok(TEXTS[1], return_tensors="pt")  # [1, L] tensors
    assert gen(model, enc) == expected
    assert gen(model, enc.input_ids) == expected  # no pad id in it: no mask needed
    assert gen(model, torch.tensor(ids["texts"][1]),
               attention_mask=torch.ones(len(ids["texts"][1]), dtype=torch.bool)) == expected


def test_chats(model, tok, ids, reference):
    expected = [reference[tuple(p)] for p in ids["chats"]]
    assert gen(model, CHATS, tokenizer=tok) == expected
    assert gen(model, CHATS[1], tokenizer=tok) == expected[1:]  # one conversation
    tok.padding_side = "left"
    try:
        enc = tok.apply_chat_template(CHATS, add_generation_prompt=True, return_dict=True,
                                      padding=True, return_tensors="pt")
    finally:
        tok.padding_side = "right"
    assert gen(model, enc) == expected
    # Mixed forms in one batch: a string, a chat, token ids.
    mixed = [TEXTS[0], CHATS[0], ids["texts"][2]]
    assert gen(model, mixed, tokenizer=tok) == [
        reference[tuple(ids["texts"][0])], expected[0], reference[tuple(ids["texts"][2])]]


def test_engine_run_takes_every_form_and_decodes_text(model, tok, ids, reference):
    engine = Engine(model, num_pages=16, page_size=16)
    expected = [reference[tuple(p)] for p in ids["texts"]]
    results = engine.run(TEXTS, NEW, tokenizer=tok, eos_token_ids=[tok.eos_token_id])
    assert tokens(results) == expected
    assert [r.text for r in results] == [tok.decode(list(t), skip_special_tokens=True)
                                         for t in expected]
    enc = tok(TEXTS, padding=True, return_tensors="pt")
    assert tokens(engine.run(enc.input_ids, NEW, attention_mask=enc.attention_mask,
                             eos_token_ids=[tok.eos_token_id])) == expected
    assert tokens(engine.run(CHATS, NEW, tokenizer=tok, eos_token_ids=[tok.eos_token_id])) == [
        reference[tuple(p)] for p in ids["chats"]]
    assert engine.run(ids["texts"], NEW)[0].text is None


def test_a_padded_batch_without_its_mask_is_refused(model, tok):
    enc = tok(TEXTS, padding=True, return_tensors="pt")
    with pytest.raises(ValueError, match=r"prompts 0, 1 of a batch without attention_mask .*"
                                         r"pad token id \[256\].*attention_mask"):
        torch_cp.generate(model, enc.input_ids, NEW, tokenizer=tok, progress=False)
    tok.padding_side = "left"
    try:
        left = tok(TEXTS, padding=True).input_ids  # lists of one length, padded on the left
    finally:
        tok.padding_side = "right"
    with pytest.raises(ValueError, match="attention_mask"):
        Engine(model, num_pages=8).run(left, NEW, tokenizer=tok)
    # Without a tokenizer, the model's pad id (its generation config's, as Qwen's) tells.
    padded = torch_cp.patch_model(tiny_qwen3())
    padded.generation_config.pad_token_id = tok.pad_token_id
    with pytest.raises(ValueError, match="attention_mask"):
        torch_cp.generate(padded, enc.input_ids, NEW, progress=False)
    # A pad id inside a row is no padding, and ragged lists are not a padded batch.
    inner = [[5, tok.pad_token_id, 7], [8, tok.pad_token_id, 9]]
    assert normalize_prompts(torch.tensor(inner), pad_token_ids=[256]) == inner
    ragged = [[5, 6, tok.pad_token_id], [8]]
    assert normalize_prompts(ragged, pad_token_ids=[256]) == ragged
    # A list of NumPy rows is a padded batch too (helper 75: it ran with its padding as prompt)
    rows = list(tok(TEXTS, padding=True, return_tensors="np")["input_ids"])
    with pytest.raises(ValueError, match="attention_mask"):
        torch_cp.generate(model, rows, NEW, tokenizer=tok, progress=False)


def test_one_token_rows_are_a_batch_not_one_prompt(model, reference):
    """``list(ids)`` of a [B, 1] tensor: B one-token prompts (helper 75: a [1] tensor read as
    an int made them one prompt of B ids)."""
    rows = list(torch.tensor([[5], [7]]))
    assert normalize_prompts(rows) == [[5], [7]]
    got = torch_cp.generate(model, rows, NEW, progress=False)
    assert [list(r.token_ids) for r in got] == [
        list(torch_cp.generate(model, [i], NEW, progress=False)[0].token_ids) for i in (5, 7)]
    assert Engine(model, num_pages=8).submit(torch.tensor([5])) == 0  # one prompt of one token


def test_bad_prompts_name_every_problem():
    chat = [{"role": "user", "content": "hi"}]
    with pytest.raises(ValueError) as e:
        normalize_prompts(["a", chat, "b", [1.5, 2]])
    msg = str(e.value)
    assert "prompts 0, 2: a string needs tokenizer=" in msg
    assert "prompt 1: a chat needs tokenizer=" in msg
    assert "prompt 3: neither token ids" in msg
    no_template = tiny_tokenizer()
    no_template.chat_template = None
    with pytest.raises(ValueError, match="has none: set tokenizer.chat_template"):
        normalize_prompts(chat, no_template)
    with pytest.raises(ValueError, match="a single chat message"):
        normalize_prompts(chat[0])
    # a chat template that raises is named at its prompt, beside the others (helper 87)
    strict = tiny_tokenizer()
    strict.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' and not "
                            "loop.first %}{{ raise_exception('system must be first') }}{% endif "
                            "%}{{ m['content'] }}{% endfor %}")
    late_system = chat + [{"role": "system", "content": "b"}]
    with pytest.raises(ValueError, match=r"prompt 0: the tokenizer raised TemplateError: system "
                                         r"must be first; prompt 2: neither token ids"):
        normalize_prompts([late_system, "x", 5], strict)
    with pytest.raises(ValueError, match=r"of shape \(2, 3\) does not match input_ids of shape "
                                         r"\(2, 4\)"):
        normalize_prompts(torch.ones(2, 4, dtype=int), attention_mask=torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"lengths \[2, 3\] does not match"):
        normalize_prompts([[1, 2, 3], [4, 5, 6]], attention_mask=[[1, 1], [1, 1, 1]])
    additive = torch.tensor([[0.0, float("-inf")]])  # 0 = keep in an additive mask: refused
    with pytest.raises(ValueError, match="1 for real tokens and 0 for padding"):
        normalize_prompts(torch.tensor([[3, 4]]), attention_mask=additive)
    with pytest.raises(ValueError, match="attention_mask given twice"):
        normalize_prompts({"input_ids": [[1]], "attention_mask": [[1]]}, attention_mask=[[1]])
    with pytest.raises(ValueError, match=r"\[L\] or \[B, L\], got \(1, 1, 2\)"):
        normalize_prompts(torch.ones(1, 1, 2, dtype=int))


def test_run_tokens_refuses_what_is_not_token_ids(model):
    """``run_tokens`` (the CLI's) took a float or bool as the token it rounds to, and a str or a
    nested list raised a TypeError mid-batch (helper 116): a ValueError now, as ``run``'s."""
    engine = Engine(model, num_pages=8)
    for prompts, named in (([[1.9]], "prompt 0:"), ([[True]], "prompt 0:"),
                           ([[1, 2], "ab", [[2]]], "prompts 1, 2:"),
                           (None, "got NoneType"), ("ab", "got str")):
        with pytest.raises(ValueError, match=f"invalid prompts: .*{named}"):
            engine.run_tokens(prompts, 2)
    assert engine.allocator.free_pages == engine.allocator.num_pages
    assert tokens(engine.run_tokens([[5, 7], torch.tensor([5, 7])], NEW)) == tokens(
        engine.run([[5, 7]] * 2, NEW))


def test_mask_semantics_are_hugging_faces():
    """1 keeps a token, 0 drops it, wherever it is; the mask's dtype does not matter."""
    ids = torch.tensor([[9, 8, 7, 6], [5, 4, 3, 2]])
    for mask in ([[0, 1, 1, 1], [1, 1, 0, 0]], torch.tensor([[0, 1, 1, 1], [1, 1, 0, 0]]).bool(),
                 torch.tensor([[0.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0]])):
        assert normalize_prompts(ids, attention_mask=mask) == [[8, 7, 6], [5, 4]]
    assert normalize_prompts([[]]) == [[]]  # an empty prompt is the engine's bad request
    assert normalize_prompts([]) == []
