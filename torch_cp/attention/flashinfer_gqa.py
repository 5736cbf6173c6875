"""FlashInfer partial attention over a placed GQA pool (paged decode, paged + ragged prefill).

A decode step attends the pool only (the new token is written first), through
``BatchDecodeWithPagedKVCacheWrapper``. Any other step attends the cached context through
``BatchPrefillWithPagedKVCacheWrapper`` (non-causal, context-only lengths) and its own tokens
through ``BatchPrefillWithRaggedKVCacheWrapper`` (causal, ``qo_indptr == kv_indptr``); the module
merges the two partials. Every kernel returns base-2 LSE; empty rows give out 0 and lse -inf.

Padding: padding rows get no pages, so no kernel ever reads the sink page (where padding and
non-owned tokens are written). Token padding past the last real row becomes one extra row of the
FlashInfer plans (kv length 0 for the context, its own zeroed K/V for the own tokens), so
``q.shape[0]`` equals the plan's token count, as FlashInfer requires and CUDA graphs need. The own
tokens' K/V of padding tokens are zeroed before the ragged kernel: FA3 loads key/value tiles past
a row's end and multiplies them by zero probabilities, which turns NaN there into NaN in the row.
Outputs of padding tokens are unspecified (NaN queries give NaN there) and reach no real row.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from torch_cp.attention.backend import AttentionGeometry
from torch_cp.attention.partial import Partial
from torch_cp.plan import PagedIndptrs, StepPlan

if TYPE_CHECKING:
    from torch_cp.graphs.buckets import Bucket

WORKSPACE_BYTES = 128 * 1024 * 1024
GQA_HEAD_DIMS = (64, 128, 256)  # FlashInfer kernels prebuilt in the device bundle
CUDA_CORE_DECODE_GROUPS = (1, 2, 3, 4, 6, 8, 16)  # FlashInfer's decode dispatch
# Tensor-core decode from this GQA group size up: on an H200 it reaches the copy roofline at
# every group, CUDA cores only at groups 1-2 (docs/gpu-runs.md).
TENSOR_CORE_MIN_GROUP = 4


def use_tensor_core_decode(group_size: int) -> bool:
    """Whether paged decode should run FlashInfer's tensor-core (prefill-kernel) path."""
    return group_size >= TENSOR_CORE_MIN_GROUP or group_size not in CUDA_CORE_DECODE_GROUPS


def real_rows_view(ctx: PagedIndptrs, num_rows: int) -> PagedIndptrs:
    """``ctx`` (host) with every padding row (index >= ``num_rows``) given no pages."""
    end = int(ctx.indptr[num_rows])
    indptr = ctx.indptr.clone()
    indptr[num_rows + 1:] = end
    last = ctx.last_page_len.clone()
    last[num_rows:] = 0
    lens = ctx.lens.clone()
    lens[num_rows:] = 0
    return PagedIndptrs(lens, indptr, ctx.indices[:end], last, ctx.table)


def with_token_padding_row(qo_indptr: torch.Tensor, padded_tokens: int) -> torch.Tensor:
    """[B + 1] host indptr -> [B + 2] with one more row holding the tokens past the last row."""
    tail = torch.tensor([padded_tokens], dtype=qo_indptr.dtype)
    return torch.cat((qo_indptr, tail))


def staged(current: torch.Tensor | None, value: torch.Tensor) -> torch.Tensor:
    """``value``, copied in place into ``current`` when the shapes match: kernels captured in a
    CUDA graph keep reading the tensor they were captured with."""
    if current is not None and current.shape == value.shape and current.device == value.device:
        return current.copy_(value)
    return value


def check_bucket(plan: StepPlan, bucket: Bucket | None, max_pages: int) -> None:
    """A plan for graph-ready wrappers must fill their bucket exactly, within ``max_pages``."""
    if bucket is None:
        return
    rows, tokens = plan.q_lens.shape[0], plan.positions.shape[0]
    pages = plan.context_host.indices.numel()
    if (rows, tokens) != (bucket.rows, bucket.tokens) or pages > max_pages:
        raise ValueError(f"step of {rows} rows, {tokens} tokens, {pages} pages does not fill "
                         f"the bucket {bucket} of {max_pages} pages")


def real_token_mask(plan: StepPlan) -> torch.Tensor:
    """[N] bool on the plan's device: tokens of real rows."""
    rows = plan.token_row
    return (rows >= 0) & (rows < plan.num_rows)


class _PlanFence:
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


