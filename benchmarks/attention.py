"""Decode attention: the placed pool against unplaced FlashInfer, on one GPU.

For each shape (``gqa``: Qwen3-8B's GQA layer; ``gqa8``: Qwen3-30B-A3B's, GQA group 8; ``mla``:
an MLA layer with a 512/64 latent) and batch x context: unplaced FlashInfer paged decode (the
kernel a user would call), torch_cp's per-partner context attention over one partner's stripe of
a placed pool (rank 0, the longest stripe) at P = 1, 2, 4, the merge of P partials (torch_cp's
and FlashInfer's ``merge_states``), and torch_cp's whole layer path at P = 1 (write + attend;
P = 1 has nothing to merge), eager and replayed from a CUDA graph. KV bytes read per second are
set against the device-to-device copy bandwidth measured in the same run.

    python -m benchmarks.attention --out benchmarks/results/attention.json
    python -m benchmarks.attention --smoke          # CPU, tiny sizes, torch backend
"""

from __future__ import annotations

import argparse
import math

import torch

from benchmarks.common import (
    Budget,
    Results,
    copy_bandwidth,
    free_cuda,
    graph_time_ms,
    kernel_times,
    run_header,
    table,
    time_ms,
)
from torch_cp.attention.backend import AttentionGeometry
from torch_cp.attention.exchange import Exchange
from torch_cp.attention.module import ContextParallelAttention
from torch_cp.attention.partial import merge_partials
from torch_cp.attention.select import make_backend
from torch_cp.kv.pool import GQAPool, MLAPool
from torch_cp.placement import ContextParallel
from torch_cp.plan import Bucket, build_step_plan

GROUP = object()  # one partner measured alone: the partners' process group is never used
PAGE = 16
DTYPE = torch.bfloat16
GQA = dict(kind="gqa", q_heads=32, kv_heads=8, head_dim=128)  # Qwen3-8B layer
GQA8 = dict(GQA, kv_heads=4)  # Qwen3-30B-A3B layer: GQA group 8
MLA = dict(kind="mla", q_heads=32, kv_heads=1, head_dim=576, rank=512, rope=64)
SIZES = ((64, 8192), (8, 32768), (128, 2048))
SMOKE_SIZES = ((4, 64), (2, 100))
PARTNERS = (1, 2, 4)


def geometry(shape: dict) -> AttentionGeometry:
    if shape["kind"] == "gqa":
        d = shape["head_dim"]
        return AttentionGeometry("gqa", shape["q_heads"], shape["kv_heads"], d, d, d ** -0.5,
                                 context_q_heads=shape["q_heads"])
    return AttentionGeometry("mla", shape["q_heads"], 1, shape["head_dim"], shape["rank"],
                             192 ** -0.5, context_q_heads=shape["q_heads"], rope_dim=shape["rope"])


def kv_bytes_per_token(shape: dict) -> int:
    if shape["kind"] == "gqa":
        return 2 * shape["kv_heads"] * shape["head_dim"] * DTYPE.itemsize
    return shape["head_dim"] * DTYPE.itemsize


def page_tables(batch: int, ctx: int, seed: int = 0) -> tuple[list[list[int]], int]:
    """Each row's logical pages for ``ctx`` tokens, shuffled over the pool (as after churn)."""
    per_row = math.ceil(ctx / PAGE)
    order = torch.randperm(batch * per_row, generator=torch.Generator().manual_seed(seed))
    return order.view(batch, per_row).tolist(), batch * per_row


