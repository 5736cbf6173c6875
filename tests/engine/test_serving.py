"""The request-level API (issue 17): ``Engine.submit`` / ``step`` / ``stream`` / ``abort`` and
``generate(stream=True)`` against the unpatched model and ``Engine.run``; aborts in a prefill
chunk, in decode and on a step launched ahead return every page (and a hybrid model's state
slot) and change no other request's tokens; logprobs against the unpatched model's logits; stop
token ids and stop strings where transformers' ``generate`` stops. fp32 tiny models: greedy
tokens compare exactly (top-2 gaps >= 5e-3, shared/notes), logprobs to 1e-4 (float32
reassociation of ~1e-6 on logits of magnitude 1-10)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from driver import tiny_model

import torch_cp
from torch_cp.engine import generation
from torch_cp.engine.sampling import SamplingParams
from torch_cp.tiny import tiny_qwen3, tiny_tokenizer

PROMPTS = [[1, 5, 9, 13, 17, 21, 25, 29] * 3, [200, 3, 150, 7, 99], [42], [7, 7, 8, 9]]
NEW = 10


def engine(model=None, **kwargs):
    model = model or torch_cp.patch_model(tiny_qwen3(), page_size=4)
    return torch_cp.Engine(model, **(dict(num_pages=64, max_tokens_per_step=8, max_rows=4)
                                      | kwargs))


@pytest.fixture(scope="module")
def hf_tokens():
    model = tiny_qwen3()
    with torch.no_grad():
        return [model.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False)
                [0, len(p):].tolist() for p in PROMPTS]


def collect(outputs):
    """request id -> (tokens, finish reason) from RequestOutputs."""
    got: dict[int, list] = {}
    reasons = {}
    for out in outputs:
        got.setdefault(out.request_id, []).extend(out.token_ids)
        if out.finished:
            assert out.request_id not in reasons, "a request finishes once"
            reasons[out.request_id] = out.finish_reason
    return got, reasons


def assert_pool_whole(e):
    a = e.allocator
    assert a.free_pages == a.num_pages and not a.live_requests
    assert a.free_state_slots == a.state_slots


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_stream_gives_the_unpatched_tokens_and_arrivals_change_nothing(hf_tokens, overlap):
    e = engine(overlap_planning=overlap)
    ids = [e.submit(p, NEW) for p in PROMPTS[:2]]
    outputs = e.step() + e.step()  # two requests run; two more arrive meanwhile
    ids += [e.submit(p, NEW) for p in PROMPTS[2:]]
    got, reasons = collect(outputs + list(e.stream()))
    assert [got[i] for i in ids] == hf_tokens
    assert set(reasons.values()) == {"length"}
    assert_pool_whole(e)
    assert [list(r.token_ids) for r in e.run(PROMPTS, NEW)] == hf_tokens  # run still works


def test_a_consumer_that_stops_mid_step_loses_no_output(hf_tokens):
    """Outputs a ``stream`` consumer did not take (it broke off, or raised, within a step's
    outputs) come first from the next ``stream`` or ``step``; until then a request counts as
    unfinished, and ``run`` refuses."""
    e = engine(max_tokens_per_step=64)
    ids = [e.submit(p, NEW) for p in PROMPTS]
    taken = []
    for out in e.stream():
        taken.append(out)
        if len(taken) == 2:  # the first step's first two outputs of four
            break
    first_two = len(taken)
    taken += e.step()  # the other two of the first step, then the second step's
    assert len(taken) == first_two + 2 + len(PROMPTS)
    with pytest.raises(RuntimeError, match="outputs not yet taken"):
        e.run(PROMPTS, 1)
    for out in e.stream():
        taken.append(out)
        if out.finished:  # every request finishes in the same step: three outputs left
            break
    assert e.has_unfinished()
    got, reasons = collect(taken + list(e.stream()))
    assert [got[i] for i in ids] == hf_tokens
    assert set(reasons) == set(ids) and not e.has_unfinished()
    assert_pool_whole(e)


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
@pytest.mark.parametrize("when", [1, 4, 7], ids=["prefill-chunk", "decode", "late-decode"])
def test_abort_returns_every_page_and_changes_no_other_request(hf_tokens, overlap, when):
    """Request 0 (24 prompt tokens, 8 a step) is aborted after ``when`` steps: during its
    prefill, or while it decodes (with ``overlap``, on a step already launched ahead)."""
    e = engine(overlap_planning=overlap)
    ids = [e.submit(p, NEW) for p in PROMPTS]
    outputs = []
    for _ in range(when):
        outputs += e.step()
    ahead = e._inflight is not None  # a step is launched ahead now: the abort lands on it
    e.abort(ids[0])
    outputs += list(e.stream())
    got, reasons = collect(outputs)
    assert reasons[ids[0]] == "abort"
    assert ahead == (overlap and when == 7)  # late decode: every row decodes, one step ahead
    assert got[ids[0]] == hf_tokens[0][:len(got[ids[0]])]
    for i, want in zip(ids[1:], hf_tokens[1:]):
        assert got[i] == want and reasons[i] == "length"
    assert_pool_whole(e)


def test_abort_of_a_waiting_request_and_of_an_unknown_id():
    e = engine(max_rows=1)  # one request runs, the other waits
    first, second = e.submit(PROMPTS[1], NEW), e.submit(PROMPTS[2], NEW)
    e.step()
    e.abort(second)
    e.abort(12345)  # never submitted: nothing happens
    e.abort(torch.tensor(first + 100))  # an integer tensor is an id too
    for not_an_id in ([first], True, torch.tensor([first])):  # True would end request 1
        with pytest.raises(ValueError, match="abort takes a request id"):
            e.abort(not_an_id)
    got, reasons = collect(e.step() + list(e.stream()))
    assert reasons == {second: "abort", first: "length"}
    assert second not in got or got[second] == []
    assert_pool_whole(e)
    e.abort(first)  # finished: nothing to end, nothing left unfinished
    assert not e.has_unfinished()
    assert [r.finish_reason for r in e.run([PROMPTS[2]], 2)] == ["length"]


def test_an_idle_engine_keeps_nothing_of_what_it_served():
    """A server aborting ids whose requests had finished (a client gone after its answer) grew
    the engine's queue without end while idle, each later poll slower; and the last step's
    logits ([rows, vocab], with their log-softmax when asked) stayed held (helper 119)."""
    e = engine()
    rid = e.submit(PROMPTS[1], NEW, logprobs=2)
    assert collect(list(e.stream()))[1] == {rid: "length"}
    for _ in range(1000):
        e.abort(rid)
        e.abort(12345)
    assert e._pending == [] and e._committed is None and not e.has_unfinished()
    e.run([PROMPTS[2]], 2, logprobs=2)
    assert e._committed is None


def test_a_hybrid_models_abort_returns_its_state_slot():
    model = torch_cp.patch_model(tiny_model("qwen3_5_text"), page_size=4)
    e = engine(model)
    ids = [e.submit(p, NEW) for p in PROMPTS]
    e.step()
    e.step()
    e.abort(ids[1])
    list(e.stream())
    assert_pool_whole(e)


def test_logprobs_are_the_unpatched_models_log_softmax():
    model = tiny_qwen3()
    e = engine()
    k = 3
    ids = [e.submit(p, NEW, logprobs=k) for p in PROMPTS[:2]]
    by_id: dict[int, list] = {i: [] for i in ids}
    for out in e.stream():
        assert len(out.logprobs) == len(out.token_ids)
        by_id[out.request_id] += list(zip(out.token_ids, out.logprobs))
    for rid, prompt in zip(ids, PROMPTS):
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True)
        want = torch.log_softmax(torch.stack(ref.logits)[:, 0].float(), dim=-1)  # [NEW, V]
        assert [t for t, _ in by_id[rid]] == ref.sequences[0, len(prompt):].tolist()
        for step, (token, (logprob, top)) in enumerate(by_id[rid]):
            torch.testing.assert_close(logprob, want[step, token].item(), atol=1e-4, rtol=0)
            values, indices = want[step].topk(k)
            assert [t for t, _ in top] == indices.tolist()
            torch.testing.assert_close([v for _, v in top], values.tolist(), atol=1e-4, rtol=0)


def test_stop_token_ids_and_stop_strings_stop_where_transformers_does(hf_tokens):
    tok = tiny_tokenizer()
    stop_token = hf_tokens[1][3]
    # A printable generated token's text, as transformers' StopStringCriteria reads it.
    row, at = next((r, i) for r, stream in enumerate(hf_tokens) for i, t in enumerate(stream)
                   if i >= 2 and tok.decode([t]).isalnum())
    stop_text = tok.decode([hf_tokens[row][at]])
    e = engine()
    by_token = e.submit(PROMPTS[1], NEW, stop_token_ids=[stop_token])
    by_text = e.submit(PROMPTS[row], NEW, stop_strings=[stop_text], tokenizer=tok)
    got, reasons = collect(e.stream())
    first = hf_tokens[1].index(stop_token)
    assert got[by_token] == hf_tokens[1][:first + 1] and reasons[by_token] == "stop"
    with torch.no_grad():
        ref = tiny_qwen3().generate(torch.tensor([PROMPTS[row]]), max_new_tokens=NEW,
                                    do_sample=False, stop_strings=[stop_text], tokenizer=tok)
    assert got[by_text] == ref[0, len(PROMPTS[row]):].tolist()
    assert reasons[by_text] == "stop" and len(got[by_text]) < NEW
    assert_pool_whole(e)


def test_a_stop_on_the_last_allowed_token_is_a_stop(hf_tokens):
    """A stop token or string hit by the token that also reaches max_new_tokens ends the request
    as "stop" (as run() reports an EOS there as "eos"), not "length"."""
    tok = tiny_tokenizer()
    row, at = next((r, i) for r, stream in enumerate(hf_tokens) for i, t in enumerate(stream)
                   if i >= 2 and tok.decode([t]).isalnum())
    e = engine()
    by_token = e.submit(PROMPTS[1], 4, stop_token_ids=[hf_tokens[1][3]])
    by_text = e.submit(PROMPTS[row], at + 1, stop_strings=[tok.decode([hf_tokens[row][at]])],
                       tokenizer=tok)
    unstopped = e.submit(PROMPTS[2], 3, stop_token_ids=[hf_tokens[2][3]])
    again = e.submit(PROMPTS[row], at + 1, stop_strings=[tok.decode([hf_tokens[row][at]])],
                     tokenizer=tok)
    assert len(e._stop_strings.unsent()) == 1, "the criterion is made once, for both requests"
    got, reasons = collect(e.stream())
    assert got[again] == got[by_text] and reasons[again] == "stop"
    assert got[by_token] == hf_tokens[1][:4] and got[by_text] == hf_tokens[row][:at + 1]
    assert reasons[by_token] == reasons[by_text] == "stop" and reasons[unstopped] == "length"
    assert_pool_whole(e)


def test_a_stop_with_a_step_launched_ahead_leaves_no_stale_step(hf_tokens):
    """With overlap planning the step after a stop's is already launched when the stop is seen;
    once nothing runs, it is settled, so the next request's first step is its own."""
    e = engine(overlap_planning=True)
    stopped = e.submit(PROMPTS[1], NEW, stop_token_ids=[hf_tokens[1][1]])
    got, reasons = collect(e.stream())
    assert got[stopped] == hf_tokens[1][:2] and reasons[stopped] == "stop"
    later = e.submit(PROMPTS[2], NEW)
    steps = e.steps
    assert [(o.request_id, o.token_ids) for o in e.step()] == [(later, (hf_tokens[2][0],))]
    assert e.steps == steps + 1
    got, _ = collect(e.stream())
    assert got[later] == hf_tokens[2][1:]
    assert_pool_whole(e)


