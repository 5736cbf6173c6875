"""Sampling: greedy, temperature, top-k, top-p against direct definitions; seeds repeat exactly."""

import pytest
import torch

from torch_cp.engine.sampling import SamplingParams, filter_logits, sample


def _logits(rows=3, vocab=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * 3


def test_greedy_is_argmax_and_needs_no_generator():
    logits = _logits()
    assert torch.equal(sample(logits, SamplingParams()), logits.argmax(-1))
    # bf16 logits on the way in: sampled in float32 on the host, the same argmax.
    assert torch.equal(sample(logits.bfloat16(), SamplingParams()),
                       logits.bfloat16().float().argmax(-1))


def test_same_seed_same_tokens_other_seed_differs():
    logits = _logits(rows=4, vocab=200)
    params = SamplingParams(temperature=1.0, seed=7)
    draws = []
    for _ in range(2):
        gens = [params.generator(i) for i in range(4)]
        draws.append(torch.stack([sample(logits, params, gens) for _ in range(20)]))
    assert torch.equal(draws[0], draws[1])
    other = SamplingParams(temperature=1.0, seed=8)
    gens = [other.generator(i) for i in range(4)]
    third = torch.stack([sample(logits, other, gens) for _ in range(20)])
    assert not torch.equal(draws[0], third)  # 80 draws over ~200 tokens: equal only by accident


def test_a_requests_stream_does_not_depend_on_its_batch():
    """Each request has its own generator: the draws of request 3 are the same alone or batched."""
    logits = _logits(rows=1, vocab=100)
    params = SamplingParams(temperature=0.8, seed=1)
    alone = [int(sample(logits, params, [g])) for g in [params.generator(3)] * 10]
    g3, g0 = params.generator(3), params.generator(0)
    batched = [int(sample(logits.expand(2, -1), params, [g0, g3])[1]) for _ in range(10)]
    assert alone == batched


def test_top_k_keeps_exactly_the_k_largest():
    logits = _logits(rows=5, vocab=40)
    out = filter_logits(logits, top_k=3, top_p=None)
    kept = torch.isfinite(out)
    assert kept.sum(-1).tolist() == [3] * 5
    top3 = logits.topk(3, -1).indices
    assert kept.gather(-1, top3).all()
    torch.testing.assert_close(out[kept], logits[kept], rtol=0, atol=0)


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    for p, expect in [(0.5, 1), (0.51, 2), (0.8, 2), (0.81, 3), (0.96, 4), (1.0, 4)]:
        kept = torch.isfinite(filter_logits(logits, None, p))
        assert kept.sum().item() == expect, p
        assert kept[0, :expect].all()


def test_sampled_tokens_stay_inside_top_k_and_follow_the_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -5.0]])
    params = SamplingParams(temperature=1.0, top_k=2, seed=3)
    g = params.generator(0)
    draws = torch.stack([sample(logits, params, [g]) for _ in range(4000)]).flatten()
    assert set(draws.tolist()) <= {0, 1}
    p0 = torch.softmax(torch.tensor([2.0, 1.0]), 0)[0].item()  # 0.731
    # 4000 draws: standard error of the frequency is ~0.007, so 0.03 is > 4 sigma.
    assert abs((draws == 0).float().mean().item() - p0) < 0.03


def test_low_temperature_approaches_greedy():
    logits = _logits(rows=6, vocab=30)
    params = SamplingParams(temperature=1e-4, seed=0)
    gens = [params.generator(i) for i in range(6)]
    assert torch.equal(sample(logits, params, gens), logits.argmax(-1))


def test_bad_parameters_name_every_problem():
    with pytest.raises(ValueError) as e:
        SamplingParams(temperature=-1.0, top_k=0, top_p=1.5)
    msg = str(e.value)
    assert "temperature" in msg and "top_k" in msg and "top_p" in msg
    with pytest.raises(ValueError, match="generator"):
        sample(_logits(), SamplingParams(temperature=1.0))