def unplaced_flashinfer(shape: dict, batch: int, ctx: int, tables, num_pages: int,
                        device) -> dict:
    """FlashInfer's own paged decode over an ordinary (unplaced) page-16 cache."""
    import flashinfer

    per_row = len(tables[0])
    indptr = torch.arange(batch + 1, dtype=torch.int32) * per_row
    indices = torch.tensor(tables, dtype=torch.int32).flatten()
    last = torch.full((batch,), ctx - (per_row - 1) * PAGE, dtype=torch.int32)
    workspace = torch.zeros(128 << 20, dtype=torch.uint8, device=device)
    h, out = shape["q_heads"], {}
    if shape["kind"] == "gqa":
        hkv, d = shape["kv_heads"], shape["head_dim"]
        kv = torch.empty(num_pages, 2, PAGE, hkv, d, dtype=DTYPE, device=device).normal_()
        q = torch.randn(batch, h, d, dtype=DTYPE, device=device)
        kernels = {}
        for tc in (True, False):
            name = "tensor_cores" if tc else "cuda_cores"
            w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD",
                                                              use_tensor_cores=tc)
            want = None
            # FlashInfer 0.7's plan takes disable_split_kv through **kwargs: try it.
            for no_split in (False, True):
                try:
                    w.plan(indptr, indices, last, h, hkv, d, PAGE, q_data_type=DTYPE,
                           kv_data_type=DTYPE, **({"disable_split_kv": True} if no_split else {}))
                except TypeError:
                    continue
                got = w.run(q, kv)
                if want is None:
                    want = got
                    out[name] = time_ms(lambda w=w: w.run(q, kv), device)
                torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)
                kernels[name + ("_no_split" if no_split else "")] = kernel_ms(
                    lambda w=w: w.run(q, kv), device)
        out["kernel_ms"] = kernels
        return out
    from flashinfer.mla import BatchMLAPagedAttentionWrapper, MLAPlanMetadata

    r, rope = shape["rank"], shape["rope"]
    ckv = torch.empty(num_pages, PAGE, r, dtype=DTYPE, device=device).normal_()
    kpe = torch.empty(num_pages, PAGE, rope, dtype=DTYPE, device=device).normal_()
    q_nope = torch.randn(batch, h, r, dtype=DTYPE, device=device)
    q_pe = torch.randn(batch, h, rope, dtype=DTYPE, device=device)
    qo = torch.arange(batch + 1, dtype=torch.int32)
    lens = torch.full((batch,), ctx, dtype=torch.int32)
    for fa in ("fa3", "fa2"):
        w = BatchMLAPagedAttentionWrapper(workspace, backend=fa)
        w.plan(metadata=MLAPlanMetadata.csr(qo, indptr, indices, lens), num_heads=h,
               head_dim_ckv=r, head_dim_kpe=rope, page_size=PAGE, causal=False,
               sm_scale=192 ** -0.5, q_data_type=DTYPE, kv_data_type=DTYPE,
               query_layout="split", kv_cache_layout="split")
        out[fa] = time_ms(lambda w=w: w.run(query=(q_nope, q_pe), kv_cache=(ckv, kpe)), device)
    return out


def kernel_ms(fn, device, calls: int = 20) -> float:
    """GPU kernel time of one call of ``fn`` (the profiler's kernel durations summed over
    ``calls`` calls): what the call costs inside a captured step, without its launch overhead,
    which at batch 1 is larger than the kernels."""
    fn()

    def repeated():
        for _ in range(calls):
            fn()

    return sum(ms for ms, _ in kernel_times(repeated, device).values()) / calls


def new_pool(shape: dict, num_pages: int, cp: ContextParallel, device):
    if shape["kind"] == "gqa":
        pool = GQAPool(1, num_pages, PAGE, shape["kv_heads"], shape["head_dim"], cp, DTYPE,
                       device)
        pool.kv.normal_()
    else:
        pool = MLAPool(1, num_pages, PAGE, shape["rank"], shape["rope"], cp, DTYPE, device)
        pool.ckv.normal_()
        pool.kpe.normal_()
    return pool