def test_an_abort_with_a_step_launched_ahead_leaves_no_stale_step(hf_tokens):
    e = engine(overlap_planning=True)
    aborted = e.submit(PROMPTS[1], NEW)
    for _ in range(3):  # prefill, then decode steps, each launching the next ahead
        e.step()
    e.abort(aborted)
    assert [(o.request_id, o.finish_reason) for o in e.step()] == [(aborted, "abort")]
    later = e.submit(PROMPTS[2], NEW)
    assert [(o.request_id, o.token_ids) for o in e.step()] == [(later, (hf_tokens[2][0],))]
    collect(e.stream())
    assert_pool_whole(e)


@pytest.mark.parametrize("how", ["abort", "stop"])
def test_a_greedy_request_ending_ahead_of_a_waiting_sampled_one(hf_tokens, how):
    """A greedy request decodes with steps launched ahead while a sampled one waits for its row
    (``max_rows=1``); the greedy one ends (aborted, or at a stop token) while a step is launched
    ahead for it: that step's token is dropped, nothing else (the waiting request once lost
    every request: its sampling made the launched step sample on the host, over a row whose
    request had no parameters left)."""
    e = engine(max_rows=1, overlap_planning=True)
    stop = [hf_tokens[1][3]] if how == "stop" else []
    greedy = e.submit(PROMPTS[1], NEW, stop_token_ids=stop)
    outputs = [o for _ in range(3) for o in e.step()]  # prefill, then decode steps launched ahead
    sampled = e.submit(PROMPTS[2], 5, sampling=SamplingParams(temperature=0.7, seed=1))
    outputs += e.step()
    if how == "abort":
        e.abort(greedy)
    got, reasons = collect(outputs + [o for _ in range(2) for o in e.step()] + list(e.stream()))
    assert reasons == {greedy: how, sampled: "length"} and len(got[sampled]) == 5
    assert got[greedy] == hf_tokens[1][:len(got[greedy])]
    assert_pool_whole(e)


