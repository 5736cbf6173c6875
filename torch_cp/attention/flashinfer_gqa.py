"""FlashInfer partial attention over a placed GQA pool (paged decode, paged + ragged prefill).

A decode step attends the pool only (the new token is written first), through
``BatchDecodeWithPagedKVCacheWrapper`` (or, with ``decode_kernel="triton"``, torch_cp's chunked
Triton kernels, ``triton_decode``; with ``"auto"``, those for steps of one token). Any other
step attends the cached context through
``BatchPrefillWithPagedKVCacheWrapper`` (non-causal, context-only lengths) and its own tokens
through ``BatchPrefillWithRaggedKVCacheWrapper`` (causal, ``qo_indptr == kv_indptr``); the module
merges the two partials. Every kernel returns base-2 LSE; empty rows give out 0 and lse -inf.
Padding: see ``flashinfer_common``.
"""

from __future__ import annotations

import torch

from torch_cp.attention.backend import AttentionGeometry
from torch_cp.attention.flashinfer_common import (
    FlashInferBackend,
    PlanFence,
    has_padding,
    real_token_mask,
    staged,
    with_token_padding_row,
)
from torch_cp.attention.partial import Partial
from torch_cp.plan import Bucket, StepPlan

GQA_HEAD_DIMS = (64, 128, 256)  # FlashInfer kernels prebuilt in the device bundle
CUDA_CORE_DECODE_GROUPS = (1, 2, 3, 4, 6, 8, 16)  # FlashInfer's decode dispatch
# Tensor-core decode from this GQA group size up: on an H200 it reaches the copy roofline at
# every group, CUDA cores only at groups 1-2 (docs/gpu-runs.md).
TENSOR_CORE_MIN_GROUP = 4
# Decode steps' kernel: FlashInfer's, torch_cp's chunked Triton kernels ("triton",
# triton_decode.py), or "auto": the Triton kernels for steps of at most TRITON_STEP_TOKENS
# tokens whose rows hold at most TRITON_MAX_CONTEXT of this partner's slots (a captured bucket:
# its table width, which no row of it outgrows; an eager step: its widest row), FlashInfer's
# otherwise. On an H200 in a CUDA graph, four layers' KV in turn (run 91), the one-token tile
# against FlashInfer for one row of Qwen3-8B / Qwen3-30B-A3B's layer: 6.9 / 6.5 against
# 9.6 / 10.0 us at 512 slots, 18.4 / 11.6 against 14.5 / 11.9 at 4096, 99 / 56 against 42 / 28
# at 32768; at 32-64 rows FlashInfer wins (runs 81, 87). End to end, 256-token calls at
# prompt 512 x 1, the fastest of five (run 96): Qwen3-30B-A3B 260 against 242 tokens/s (3.67
# against 3.85 ms a step, every call 63-83 ms shorter), Qwen3-8B 191 against 188 (5.12 against
# 5.24 ms; that cell printed only); so "auto".
DECODE_KERNEL = "auto"
DECODE_KERNELS = ("flashinfer", "triton", "auto")
TRITON_STEP_TOKENS = 1
TRITON_MAX_CONTEXT = 1024  # between the timed 512 (a win) and 4096 (a loss for Qwen3-8B)


def use_tensor_core_decode(group_size: int) -> bool:
    """Whether paged decode should run FlashInfer's tensor-core (prefill-kernel) path."""
    return group_size >= TENSOR_CORE_MIN_GROUP or group_size not in CUDA_CORE_DECODE_GROUPS


