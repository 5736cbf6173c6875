"""PagedKVCache's own checks (hf/cache.py): a pool built for another placement than the model's
is refused when the cache is made, and a step plan built for another partner's placement (or
another page size or sink page) is refused by ``begin_step`` before the backend plans anything.

Placements over two partners use a stand-in process group (the checks never touch it), and the
runtime is built by hand from the core as in tests/models/test_patch_mla.py; one case patches the
tiny Qwen3 at P = 1 with ``patch_model``. No process is spawned.
"""

from __future__ import annotations

import pytest
import torch

import torch_cp
from torch_cp.attention import AttentionGeometry, Exchange, TorchBackend
from torch_cp.hf.cache import PagedKVCache
from torch_cp.kv import GQAPool
from torch_cp.placement import ContextParallel
from torch_cp.plan import StepPlan, build_step_plan
from torch_cp.runtime import ModelRuntime

GROUP, OTHER_GROUP = object(), object()  # stand-ins for the partners' process groups
PAGE_SIZE, NUM_PAGES, LAYERS = 8, 6, 2


class SpyBackend(TorchBackend):
    """The reference backend, recording every plan it is given."""

    def __init__(self, geometry):
        super().__init__(geometry)
        self.planned: list[StepPlan] = []

    def plan(self, plan: StepPlan) -> None:
        self.planned.append(plan)
        super().plan(plan)


def runtime(placement: ContextParallel) -> ModelRuntime:
    geometry = AttentionGeometry(kind="gqa", q_heads=2, kv_heads=1, head_dim=4, head_dim_v=4,
                                 scale=0.5, context_q_heads=2 * placement.size)
    return ModelRuntime(placement, Exchange(placement), SpyBackend(geometry), geometry, LAYERS,
                        torch.float32, torch.device("cpu"), PAGE_SIZE)


def pool(placement: ContextParallel, num_pages: int = NUM_PAGES,
         page_size: int = PAGE_SIZE) -> GQAPool:
    return GQAPool(LAYERS, num_pages, page_size, 1, 4, placement, torch.float32)


def plan(placement: ContextParallel, page_size: int = PAGE_SIZE,
         sink_page: int = NUM_PAGES) -> StepPlan:
    """A prefill of 5 tokens and a decode row after 9 cached ones."""
    return build_step_plan([5, 1], [0, 9], [[0], [1, 2]], page_size=page_size,
                           sink_page=sink_page, placement=placement)


PARTNER_0 = ContextParallel(2, 0, "tp", GROUP)
PARTNER_1 = ContextParallel(2, 1, "tp", GROUP)
OTHERS = {
    "the other partner": PARTNER_1,
    "the same index in another group": ContextParallel(2, 0, "tp", OTHER_GROUP),
    "the same index in SP mode": ContextParallel(2, 0, "sp", GROUP),
    "one partner": ContextParallel.single(),
    "four partners": ContextParallel(4, 0, "tp", GROUP),
}


def test_a_plan_for_this_placement_is_taken():
    cache = PagedKVCache(rt := runtime(PARTNER_0), pool(PARTNER_0))
    step = plan(PARTNER_0)
    cache.begin_step(step)
    assert cache.plan is step and rt.backend.planned == [step]


@pytest.mark.parametrize("other", list(OTHERS))
def test_a_plan_for_another_placement_is_refused_before_the_backend_plans(other):
    rt = runtime(PARTNER_0)
    cache = PagedKVCache(rt, pool(PARTNER_0))
    first = plan(PARTNER_0)
    cache.begin_step(first)
    with pytest.raises(ValueError, match="step plan was built for another placement"):
        cache.begin_step(plan(OTHERS[other]))
    assert cache.plan is first and rt.backend.planned == [first], "nothing changed"


@pytest.mark.parametrize("page_size,sink_page", [(16, NUM_PAGES), (PAGE_SIZE, NUM_PAGES + 1)])
def test_a_plan_for_another_page_size_or_sink_page_is_refused(page_size, sink_page):
    rt = runtime(PARTNER_0)
    cache = PagedKVCache(rt, pool(PARTNER_0))
    with pytest.raises(ValueError, match="does not match the pool"):
        cache.begin_step(plan(PARTNER_0, page_size, sink_page))
    assert cache.plan is None and rt.backend.planned == []


def test_a_patched_model_refuses_another_partners_plan():
    """patch_model at P = 1, then a plan built for partner 1 of 2 with the model's page size and
    sink page: refused, and the model's backend is never planned with it."""
    model = torch_cp.patch_model(torch_cp.tiny_qwen3(), page_size=PAGE_SIZE)
    cache = PagedKVCache.for_model(model, NUM_PAGES)
    planned = []
    backend_plan = model.torch_cp.backend.plan
    model.torch_cp.backend.plan = lambda p: (planned.append(p), backend_plan(p))
    with pytest.raises(ValueError, match="step plan was built for another placement"):
        cache.begin_step(plan(PARTNER_1, sink_page=cache.pool.sink_page))
    assert cache.plan is None and planned == []
    own = plan(ContextParallel.single(), sink_page=cache.pool.sink_page)
    cache.begin_step(own)
    assert cache.plan is own and planned == [own]


@pytest.mark.parametrize("other", list(OTHERS))
def test_a_pool_for_another_placement_is_refused(other):
    with pytest.raises(ValueError, match="pool was built for another placement"):
        PagedKVCache(runtime(PARTNER_0), pool(OTHERS[other]))


def test_a_pool_for_this_placement_is_taken_with_its_own_size():
    """The pool's page count and page size are the pool's business: any pool of the model's
    placement is taken."""
    p = pool(PARTNER_0, num_pages=3, page_size=4)
    assert PagedKVCache(runtime(PARTNER_0), p).pool is p