def test_each_request_keeps_its_own_sampling(hf_tokens):
    sampled = SamplingParams(temperature=0.8, top_k=20, seed=3)
    e = engine()
    ids = [e.submit(p, NEW, sampling=sampled if i == 2 else None)
           for i, p in enumerate(PROMPTS)]
    got, _ = collect(e.stream())
    alone = engine().run(PROMPTS, NEW, sampling=sampled)  # request 2 draws the same stream
    assert got[ids[2]] == list(alone[2].token_ids) != hf_tokens[2]
    assert [got[i] for i in ids[:2] + ids[3:]] == hf_tokens[:2] + hf_tokens[3:]


def test_bad_requests_end_with_an_error_and_the_others_run(hf_tokens):
    e = engine()
    bad = e.submit([], NEW)
    good = e.submit(PROMPTS[1], NEW)
    got, reasons = collect(e.stream())
    assert reasons[bad] == "error" and got[good] == hf_tokens[1]
    with pytest.raises(ValueError, match="stop_strings need a tokenizer"):
        e.submit(PROMPTS[1], NEW, stop_strings=["x"])


def test_a_str_is_one_stop_string_and_an_int_one_stop_token(hf_tokens):
    """As transformers takes them: ``stop_strings="ab"`` is the string "ab", not "a" and "b"."""
    tok = tiny_tokenizer()
    prompt, generated = PROMPTS[3], hf_tokens[3]
    first = next(t for t in generated if tok.decode([t]).isascii() and tok.decode([t]).isalnum())
    stop = tok.decode([first]) + "\x07"  # a generated token's text, then a byte never generated
    with torch.no_grad():
        ref = tiny_qwen3().generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False,
                                    stop_strings=stop, tokenizer=tok)[0, len(prompt):].tolist()
    e = engine()
    by_str = e.submit(prompt, NEW, stop_strings=stop, tokenizer=tok)
    by_int = e.submit(prompt, NEW, stop_token_ids=first)
    got, reasons = collect(e.stream())
    assert got[by_str] == ref == generated and reasons[by_str] == "length"
    assert got[by_int] == generated[:generated.index(first) + 1] and reasons[by_int] == "stop"


