"""FlashInfer GQA and MLA backends, placed over P = 1, 2, 4 partners on one GPU (gpu_harness).

Oracle: the torch reference backend with one partner holding everything (dense attention in
float32). Also compared with unplaced FlashInfer. Tolerances (bf16, 8 significant bits, one step
is 2^-8 = 3.9e-3 relative): FlashInfer rounds probabilities to bf16 before P @ V and every partial
output to bf16 before the merge, the reference rounds once; outputs are of order 1, so a few
steps: atol = rtol = 2e-2. LSE is float32 from exact bf16 products in both: atol = rtol = 2e-3.
The last test (CPU) checks the harness's exchange itself with the torch backend in float32.
"""

import dataclasses

import pytest
import torch
from gpu_harness import MLA16, QWEN3, QWEN3_TP, Batch, Shape, make_inputs, run_placed

from torch_cp.attention.partial import Partial
from torch_cp.attention.torch_ref import TorchBackend

OUT_TOL = dict(atol=2e-2, rtol=2e-2)
LSE_TOL = dict(atol=2e-3, rtol=2e-3)
SIZES = [1, 2, 4]

# decode rows: contexts below P (empty stripes), not page multiples, long
DECODE = Batch(q_lens=(1,) * 7, ctx_lens=(0, 1, 2, 3, 17, 100, 700))
# mixed: decode rows, prefill rows, extend rows, rows shorter than P, odd lengths
MIXED = Batch(q_lens=(1, 37, 9, 1, 2, 64, 1, 130), ctx_lens=(250, 0, 50, 2, 1, 0, 0, 333))
BATCHES = {"decode": DECODE, "mixed": MIXED}
CASES = [(QWEN3, "sp"), (QWEN3_TP, "tp"), (MLA16, "sp"), (MLA16, "tp")]
CASE_IDS = ["gqa-sp", "gqa-tp", "mla-sp", "mla-tp"]


def flashinfer_backend(**options):
    from torch_cp.attention.flashinfer_gqa import FlashInferGQABackend
    from torch_cp.attention.flashinfer_mla import FlashInferMLABackend

    def make(geometry):
        if geometry.kind == "gqa":  # FlashInfer's decode unless a test asks for another
            return FlashInferGQABackend(geometry, "cuda", dtype=torch.bfloat16,
                                        **{"decode_kernel": "flashinfer", **options})
        return FlashInferMLABackend(geometry, "cuda", dtype=torch.bfloat16, **options)
    return make


def tp_shape(shape: Shape, size: int) -> Shape:
    """TP mode: each of the P partners owns shape.q_heads query heads of one KV head."""
    return Shape(shape.kind, shape.q_heads * size, shape.kv_heads, shape.head_dim,
                 shape.head_dim_v, shape.rope_dim)


def reference(shape, batch, inputs, dtype=torch.bfloat16):
    return run_placed(TorchBackend, shape, 1, "sp", batch, inputs, dtype).merged


def assert_close_real(got, want, tokens, out_tol=OUT_TOL, lse_tol=LSE_TOL, what=""):
    def msg(text):
        return f"{what}: {text}" if what else text
    torch.testing.assert_close(got.out[:tokens].float(), want.out[:tokens].float(), **out_tol,
                               msg=msg)
    torch.testing.assert_close(got.lse[:tokens], want.lse[:tokens], **lse_tol, msg=msg)


@pytest.mark.gpu
@pytest.mark.parametrize("batch", list(BATCHES), ids=list(BATCHES))
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("shape,mode", CASES, ids=CASE_IDS)
def test_placed_flashinfer_matches_reference_and_unplaced(shape, mode, size, batch):
    shape = tp_shape(shape, size) if mode == "tp" else shape
    batch = BATCHES[batch]
    inputs = make_inputs(shape, batch, torch.bfloat16, "cuda", seed=size)
    got = run_placed(flashinfer_backend(), shape, size, mode, batch, inputs)
    assert torch.isfinite(got.merged.out[:inputs.num_tokens]).all()
    assert_close_real(got.merged, reference(shape, batch, inputs), inputs.num_tokens)
    unplaced = run_placed(flashinfer_backend(), shape, 1, mode, batch, inputs)
    assert_close_real(got.merged, unplaced.merged, inputs.num_tokens)