class FlashInferGQABackend(FlashInferBackend):
    """FlashInfer partials over this partner's slots of a ``GQAPool`` (see ``AttentionBackend``).

    Args:
        geometry: GQA shapes; ``head_dim == head_dim_v``.
        device: a CUDA device.
        dtype: query and pool dtype (bf16 or fp16; only bf16 kernels are prebuilt here).
        decode_tensor_cores: force the decode path; ``None`` decides from the context GQA group.
        decode_kernel: ``"flashinfer"``, ``"triton"`` (``triton_decode``) or ``"auto"`` (Triton for
            decode steps of at most ``TRITON_STEP_TOKENS`` tokens over rows of at most
            ``TRITON_MAX_CONTEXT`` of this partner's slots) for decode steps; ``None``:
            ``DECODE_KERNEL`` where the Triton kernels take the shapes, else FlashInfer's.
    """

    def __init__(self, geometry: AttentionGeometry, device: torch.device | str, *,
                 dtype: torch.dtype = torch.bfloat16, decode_tensor_cores: bool | None = None,
                 decode_kernel: str | None = None):
        problems = []
        if decode_kernel is None:  # the default, where the Triton kernels take the shapes
            decode_kernel = (DECODE_KERNEL if DECODE_KERNEL == "flashinfer"
                             or _triton_decode_takes(geometry) else "flashinfer")
        if decode_kernel not in DECODE_KERNELS:
            problems.append(f"decode_kernel must be one of {DECODE_KERNELS}, got "
                            f"{decode_kernel!r}")
        elif decode_kernel != "flashinfer" and not _triton_decode_takes(geometry):
            problems.append(f"decode_kernel={decode_kernel!r} (Triton) takes head_dim a power "
                            f"of two from 16 to 256 and GQA groups up to 64, not head_dim "
                            f"{geometry.head_dim}, group "
                            f"{geometry.context_q_heads // max(geometry.kv_heads, 1)}")
        if geometry.kind != "gqa":
            problems.append(f"geometry kind is {geometry.kind!r}, not 'gqa'")
        if geometry.head_dim != geometry.head_dim_v:
            problems.append(f"head_dim {geometry.head_dim} != head_dim_v {geometry.head_dim_v}")
        if geometry.context_q_heads % geometry.kv_heads or geometry.q_heads % geometry.kv_heads:
            problems.append("query heads must be a multiple of kv_heads")
        group = geometry.context_q_heads // geometry.kv_heads
        if decode_tensor_cores is False and group not in CUDA_CORE_DECODE_GROUPS:
            problems.append(f"decode_tensor_cores=False: FlashInfer's CUDA-core decode takes GQA "
                            f"groups {CUDA_CORE_DECODE_GROUPS}, not {group} (leave it None)")
        if problems:
            raise ValueError("FlashInferGQABackend: " + "; ".join(problems))
        self.decode_tensor_cores = (use_tensor_core_decode(group) if decode_tensor_cores is None
                                    else decode_tensor_cores)
        self.decode_kernel = decode_kernel
        super().__init__(geometry, device, dtype)

    def make_kernels(self, bucket: Bucket | None) -> _GQAKernels:
        return _GQAKernels(self, bucket)