def test_stop_strings_no_request_names_are_dropped_but_the_last_used(hf_tokens):
    """Helper 61's soak: every distinct stop string's criterion (about 4 MB at a 150k
    vocabulary) was kept for the engine's life. Now only ``IDLE_KEPT`` that no live request
    names stay, the ones used last, and the other ranks drop what rank 0 drops."""
    from torch_cp.engine.stops import IDLE_KEPT, StopStrings

    tok = tiny_tokenizer()
    texts = [f"zz{i}\x07" for i in range(IDLE_KEPT + 5)]  # never generated: each runs its length
    e = engine()
    for text in texts:
        e.submit(PROMPTS[2], 2, stop_strings=text, tokenizer=tok)
    got, reasons = collect(e.stream())
    assert set(reasons.values()) == {"length"} and all(v == hf_tokens[2][:2] for v in got.values())
    e.step()  # idle: the criteria of the ended requests are forgotten at a step's decisions
    stops = e._stop_strings
    assert len(stops) == IDLE_KEPT
    kept = stops.number(tok, (texts[-1],))  # kept: the same criterion, not made again
    assert len(stops) == IDLE_KEPT and stops[kept] is stops[stops.number(tok, (texts[-1],))]
    again = e.submit(PROMPTS[3], NEW, stop_strings=texts[0], tokenizer=tok)  # dropped: made anew
    got, reasons = collect(e.stream())
    assert got[again] == hf_tokens[3] and reasons[again] == "length"
    assert_pool_whole(e)
    # Another rank mirrors rank 0 from what it sends (criteria, and None for each dropped).
    rank0, rank1 = StopStrings(), StopStrings()
    for text in texts:
        rank0.number(tok, (text,))
    rank1.learn(rank0.unsent())
    rank0.forget_idle(live={0})
    rank1.learn(rank0.unsent())
    assert len(rank0) == IDLE_KEPT + 1 and all(rank1[n] is rank0[n] for n in rank0._criteria)
    assert len(rank1) == len(rank0)