@pytest.mark.gpu
@pytest.mark.parametrize("tensor_cores", [False, True])
def test_gqa_decode_both_kernels(tensor_cores):
    inputs = make_inputs(QWEN3, DECODE, torch.bfloat16, "cuda", seed=3)
    got = run_placed(flashinfer_backend(decode_tensor_cores=tensor_cores), QWEN3, 2, "sp",
                     DECODE, inputs)
    assert_close_real(got.merged, reference(QWEN3, DECODE, inputs), inputs.num_tokens)


@pytest.mark.gpu
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("shape,mode", CASES[:2], ids=CASE_IDS[:2])
def test_gqa_decode_on_the_triton_kernels(shape, mode, size, monkeypatch):
    """``decode_kernel="triton"`` (attention/triton_decode.py): the reference's partials, placed
    and merged, at P = 1, 2, 4 in both modes."""
    shape = tp_shape(shape, size) if mode == "tp" else shape
    from torch_cp.attention import triton_decode

    calls = []
    decode = triton_decode.decode
    monkeypatch.setattr(triton_decode, "decode", lambda *a: calls.append(1) or decode(*a))
    inputs = make_inputs(shape, DECODE, torch.bfloat16, "cuda", seed=size)
    got = run_placed(flashinfer_backend(decode_kernel="triton"), shape, size, mode, DECODE,
                     inputs)
    assert_close_real(got.merged, reference(shape, DECODE, inputs), inputs.num_tokens)
    assert calls, "decode ran on the Triton kernels"


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [Batch(q_lens=(1,), ctx_lens=(700,)), DECODE],
                         ids=["one-token", "seven-tokens"])
def test_auto_decode_takes_triton_for_one_token_steps_only(batch, monkeypatch):
    """``decode_kernel="auto"``: a one-token decode step on the Triton kernels (at their
    one-token tile), a longer one on FlashInfer's; both the reference's partials."""
    from torch_cp.attention import flashinfer_gqa, triton_decode

    calls = []
    decode = triton_decode.decode
    monkeypatch.setattr(triton_decode, "decode", lambda *a: calls.append(a[-3:]) or decode(*a))
    inputs = make_inputs(QWEN3, batch, torch.bfloat16, "cuda", seed=5)
    got = run_placed(flashinfer_backend(decode_kernel="auto"), QWEN3, 1, "sp", batch, inputs)
    assert_close_real(got.merged, reference(QWEN3, batch, inputs), inputs.num_tokens)
    one_token = inputs.num_tokens <= flashinfer_gqa.TRITON_STEP_TOKENS
    block_n, warps, _, stages = triton_decode.ONE_TOKEN_TILE
    assert calls == ([(block_n, warps, stages)] if one_token else [])


@pytest.mark.gpu
@pytest.mark.parametrize("size", [1, 2])
def test_a_large_gqa_group_plans_within_its_workspace(size):
    """GLM-4-32B's attention (48 query heads over 2 KV heads, group 24): split-KV scratch for
    a 32k-token row passes the default 128 MiB workspace (``workspace_bytes`` sizes it). Decode
    runs on tensor cores: FlashInfer's CUDA-core decode has no group 24 (run 66: "Unsupported
    group_size: 24"; forcing it is refused, ``test_flashinfer_gqa.py``)."""
    shape = Shape("gqa", 48, 2, 128, 128)
    batch = Batch(q_lens=(1,) * 4, ctx_lens=(32768, 5000, 17, 0))
    inputs = make_inputs(shape, batch, torch.bfloat16, "cuda", seed=24)
    got = run_placed(flashinfer_backend(), shape, size, "sp", batch, inputs)
    assert_close_real(got.merged, reference(shape, batch, inputs), inputs.num_tokens)


