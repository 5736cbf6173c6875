"""PagedKVCache: the transformers ``Cache`` a patched model's forward receives.

It carries the model's runtime, the placed pool, a hybrid model's state pool and the current
step plan. The patched attention
modules write the pool themselves (through ``ContextParallelAttention``), so ``update`` is never
called; the model-level code of transformers only asks the cache how to size its attention mask,
which the patched attention ignores.
"""

from __future__ import annotations

import copy

import torch
from transformers.cache_utils import Cache

from torch_cp.kv.pool import GQAPool, MLAPool
from torch_cp.plan import StepPlan
from torch_cp.runtime import ModelRuntime, new_pools, runtime_to_run
from torch_cp.state import StatePool


class PagedKVCache(Cache):
    """Pass as ``cache=`` to a patched model (``past_key_values=`` in earlier transformers 5
    releases: ``compat.cache_kwarg``), after ``begin_step(plan)`` for each step.

    Args:
        runtime: the patched model's ``model.torch_cp``.
        pool: the placed pool (``runtime.new_pool(num_pages, page_size)``); None for a cache
            that allocates both pools at its first forward (``GenerateCache.deferred``).
        state: a hybrid model's state pool (``torch_cp.runtime.new_state_pool``); its plans
            then carry ``state_slots``.

    Attributes:
        plan: the step plan of the forward about to run (``None`` before the first step).
    """

    def __init__(self, runtime: ModelRuntime, pool: GQAPool | MLAPool | None,
                 state: StatePool | None = None):
        super().__init__(layers=[])
        if pool is not None and pool.placement != runtime.placement:
            raise ValueError("the pool was built for another placement than the model's")
        if pool is not None and (runtime.linear is None) != (state is None):
            raise ValueError("a hybrid model needs a state pool (torch_cp.runtime."
                             "new_state_pool), and only a hybrid model takes one")
        self.runtime = runtime
        self.pool = pool
        self.state = state
        self.plan: StepPlan | None = None

    def __deepcopy__(self, memo):
        """A copy holding its own pool and state pool (a prompt's cache reused for several
        continuations, a conversation branched), for the same model: its runtime (placement,
        process groups, attention backend) is shared, not copied. Never inference tensors (a
        copy made under ``torch.inference_mode`` serves a turn outside it)."""
        shared = {id(self.runtime): self.runtime, id(self.runtime.placement):
                  self.runtime.placement}
        added = [key for key in shared if key not in memo]
        memo.update({key: shared[key] for key in added})
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        try:
            with torch.inference_mode(False):
                for name, value in self.__dict__.items():
                    setattr(new, name, copy.deepcopy(value, memo))
        finally:  # shared for this copy only: a model copied beside it is still refused
            for key in added:
                del memo[key]
        return new

    @classmethod
    def for_model(cls, model, num_pages: int, page_size: int | None = None,
                  state_slots: int = 1) -> PagedKVCache:
        """A cache with a fresh pool of ``num_pages`` pages for a patched ``model`` (page size:
        the one given to ``patch_model`` unless overridden), and for a hybrid model a state
        pool of ``state_slots`` slots. Under torchrun, allocated on every rank or on none
        (``agreement.together``)."""
        runtime = runtime_to_run(model)
        return cls(runtime, *new_pools(runtime, num_pages, page_size, state_slots,
                                       "allocating a paged cache"))

    def begin_step(self, plan: StepPlan) -> None:
        """Make ``plan`` the plan of the next forward and plan the backend for it (host side)."""
        if plan.placement != self.runtime.placement:
            raise ValueError("the step plan was built for another placement than the model's")
        if (plan.page_size, plan.sink_page) != (self.pool.page_size, self.pool.sink_page):
            raise ValueError(
                f"the step plan (page_size {plan.page_size}, sink page {plan.sink_page}) does not "
                f"match the pool (page_size {self.pool.page_size}, "
                f"sink page {self.pool.sink_page})")
        if (self.state is None) != (plan.state_slots is None):
            raise ValueError("a hybrid model's step plan needs state_slots (and only its plan "
                             "takes them): build_step_plan(..., state_slots=, sink_slot=)")
        if self.state is not None and plan.state_sink_slot != self.state.sink_slot:
            raise ValueError(f"the step plan's sink_slot {plan.state_sink_slot} is not the state "
                             f"pool's ({self.state.sink_slot}, one past its "
                             f"{self.state.num_slots} request slots)")
        self.plan = plan
        self.runtime.planned_for = None  # until the backend holds it (a plan may be refused)
        self.runtime.backend.plan(plan)
        self.runtime.planned_for = plan
        if self.state is not None:
            self.state.begin_step(plan)

    def claim_backend(self) -> None:
        """Plan the backend for this cache's plan again if another cache of the model planned
        it since (``begin_step``): the backend is the model's, shared by every cache and
        engine on it (helpers 109, 110: a forward ran on another cache's plan)."""
        if self.plan is not None and self.runtime.planned_for is not self.plan:
            self.begin_step(self.plan)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        raise RuntimeError("PagedKVCache.update was called: only attention modules patched by "
                           "torch_cp.patch_model can use this cache, and they write the pool")

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens cached before the current step, for its longest row (rows differ; the patched
        model takes positions from ``position_ids``, which a forward given none gets from the
        plan: ``hf/model_generate._with_plan_positions``)."""
        if self.plan is None or self.plan.num_rows == 0:
            return 0
        return int(self.plan.ctx_lens.max())

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        """(kv_length, kv_offset) of the mask transformers builds before the layers. The patched
        attention ignores that mask, so it spans one key: O(tokens) for any attention
        implementation (eager would otherwise build a [tokens, tokens] float mask)."""
        return 1, 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    @property
    def is_compileable(self) -> bool:
        return False


def paged_cache_from(cache) -> PagedKVCache:
    """The ``PagedKVCache`` a patched attention forward received, with a plan; a clear error for
    anything else (e.g. the ``DynamicCache`` transformers builds when none is passed)."""
    if not isinstance(cache, PagedKVCache):
        raise TypeError(
            f"a model patched by torch_cp needs a PagedKVCache, got {type(cache).__name__}: for "
            f"a forward of your own pass torch_cp.new_cache(model, batch_size, max_length) as "
            f"its cache (it plans each forward from its inputs, as model.generate's does)")
    if cache.plan is None:
        raise RuntimeError("PagedKVCache.begin_step(plan) must run before the forward (for a "
                           "forward of your own, torch_cp.new_cache(model, batch_size, "
                           "max_length) plans each forward from its inputs)")
    return cache


__all__ = ["PagedKVCache", "paged_cache_from"]