def new_tokens(shape: dict, batch: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's new K/V (MLA: ckv, kpe) for the whole-path write."""
    if shape["kind"] == "gqa":
        size = (batch, shape["kv_heads"], shape["head_dim"])
        return torch.randn(size, dtype=DTYPE, device=device), torch.randn(size, dtype=DTYPE,
                                                                           device=device)
    return (torch.randn(batch, shape["rank"], dtype=DTYPE, device=device),
            torch.randn(batch, shape["rope"], dtype=DTYPE, device=device))


def placed(shape: dict, batch: int, ctx: int, tables, num_pages: int, size: int, backend_name,
           device, smoke: bool) -> dict:
    """One partner (rank 0) of ``size``: its context attention, and at P = 1 the whole path."""
    import time

    cp = ContextParallel(size, 0, "sp", GROUP if size > 1 else None)
    # A decode step writes its token first and attends ctx + 1 tokens: ctx - 1 cached + 1 new.
    plan = build_step_plan([1] * batch, [ctx - 1] * batch, tables, page_size=PAGE,
                           sink_page=num_pages, placement=cp, device=device)
    pool = new_pool(shape, num_pages, cp, device)
    geo = geometry(shape)
    backend = make_backend(backend_name, geo, device, DTYPE)
    t0 = time.perf_counter()
    for _ in range(3):
        backend.plan(plan)
    out = dict(plan_host_ms=(time.perf_counter() - t0) * 1e3 / 3)
    q = torch.randn(batch, geo.q_heads, geo.head_dim, dtype=DTYPE, device=device)
    out["ms"] = time_ms(lambda: backend.run_context(q, pool.tensors, 0), device)
    local = int(plan.context_host.lens.to(torch.int64).sum())
    out["kv_bytes"] = local * kv_bytes_per_token(shape)
    if size == 1:
        module = ContextParallelAttention(0, backend, Exchange(cp))
        k_new, v_new = new_tokens(shape, batch, device)
        out["whole_eager_ms"] = time_ms(lambda: module(q, k_new, v_new, pool, plan), device)
        if device.type == "cuda":
            bucket = Bucket(batch, batch, batch * len(tables[0]))
            backend.add_bucket(bucket)
            graph_plan = build_step_plan([1] * batch, [ctx - 1] * batch, tables, page_size=PAGE,
                                         sink_page=num_pages, placement=cp, device=device,
                                         bucket=bucket)
            backend.plan(graph_plan)
            out["whole_graph_ms"] = graph_time_ms(
                lambda: module(q, k_new, v_new, pool, graph_plan), device)
    return out


def merges(shape: dict, batch: int, size: int, device) -> dict:
    """Merging ``size`` partials of [batch, heads, Dv]: torch_cp's merge, FlashInfer's."""
    h, dv = shape["q_heads"], shape["rank"] if shape["kind"] == "mla" else shape["head_dim"]
    outs = torch.randn(size, batch, h, dv, dtype=DTYPE, device=device)
    lses = torch.randn(size, batch, h, dtype=torch.float32, device=device) * 4
    res = dict(eager_ms=time_ms(lambda: merge_partials(outs, lses), device))
    if device.type == "cuda":
        res["graph_ms"] = graph_time_ms(lambda: merge_partials(outs, lses), device)
        import flashinfer

        v, s = outs.transpose(0, 1).contiguous(), lses.transpose(0, 1).contiguous()
        res["flashinfer_ms"] = time_ms(lambda: flashinfer.merge_states(v, s), device)
        res["flashinfer_graph_ms"] = graph_time_ms(lambda: flashinfer.merge_states(v, s), device)
    return res


def run_case(shape: dict, batch: int, ctx: int, copy_bw: float, device, smoke: bool) -> dict:
    tables, num_pages = page_tables(batch, ctx)
    rec = dict(shape=shape["kind"], batch=batch, ctx=ctx, page=PAGE, dtype=str(DTYPE),
               copy_tb_s=copy_bw / 1e12, **{k: v for k, v in shape.items() if k != "kind"})
    if not smoke:
        rec["unplaced"] = unplaced_flashinfer(shape, batch, ctx, tables, num_pages, device)
        free_cuda(device)
    backend_name = "torch" if smoke else "flashinfer"
    rec["placed"] = {}
    for size in PARTNERS:
        rec["placed"][size] = placed(shape, batch, ctx, tables, num_pages, size, backend_name,
                                     device, smoke)
        if size > 1:
            rec["placed"][size]["merge"] = merges(shape, batch, size, device)
        free_cuda(device)
    base = (min(v for v in rec["unplaced"].values() if isinstance(v, float)) if not smoke
            else rec["placed"][1]["ms"])
    rec["unplaced_best_ms"] = base
    rec["unplaced_kv_tb_s"] = batch * ctx * kv_bytes_per_token(shape) / (base * 1e-3) / 1e12
    for size, p in rec["placed"].items():
        p["kv_tb_s"] = p["kv_bytes"] / (p["ms"] * 1e-3) / 1e12
        p["kv_over_copy"] = p["kv_tb_s"] * 1e12 / copy_bw
        p["ratio_to_ideal"] = p["ms"] / (base / size)  # 1.0: exactly 1/P of the unplaced time
    return rec


def summary(records: list[dict]) -> str:
    rows = []
    for r in records:
        p = r["placed"]
        row = {"shape": r["shape"], "batch x ctx": f"{r['batch']}x{r['ctx']}",
               "unplaced ms": r["unplaced_best_ms"], "KV TB/s": r["unplaced_kv_tb_s"],
               "KV/copy": r["unplaced_kv_tb_s"] * 1e12 / (r["copy_tb_s"] * 1e12)}
        for size in (2, 4):
            row[f"P={size} ms"] = p[size]["ms"]
            row[f"P={size} ratio"] = p[size]["ratio_to_ideal"]
            m = p[size]["merge"]
            row[f"merge{size} us"] = 1e3 * m.get("graph_ms", m["eager_ms"])
        row["whole P=1 ms"] = p[1].get("whole_graph_ms", p[1]["whole_eager_ms"])
        rows.append(row)
    return table(rows, list(rows[0]) if rows else [])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="JSON results path")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny sizes, torch backend")
    ap.add_argument("--budget-s", type=float, default=240.0, help="skip cases past this")
    ap.add_argument("--shapes", default="gqa,mla")
    ap.add_argument("--sizes", default=None,
                    help="batch x context cases, e.g. '1x512,1x4096,32x512' (default: SIZES)")
    args = ap.parse_args(argv)
    smoke = args.smoke
    device = torch.device("cpu" if smoke else "cuda")
    torch.manual_seed(0)
    budget = Budget(args.budget_s)
    results = Results(args.out, run_header(device))
    copy_bw = copy_bandwidth(device)
    results.data["copy_tb_s"] = copy_bw / 1e12
    shapes = {"gqa": GQA, "gqa8": GQA8, "mla": MLA}
    if smoke:
        shapes = {"gqa": dict(GQA, q_heads=4, kv_heads=2, head_dim=16),
                  "gqa8": dict(GQA, q_heads=8, kv_heads=1, head_dim=16),
                  "mla": dict(MLA, q_heads=4, head_dim=40, rank=32, rope=8)}
    records = []
    for name in args.shapes.split(","):
        sizes = SMOKE_SIZES if smoke else SIZES
        if args.sizes:
            sizes = [tuple(map(int, case.split("x"))) for case in args.sizes.split(",")]
        for batch, ctx in sizes:
            if not budget.allows(20):
                results.add(shape=name, batch=batch, ctx=ctx, skipped="time budget")
                continue
            rec = dict(run_case(shapes[name], batch, ctx, copy_bw, device, smoke), shape=name)
            records.append(results.add(**rec))
            print(f"{name} {batch}x{ctx}: unplaced {rec['unplaced_best_ms']:.3f} ms, "
                  + ", ".join(f"P={s} {p['ms']:.3f} ms" for s, p in rec["placed"].items()),
                  flush=True)
    print(f"\ncopy bandwidth {copy_bw / 1e12:.2f} TB/s (read + written); ratio = per-partner "
          f"time / (unplaced time / P)")
    print(summary(records))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