@pytest.mark.gpu
@pytest.mark.parametrize("own_tokens", ["torch", "auto"])
@pytest.mark.parametrize("heads", [16, 20, 40, 5, 10])
def test_mla_own_token_paths(heads, own_tokens, monkeypatch):
    """20, 40, 5 and 10 heads (GLM-4.7-Flash whole, and at TP 4 and 2): FlashInfer 0.7.2 cannot
    plan causal MLA exactly at MIXED's query tile (128); "auto" runs them as 16 + 4, 32 + 8,
    4 + 1 and 8 + 2, each part's queries read and outputs written in place. Which kernel ran is
    checked too."""
    from torch_cp.attention import flashinfer_mla

    dense = flashinfer_mla.dense_own_mla
    calls = []
    monkeypatch.setattr(flashinfer_mla, "dense_own_mla",
                        lambda *a, **k: calls.append(1) or dense(*a, **k))
    shape = Shape("mla", heads, 1, 576, 512, 64)
    inputs = make_inputs(shape, MIXED, torch.bfloat16, "cuda", seed=heads)
    got = run_placed(flashinfer_backend(own_tokens=own_tokens), shape, 2, "sp", MIXED, inputs)
    assert_close_real(got.merged, reference(shape, MIXED, inputs), inputs.num_tokens)
    on_torch = own_tokens == "torch"
    assert bool(calls) == on_torch, f"own tokens ran on {'torch' if calls else 'FlashInfer'}"


