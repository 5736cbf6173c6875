"""Fixed-address step-plan buffers for one bucket: captured kernels read them, every replay's
plan is copied into them on the host side before the replay."""

from __future__ import annotations

from dataclasses import fields, replace

import torch

from torch_cp.kv.tables import PagedIndptrs
from torch_cp.plan import StepPlan


class StaticPlan:
    """The device tensors of a bucket's step plan, allocated once.

    ``load(plan)`` copies a plan built for the same bucket (same padded rows and tokens) into
    the buffers and returns that plan re-pointed at them; the host-side fields (row counts,
    host indptrs) are the new plan's. ``context.indices`` varies in length, so its buffer holds
    every page of the bucket's table and a plan's indices fill its prefix; ``context.table`` is
    the bucket's width and a plan's table, as wide as its longest row, fills its first columns
    (the columns past a row's length, sink or earlier steps' pages, are never read).
    """

    def __init__(self, template: StepPlan):
        assert template.token_index is None, "captured steps take packed tokens"
        assert template.bucket is not None, "a bucket's plan"
        ctx = template.context
        rows, width = ctx.table.shape[0], template.bucket.table_width
        self.context = PagedIndptrs(
            lens=ctx.lens.clone(), indptr=ctx.indptr.clone(),
            indices=torch.zeros(rows * width, dtype=ctx.indices.dtype, device=ctx.table.device),
            last_page_len=ctx.last_page_len.clone(),
            table=torch.full((rows, width), template.sink_page, dtype=ctx.table.dtype,
                             device=ctx.table.device))
        self.tensors = {name: getattr(template, name).clone() for name in _STEP_TENSORS
                        if getattr(template, name) is not None}
        self.plan = self.load(template)

    def load(self, plan: StepPlan) -> StepPlan:
        """Copy ``plan`` into the buffers; returns it pointing at them."""
        for name, buffer in self.tensors.items():
            new = getattr(plan, name)
            assert new.shape == buffer.shape, f"{name}: {tuple(new.shape)} != {tuple(buffer.shape)}"
            buffer.copy_(new, non_blocking=True)
        for buffer, new in zip(_context_tensors(self.context), _context_tensors(plan.context)):
            if buffer is self.context.indices:
                buffer[: new.shape[0]].copy_(new, non_blocking=True)
            elif buffer is self.context.table:
                assert new.shape[0] == buffer.shape[0] and new.shape[1] <= buffer.shape[1]
                buffer[:, : new.shape[1]].copy_(new, non_blocking=True)
            else:
                assert new.shape == buffer.shape
                buffer.copy_(new, non_blocking=True)
        return replace(plan, context=self.context, **self.tensors)


_STEP_TENSORS = ("qo_indptr", "q_lens", "ctx_lens", "positions", "token_row", "write_index",
                 "state_slots", "state_fresh")


def _context_tensors(ctx: PagedIndptrs) -> tuple[torch.Tensor, ...]:
    return tuple(getattr(ctx, f.name) for f in fields(ctx))
