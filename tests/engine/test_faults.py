"""Faults: a step that raises (forward error, out of memory, KeyboardInterrupt; in the model or in
sampling; on a prefill chunk, a decode step or a step launched ahead) returns every page and
leaves the engine as good as new; sampling at any temperature is exact; a request that can never
fit is refused without sizing anything by it; bad ``Engine`` arguments are named together."""

import sys
import time

import pytest
import torch

import torch_cp
from torch_cp.engine import Engine, generation
from torch_cp.engine import engine as engine_module
from torch_cp.engine.sampling import SamplingParams, greedy_tokens, sample, scaled_logits
from torch_cp.layers import decoder_layers
from torch_cp.tiny import tiny_qwen3

PROMPTS = [[42], [200, 3, 150, 7, 99], list(range(1, 20)), [(7 * i) % 300 + 1 for i in range(40)]]
NEW = 4
ENGINE = dict(num_pages=12, page_size=8, max_tokens_per_step=16)  # 40 tokens: 3 chunks
SAMPLED = SamplingParams(temperature=1.0, top_k=40, seed=5)
FAULTS = [RuntimeError, torch.OutOfMemoryError, KeyboardInterrupt]


class Planted(Exception):
    """Never raised by torch_cp: marks the wrapped call that failed."""


def _tokens(results):
    assert all(r.ok for r in results), [r.error for r in results]
    return [r.token_ids for r in results]


@pytest.fixture(scope="module")
def expected(model):
    """Tokens of a fresh engine: greedy and sampled, without and with overlap planning."""
    out = {}
    for overlap in (False, True):
        for sampling in (SamplingParams(), SAMPLED):
            engine = Engine(model, overlap_planning=overlap, **ENGINE)
            out[overlap, sampling] = _tokens(engine.run(PROMPTS, NEW, sampling))
    return out


def _step_kind(engine) -> str:
    frame = sys._getframe()
    while frame is not None:
        if frame.f_code.co_name == "_overlap":
            return "launched ahead"
        frame = frame.f_back
    return "prefill" if int(engine.cache.plan.q_lens.max()) > 1 else "decode"


def _fail_on(monkeypatch, owner, name, engine, fault):
    """Wrap ``owner.name`` to raise ``fault`` on its k-th call (``set(k)``; 0: never); returns
    (set, the kinds of step each call ran in)."""
    wrapped, calls, kinds, at = getattr(owner, name), [0], [], [0]

    def wrapper(*args, **kwargs):
        calls[0] += 1
        kinds.append(_step_kind(engine))
        if calls[0] == at[0]:
            raise fault("planted fault")
        return wrapped(*args, **kwargs)

    def arm(k):
        calls[0], at[0] = 0, k
        kinds.clear()
    monkeypatch.setattr(owner, name, wrapper)
    return arm, kinds


def _sites(model, sampling):
    """Where a fault is planted: the last decoder layer (after layer 0 wrote the pool), and the
    function that picks the tokens."""
    picker = "greedy_tokens" if sampling.greedy else "sample_rows"
    return {"forward": (decoder_layers(model)[-1], "forward"), "sampling": (engine_module, picker)}


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
@pytest.mark.parametrize("site", ["forward", "sampling"])
@pytest.mark.parametrize("sampling", [SamplingParams(), SAMPLED], ids=["greedy", "sampled"])
def test_a_failed_step_returns_every_page_and_the_next_run_is_unchanged(
        model, expected, monkeypatch, overlap, site, sampling):
    engine = Engine(model, overlap_planning=overlap, **ENGINE)
    owner, name = _sites(model, sampling)[site]
    fault = [RuntimeError]
    arm, kinds = _fail_on(monkeypatch, owner, name, engine, lambda msg: fault[0](msg))
    arm(0)
    assert _tokens(engine.run(PROMPTS, NEW, sampling)) == expected[overlap, sampling]
    calls, seen = len(kinds), set(kinds)
    want = {"prefill", "decode"} | ({"launched ahead"} if overlap and sampling.greedy else set())
    assert want <= seen, seen  # the faults below hit every kind of step
    for k in range(1, calls + 1):
        fault[0] = FAULTS[k % len(FAULTS)]
        arm(k)
        with pytest.raises(fault[0], match="planted fault"):
            engine.run(PROMPTS, NEW, sampling)
        assert engine.allocator.free_pages == engine.allocator.num_pages, (k, kinds[-1])
        assert engine.allocator.live_requests == [], (k, kinds[-1])
        arm(0)
        assert _tokens(engine.run(PROMPTS, NEW, sampling)) == expected[overlap, sampling], k


