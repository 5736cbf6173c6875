"""torch_cp.generate against the unpatched Hugging Face model (greedy tokens, float32 tiny Qwen3),
and the scheduler's admission, chunking, refusals and page accounting."""

import contextlib

import numpy as np
import pytest
import torch

import torch_cp
from torch_cp.engine import Engine
from torch_cp.engine.sampling import SamplingParams
from torch_cp.engine.scheduler import Request, Scheduler
from torch_cp.kv import PageAllocator
from torch_cp.plan import StepRefused
from torch_cp.tiny import TINY_VOCAB, tiny_qwen3, tiny_tokenizer

PROMPTS = [[42], [200, 3, 150, 7, 99], list(range(1, 20)), [(7 * i) % 300 + 1 for i in range(40)]]
NEW = 12


@pytest.fixture(scope="module")
def reference():
    """Greedy tokens of the unpatched model, one prompt at a time (no padding anywhere)."""
    model = tiny_qwen3()
    out = []
    for p in PROMPTS:
        ids = model.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False,
                             attention_mask=torch.ones(1, len(p), dtype=torch.long))
        out.append(tuple(ids[0, len(p):].tolist()))
    return out


def _steps(engine):
    """Record each step's (q_lens, ctx_lens) and the requests holding pages then."""
    seen, live = [], []
    begin = engine.cache.begin_step

    def spy(plan):
        begin(plan)  # a refused step is not recorded
        seen.append((plan.q_lens.tolist(), plan.ctx_lens.tolist()))
        live.append(engine.allocator.live_requests)
    engine.cache.begin_step = spy
    return seen, live


def test_greedy_matches_unpatched_hf(model, reference):
    results = torch_cp.generate(model, PROMPTS, max_new_tokens=NEW, progress=False)
    assert [r.token_ids for r in results] == reference
    assert [r.finish_reason for r in results] == ["length"] * len(PROMPTS)
    assert [r.index for r in results] == list(range(len(PROMPTS)))


def test_chunked_prefill_and_a_tight_pool_make_requests_wait(model, reference):
    # page 8; the 40-token prompt + 11 cached new tokens needs 7 pages; 8 pages hold one such
    # request plus one small one, so the others wait. 6 tokens a step: prompts prefill in chunks.
    engine = Engine(model, num_pages=8, page_size=8, max_tokens_per_step=6)
    steps, steps_live = _steps(engine)
    results = engine.run(PROMPTS, NEW)
    assert [r.token_ids for r in results] == reference
    assert engine.allocator.free_pages == engine.allocator.num_pages
    extend_rows = [(q, c) for qs, cs in steps for q, c in zip(qs, cs) if q > 1 and c > 0]
    assert extend_rows, "a prompt longer than the budget is prefilled in extend rows"
    assert max(sum(qs) for qs, _ in steps) <= 6
    # Lifetimes take 2, 2, 4 and 7 pages: request 3 waits until 0, 1 and 2 have all finished.
    live = [set(ids) for ids in steps_live]
    assert {0, 1, 2} in live and {3} in live
    assert all(ids == {3} for ids in live if 3 in ids)


def test_bad_requests_fail_alone_and_every_page_returns(model, reference):
    prompts = [PROMPTS[1], [], [5, TINY_VOCAB, -1], PROMPTS[2], [1] * 100, PROMPTS[0]]
    news = [NEW, NEW, NEW, NEW, NEW, 0]
    engine = Engine(model, num_pages=6, page_size=16)
    results = engine.run(prompts, news)
    assert engine.allocator.free_pages == 6
    ok = {0: reference[1], 3: reference[2]}
    for r in results:
        if r.index in ok:
            assert r.ok and r.token_ids == ok[r.index]
        else:
            assert r.finish_reason == "error" and r.token_ids == ()
    errors = {r.index: r.error for r in results}
    assert "empty prompt" in errors[1]
    assert f"outside the vocabulary [0, {TINY_VOCAB}): -1, {TINY_VOCAB}" in errors[2]
    assert "more than the pool can ever hold (96 tokens)" in errors[4]
    assert "max_new_tokens must be >= 1, got 0" in errors[5]