@pytest.mark.gpu
@pytest.mark.parametrize("shape,mode", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("batch", list(BATCHES), ids=list(BATCHES))
def test_empty_stripes_are_zero_and_minus_inf(batch, shape, mode):
    """P = 4 partners over rows this short: partner r holds nothing of a row of <= r tokens."""
    short = (Batch((1, 1, 1, 1), (0, 1, 2, 3)) if batch == "decode"
             else Batch((3, 1, 2), (0, 2, 1)))
    size = 4
    shape = tp_shape(shape, size) if mode == "tp" else shape
    inputs = make_inputs(shape, short, torch.bfloat16, "cuda", seed=5)
    got = run_placed(flashinfer_backend(), shape, size, mode, short, inputs)
    empties = 0
    for partial, plan in zip(got.context, got.plans, strict=True):
        rows = plan.token_row[:inputs.num_tokens]
        empty = plan.context.lens[rows] == 0
        empties += int(empty.sum())
        assert not partial.out.isnan().any() and not partial.lse.isnan().any()
        assert (partial.out[:inputs.num_tokens][empty] == 0).all()
        assert (partial.lse[:inputs.num_tokens][empty] == float("-inf")).all()
        assert torch.isfinite(partial.lse[:inputs.num_tokens][~empty]).all()
    assert empties >= 3 and bool((got.plans[-1].context.lens[: len(short.q_lens)] == 0).any())
    assert_close_real(got.merged, reference(shape, short, inputs), inputs.num_tokens)


NAN_CASES = [(QWEN3, "sp"), (QWEN3_TP, "tp"), (MLA16, "sp"), (MLA16, "tp")]


@pytest.mark.gpu
@pytest.mark.parametrize("bucket", ["decode", "prefill"])
@pytest.mark.parametrize("shape,mode", NAN_CASES, ids=CASE_IDS)
def test_nan_in_padding_reaches_no_real_row(shape, mode, bucket):
    """Padding rows and padding tokens with NaN queries, keys and values (written to the sink
    page): real rows are bitwise those of finite padding, and close to the unpadded step."""
    size = 2
    shape = tp_shape(shape, size) if mode == "tp" else shape
    if bucket == "decode":
        plain = DECODE
        padded = DECODE.padded(rows=len(DECODE.q_lens) + 5, tokens=None)
    else:
        plain = MIXED
        padded = MIXED.padded(rows=len(MIXED.q_lens) + 2, tokens=sum(MIXED.q_lens) + 13)
    runs = {}
    for name, batch, nan in (("plain", plain, False), ("finite", padded, False),
                             ("nan", padded, True)):
        inputs = make_inputs(shape, batch, torch.bfloat16, "cuda", seed=11, nan_padding=nan)
        runs[name] = run_placed(flashinfer_backend(), shape, size, mode, batch, inputs).merged
        tokens = inputs.num_tokens
    if bucket == "decode":
        assert runs["nan"].out.shape[0] == len(DECODE.q_lens) + 5
    else:
        assert runs["nan"].out.shape[0] == sum(MIXED.q_lens) + 13
    assert torch.isfinite(runs["nan"].out[:tokens]).all()
    assert torch.equal(runs["nan"].out[:tokens], runs["finite"].out[:tokens])
    assert torch.equal(runs["nan"].lse[:tokens], runs["finite"].lse[:tokens])
    assert_close_real(runs["nan"], runs["plain"], tokens)


@pytest.mark.gpu
def test_mla_work_items_bound_flashinfer_planner():
    """The query-length bound is >= FlashInfer's own count for any KV lengths, within clusters."""
    from flashinfer.mla._batch_mla._backends._fa_common import _fa_plan_work_count

    from torch_cp.attention.mla_planner import mla_work_items

    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    gen = torch.Generator().manual_seed(0)
    for trial in range(300):
        rows = int(torch.randint(1, 40, (1,), generator=gen))
        top = [2, 40, 600, 5000][trial % 4]
        q_lens = torch.randint(0, top, (rows,), generator=gen).tolist()
        q_lens[0] = max(q_lens[0], 1)
        kv_lens = (torch.randint(0, 20000, (rows,), generator=gen)
                   * torch.randint(0, 2, (rows,), generator=gen)).tolist()
        heads = [16, 20, 32, 64, 128][trial % 5]
        bound = mla_work_items(q_lens, heads, num_sms)
        for causal in (False, True):
            kv = [max(k, q) for k, q in zip(kv_lens, q_lens, strict=True)] if causal else kv_lens
            try:
                count = _fa_plan_work_count(q_lens, kv, heads, num_sms, causal)
            except ValueError:  # FlashInfer's early refusal: tiles alone exceed its cap
                assert bound > 16384
                continue
            assert count <= bound <= count + num_sms, (q_lens, kv, heads, causal)


@pytest.mark.gpu
def test_mla_step_past_the_cap_is_refused_before_planning():
    from torch_cp.attention.mla_planner import FA_MAX_WORK_ITEMS, PlannerCapExceeded
    from torch_cp.plan import build_step_plan

    backend = flashinfer_backend()(_mla_geometry(128))
    rows = 140  # 140 rows x 1024 tokens x 128 heads / 128-row tiles = 143360 tiles
    plan = build_step_plan([1024] * rows, [0] * rows, [[i * 64 + j for j in range(64)]
                                                       for i in range(rows)],
                           page_size=16, sink_page=rows * 64, device="cuda")
    with pytest.raises(PlannerCapExceeded) as info:
        backend.plan(plan)
    assert info.value.work_items > FA_MAX_WORK_ITEMS == info.value.cap
    assert info.value.num_rows == rows
    small = build_step_plan([1024] * 8, [0] * 8, [[i * 64 + j for j in range(64)]
                                                  for i in range(8)],
                            page_size=16, sink_page=rows * 64, device="cuda")
    backend.plan(small)  # 8 x 1024 tokens fit


def _mla_geometry(heads):
    from torch_cp.attention.backend import AttentionGeometry
    return AttentionGeometry("mla", heads, 1, 576, 512, 192 ** -0.5, heads, rope_dim=64)


@pytest.mark.parametrize("mode", ["sp", "tp"])
def test_harness_exchange_with_torch_backend_on_cpu(mode):
    """Placed torch reference (P = 2, 4) through the harness equals one partner (float32).
    TP-mode partners share their one KV head; SP-mode partners hold all of them."""
    shape = Shape("gqa", 8, 1 if mode == "tp" else 2, 16, 16)
    batch = Batch(q_lens=(1, 5, 3, 1), ctx_lens=(9, 0, 6, 2), page_size=4,
                  pad_rows_to=5, pad_tokens_to=12)
    inputs = make_inputs(shape, batch, torch.float32, "cpu", seed=2)
    want = run_placed(TorchBackend, shape, 1, mode, batch, inputs, torch.float32).merged
    for size in (2, 4):
        got = run_placed(TorchBackend, shape, size, mode, batch, inputs, torch.float32).merged
        n = inputs.num_tokens
        torch.testing.assert_close(got.out[:n], want.out[:n], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got.lse[:n], want.lse[:n], atol=1e-5, rtol=1e-5)


def test_forced_cuda_core_decode_of_a_group_it_lacks_is_refused_on_cpu():
    """Before any allocation, with every problem named: FlashInfer's CUDA-core decode has no
    group 24 (run 66: "Unsupported group_size: 24" from inside its planner)."""
    from torch_cp.attention.backend import AttentionGeometry
    from torch_cp.attention.flashinfer_gqa import FlashInferGQABackend

    geometry = AttentionGeometry("gqa", 48, 2, 128, 64, 128 ** -0.5, 48)
    with pytest.raises(ValueError, match="head_dim 128 != head_dim_v 64.*not 24"):
        FlashInferGQABackend(geometry, "cpu", decode_tensor_cores=False)


def test_a_decode_kernel_that_cannot_run_is_refused_on_cpu():
    """Before any allocation: an unknown decode kernel, and the Triton kernels ("triton" or
    "auto") for a head size they do not take."""
    pytest.importorskip("triton")
    from torch_cp.attention.backend import AttentionGeometry
    from torch_cp.attention.flashinfer_gqa import FlashInferGQABackend

    geometry = AttentionGeometry("gqa", 8, 2, 96, 96, 96 ** -0.5, 8)
    with pytest.raises(ValueError, match="must be one of"):
        FlashInferGQABackend(geometry, "cpu", decode_kernel="cuda")
    for kernel in ("triton", "auto"):
        with pytest.raises(ValueError, match=f"decode_kernel='{kernel}' \\(Triton\\) takes"):
            FlashInferGQABackend(geometry, "cpu", decode_kernel=kernel)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [QWEN3, MLA16], ids=["gqa", "mla"])