def test_bad_options_are_refused_at_submit_each_named_and_nothing_queued():
    e = engine()
    vocab = tiny_qwen3().config.vocab_size
    with pytest.raises(ValueError) as caught:
        e.submit(PROMPTS[1], NEW, sampling={"temperature": 0.5}, stop_token_ids=["7"],
                 stop_strings=[""], logprobs=vocab + 1)
    for named in ("sampling must be a SamplingParams",
                  "stop_token_ids must be an int or a list of ints",
                  "stop_strings must be a non-empty str or such strs",
                  "stop_strings need a tokenizer",
                  f"logprobs must be None or an int in [0, {vocab}]"):
        assert named in str(caught.value)
    # what is neither one nor a collection is named (helper 70: a TypeError)
    with pytest.raises(ValueError) as caught:
        e.submit(PROMPTS[1], "x", stop_token_ids=2.0, stop_strings=7, logprobs=-1)
    for named in ("stop_token_ids must be an int or a list of ints, got 2.0",
                  "stop_strings must be a non-empty str or such strs, got 7",
                  "max_new_tokens must be an int", "logprobs"):
        assert named in str(caught.value)
    with pytest.raises(ValueError, match="stop_strings need a tokenizer, got a str"):
        e.submit(PROMPTS[1], NEW, stop_strings="x", tokenizer="not a tokenizer")
    # tokenizers' own class has get_vocab but not transformers' API (helper 98: a TypeError
    # from inside the next step)
    with pytest.raises(ValueError, match="stop_strings need a tokenizer, got a Tokenizer"):
        e.submit(PROMPTS[1], NEW, stop_strings="x",
                 tokenizer=tiny_tokenizer().backend_tokenizer)
    for k in (True, -1, 2.0):
        with pytest.raises(ValueError, match="logprobs"):
            e.submit(PROMPTS[1], NEW, logprobs=k)
    with pytest.raises(ValueError) as caught:
        e.submit("12", 2.7)  # a str would be read as token ids 1 and 2
    assert "prompt must be a sequence of token ids" in str(caught.value)
    assert "max_new_tokens must be an int, got 2.7" in str(caught.value)
    for prompt, new in (([1.0, 2.0], NEW), ([True], NEW), (PROMPTS[1], None)):
        with pytest.raises(ValueError, match="prompt must|max_new_tokens must"):
            e.submit(prompt, new)
    assert not e.has_unfinished()
    assert e.submit(PROMPTS[1], NEW, logprobs=vocab) == 0  # the whole vocabulary is allowed
    assert e.submit(torch.tensor(PROMPTS[1]), NEW) == 1  # no id was spent on a refusal
    assert e.submit(PROMPTS[1], np.int64(NEW)) == 2  # NumPy's ints, as Engine.run takes them