def test_eos_stops_a_request_and_is_returned(model, reference):
    eos = reference[2][4]
    first = reference[2].index(eos)
    results = torch_cp.generate(model, [PROMPTS[2], PROMPTS[1]], NEW, eos_token_id=eos,
                                progress=False)
    assert results[0].finish_reason == "eos"
    assert results[0].token_ids == reference[2][: first + 1]
    other = reference[1]
    expect = other[: other.index(eos) + 1] if eos in other else other
    assert results[1].token_ids == expect
    # Engine.run reads its eos ids as generate does (helper 75: a tensor never stopped, an int
    # raised a TypeError, a str id was dropped)
    engine = Engine(model, num_pages=64, page_size=4)
    for form in (eos, [eos], torch.tensor([eos]), np.int64(eos)):
        got = engine.run([PROMPTS[2]], NEW, eos_token_ids=form)[0]
        assert got.token_ids == reference[2][: first + 1] and got.finish_reason == "eos", form
    with pytest.raises(ValueError, match=r"eos_token_ids must be an int or a list of ints, "
                                         r"got \['8'\]"):
        engine.run([PROMPTS[2]], NEW, eos_token_ids=["8"])
    # and its sampling as submit does: None is greedy, anything else but a SamplingParams is
    # named with the rest (helper 87: an AttributeError after the run began)
    assert engine.run([PROMPTS[2]], NEW, None, eos)[0].token_ids == reference[2][: first + 1]
    with pytest.raises(ValueError, match=r"sampling must be a SamplingParams, got float; "
                                         r"eos_token_ids must be"):
        engine.run([PROMPTS[2]], NEW, 0.7, ["8"])
    assert engine.allocator.free_pages == engine.allocator.num_pages


def test_sampling_repeats_with_the_seed(model):
    kwargs = dict(max_new_tokens=NEW, temperature=1.0, top_k=50, top_p=0.9, progress=False)
    a = torch_cp.generate(model, PROMPTS, seed=5, **kwargs)
    b = torch_cp.generate(model, PROMPTS, seed=5, **kwargs)
    c = torch_cp.generate(model, PROMPTS, seed=6, **kwargs)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    assert [r.token_ids for r in a] != [r.token_ids for r in c]


@contextlib.contextmanager
def refusing(model, why):
    """The model's backend refuses (StepRefused) every step plan ``why(plan)`` names a reason
    for; the reasons given are collected in the yielded list."""
    backend = model.torch_cp.backend
    plan_fn, refused = backend.plan, []

    def plan(step_plan):
        reason = why(step_plan)
        if reason:
            refused.append(reason)
            raise StepRefused(reason)
        plan_fn(step_plan)
    backend.plan = plan
    try:
        yield refused
    finally:
        del backend.plan


def test_refused_steps_are_retried_smaller(model, reference):
    engine = Engine(model, num_pages=16, page_size=16, max_tokens_per_step=64)
    too_big = lambda plan: "too big" if plan.num_rows > 2 or plan.num_tokens > 10 else None
    with refusing(model, too_big) as refused:
        results = engine.run(PROMPTS, NEW)
    assert refused
    assert [r.token_ids for r in results] == reference
    assert engine.allocator.free_pages == 16


def test_a_refused_prefill_shrinks_its_chunks_and_keeps_every_decode_row(model):
    """A cap on a step's tokens (as FlashInfer MLA's planner caps its work items) shrinks the
    prefill chunks; every step holds every decoding request and some prefill while prompts wait.
    Cutting rows instead dropped the prefill rows (last in a step) until the decoding requests
    finished: the FlashInfer MLA model at 32 x 4096 took 257 steps for 128 tokens."""
    engine = Engine(model, num_pages=16, page_size=16, max_tokens_per_step=256)
    prompts = [[(11 * i + j) % 300 + 1 for j in range(10)] for i in range(6)]
    unrefused = engine.run(prompts, 6)
    steps, launch = [], engine._launch
    engine._launch = lambda step, rows, *a: steps.append(rows) or launch(step, rows, *a)
    with refusing(model, lambda plan: "too many" if plan.num_tokens > 25 else None) as refused:
        results = engine.run(prompts, 6)
    del engine._launch
    assert refused
    sampled = dict.fromkeys(range(6), 0)
    for rows in steps:
        decoding = {i for i, n in sampled.items() if 0 < n < 6}
        prefilling = {i for i, n in sampled.items() if n == 0}
        assert decoding <= {r.request for r in rows}
        assert not prefilling or prefilling & {r.request for r in rows}, "prefill starved"
        for r in rows:
            sampled[r.request] += r.samples
    assert len(steps) <= 5 + 6, "the prefill (60 tokens, 25 a step) overlaps the decode"
    assert [r.token_ids for r in results] == [r.token_ids for r in unrefused]
    assert engine.allocator.free_pages == 16