def test_auto_picks_flashinfer_on_this_gpu(shape):
    from gpu_harness import geometry_for

    from torch_cp.attention.select import make_backend

    backend = make_backend("auto", geometry_for(shape, 1, "sp"), "cuda")
    assert backend.name == "flashinfer"
    assert type(backend).__name__.startswith("FlashInfer")


@pytest.mark.gpu
@pytest.mark.parametrize("step", ["decode", "prefill"])
@pytest.mark.parametrize("kind", ["gqa", "mla", "mla20", "gqa-triton"])
def test_graph_bucket_wrappers_replay_like_eager(kind, step):
    """Wrappers made for a bucket (use_cuda_graph=True, fixed buffers): run_* captured once,
    re-planned outside the graph for two steps of different lengths, replayed; equal to eager
    within bf16 tolerance (the graph plans split KV differently). Planning never synchronizes
    (it runs while the step launched before it executes). ``gqa-triton``: decode steps on
    torch_cp's Triton kernels, graph-ready and eager alike. ``mla20``: 20 heads, whose own
    tokens run as 16 + 4 (``mla_planner.own_token_parts``), both parts captured."""
    from gpu_harness import GROUP, geometry_for

    options = {}
    if kind == "gqa-triton":
        if step == "prefill":
            pytest.skip("the Triton kernels run decode steps only")
        kind, options = "gqa", dict(decode_kernel="triton")

    from torch_cp.kv.pool import GQAPool, MLAPool
    from torch_cp.placement import ContextParallel
    from torch_cp.plan import Bucket, build_step_plan

    shape = {"gqa": QWEN3, "mla": MLA16, "mla20": Shape("mla", 20, 1, 576, 512, 64)}[kind]
    cp = ContextParallel(2, 1, "sp", GROUP)  # partner 1 of 2: some stripes are empty
    if step == "decode":
        steps = [((1,) * 5, (3, 40, 100, 0, 17)), ((1,) * 7, (200, 1, 2, 50, 9, 0, 31))]
        bucket = Bucket(rows=8, tokens=8, max_pages=128)
    else:
        steps = [((5, 20, 1), (0, 33, 70)), ((30, 1, 9, 2), (12, 0, 150, 1))]
        bucket = Bucket(rows=8, tokens=64, max_pages=128)
    gen = torch.Generator().manual_seed(0)
    if kind == "gqa":
        pool = GQAPool(1, 128, 16, shape.kv_heads, shape.head_dim, cp, torch.bfloat16, "cuda")
        pool.kv.copy_(torch.randn(pool.kv.shape, generator=gen))
        k_shape, v_shape = (shape.kv_heads, shape.head_dim), (shape.kv_heads, shape.head_dim)
    else:
        pool = MLAPool(1, 128, 16, 512, 64, cp, torch.bfloat16, "cuda")
        pool.ckv.copy_(torch.randn(pool.ckv.shape, generator=gen))
        pool.kpe.copy_(torch.randn(pool.kpe.shape, generator=gen))
        k_shape, v_shape = (512,), (64,)
    plans = []
    for q_lens, ctx_lens in steps:
        pages = torch.randperm(128, generator=gen).tolist()
        tables, at = [], 0
        for q, c in zip(q_lens, ctx_lens, strict=True):
            n = -(-(q + c) // 16)
            tables.append(pages[at:at + n])
            at += n
        plans.append(build_step_plan(q_lens, ctx_lens, tables, page_size=16, sink_page=128,
                                     placement=cp, device="cuda", bucket=bucket))
    n = bucket.tokens
    q = torch.zeros(n, shape.q_heads, shape.head_dim, dtype=torch.bfloat16, device="cuda")
    k = torch.zeros(n, *k_shape, dtype=torch.bfloat16, device="cuda")
    v = torch.zeros(n, *v_shape, dtype=torch.bfloat16, device="cuda")

    def fill():
        for t in (q, k, v):
            t.copy_(torch.randn(t.shape, generator=gen))

    geometry = geometry_for(shape, 1, "sp")
    graphed = flashinfer_backend(**options)(geometry)
    graphed.add_bucket(bucket)
    eager = flashinfer_backend(**options)(geometry)

    def run(backend):
        parts = [backend.run_context(q, pool.tensors, 0)]
        if step == "prefill":
            parts.append(backend.run_own(q, k, v))
        return parts

    fill()
    graphed.plan(plans[0])
    run(graphed)  # load the kernels outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run(graphed)
    for index, plan in enumerate(plans):
        torch.cuda.set_sync_debug_mode("error")  # planning must not wait for the device
        try:
            graphed.plan(plan)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        fill()
        graph.replay()
        replayed = [Partial(p.out.clone(), p.lse.clone()) for p in captured]
        direct = run(graphed)  # the graph-ready wrappers, not captured
        eager.plan(dataclasses.replace(plan, bucket=None))  # the same padded step, eagerly
        for part, got, uncaptured, want in zip(("context", "own"), replayed, direct, run(eager)):
            assert_close_real(uncaptured, want, plan.num_tokens,
                              what=f"step {index} {part} uncaptured")
            assert_close_real(got, want, plan.num_tokens, what=f"step {index} {part} replayed")
