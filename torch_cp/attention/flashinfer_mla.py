"""FlashInfer partial attention over a placed MLA latent pool (``BatchMLAPagedAttentionWrapper``).

The absorbed query ``q [N, H, kv_lora_rank + rope_dim]`` is passed as split views
``(q_nope, q_pe)`` and the pool as its ``(ckv, kpe)`` layer views, so nothing is copied. The
context partial is non-causal over context-only local lengths (a decode step's ``ctx + 1``,
written first). A multi-token step's own tokens run through a second MLA wrapper, causal, over a
page-size-1 view of the step's own ``ckv``/``kpe`` (page i is token i: zero copies, prebuilt
kernels, FA3 on Hopper). Where FlashInfer 0.7.2's causal MLA kernels would drop a key (its query
tile is not a multiple of the head count, e.g. 20 heads) the own tokens run in parts of
consecutive heads, each a power of two that divides the tile (20 as 16 + 4), every part reading
its heads of ``q`` in place and writing them into one output (the kernel takes strided queries
and outputs). ``own_tokens="torch"`` runs them on a chunked dense torch kernel instead.
Padding: see ``flashinfer_common``; what the planner accepts: ``mla_planner``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

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
from torch_cp.attention.mla_planner import (
    check_mla_work_items,
    max_own_parts,
    mixed_bucket_problems,
    own_parts_for,
)
from torch_cp.attention.partial import Partial
from torch_cp.plan import Bucket, StepPlan

LN2 = math.log(2.0)


def dense_own_mla(q: torch.Tensor, ckv: torch.Tensor, kpe: torch.Tensor, real: torch.Tensor,
                  token_row: torch.Tensor, scale: float, max_elements: int = 1 << 26,
                  bounds: list[int] | None = None) -> Partial:
    """Causal attention of each real token over its row's own tokens, in float32 chunks.

    Args:
        q: [N, H, R + rope]; ckv: [N, R]; kpe: [N, rope]; real: [N] bool; token_row: [N].
        bounds: the real rows' token bounds on the host (``qo_indptr``), when known: each chunk
            of a row's queries then scores that row's tokens only, not every packed token (a
            step of B equal rows does 1/B of the work). Without them (a captured step, whose
            rows change between replays) every chunk scores every token, masked.
    Returns:
        out [N, H, R] in q's dtype, lse [N, H] base 2 (0 and -inf for padding tokens).
    """
    n, h, _ = q.shape
    keys = torch.cat((ckv, kpe), -1).float().masked_fill(~real[:, None], 0)  # [N, R + rope]
    values = ckv.float().masked_fill(~real[:, None], 0)
    index = torch.arange(n, device=q.device)
    zero = torch.zeros((), dtype=torch.float32, device=q.device)
    spans = [(0, n, 0, n)] if bounds is None else [  # (queries, keys) of each row
        (a, b, a, b) for a, b in zip(bounds, bounds[1:]) if b > a]
    out = torch.zeros(n, h, ckv.shape[-1], dtype=q.dtype, device=q.device)
    lse_nh = torch.full((n, h), float("-inf"), dtype=torch.float32, device=q.device)
    for q_start, q_end, k_start, k_end in spans:
        chunk = max(1, max_elements // max(1, h * (k_end - k_start)))
        for start in range(q_start, q_end, chunk):
            rows = slice(start, min(q_end, start + chunk))
            cols = slice(k_start, k_end)
            scores = torch.einsum("chd,nd->chn", q[rows].float(), keys[cols]) * scale
            visible = ((token_row[None, cols] == token_row[rows, None])
                       & (index[None, cols] <= index[rows, None]) & real[rows, None])
            scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
            lse = torch.logsumexp(scores, -1)  # [C, H]
            finite = torch.isfinite(lse)
            probs = torch.exp(scores - torch.where(finite, lse, zero).unsqueeze(-1))
            out[rows] = torch.where(finite.unsqueeze(-1),
                                    torch.einsum("chn,nr->chr", probs, values[cols]),
                                    zero).to(q.dtype)
            lse_nh[rows] = lse / LN2
    return Partial(out, lse_nh)


class FlashInferMLABackend(FlashInferBackend):
    """FlashInfer partials over this partner's slots of an ``MLAPool`` (see ``AttentionBackend``).

    Args:
        geometry: absorbed MLA shapes (``head_dim = kv_lora_rank + rope_dim``).
        device: a CUDA device.
        dtype: query and pool dtype.
        fa_backend: FlashInfer MLA backend, ``"fa3"`` on Hopper and ``"fa2"`` elsewhere by default.
        own_tokens: ``"auto"`` (FlashInfer, the heads in parts where it would not plan causal
            MLA exactly, ``own_token_parts``) or ``"torch"``.
    """

    def __init__(self, geometry: AttentionGeometry, device: torch.device | str, *,
                 dtype: torch.dtype = torch.bfloat16, fa_backend: str | None = None,
                 own_tokens: str = "auto"):
        problems = []
        if geometry.kind != "mla":
            problems.append(f"geometry kind is {geometry.kind!r}, not 'mla'")
        if geometry.head_dim != geometry.kv_lora_rank + geometry.rope_dim:
            problems.append(f"head_dim {geometry.head_dim} != kv_lora_rank + rope_dim")
        if own_tokens not in ("auto", "torch"):
            problems.append(f"own_tokens must be 'auto' or 'torch', "
                            f"got {own_tokens!r}")
        if problems:
            raise ValueError("FlashInferMLABackend: " + "; ".join(problems))
        props = torch.cuda.get_device_properties(torch.device(device))
        self.num_sms = props.multi_processor_count
        self.fa_backend = fa_backend or ("fa3" if props.major == 9 else "fa2")
        self.own_tokens = own_tokens
        super().__init__(geometry, device, dtype)

    def make_kernels(self, bucket: Bucket | None) -> _MLAKernels:
        return _MLAKernels(self, bucket)

    def mixed_bucket_problems(self, shapes: Sequence[tuple[int, int]]) -> list[str]:
        """``mixed_bucket_problems`` for this backend (``Engine`` asks before allocating), for
        the context's heads and, where the own tokens run on FlashInfer, theirs (a captured
        step's rows and tokens are the bucket's, so its capture step decides)."""
        g = self.geometry
        problems = []
        for rows, tokens in shapes:
            own = own_parts_for(self.own_tokens, [0] * rows + [tokens], g.q_heads) or (0,)
            problems += mixed_bucket_problems([(rows, tokens)], max(g.context_q_heads, *own),
                                              self.num_sms)
        return problems


class _MLAKernels:
    """The wrappers of one step shape: eager (``bucket`` None) or graph-ready for ``bucket``.
    One context wrapper per step kind: their indptrs differ by the token-padding row."""

    def __init__(self, backend: FlashInferMLABackend, bucket: Bucket | None):
        from flashinfer.mla import BatchMLAPagedAttentionWrapper, MLAPlanMetadata

        self.geometry, self.dtype = backend.geometry, backend.dtype
        self.num_sms, self.own_tokens = backend.num_sms, backend.own_tokens
        self._metadata = MLAPlanMetadata
        names = ("decode", "context") + tuple(
            _own_wrapper(i) for i in range(max_own_parts(backend.geometry.q_heads)))
        buffers = _graph_buffers(bucket, names, backend.device) if bucket is not None else {}
        self._wrappers = {
            name: BatchMLAPagedAttentionWrapper(
                backend.workspace, use_cuda_graph=bucket is not None,
                backend=backend.fa_backend, **buffers.get(name, {}))
            for name in names}
        self._fences = {name: PlanFence(backend.device) for name in self._wrappers}
        self._is_decode = self._attends_context = True
        self._own_parts: tuple[int, ...] | None = None  # own tokens' head parts; None: torch
        self._real: torch.Tensor | None = None  # [N] tokens of real rows
        self._padding: torch.Tensor | None = None  # [N, 1] the others
        self._token_row: torch.Tensor | None = None  # [N] plan.token_row
        self._eager = bucket is None
        self._bounds: list[int] | None = None  # an eager step's row bounds (host)

    def _plan_wrapper(self, name: str, qo: torch.Tensor, kv_indptr: torch.Tensor,
                      kv_indices: torch.Tensor, kv_lens: torch.Tensor, num_heads: int,
                      page_size: int, causal: bool) -> None:
        g = self.geometry
        self._fences[name].wait()
        self._wrappers[name].plan(
            metadata=self._metadata.csr(qo, kv_indptr, kv_indices, kv_lens),
            num_heads=num_heads, head_dim_ckv=g.kv_lora_rank, head_dim_kpe=g.rope_dim,
            page_size=page_size, causal=causal, sm_scale=g.scale, q_data_type=self.dtype,
            kv_data_type=self.dtype, query_layout="split", kv_cache_layout="split",
            lse_mode="base2")
        self._fences[name].mark()

    def plan(self, plan: StepPlan) -> None:
        """Plan the step from host indptrs; ``PlannerCapExceeded`` before planning anything."""
        g = self.geometry
        if plan.is_decode:
            qo, ctx = plan.qo_indptr_host, plan.context_host
        else:
            qo, ctx = with_token_padding_row(plan)
        q_lens_t = (qo[1:] - qo[:-1]).to(torch.int32)
        q_lens = q_lens_t.tolist()
        if plan.attends_context:  # a step of fresh rows runs its own tokens only
            check_mla_work_items(q_lens, g.context_q_heads, self.num_sms, plan.num_rows)
        own_parts = None if plan.is_decode else own_parts_for(self.own_tokens, q_lens, g.q_heads)
        for heads in set(own_parts or ()):
            check_mla_work_items(q_lens, heads, self.num_sms, plan.num_rows)
        if plan.attends_context:
            name = "decode" if plan.is_decode else "context"
            self._plan_wrapper(name, qo, ctx.indptr, ctx.indices, ctx.lens, g.context_q_heads,
                               plan.local_page_size, causal=False)
        if own_parts:
            tokens = torch.arange(int(qo[-1]), dtype=torch.int32)
            for i, heads in enumerate(own_parts):
                self._plan_wrapper(_own_wrapper(i), qo, qo, tokens, q_lens_t, heads, 1, causal=True)
        self._own_parts = own_parts
        if not plan.is_decode:  # in place: captured kernels keep reading these tensors
            self._real = staged(self._real, real_token_mask(plan))
            self._padding = (staged(self._padding, ~self._real.unsqueeze(-1))
                             if has_padding(plan) else None)
            self._token_row = staged(self._token_row, plan.token_row)
            if self._eager:  # a captured step's rows change between replays: no host bounds
                self._bounds = plan.qo_indptr_host[: plan.num_rows + 1].tolist()
        self._is_decode, self._attends_context = plan.is_decode, plan.attends_context

    def _split(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        r = self.geometry.kv_lora_rank
        return q[..., :r], q[..., r:]

    def run_context(self, q: torch.Tensor, caches: list[torch.Tensor], layer_idx: int
                    ) -> Partial:
        """q [N, context_q_heads, R + rope] over this partner's slots -> Partial [N, H, R]."""
        assert self._attends_context, "a step of fresh rows plans no context kernel"
        wrapper = self._wrappers["decode" if self._is_decode else "context"]
        ckv, kpe = caches
        out, lse = wrapper.run(query=self._split(q), kv_cache=(ckv[layer_idx], kpe[layer_idx]),
                               return_lse=True)
        return Partial(out, lse)

    def run_own(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Partial:
        """q [N, q_heads, R + rope] over own tokens, causally; k = ckv [N, R], v = kpe [N, rope]."""
        assert not self._is_decode, "run_own() needs a planned multi-token step"
        if self._own_parts is None:
            return dense_own_mla(q, k, v, self._real, self._token_row, self.geometry.scale,
                                 bounds=self._bounds)
        if self._padding is not None:
            k, v = k.masked_fill(self._padding, 0), v.masked_fill(self._padding, 0)
        ckv, kpe = k.unsqueeze(1), v.unsqueeze(1)  # [N, 1, R]: page i holds token i
        out = q.new_empty(q.shape[0], q.shape[1], self.geometry.kv_lora_rank)
        lses, start = [], 0
        for i, heads in enumerate(self._own_parts):
            part = slice(start, start + heads)
            wrapper = self._wrappers[_own_wrapper(i)]
            _, lse = wrapper.run(query=self._split(q[:, part]), kv_cache=(ckv, kpe),
                                 out=out[:, part], return_lse=True)
            lses.append(lse)
            start += heads
        return Partial(out, lses[0] if len(lses) == 1 else torch.cat(lses, 1))


def _own_wrapper(part: int) -> str:
    """The name of the wrapper of the own tokens' ``part``-th heads."""
    return f"own{part}"


def _graph_buffers(bucket: Bucket, names: Sequence[str], device: torch.device) -> dict:
    """Fixed plan buffers of a bucket's wrappers ``names`` (multi-token steps: one more row,
    the token padding's)."""
    def csr(rows: int, indices: int) -> dict:
        i32 = dict(dtype=torch.int32, device=device)
        return dict(qo_indptr=torch.zeros(rows + 1, **i32),
                    kv_indptr=torch.zeros(rows + 1, **i32),
                    kv_indices=torch.zeros(indices, **i32),
                    kv_len_arr=torch.zeros(rows, **i32))

    sizes = {"decode": (bucket.rows, bucket.max_pages),
             "context": (bucket.rows + 1, bucket.max_pages)}
    own = (bucket.rows + 1, bucket.tokens)  # every own-token part's wrapper
    return {name: csr(*sizes.get(name, own)) for name in names}