def test_a_request_refused_even_alone_fails_and_the_others_complete(model, reference):
    engine = Engine(model, num_pages=16, page_size=16)
    too_long = lambda plan: ("row longer than 25 tokens"
                             if int((plan.ctx_lens + plan.q_lens).max()) > 25 else None)
    with refusing(model, too_long):
        results = engine.run(PROMPTS, NEW)
    assert [r.token_ids for r in results[:2]] == reference[:2]
    # Request 2 (19 prompt tokens) grows past 25 tokens at its 7th new token and fails there.
    assert results[2].finish_reason == "error" and "row longer than 25" in results[2].error
    assert results[2].token_ids == reference[2][: 25 - 19 + 1]
    assert results[3].finish_reason == "error" and results[3].token_ids == ()
    assert engine.allocator.free_pages == 16


def test_text_with_a_tokenizer(model):
    tok = tiny_tokenizer()
    results = torch_cp.generate(model, ["Hello", "torch_cp"], max_new_tokens=4, tokenizer=tok,
                                progress=False)
    direct = torch_cp.generate(model, [tok("Hello", add_special_tokens=False)["input_ids"]],
                               max_new_tokens=4, progress=False, eos_token_id=tok.eos_token_id)
    assert results[0].token_ids == direct[0].token_ids
    for r in results:
        assert r.text == tok.decode(list(r.token_ids), skip_special_tokens=True)


def test_unpatched_model_and_bad_engine_settings_raise():
    with pytest.raises(ValueError, match="patch_model"):
        torch_cp.generate(tiny_qwen3(), [[1, 2]], 2)
    with pytest.raises(ValueError) as e:
        Engine(torch_cp.patch_model(tiny_qwen3()), num_pages=0, max_tokens_per_step=0)
    assert "num_pages" in str(e.value) and "max_tokens_per_step" in str(e.value)


# The scheduler alone (no model): admission, chunking, promises.

def _request(i, prompt_len, new):
    return Request(i, list(range(1, prompt_len + 1)), new)


def test_admission_waits_for_pages_first_come_first_served():
    alloc = PageAllocator(num_pages=4, page_size=4)
    s = Scheduler(alloc, max_tokens_per_step=100)
    for r in (_request(0, 6, 3), _request(1, 6, 3), _request(2, 2, 1)):
        s.add(r)  # lifetimes: 8, 8, 2 tokens -> 2, 2, 1 pages
    rows = s.schedule()
    assert [r.request for r in rows] == [0, 1]  # 2 + 2 pages: request 2 waits behind them
    assert alloc.free_pages == 0  # 6 prompt tokens take 2 pages of 4 each
    finished = s.commit(rows, {0: 9, 1: 9}, frozenset())
    assert finished == [] and [r.request for r in s.schedule()] == [0, 1]
    for _ in range(2):  # 3 new tokens each: both finish, and request 2 gets their pages
        rows = s.schedule()
        finished = s.commit(rows, {0: 9, 1: 9}, frozenset())
    assert [(r.index, reason) for r, reason in finished] == [(0, "length"), (1, "length")]
    assert alloc.free_pages == 4 and [r.request for r in s.schedule()] == [2]


def test_promised_pages_block_admission_before_they_are_taken():
    alloc = PageAllocator(num_pages=3, page_size=4)
    s = Scheduler(alloc, max_tokens_per_step=100)
    s.add(_request(0, 2, 7))  # 8 tokens in its lifetime: 2 pages, 1 taken at first
    s.add(_request(1, 4, 1))  # 1 page
    s.add(_request(2, 4, 1))  # 1 page: the pool is promised out
    rows = s.schedule()
    assert [r.request for r in rows] == [0, 1]
    assert alloc.free_pages == 1 and 2 not in s.running