def test_other_numbers_are_read_as_pythons():
    """A Fraction passed the checks and then met a tensor mid-run (helper 79); NumPy's ints
    were refused for top_k and seed, taken for max_new_tokens."""
    from fractions import Fraction

    import numpy as np

    got = SamplingParams(Fraction(1, 2), np.int64(3), Fraction(9, 10), np.int64(7))
    assert got == SamplingParams(0.5, 3, 0.9, 7)
    assert [type(v) for v in (got.temperature, got.top_k, got.top_p, got.seed)] == [
        float, int, float, int]
    rows = _logits()
    assert sample(rows, got, [got.generator(i) for i in range(rows.shape[0])]).dtype == torch.int64


# --- independent streams per request, end to end ---

PROMPT = [5, 17, 33, 101, 7]
SEED = 3


def test_the_requests_of_one_call_draw_independent_streams():
    """One seed, four requests: four different generator streams (the seed of each request
    mixes in its index), and the same streams again from the same seed."""
    params = SamplingParams(temperature=1.0, seed=SEED)
    streams = [torch.rand(16, generator=params.generator(i)) for i in range(4)]
    assert all(not torch.equal(streams[i], streams[j])
               for i in range(4) for j in range(i + 1, 4))
    again = [torch.rand(16, generator=params.generator(i)) for i in range(4)]
    assert all(torch.equal(a, b) for a, b in zip(streams, again))


@pytest.mark.parametrize("seed", [2**62, -(2**62), 9 * 10**18 // 1_000_003 + 1])
def test_every_int_seed_makes_a_generator(seed):
    """Seeds whose request seeds pass int64 (a ``time.time_ns()``, say) draw the same streams
    again; ordinary seeds keep their streams (``seed * 1_000_003 + index``)."""
    params = SamplingParams(temperature=1.0, seed=seed)
    draws = [torch.rand(4, generator=params.generator(i)) for i in range(2)]
    assert torch.equal(draws[1], torch.rand(4, generator=params.generator(1)))
    assert torch.equal(torch.rand(4, generator=SamplingParams(seed=SEED).generator(2)),
                       torch.rand(4, generator=torch.Generator().manual_seed(SEED * 1_000_003 + 2)))


@pytest.mark.parametrize("seed", [1.5, True, "3"])
def test_a_seed_that_is_no_int_is_refused(seed):
    with pytest.raises(ValueError, match="seed must be an int"):
        SamplingParams(temperature=1.0, seed=seed)


def test_identical_prompts_sample_different_continuations(model):
    """Four copies of one prompt at temperature 1 in one call: their continuations differ
    (they would be identical if every request drew the same stream). The tiny model's
    next-token distributions are broad at temperature 1, so with this seed no two of the four
    streams of 8 tokens agree; the run repeats exactly."""
    import torch_cp

    kwargs = dict(max_new_tokens=8, temperature=1.0, seed=SEED, progress=False)
    results = torch_cp.generate(model, [PROMPT] * 4, **kwargs)
    tokens = [r.token_ids for r in results]
    assert all(len(t) == 8 for t in tokens)
    assert len(set(tokens)) == 4, tokens
    assert [r.token_ids for r in torch_cp.generate(model, [PROMPT] * 4, **kwargs)] == tokens


def test_a_requests_tokens_do_not_depend_on_what_shares_its_steps(model):
    """Request i samples the same tokens whether it runs alone or batched with others (prompts
    of other lengths, so its steps mix prefill and decode rows of other requests), same seed.
    "Alone" keeps its index: the other requests ask for 0 new tokens and fail before any step."""
    from torch_cp.engine import Engine

    prompts = [PROMPT, [9, 8, 7], list(range(1, 30)), PROMPT]
    news = [8, 5, 8, 6]
    params = SamplingParams(temperature=1.0, top_k=100, seed=SEED)
    engine = Engine(model, num_pages=32, page_size=8)
    together = [r.token_ids for r in engine.run(prompts, news, params)]
    assert len(set(together)) == 4 and all(len(t) == n for t, n in zip(together, news))
    for i in range(len(prompts)):
        alone = engine.run(prompts, [n if j == i else 0 for j, n in enumerate(news)], params)
        assert [r.ok for r in alone] == [j == i for j in range(len(prompts))]
        assert alone[i].token_ids == together[i], i