def test_an_interrupt_while_pages_return_loses_none(model, expected, monkeypatch):
    """A Ctrl-C inside the prefix cache's give-back (a finished request's pages half returned,
    its table already gone): the fault handling resets the allocator (``release_all``), every
    page is back and the next run's tokens are unchanged (review, session 14)."""
    engine = Engine(model, prefix_caching=True, **ENGINE)
    give_back, armed = engine.allocator._give_back, [True]

    def interrupted(pages):
        if armed[0] and len(pages) > 1:
            armed[0] = False
            give_back(pages[:1])
            raise KeyboardInterrupt
        give_back(pages)
    monkeypatch.setattr(engine.allocator, "_give_back", interrupted)
    with pytest.raises(KeyboardInterrupt):
        engine.run(PROMPTS, NEW)
    assert engine.allocator.free_pages == engine.allocator.num_pages
    assert set(engine.allocator.state().refcounts) == {0}
    assert _tokens(engine.run(PROMPTS, NEW)) == expected[False, SamplingParams()]


def test_every_kind_of_fault_is_re_raised_as_itself(model, expected, monkeypatch):
    """Each fault on a decode step launched ahead: the same exception object reaches the caller
    (KeyboardInterrupt is not swallowed or wrapped), and the engine runs on."""
    engine = Engine(model, overlap_planning=True, **ENGINE)
    layer = decoder_layers(model)[-1]
    wrapped = layer.forward
    for fault in FAULTS:
        raised = fault("planted fault")
        state = {"armed": True}

        def failing(*args, raised=raised, state=state, **kwargs):
            if state["armed"] and _step_kind(engine) == "launched ahead":
                state["armed"] = False
                raise raised
            return wrapped(*args, **kwargs)
        monkeypatch.setattr(layer, "forward", failing)
        with pytest.raises(fault) as caught:
            engine.run(PROMPTS, NEW)
        assert caught.value is raised
        assert engine.allocator.free_pages == engine.allocator.num_pages
    monkeypatch.setattr(layer, "forward", wrapped)
    assert _tokens(engine.run(PROMPTS, NEW)) == expected[True, SamplingParams()]


def test_a_serving_step_that_raises_names_the_requests_it_ended(model, monkeypatch):
    """A fault inside ``step`` ends every request the engine held (their pages back); without
    a word they would vanish from ``has_unfinished`` and ``step`` (helper 109). The exception,
    the same object, names them; a request submitted after it runs as on a new engine."""
    engine = Engine(model, **ENGINE)
    layer = decoder_layers(model)[-1]
    raised = RuntimeError("planted fault")

    def failing(*args, **kwargs):
        raise raised
    first, second = engine.submit(PROMPTS[3], NEW), engine.submit(PROMPTS[1], NEW)
    engine.step()  # the first prefill chunk
    monkeypatch.setattr(layer, "forward", failing)
    with pytest.raises(RuntimeError) as caught:
        engine.step()
    assert caught.value is raised
    assert f"requests {[first, second]} ended with this exception" in caught.value.__notes__[0]
    assert not engine.has_unfinished() and engine.step() == []
    assert engine.allocator.free_pages == engine.allocator.num_pages
    monkeypatch.undo()
    again = engine.submit(PROMPTS[1], NEW)
    tokens = [t for out in engine.stream() for t in out.token_ids if out.request_id == again]
    assert [tuple(tokens)] == _tokens(Engine(model, **ENGINE).run(PROMPTS[1:2], NEW))


class _NoNotes(RuntimeError):
    """An exception as Python 3.10 makes them (``add_note`` came in 3.11)."""

    def __getattribute__(self, name):
        if name == "add_note":
            raise AttributeError(name)
        return super().__getattribute__(name)


