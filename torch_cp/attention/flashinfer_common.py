"""What the FlashInfer GQA and MLA backends share: one workspace, kernels per captured bucket,
plan fences, in-place staging for captured kernels, and how padding enters FlashInfer's plans.

Padding: the step plan gives padding rows no pages, so no kernel ever reads the sink page (where
padding and non-owned tokens are written). Token padding past the last real row becomes one
extra row of a multi-token step's plans (kv length 0 for the context, its own zeroed K/V for the
own tokens), so ``q.shape[0]`` equals the plan's token count, as FlashInfer requires and CUDA
graphs need. The own tokens' K/V of padding tokens (where a step may hold any, ``has_padding``)
are zeroed before the kernel: FA3 loads key/value tiles past a row's end and multiplies them by
zero probabilities, which turns NaN there into NaN in the row. Outputs of padding tokens are
unspecified and reach no real row.
"""

from __future__ import annotations

import torch

from torch_cp.attention.backend import AttentionGeometry
from torch_cp.attention.partial import Partial
from torch_cp.kv.tables import PagedIndptrs
from torch_cp.plan import Bucket, StepPlan

# One zeroed float workspace per backend, shared by all its kernels: they run one after another
# on one stream, eagerly or replayed (each wrapper keeps its own int workspace for its plan).
WORKSPACE_BYTES = 128 * 1024 * 1024


def workspace_bytes(geometry: AttentionGeometry, sms: int) -> int:
    """The float workspace a GQA backend needs: FlashInfer's split-KV prefill and tensor-core
    decode keep a float32 partial output and LSE per query head, work item and query tile row,
    for up to ``2 * sms / kv_heads`` work items (what its planner pads a graph's batch to, and
    where it stops splitting) of up to 128 tile rows: ``WORKSPACE_BYTES`` unless that bound is
    larger. Large GQA groups need more (GLM-4-32B's 48 query heads over 2 KV heads: 418 MB on an
    H200); MLA's planner keeps its own bounds (``mla_work_items``)."""
    if geometry.kind != "gqa":
        return WORKSPACE_BYTES
    items = -(-2 * sms // geometry.kv_heads)
    return max(WORKSPACE_BYTES, geometry.context_q_heads * items * 128
               * (geometry.head_dim_v + 1) * 4)


class PlanFence:
    """Waits before re-planning a wrapper until its previous plan's host-to-device copy ran.

    FlashInfer stages plan metadata in a pinned host buffer and copies it asynchronously;
    planning the same wrapper again before that copy lands would overwrite what it reads.
    """

    def __init__(self, device: torch.device):
        self._device = device
        self._event: torch.cuda.Event | None = None

    def wait(self) -> None:
        if self._event is not None:
            self._event.synchronize()

    def mark(self) -> None:
        self._event = torch.cuda.Event()
        self._event.record(torch.cuda.current_stream(self._device))


def staged(current: torch.Tensor | None, value: torch.Tensor) -> torch.Tensor:
    """``value``, copied in place into ``current`` when the shapes match (kernels captured in a
    CUDA graph keep reading the tensor they were captured with), else into a tensor of its own:
    never ``value`` itself, which may be a plan's, changed in place by the next step's staging
    while whoever holds that plan still reads it. Never an inference tensor: a step under
    ``torch.inference_mode`` (the engine's) would leave one that a later step outside it (a
    ``model.generate`` turn) could not copy into."""
    if current is not None and current.shape == value.shape and current.device == value.device:
        return current.copy_(value)
    with torch.inference_mode(False):
        return value.clone()


def with_token_padding_row(plan: StepPlan) -> tuple[torch.Tensor, PagedIndptrs]:
    """A multi-token step's host ``qo_indptr`` [B + 2] and context [B + 1 rows] with one more
    row holding the tokens past the last row (no context)."""
    qo = plan.qo_indptr_host
    qo = torch.cat((qo, torch.tensor([plan.positions.shape[0]], dtype=qo.dtype)))
    ctx = plan.context_host
    zero = ctx.lens.new_zeros(1)
    return qo, PagedIndptrs(torch.cat((ctx.lens, zero)), torch.cat((ctx.indptr, ctx.indptr[-1:])),
                            ctx.indices, torch.cat((ctx.last_page_len, zero)), ctx.table)


def has_padding(plan: StepPlan) -> bool:
    """Whether a step may hold padding tokens: a captured one always (its replays may), an
    eager one where it has tokens past its real ones (host shapes only, no sync)."""
    return plan.bucket is not None or plan.positions.shape[0] > plan.num_tokens


def real_token_mask(plan: StepPlan) -> torch.Tensor:
    """[N] bool on the plan's device: tokens of real rows."""
    rows = plan.token_row
    return (rows >= 0) & (rows < plan.num_rows)


class FlashInferBackend:
    """Base of the FlashInfer backends (see ``AttentionBackend``): one set of kernels for eager
    steps and one graph-ready set per captured bucket (fixed buffers; a captured graph replays
    the kernels it was captured with), chosen by ``plan.bucket`` when a step is planned.

    Subclasses make a kernel set with ``make_kernels(bucket)``; a set has ``plan``,
    ``run_context`` and ``run_own``.
    """

    name = "flashinfer"

    def __init__(self, geometry: AttentionGeometry, device: torch.device | str,
                 dtype: torch.dtype):
        self.geometry = geometry
        self.device = torch.device(device)
        self.dtype = dtype
        sms = (torch.cuda.get_device_properties(self.device).multi_processor_count
               if self.device.type == "cuda" else 1)
        self.num_sms = sms
        self.workspace = torch.zeros(workspace_bytes(geometry, sms), dtype=torch.uint8,
                                     device=self.device)
        self._kernels = {None: self.make_kernels(None)}
        self._active = self._kernels[None]

    def make_kernels(self, bucket: Bucket | None):
        raise NotImplementedError

    def add_bucket(self, bucket: Bucket) -> None:
        if bucket not in self._kernels:
            self._kernels[bucket] = self.make_kernels(bucket)

    def plan(self, plan: StepPlan) -> None:
        kernels = self._kernels.get(plan.bucket)
        if kernels is None:
            raise ValueError(f"no graph-ready kernels for {plan.bucket}: add_bucket(bucket) "
                             f"must run before its steps are planned")
        kernels.plan(plan)
        self._active = kernels

    def run_context(self, q: torch.Tensor, caches: list[torch.Tensor], layer_idx: int
                    ) -> Partial:
        return self._active.run_context(q, caches, layer_idx)

    def run_own(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Partial:
        return self._active.run_own(q, k, v)