def test_no_more_requests_run_than_max_rows():
    """Admitted only into a free row: a request admitted beyond ``max_rows`` would hold its
    pages' promise and wait for a row behind the decoding requests."""
    alloc = PageAllocator(num_pages=20, page_size=4)
    s = Scheduler(alloc, max_tokens_per_step=100, max_rows=2)
    for i in range(3):
        s.add(_request(i, 3, 2))
    rows = s.schedule()
    assert [r.request for r in rows] == [0, 1] and list(s.running) == [0, 1]
    assert [r.index for r in s.waiting] == [2]
    s.commit(rows, {0: 7, 1: 7}, frozenset())
    s.commit(s.schedule(), {0: 7, 1: 7}, frozenset())  # both finish: request 2 gets a row
    assert [r.request for r in s.schedule()] == [2]


def test_chunks_respect_the_budget_and_decode_rows_go_first():
    alloc = PageAllocator(num_pages=10, page_size=4)
    s = Scheduler(alloc, max_tokens_per_step=5)
    s.add(_request(0, 3, 4))
    s.add(_request(1, 9, 2))
    rows = s.schedule()
    assert [(r.request, r.start, r.length, r.samples) for r in rows] == [
        (0, 0, 3, True), (1, 0, 2, False)]
    s.commit(rows, {0: 7}, frozenset())
    rows = s.schedule()
    assert [(r.request, r.start, r.length, r.samples) for r in rows] == [
        (0, 3, 1, True), (1, 2, 4, False)]


def test_a_request_larger_than_the_pool_is_refused_at_add():
    s = Scheduler(PageAllocator(num_pages=2, page_size=4), max_tokens_per_step=8)
    with pytest.raises(ValueError, match="more than the pool"):
        s.add(_request(0, 8, 2))


def test_sampling_params_are_validated_by_generate(model):
    with pytest.raises(ValueError, match="top_p"):
        torch_cp.generate(model, [[1]], 1, temperature=1.0, top_p=0.0, progress=False)
    assert SamplingParams().greedy


def test_generate_names_every_problem_at_once(model):
    with pytest.raises(ValueError) as e:
        torch_cp.generate(model, [[1, True]], [2, 2.5], temperature=-1, page_size=0,
                          logprobs=-1, max_tokens_per_step=0, cuda_graphs=True, progress=False)
    assert [p.split(":")[0] for p in str(e.value).split("; ")] == [
        "invalid sampling parameters", "invalid prompts",
        "max_new_tokens[1] must be an int, got 2.5",
        "logprobs must be None or an int in [0, 320] (the vocabulary), got -1",
        "page_size must be a positive int, got 0",
        "max_tokens_per_step must be a positive int, got 0",
        "cuda_graphs needs a model on CUDA, not cpu"]
    with pytest.raises(ValueError, match=r"max_new_tokens\[1\] must be an int, got None; "
                                         r"max_new_tokens has 2 entries for 3 prompts"):
        torch_cp.generate(model, [[1], [2], [3]], [1, None], progress=False)
    for news in (torch.tensor([2]), "12"):  # a [1] tensor is one entry; a str no ints
        with pytest.raises(ValueError, match="max_new_tokens"):
            torch_cp.generate(model, [[1], [2]], news, progress=False)
    with pytest.raises(ValueError, match="a tensor prompt must be 1-D integer token ids"):
        torch_cp.generate(model, torch.tensor([True, False]), 2, progress=False)
    with pytest.raises(ValueError, match=r"temperature must be .*; num_pages 10+ need"):
        torch_cp.generate(model, [[1]], 2, temperature=-1, num_pages=10**12, progress=False)
    numpy_ints = torch_cp.generate(model, [[5, 6]], [np.int64(2)], progress=False)
    assert numpy_ints[0].token_ids == torch_cp.generate(model, [[5, 6]], 2,
                                                        progress=False)[0].token_ids