@pytest.mark.parametrize("slots", [[0, 0], [0, 3], [3, 1], [-1, 0]],
                         ids=["twice", "sink", "zero", "negative"])
def test_state_slots_must_be_distinct_request_slots(slots):
    """A pool of 3 request slots: the sink is slot 3 and the zero slot 4 (a real row on either
    would be read by padding or by every later fresh row)."""
    with pytest.raises(ValueError, match=r"state_slots must be distinct slots in \[0, 3\)"):
        build_step_plan([5, 1], [0, 9], [[0], [1, 2]], page_size=PAGE_SIZE, sink_page=NUM_PAGES,
                        state_slots=slots, sink_slot=3)


def test_a_plan_for_another_state_pool_is_refused():
    from torch_cp.tiny import tiny_qwen3_5

    model = torch_cp.patch_model(tiny_qwen3_5(), page_size=PAGE_SIZE)
    cache = PagedKVCache.for_model(model, NUM_PAGES, state_slots=2)
    step = build_step_plan([5, 1], [0, 9], [[0], [1, 2]], page_size=PAGE_SIZE,
                           sink_page=cache.pool.sink_page, state_slots=[0, 2], sink_slot=4)
    with pytest.raises(ValueError, match=r"sink_slot 4 is not the state pool's \(2"):
        cache.begin_step(step)
    cache.begin_step(build_step_plan([5, 1], [0, 9], [[0], [1, 2]], page_size=PAGE_SIZE,
                                     sink_page=cache.pool.sink_page, state_slots=[1, 0],
                                     sink_slot=2))


def test_a_forward_without_a_cache_names_the_cache_that_works():
    """The error pointed at ``PagedKVCache.for_model``, whose forward then failed for want of a
    plan (helper 98); the cache it names now runs a forward of one's own, as the unpatched
    model computes it."""
    from torch_cp.compat import cache_kwarg
    from torch_cp.tiny import tiny_qwen3

    reference, model = tiny_qwen3(), torch_cp.patch_model(tiny_qwen3())
    ids = torch.tensor([[5, 6, 7, 8]])
    with pytest.raises(TypeError, match=r"torch_cp.new_cache\(model, batch_size, max_length\)"):
        model(ids)
    logits = model(ids, **{cache_kwarg(model): torch_cp.new_cache(model, 1, 8)}).logits
    torch.testing.assert_close(logits, reference(ids).logits)


def test_a_cache_made_for_another_patched_model_is_refused_by_name():
    """A generate cache from another patched model, or from this model before it was patched
    again: its pool and plan are not the ones the model's attention reads. It gave other tokens
    with no error, or an assertion in the backend (helper 109); now a ValueError, from
    ``model.generate`` and from a direct forward, and a new cache serves."""
    from torch_cp.compat import cache_kwarg
    from torch_cp.tiny import tiny_qwen3

    reference, model, other = tiny_qwen3(), torch_cp.patch_model(tiny_qwen3()), tiny_qwen3()
    other = torch_cp.patch_model(other)
    ids, kw = torch.tensor([[5, 6, 7, 8]]), dict(max_new_tokens=3, do_sample=False,
                                                 pad_token_id=0)
    stale = torch_cp.new_cache(model, 1, 16)
    torch_cp.unpatch_model(model)
    torch_cp.patch_model(model)
    for cache in (stale, torch_cp.new_cache(other, 1, 16)):
        with pytest.raises(ValueError, match="made for another patched model"):
            model.generate(ids, cache=cache, **kw)
        with pytest.raises(ValueError, match="made for another patched model"):
            model(ids, **{cache_kwarg(model): cache})
    fresh = torch_cp.new_cache(model, 1, 16)
    assert torch.equal(model.generate(ids, cache=fresh, **kw), reference.generate(ids, **kw))


def test_caches_planned_in_turn_each_run_on_their_own_plan():
    """Two ``PagedKVCache``s of one model, each given its next step with ``begin_step``, then
    each forwarded: the attention backend is the model's, so the first forward ran on the
    second cache's plan (other logits, no error; helper 110). A forward plans the backend
    again when another cache planned it since."""
    from torch_cp.compat import cache_kwarg
    from torch_cp.tiny import tiny_qwen3

    model = torch_cp.patch_model(tiny_qwen3(), page_size=4)
    kwarg = cache_kwarg(model)

    def planned(cache, q_len, context):
        plan = build_step_plan([q_len], [context], [[0, 1, 2]], page_size=4,
                               sink_page=cache.pool.sink_page, placement=model.torch_cp.placement)
        cache.begin_step(plan)
        return plan

    def forward(cache, plan, ids):
        with torch.no_grad():
            return model(input_ids=torch.tensor([ids]), position_ids=plan.positions[None],
                         **{kwarg: cache}).logits[0, -1]

    def prefilled(prompt):
        cache = PagedKVCache.for_model(model, num_pages=8)
        forward(cache, planned(cache, len(prompt), 0), prompt)
        return cache

    a_prompt, b_prompt = [5, 7, 9, 11, 13, 17], [40, 41, 42]
    a, b = prefilled(a_prompt), prefilled(b_prompt)
    alone_a = forward(a, planned(a, 1, 6), [19])
    alone_b = forward(b, planned(b, 1, 3), [23])
    a, b = prefilled(a_prompt), prefilled(b_prompt)
    plan_a, plan_b = planned(a, 1, 6), planned(b, 1, 3)
    torch.testing.assert_close(forward(a, plan_a, [19]), alone_a, rtol=0, atol=0)
    torch.testing.assert_close(forward(b, plan_b, [23]), alone_b, rtol=0, atol=0)