def test_none_for_the_stop_options_is_no_stops():
    e = engine()
    ids = [e.submit(PROMPTS[1], NEW, stop_token_ids=None, stop_strings=None),
           e.submit(PROMPTS[1], NEW)]
    tokens = {i: [] for i in ids}
    for out in e.stream():
        tokens[out.request_id] += out.token_ids
    assert tokens[ids[0]] == tokens[ids[1]] and len(tokens[ids[0]]) == NEW


def test_run_and_generate_refuse_bad_logprobs_before_anything_runs(monkeypatch):
    e = engine()
    with pytest.raises(ValueError, match="logprobs"):
        e.run(PROMPTS, NEW, logprobs=10**6)
    assert e.allocator.free_pages == e.allocator.num_pages
    model = torch_cp.patch_model(tiny_qwen3(), page_size=4)
    monkeypatch.setattr(generation, "engine_for", lambda *a, **k: pytest.fail("allocated"))
    with pytest.raises(ValueError, match="logprobs"):
        torch_cp.generate(model, PROMPTS, NEW, logprobs=-1, progress=False)


def test_an_interrupt_after_the_steps_commit_returns_every_page(hf_tokens):
    """A KeyboardInterrupt in the step's host work after the tokens are committed (here: a stop
    string's check) ends every request like a fault inside the step: the pool is whole and the
    engine serves the next request unchanged."""
    tok = tiny_tokenizer()
    e = engine()
    e.submit(PROMPTS[1], NEW)
    watched = e.submit(PROMPTS[3], NEW, stop_strings=["zz"], tokenizer=tok)
    e.step()

    class Interrupted:  # a StopStringCriteria that raises
        maximum_token_len = 4

        def __call__(self, ids, scores):
            raise KeyboardInterrupt("planted")
    e._stop_strings._criteria[e._options[watched].stop] = Interrupted()
    with pytest.raises(KeyboardInterrupt, match="planted"):
        e.step()
    assert_pool_whole(e)
    assert not e.has_unfinished()
    again = e.submit(PROMPTS[1], NEW)
    assert collect(e.stream())[0][again] == hf_tokens[1]


def test_run_refuses_while_submitted_requests_are_unfinished():
    e = engine()
    e.submit(PROMPTS[1], NEW)
    with pytest.raises(RuntimeError, match="unfinished"):
        e.run(PROMPTS, NEW)


def test_generate_streams(hf_tokens):
    model = torch_cp.patch_model(tiny_qwen3(), page_size=4)
    got, reasons = collect(torch_cp.generate(model, PROMPTS, NEW, stream=True, progress=False))
    assert [got[i] for i in range(len(PROMPTS))] == hf_tokens


def test_generate_streams_with_the_warnings_generate_gives():
    from torch_cp.engine.feedback import IgnoredSettingWarning, PositionLimitWarning

    model = torch_cp.patch_model(tiny_qwen3(max_position_embeddings=16), page_size=4)
    for stream in (False, True):
        with pytest.warns(IgnoredSettingWarning), pytest.warns(PositionLimitWarning):
            out = torch_cp.generate(model, [list(range(1, 15))], 4, top_k=5, progress=False,
                                    stream=stream)
            list(out)