class _GQAKernels:
    """The wrappers of one step shape: eager (``bucket`` None) or graph-ready for ``bucket``."""

    def __init__(self, backend: FlashInferGQABackend, bucket: Bucket | None):
        import flashinfer

        self.geometry, self.dtype = backend.geometry, backend.dtype
        graph = bucket is not None
        buffers = _graph_buffers(bucket, backend.device) if graph else {}
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            backend.workspace, "NHD", use_cuda_graph=graph,
            use_tensor_cores=backend.decode_tensor_cores, **buffers.get("decode", {}))
        self._context = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            backend.workspace, "NHD", use_cuda_graph=graph, **buffers.get("context", {}))
        self._own = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(
            backend.workspace, "NHD", use_cuda_graph=graph, **buffers.get("own", {}))
        self._fences = {name: PlanFence(backend.device) for name in ("decode", "context", "own")}
        self._is_decode = self._attends_context = True
        self._padding: torch.Tensor | None = None  # [N, 1, 1] tokens of no real row
        self._triton_decode = None
        if backend.decode_kernel != "flashinfer":
            from torch_cp.attention import triton_decode

            self._triton_decode = triton_decode
        self._always_triton = backend.decode_kernel == "triton"
        self._num_sms = backend.num_sms
        # A Triton decode step's tables, copied in place at each plan like FlashInfer's buffers
        # (captured kernels keep reading these tensors): [B, width], [B], [N]; its tile and work
        # items. A bucket's decode steps keep the kernel and tile of its first (the captured
        # ones), whatever the module settings say later; eager steps choose at each plan.
        self._table = self._lens = self._token_row = None
        self._on_triton, self._tile, self._spare = False, None, 0
        self._keeps_choice, self._chosen = graph, None

    def plan(self, plan: StepPlan) -> None:
        """Plan the step's wrappers from host indptrs (no device sync)."""
        g = self.geometry
        # Page ids from the device: FlashInfer copies host ones with a blocking copy, which would
        # wait for the step launched ahead. The indptrs stay on the host, where its planner reads
        # them (pinned, so their copies do not wait).
        indices = plan.page_ids
        common = dict(q_data_type=self.dtype, kv_data_type=self.dtype, sm_scale=g.scale)
        tokens = plan.positions.shape[0]
        pages = plan.bucket.table_width if plan.bucket is not None else plan.context.table.shape[1]
        width = pages * plan.local_page_size  # slots a row can hold
        self._on_triton, self._tile = self._decode_choice(plan.is_decode, tokens, width)
        if self._on_triton:
            table = plan.context.table
            if plan.bucket is not None and table.shape[1] < pages:
                # A bucket's plan not loaded into its static buffers is only as wide as its
                # longest row: staged at the bucket's width, the kernels a graph captured keep
                # their tensor and row stride.
                table = torch.nn.functional.pad(table, (0, pages - table.shape[1]),
                                                value=plan.sink_page)
            self._table = staged(self._table, table)
            self._lens = staged(self._lens, plan.context.lens)
            self._token_row = staged(self._token_row, plan.token_row)
            self._spare = self._triton_decode.spare_items(tokens, g.kv_heads, self._num_sms,
                                                          self._tile[2])
        elif plan.is_decode:
            ctx = plan.context_host
            self._fences["decode"].wait()
            self._decode.plan(ctx.indptr, indices, ctx.last_page_len, g.context_q_heads,
                              g.kv_heads, g.head_dim, plan.local_page_size, **common)
            self._fences["decode"].mark()
        else:
            qo, ctx = with_token_padding_row(plan)
            if plan.attends_context:  # a step of fresh rows runs its own tokens only
                self._fences["context"].wait()
                self._context.plan(qo, ctx.indptr, indices, ctx.last_page_len,
                                   g.context_q_heads, g.kv_heads, g.head_dim,
                                   plan.local_page_size, causal=False, **common)
                self._fences["context"].mark()
            self._fences["own"].wait()
            self._own.plan(qo, qo, g.q_heads, g.kv_heads, g.head_dim, head_dim_vo=g.head_dim_v,
                           causal=True, **common)
            self._fences["own"].mark()
            self._padding = (staged(self._padding, ~real_token_mask(plan).view(-1, 1, 1))
                             if has_padding(plan) else None)
        self._is_decode, self._attends_context = plan.is_decode, plan.attends_context

    def _decode_choice(self, is_decode: bool, tokens: int, width: int
                       ) -> tuple[bool, tuple | None]:
        """Whether a step of ``tokens`` over rows of up to ``width`` slots runs the Triton
        decode, and its tile (see ``__init__``)."""
        if not is_decode or self._triton_decode is None:
            return False, None
        if self._keeps_choice and self._chosen is not None:
            return self._chosen
        on_triton = self._always_triton or (tokens <= TRITON_STEP_TOKENS
                                             and width <= TRITON_MAX_CONTEXT)
        choice = on_triton, self._triton_decode.tile_for(tokens) if on_triton else None
        if self._keeps_choice:
            self._chosen = choice
        return choice

    def run_context(self, q: torch.Tensor, caches: list[torch.Tensor], layer_idx: int
                    ) -> Partial:
        """q [N, context_q_heads, head_dim] over this partner's slots -> Partial [N, H, D]."""
        assert self._attends_context, "a step of fresh rows plans no context kernel"
        if self._on_triton:
            block_n, warps, _, stages = self._tile
            return Partial(*self._triton_decode.decode(
                q, caches[0][layer_idx], self._table, self._lens, self._token_row,
                self.geometry.scale, self._spare, block_n, warps, stages))
        wrapper = self._decode if self._is_decode else self._context
        out, lse = wrapper.run(q.contiguous(), caches[0][layer_idx], return_lse=True)
        return Partial(out, lse)

    def run_own(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Partial:
        """q [N, q_heads, D] over the step's own tokens of its row, causally."""
        assert not self._is_decode, "run_own() needs a planned multi-token step"
        if self._padding is not None:
            k = k.masked_fill(self._padding, 0)
            v = v.masked_fill(self._padding, 0)
        # v may be a view of the fused q/k/v GEMM's output (fused_linear.py).
        out, lse = self._own.run(q.contiguous(), k.contiguous(), v.contiguous(), return_lse=True)
        return Partial(out, lse)


def _triton_decode_takes(geometry: AttentionGeometry) -> bool:
    try:
        from torch_cp.attention import triton_decode
    except ImportError:  # no Triton
        return False
    return triton_decode.supported(geometry.head_dim,
                                   geometry.context_q_heads // max(geometry.kv_heads, 1))


def _graph_buffers(bucket: Bucket, device: torch.device) -> dict:
    """Fixed plan buffers of a bucket's wrappers (multi-token steps: one more row, the token
    padding's)."""
    i32 = dict(dtype=torch.int32, device=device)
    rows, pages = bucket.rows + 1, bucket.max_pages
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