def test_a_serving_fault_without_notes_still_returns_every_page(model, monkeypatch):
    """On Python 3.10 (which the package allows) the note's ``add_note`` raised an
    AttributeError in place of the fault, and the requests kept their pages (helper 115)."""
    engine = Engine(model, **ENGINE)
    raised = _NoNotes("planted fault")

    def failing(*args, **kwargs):
        raise raised
    engine.submit(PROMPTS[3], NEW)
    monkeypatch.setattr(decoder_layers(model)[-1], "forward", failing)
    with pytest.raises(_NoNotes) as caught:
        engine.step()
    assert caught.value is raised
    assert not engine.has_unfinished()
    assert engine.allocator.free_pages == engine.allocator.num_pages


# --- sampling at temperatures whose quotient overflows ---

TINY_TEMPERATURES = [1e-3, 1e-20, 1e-38, 1e-45, 1e-300, 5e-324]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("temperature", TINY_TEMPERATURES)
def test_a_tiny_temperature_samples_the_argmax(dtype, temperature):
    """Logits up to 6e4 (bf16 / fp16 range) over a temperature down to the smallest float64:
    logits / temperature overflows in float32 (and rounds the temperature to 0 below 1e-45);
    the scaled logits stay finite at the top and sampling returns the argmax."""
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(8, 64, generator=g) * 2e4).clamp(-6e4, 6e4).to(dtype)
    assert len({tuple(row) for row in logits.float().topk(2).values.tolist()}) == 8
    scaled = scaled_logits(logits, temperature)
    assert not scaled.isnan().any() and (scaled <= 0).all()
    assert (scaled.amax(-1) == 0).all()
    params = SamplingParams(temperature=temperature, seed=1)
    gens = [params.generator(i) for i in range(8)]
    for _ in range(3):
        assert torch.equal(sample(logits, params, gens), greedy_tokens(logits).cpu())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [0.05, 0.7, 1.0, 3.0, 1e6])
def test_scaled_logits_give_the_softmax_of_logits_over_temperature(dtype, temperature):
    """Against a float64 reference softmax(logits / temperature)."""
    logits = (torch.randn(4, 100, generator=torch.Generator().manual_seed(2)) * 4).to(dtype)
    want = torch.softmax(logits.double() / temperature, dim=-1)
    got = torch.softmax(scaled_logits(logits, temperature), dim=-1).double()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_temperatures_that_are_not_finite_are_refused():
    for bad in (float("inf"), float("nan"), -1e-30):
        with pytest.raises(ValueError, match="temperature must be finite and >= 0"):
            SamplingParams(temperature=bad)


def test_sampling_values_of_the_wrong_type_are_named_not_crashed_on():
    """A bool would pass as 1 and a str would raise a TypeError deep inside."""
    with pytest.raises(ValueError) as caught:
        SamplingParams(temperature="0.7", top_k=True, top_p="0.9")
    for named in ("temperature must be finite", "top_k must be a positive int",
                  "top_p must be in (0, 1]"):
        assert named in str(caught.value)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=True)
    SamplingParams(temperature=0.5, top_k=4, top_p=0.9)  # still fine


# --- a request that can never fit ---