@pytest.mark.parametrize("k", [np.int64(2), torch.tensor(2)], ids=["numpy", "0-d tensor"])
def test_logprobs_take_numpy_and_0d_tensor_ints_as_max_new_tokens_does(k):
    """They were refused as not an int (helper 94), while max_new_tokens, top_k and seed took
    them."""
    e = engine()
    got = [e.submit(PROMPTS[1], 3, logprobs=k)]
    streamed = [o.logprobs for o in e.stream()]
    assert e.run([PROMPTS[1]], 3, logprobs=k)[0].logprobs == engine().run(
        [PROMPTS[1]], 3, logprobs=2)[0].logprobs
    assert got == [0] and all(len(top) == 2 for lps in streamed for _, top in lps)


def test_run_and_generate_results_carry_the_streams_logprobs():
    prompts = PROMPTS[:2]
    e = engine()
    ids = [e.submit(p, NEW, logprobs=2) for p in prompts]
    streamed: dict[int, list] = {i: [] for i in ids}
    for out in e.stream():
        streamed[out.request_id] += list(out.logprobs)
    results = e.run(prompts, NEW, logprobs=2)
    model = torch_cp.patch_model(tiny_qwen3(), page_size=4)
    generated = torch_cp.generate(model, prompts, NEW, logprobs=2, progress=False)
    for rid, r, g in zip(ids, results, generated):
        assert len(r.logprobs) == NEW
        torch.testing.assert_close(list(r.logprobs), streamed[rid], atol=1e-5, rtol=0)
        torch.testing.assert_close(list(g.logprobs), streamed[rid], atol=1e-5, rtol=0)
    assert engine().run(prompts, NEW)[0].logprobs == ()  # not asked: none


def test_greedy_logprobs_come_home_with_the_step_not_after_the_step_launched_ahead(monkeypatch):
    """With a step launched ahead, reading a greedy token's log-probability from the device
    log-softmax (``.item()`` of a CUDA tensor) waited for that step too (helper 94). Its value
    now comes home with the top k from the step's own copy: here the device tensor cannot be
    read at all, and every log-probability equals the run without overlap."""
    from torch_cp.engine import serving

    class Unread:
        def __getitem__(self, key):
            raise AssertionError("a greedy row's log-probability read from the device")

    logprob_rows = serving.Serving._logprob_rows

    def sealed(self, step):
        logprob_rows(self, step)
        if step.logprob_rows is not None and step.device_ids is not None:
            step.logprob_rows = dataclasses.replace(step.logprob_rows, device=Unread())

    want = engine().run(PROMPTS, NEW, logprobs=3)
    monkeypatch.setattr(serving.Serving, "_logprob_rows", sealed)
    e = engine(overlap_planning=True)
    got = e.run(PROMPTS, NEW, logprobs=3)
    assert e.launched_ahead_steps > 0
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids and len(g.logprobs) == NEW
        torch.testing.assert_close(list(g.logprobs), list(w.logprobs), atol=1e-5, rtol=0)


def test_prefix_caching_through_the_stream_counts_reused_tokens(hf_tokens):
    """Requests submitted after one that prefilled their shared prefix reuse its pages, and the
    engine counts them as ``run`` does."""
    e = engine(prefix_caching=True)
    first = e.submit(PROMPTS[0], NEW)
    outputs = []
    while not any(o.request_id == first and o.token_ids for o in outputs):
        outputs += e.step()
    later = e.submit(PROMPTS[0], NEW)  # the same prompt: all but its last page is cached
    got, _ = collect(outputs + list(e.stream()))
    assert got[first] == got[later] == hf_tokens[0]
    assert e.reused_tokens == 20 and e.prefilled_tokens == 2 * 24 - 20
    assert_pool_whole(e)


def test_a_request_begun_inside_inference_mode_runs_on_outside_it(hf_tokens):
    """Its page table was made inside ``torch.inference_mode()`` (an inference tensor), and the
    step outside it that gave the request a new page wrote into it: a RuntimeError ended the
    request (helper 110). Tables are made outside inference mode now."""
    e = engine()
    with torch.inference_mode():
        rid = e.submit(PROMPTS[1], NEW)  # 5 tokens: a new page at the 4th decode step
        first = e.step()
    got, reasons = collect(first + list(e.stream()))
    assert got[rid] == hf_tokens[1] and reasons[rid] == "length"
    assert_pool_whole(e)
