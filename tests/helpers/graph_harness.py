"""A patched model with its pool and captured buckets, and the check that replays equal eager
steps with NaN padding kept out (one GPU: tests/graphs/test_graphs_gpu.py; over NCCL:
tests/helpers/nccl_checks.py)."""

from __future__ import annotations

import contextlib

import torch
from gpu_models import MODELS

from torch_cp import PagedKVCache, patch_model
from torch_cp.graphs import CUDAGraphRunner, compiled_layers, default_buckets
from torch_cp.kv import PageAllocator
from torch_cp.plan import build_step_plan

PAGE = 16
NAN_ID = 319  # the tiny model's last token id; its embedding is set to NaN in the padding check


class Harness:
    """A patched model, its pool and captured buckets. With ``mesh`` the model is patched for
    context parallelism in ``mode`` (every rank of the mesh builds its own Harness)."""

    def __init__(self, backend: str, dtype: torch.dtype, compile_layers: bool = False,
                 model: str = "qwen3", mesh=None, mode: str = "tp"):
        self.model = MODELS[model](dtype).cuda()
        patch_model(self.model, context_parallel=mesh is not None, mesh=mesh, mode=mode,
                    backend=backend, page_size=PAGE)
        self.placement = self.model.torch_cp.placement
        self.cache = PagedKVCache.for_model(self.model, num_pages=64)
        self.alloc = PageAllocator(64, PAGE)
        buckets = (default_buckets(max_rows=2, table_width=8) if compile_layers
                   else default_buckets(max_rows=8, table_width=8, mixed=[(4, 64)]))
        self.runner = CUDAGraphRunner(self.model, self.cache, buckets)
        with compiled_layers(self.model) if compile_layers else contextlib.nullcontext():
            self.runner.capture()
        self.kwarg = self.runner.cache_kwarg

    def eager(self, token_ids, q_lens, ctx_lens, tables, logit_rows):
        plan = build_step_plan(q_lens, ctx_lens, tables, page_size=PAGE,
                               sink_page=self.cache.pool.sink_page, placement=self.placement,
                               device="cuda")
        self.cache.begin_step(plan)
        ends = plan.qo_indptr_host[1:].long() - 1
        with torch.inference_mode():
            out = self.model(input_ids=torch.tensor([token_ids], device="cuda"),
                             position_ids=plan.positions[None], use_cache=False,
                             logits_to_keep=ends[list(logit_rows)].cuda(),
                             **{self.kwarg: self.cache})
        return out.logits[0].float()


def check_replay_and_padding(h: Harness, atol: float) -> None:
    """Replays equal eager steps (extend and decode), and NaN padding never reaches a real row.
    Over several partners every rank runs it with the same inputs (tests/nccl_checks.py)."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (5, 17, 33)]
    rows = range(len(prompts))
    for r, p in zip(rows, prompts):
        assert h.alloc.reserve(r, len(p) + 40)
    tables = [h.alloc.table(r) for r in rows]
    # Prefill two rows eagerly, extend the third in a captured mixed step after its first half.
    logits = h.eager(prompts[0] + prompts[1], [5, 17], [0, 0], tables[:2], [0, 1])
    half = prompts[2][:16]
    h.eager(half, [16], [0], tables[2:], [0])
    rest = prompts[2][16:]
    graph = h.runner.step(rest, [len(rest)], [16], tables[2:], [0])
    eager = h.eager(rest, [len(rest)], [16], tables[2:], [0])
    assert graph is not None, "the extend step fits the (4, 64) mixed bucket"
    torch.testing.assert_close(graph.float(), eager, atol=atol, rtol=0)
    seqs = [list(p) for p in prompts]
    nxt = logits.argmax(-1).tolist() + eager.argmax(-1).tolist()
    for _ in range(6):  # decode: 3 real rows in the 4-row bucket, one padding row
        for s, t in zip(seqs, nxt):
            s.append(t)
        ctx = [len(s) - 1 for s in seqs]
        step = dict(token_ids=nxt, q_lens=[1, 1, 1], ctx_lens=ctx, tables=tables,
                    logit_rows=[0, 1, 2])
        eager = h.eager(**step)
        graph = h.runner.step(**step)
        assert graph is not None
        torch.testing.assert_close(graph.float(), eager, atol=atol, rtol=0)
        assert graph.argmax(-1).tolist() == eager.argmax(-1).tolist()
        nxt = graph.argmax(-1).tolist()

    # Padding tokens whose embedding is NaN: their queries, keys and values (written to the sink
    # page, which padding rows attend) are NaN. Real rows stay bit-identical to finite padding,
    # in a decode bucket with a padding row and in a mixed bucket with padding tokens.
    with torch.no_grad():
        h.model.get_input_embeddings().weight[NAN_ID] = float("nan")
    for s, t in zip(seqs, nxt):
        s.append(t)
    decode = dict(token_ids=nxt, q_lens=[1, 1, 1], ctx_lens=[len(s) - 1 for s in seqs],
                  tables=tables, logit_rows=[0, 1, 2])
    extend = dict(token_ids=[7, 8, 9, 10, 11], q_lens=[2, 3], ctx_lens=[len(s) for s in seqs[:2]],
                  tables=tables[:2], logit_rows=[0, 1])
    for step in (decode, extend):
        h.runner.pad_token_id = 1
        finite = h.runner.step(**step).clone()
        h.runner.pad_token_id = NAN_ID
        poisoned = h.runner.step(**step).clone()
        assert torch.isfinite(poisoned).all(), "NaN padding reached a real row"
        assert torch.equal(poisoned, finite)
        torch.testing.assert_close(poisoned.float(), h.eager(**step), atol=atol, rtol=0)