class FlashInferGQABackend:
    """FlashInfer partials over this partner's slots of a ``GQAPool`` (see ``AttentionBackend``).

    Args:
        geometry: GQA shapes; ``head_dim == head_dim_v``.
        device: a CUDA device.
        dtype: query and pool dtype (bf16 or fp16; only bf16 kernels are prebuilt here).
        decode_tensor_cores: force the decode path; ``None`` decides from the context GQA group.
        graph_bucket: make the wrappers CUDA-graph ready with fixed buffers for this bucket
            (``torch_cp.graphs.Bucket``), holding up to ``graph_max_pages`` page ids.
    """

    name = "flashinfer"

    def __init__(self, geometry: AttentionGeometry, device: torch.device | str, *,
                 dtype: torch.dtype = torch.bfloat16, decode_tensor_cores: bool | None = None,
                 graph_bucket: Bucket | None = None, graph_max_pages: int = 0):
        import flashinfer

        problems = []
        if graph_bucket is not None and graph_max_pages < 1:
            problems.append(f"a graph bucket needs graph_max_pages >= 1, got {graph_max_pages}")
        if geometry.kind != "gqa":
            problems.append(f"geometry kind is {geometry.kind!r}, not 'gqa'")
        if geometry.head_dim != geometry.head_dim_v:
            problems.append(f"head_dim {geometry.head_dim} != head_dim_v {geometry.head_dim_v}")
        if geometry.context_q_heads % geometry.kv_heads or geometry.q_heads % geometry.kv_heads:
            problems.append("query heads must be a multiple of kv_heads")
        if problems:
            raise ValueError("FlashInferGQABackend: " + "; ".join(problems))
        self.geometry = geometry
        self.device = torch.device(device)
        self.dtype = dtype
        group = geometry.context_q_heads // geometry.kv_heads
        self.decode_tensor_cores = (use_tensor_core_decode(group) if decode_tensor_cores is None
                                    else decode_tensor_cores)
        self.graph_bucket = graph_bucket
        self.graph_max_pages = graph_max_pages
        self._workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        graph = self._graph_buffers(graph_bucket)
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self._workspace, "NHD", use_cuda_graph=graph is not None,
            use_tensor_cores=self.decode_tensor_cores, **(graph or {}).get("decode", {}))
        self._context = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self._workspace, "NHD", use_cuda_graph=graph is not None,
            **(graph or {}).get("context", {}))
        self._own = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(
            self._workspace, "NHD", use_cuda_graph=graph is not None,
            **(graph or {}).get("own", {}))
        self._fences = {name: _PlanFence(self.device) for name in ("decode", "context", "own")}
        self._plan: StepPlan | None = None
        self._padding: torch.Tensor | None = None  # [N, 1, 1] tokens of no real row

    def _graph_buffers(self, bucket: Bucket | None) -> dict | None:
        if bucket is None:
            return None
        pages = self.graph_max_pages
        i32 = dict(dtype=torch.int32, device=self.device)
        rows = bucket.rows + 1  # the token-padding row of multi-token steps
        return {
            "decode": dict(paged_kv_indptr_buffer=torch.zeros(bucket.rows + 1, **i32),
                           paged_kv_indices_buffer=torch.zeros(pages, **i32),
                           paged_kv_last_page_len_buffer=torch.zeros(bucket.rows, **i32)),
            "context": dict(qo_indptr_buf=torch.zeros(rows + 1, **i32),
                            paged_kv_indptr_buf=torch.zeros(rows + 1, **i32),
                            paged_kv_indices_buf=torch.zeros(pages, **i32),
                            paged_kv_last_page_len_buf=torch.zeros(rows, **i32)),
            "own": dict(qo_indptr_buf=torch.zeros(rows + 1, **i32),
                        kv_indptr_buf=torch.zeros(rows + 1, **i32)),
        }

    def plan(self, plan: StepPlan) -> None:
        """Plan the step's wrappers from host indptrs (no device sync)."""
        g = self.geometry
        check_bucket(plan, self.graph_bucket, self.graph_max_pages)
        ctx = real_rows_view(plan.context_host, plan.num_rows)
        # Page ids from the device: FlashInfer copies host ones with a blocking copy, which would
        # wait for the step launched ahead. The indptrs stay on the host, where its planner reads
        # them (pinned, so their copies do not wait).
        indices = plan.context.indices[: ctx.indices.numel()]
        common = dict(q_data_type=self.dtype, kv_data_type=self.dtype, sm_scale=g.scale)
        if plan.is_decode:
            self._fences["decode"].wait()
            self._decode.plan(ctx.indptr, indices, ctx.last_page_len, g.context_q_heads,
                              g.kv_heads, g.head_dim, plan.local_page_size, **common)
            self._fences["decode"].mark()
        else:
            qo = with_token_padding_row(plan.qo_indptr_host, plan.positions.shape[0])
            kv_indptr = torch.cat((ctx.indptr, ctx.indptr[-1:]))
            last = torch.cat((ctx.last_page_len, ctx.last_page_len.new_zeros(1)))
            self._fences["context"].wait()
            self._context.plan(qo, kv_indptr, indices, last, g.context_q_heads, g.kv_heads,
                               g.head_dim, plan.local_page_size, causal=False, **common)
            self._fences["context"].mark()
            self._fences["own"].wait()
            self._own.plan(qo, qo, g.q_heads, g.kv_heads, g.head_dim, head_dim_vo=g.head_dim_v,
                           causal=True, **common)
            self._fences["own"].mark()
            self._padding = staged(self._padding, ~real_token_mask(plan).view(-1, 1, 1))
        self._plan = plan

    def run_context(self, q: torch.Tensor, pool, layer_idx: int) -> Partial:
        """q [N, context_q_heads, head_dim] over this partner's slots -> Partial [N, H, D]."""
        assert self._plan is not None, "plan() must run before run_context()"
        wrapper = self._decode if self._plan.is_decode else self._context
        out, lse = wrapper.run(q.contiguous(), pool.layer(layer_idx), return_lse=True)
        return Partial(out, lse)

    def run_own(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Partial:
        """q [N, q_heads, D] over the step's own tokens of its row, causally."""
        assert self._plan is not None and not self._plan.is_decode, \
            "run_own() needs a planned multi-token step"
        k = k.masked_fill(self._padding, 0)
        v = v.masked_fill(self._padding, 0)
        out, lse = self._own.run(q.contiguous(), k, v, return_lse=True)
        return Partial(out, lse)