def test_a_huge_max_new_tokens_gets_its_error_without_sizing_the_pool(model, monkeypatch):
    built = []

    class Recorded(Engine):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            built.append(self)
    monkeypatch.setattr(generation, "Engine", Recorded)
    prompts = PROMPTS[:3]
    began = time.perf_counter()
    results = torch_cp.generate(model, prompts, [NEW, 10**12, NEW], progress=False)
    elapsed = time.perf_counter() - began
    assert not results[1].ok and "can never fit" in results[1].error, results[1].error
    assert results[1].token_ids == ()
    (engine,) = built
    alone = torch_cp.generate(model, [prompts[0], prompts[2]], NEW, progress=False)
    assert [results[0].token_ids, results[2].token_ids] == _tokens(alone)
    # The pool holds the two other requests' lifetimes and nothing more.
    page = engine.page_size
    pages = sum(-(-(len(p) + NEW - 1) // page) for p in (prompts[0], prompts[2]))
    assert engine.allocator.num_pages == pages
    assert engine.kv_bytes == model.torch_cp.new_pool(pages, page).bytes < 2**20
    assert elapsed < 10
    with pytest.raises(ValueError, match="max_new_tokens must be an int or one int a prompt"):
        torch_cp.generate(model, prompts, 4.0, progress=False)  # was list(4.0): a TypeError


def test_the_default_pool_is_capped_by_free_host_memory(model, monkeypatch):
    """With 256 KiB free, the pool takes half of it, its sink page included; a request longer
    than that can never fit, one that fits waits for pages."""
    from torch_cp.engine import memory

    monkeypatch.setattr(memory, "free_host_bytes", lambda: 2**18)
    per_page = memory.pool_bytes_per_page(model.torch_cp, 16)
    cap = 2**17 // per_page - 1
    long = [1] * (cap * 16 - 5)
    results = torch_cp.generate(model, [[5, 6], long, [7] * (cap * 16 + 1)], 4, progress=False)
    assert [r.ok for r in results] == [True, True, False]
    assert f"at most {cap} pages" in results[2].error


def test_a_hybrid_models_default_pool_leaves_room_for_its_state_pool(monkeypatch):
    """The cap is half the free host memory less the state pool the engine allocates beside the
    KV pool (running requests' slots, one per request of the batch, and, with prefix caching,
    as many checkpoints), less the KV pool's sink page."""
    from torch_cp.engine import memory
    from torch_cp.tiny import tiny_qwen3_5

    hybrid = torch_cp.patch_model(tiny_qwen3_5(), page_size=16)
    runtime = hybrid.torch_cp
    state = memory.state_pool_bytes(runtime, 2, prefix_caching=True)  # 2 requests
    assert state == Engine(hybrid, num_pages=1, max_rows=2, prefix_caching=True).state_bytes
    assert state < memory.state_pool_bytes(runtime, prefix_caching=True) / 16  # 64 rows'
    made = []
    monkeypatch.setattr(generation, "Engine", lambda *a, **k: made.append(Engine(*a, **k))
                        or made[-1])
    per_page = memory.pool_bytes_per_page(runtime, 16)
    free = 2 * (state + 11 * per_page)  # 10 pages and the sink page
    monkeypatch.setattr(memory, "free_host_bytes", lambda: free)
    results = torch_cp.generate(hybrid, [[5] * (10 * 16), [5] * (10 * 16 + 1)], 1,
                                prefix_caching=True, progress=False)
    assert [r.ok for r in results] == [True, False]
    assert "at most 10 pages" in results[1].error
    assert made[0].state_bytes == state  # helper 98: 64 rows' slots for any batch


# --- Engine arguments ---

def _meta_pools_only(runtime):
    """``runtime.new_pool`` that sizes pools on the meta device (the memory check) and refuses
    to allocate one anywhere else."""
    sized = runtime.new_pool

    def new_pool(*args, **kwargs):
        assert "meta" in args or kwargs.get("device") == "meta", "a pool was allocated"
        return sized(*args, **kwargs)
    return new_pool


def test_every_bad_engine_argument_is_named_at_once_before_allocation(model, monkeypatch):
    monkeypatch.setattr(model.torch_cp, "new_pool", _meta_pools_only(model.torch_cp))
    with pytest.raises(ValueError) as e:
        Engine(model, num_pages=0, page_size=-8, max_tokens_per_step=0, max_rows=0,
               max_pages_per_row=-1, mixed_buckets=[(4, 2), (0, 8), "x"])
    msg = str(e.value)
    for name in ("num_pages", "page_size", "max_tokens_per_step", "max_rows",
                 "max_pages_per_row", "(4, 2)", "(0, 8)", "('x',)"):
        assert name in msg, (name, msg)
    with pytest.raises(ValueError, match="mixed_buckets .* need cuda_graphs"):
        Engine(model, num_pages=4, mixed_buckets=[(2, 8)])
    with pytest.raises(ValueError, match="num_pages must be a positive int, got 2.5"):
        Engine(model, num_pages=2.5)


def test_engine_flags_that_are_not_bools_and_a_pool_larger_than_memory_are_refused(model,
                                                                                   monkeypatch):
    """A truthy str would turn a flag on; a pool of 10**12 pages would fail (or be killed)
    inside its allocation: both refused first, the pool sized on the meta device only."""
    monkeypatch.setattr(model.torch_cp, "new_pool", _meta_pools_only(model.torch_cp))
    with pytest.raises(ValueError) as e:
        Engine(model, num_pages=4, overlap_planning="no", prefix_caching=1, compile="yes")
    for named in ("overlap_planning must be True or False, got 'no'",
                  "prefix_caching must be True or False, got 1", "compile must be True or False"):
        assert named in str(e.value)
    with pytest.raises(ValueError, match=r"max_rows must be a positive int or None, got 0; "
                                         r"num_pages 1000000000000 need .* GiB of pool on each "
                                         r"rank; the free memory holds at most \d+ pages"):
        Engine(model, num_pages=10**12, max_rows=0)  # both named (helper 43)


def test_stream_and_progress_that_are_not_bools_are_refused(model, monkeypatch):
    """``stream="False"`` returned a stream (a str is truthy; helper 116)."""
    with pytest.raises(ValueError, match="progress must be True or False, got 'x'"):
        Engine(model, num_pages=4).run(PROMPTS, NEW, progress="x")
    monkeypatch.setattr(model.torch_cp, "new_pool", _meta_pools_only(model.torch_cp))
    with pytest.raises(ValueError, match="progress must be True or False, got 'no'; stream must "
                                         "be True or False, got 'False'"):
        torch_cp.generate(model, PROMPTS, NEW, stream="False", progress="no")
    with pytest.raises(ValueError, match="progress must be True or False, got 1"):
        Engine(model, num_pages=4, progress=1)


def test_sizes_computed_with_numpy_or_torch_are_taken_as_ints(model, expected):
    """``num_pages=np.int64(...)``, a page size from a 0-d tensor: the tokens of Python ints
    (they were refused as not ints); bools and floats of either kind are still named."""
    np = pytest.importorskip("numpy")
    engine = Engine(model, num_pages=np.int64(12), page_size=torch.tensor(8),
                    max_tokens_per_step=np.int32(16), max_rows=np.int64(4))
    assert type(engine.page_size) is int and type(engine.allocator.num_pages) is int
    assert _tokens(engine.run(PROMPTS, NEW)) == expected[False, SamplingParams()]
    results = torch_cp.generate(model, PROMPTS, NEW, num_pages=np.int64(12),
                                page_size=np.int64(8), max_tokens_per_step=np.int64(16),
                                progress=False)
    assert _tokens(results) == expected[False, SamplingParams()]
    with pytest.raises(ValueError) as e:
        Engine(model, num_pages=np.float64(12), page_size=np.bool_(True))
    assert "num_pages must be a positive int, got" in str(e.value)
    assert "page_size must be a positive int, got" in str(e.value)
    patched = torch_cp.patch_model(torch_cp.tiny_qwen3(), page_size=np.int64(8))
    assert type(patched.torch_cp.page_size) is int


def test_generate_refuses_a_default_pool_whose_first_page_cannot_fit(model, monkeypatch):
    """Sized from the requests, the pool still takes one page (a hybrid model its state pool
    beside): refused first, as ``Engine`` refuses a ``num_pages`` (helper 87: generate went on
    to allocate it)."""
    monkeypatch.setattr(model.torch_cp, "new_pool", _meta_pools_only(model.torch_cp))
    with pytest.raises(ValueError, match=r"the default pool's first page \(page_size 1000000000\) "
                                         r"needs .* GiB of pool on each rank; the free memory "
                                         r"holds at most 0 pages"):
        torch_cp.generate(model, [[1, 2, 3]], 2, page_size=10**9, progress=False)


def test_the_memory_check_counts_the_sink_page(model, monkeypatch):
    """A pool of N pages allocates N + 1 (the sink): free memory of 1.5 pages holds none
    (helper 88: a pool of one page passed, and took two)."""
    from torch_cp.engine import memory

    per_page = memory.pool_bytes_per_page(model.torch_cp, 8)
    monkeypatch.setattr(memory, "_free_bytes", lambda runtime: per_page * 3 // 2)
    assert memory.pool_fit_problems(model.torch_cp, 8, 1)[0].endswith("holds at most 0 pages")
    monkeypatch.setattr(memory, "_free_bytes", lambda runtime: per_page * 2)
    assert memory.pool_fit_problems(model.torch_cp, 8, 1) == []


def test_engines_for_calls_of_similar_lengths_share_their_bucket_width(model, monkeypatch):
    """The captured buckets' page-table width is the longest request's, rounded up to a power
    of two (the backend keeps a kernel set per bucket shape): 5 and 7 pages give 8."""
    made = []
    monkeypatch.setattr(generation, "Engine", lambda *a, **k: made.append(k) or k)
    for pages in (5, 7, 9):
        generation.engine_for(model, [[1] * (pages * 8 - 3)], [4], 8, num_pages=64)
    assert [k["max_pages_per_row"] for k in made] == [8, 8, 16]
    generation.engine_for(model, [[1] * 37], [4], 8, num_pages=6)
    assert made[-1]["max_pages_per_row"] == 6  # never wider than the pool


def test_mixed_buckets_the_mla_planner_refuses_are_named_before_allocation(model, monkeypatch):
    """DeepSeek-V3's 128 heads on 132 SMs: a capture step of 16,384 tokens makes 16,384 query
    tiles of 128 rows, over FlashInfer's cap of 16,384 planner work items with the splits;
    8,192 tokens, or 16 heads, fit. The backend is asked before anything is allocated."""
    from types import SimpleNamespace

    from torch_cp.attention.mla_planner import mixed_bucket_problems

    assert mixed_bucket_problems([(4, 8192)], 128, 132) == []
    assert mixed_bucket_problems([(4, 16384)], 16, 132) == []
    refused = mixed_bucket_problems([(4, 16384)], 128, 132)
    assert len(refused) == 1 and "mixed bucket (4, 16384)" in refused[0]

    monkeypatch.setattr(model.torch_cp, "new_pool", _meta_pools_only(model.torch_cp))
    monkeypatch.setattr(model.torch_cp, "backend", SimpleNamespace(
        mixed_bucket_problems=lambda shapes: mixed_bucket_problems(shapes, 128, 132)))
    with pytest.raises(ValueError) as e:
        Engine(model, num_pages=4, cuda_graphs=True, mixed_buckets=[(4, 8192), (4, 16384)])
    assert str(e.value).count("mixed bucket (") == 1 and refused[0] in str(e.value)


def test_an_engine_refuses_a_model_changed_since_it_was_made():
    """An engine made before the model was cast ran on (bf16 compute over its fp32 pool), and
    one made before an unpatch and patch again failed on an internal assertion (helper 98):
    both are named at ``run``, ``submit``, ``step`` and ``stream``, and nothing is lost."""
    model = torch_cp.patch_model(tiny_qwen3(num_hidden_layers=1))
    engine = Engine(model, **ENGINE)
    want = _tokens(engine.run(PROMPTS[:1], NEW))
    model.to(torch.bfloat16)
    for call in (lambda: engine.run(PROMPTS[:1], NEW), lambda: engine.submit(PROMPTS[0], NEW)):
        with pytest.raises(ValueError, match="cast to torch.bfloat16 after torch_cp.patch_m"):
            call()
    model.to(torch.float32)
    engine.submit(PROMPTS[0], NEW)
    model.to(torch.bfloat16)  # after a submit: its steps are refused, the request kept (helper 100)
    for call in (engine.step, lambda: next(engine.stream())):
        with pytest.raises(ValueError, match="cast to torch.bfloat16 after torch_cp.patch_m"):
            call()
    model.to(torch.float32)
    streamed = [t for out in engine.stream() for t in out.token_ids]
    assert [tuple(streamed)] == want and not engine.has_unfinished()
    model.to(torch.bfloat16)
    torch_cp.unpatch_model(model)
    torch_cp.patch_model(model.to(torch.float32))
    for call in (lambda: engine.run(PROMPTS[:1], NEW), lambda: engine.submit(PROMPTS[0], NEW)):
        with pytest.raises(ValueError, match="patched again after this Engine was made for it"):
            call()
    assert _tokens(Engine(model, **ENGINE).run(PROMPTS[:1], NEW))  # a new engine runs


def test_a_base_model_without_its_head_is_refused_before_allocation(monkeypatch):
    """A patched base model (no LM head) allocated its pool and failed in the first step on
    ``out.logits`` (helper 98)."""
    base = torch_cp.patch_model(tiny_qwen3(num_hidden_layers=1).model)
    monkeypatch.setattr(base.torch_cp, "new_pool", _meta_pools_only(base.torch_cp))
    for call in (lambda: Engine(base, **ENGINE),
                 lambda: torch_cp.generate(base, PROMPTS[:1], NEW, progress=False)):
        with pytest.raises(ValueError, match="Qwen3Model has no LM head"):
            call()
