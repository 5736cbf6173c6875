"""Decode at long context: P = 1 on one GPU against P partners over NCCL, in one torchrun job.

    torchrun --standalone --nproc-per-node 2 -m benchmarks.long_context \
        --out benchmarks/results/long_context.json

Models (random bf16 weights, ``benchmarks.models``): Qwen3-8B's shape in SP mode (sp = world:
every rank holds the whole model and 1/P of every request's KV), the 8B MLA model in TP mode
(tp = world: weights split, the latent striped over all TP ranks) and, with ``--models
qwen3_5``, Qwen3.5-9B's hybrid shape in SP mode (its linear-attention state whole on every
partner, its full-attention KV striped). One job runs one P: P = 1
with one process, else P = world; each job appends its records to ``--out``, so run P = 1 and
P = 2 one after the other (a fresh process each, so that neither inherits the other's memory):

    for p in 1 2; do torchrun --standalone --nproc-per-node $p -m benchmarks.long_context \
        --out benchmarks/results/long_context.json; done

Each run reports:

- the largest context one request can hold: the pool pages that fit in 90% of the memory free
  after the model is loaded, times the page size (allocated, then freed);
- per (context, batch): the decode step time (CUDA-graph replay after host planning, the greedy
  token back on the host: what ``generate`` does per step), or why it does not fit; and the
  same with each step planned and launched before the host waits for the previous step's token
  (``step_ms_overlap``: ``Engine(overlap_planning=True)``'s steady state);
- the exchange's share of the step: CUDA time of NCCL kernels per step (torch.profiler over
  replays) against the step time. NCCL kernels wait for the slowest partner, so this counts the
  partners' skew as exchange time.

``--smoke`` runs tiny models on the CPU (gloo, torch backend, eager steps) as a dry run.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

import torch_cp
from benchmarks import models
from benchmarks.common import Results, appending_results, free_cuda, table, torchrun_setup
from torch_cp.engine.memory import pool_bytes_per_page
from torch_cp.engine.sampling import greedy_tokens
from torch_cp.engine.scheduler import Row
from torch_cp.engine.steps import LaunchedStep

PAGE = 16
SETUPS = {"qwen3": "sp", "mla": "tp", "qwen3_5": "sp"}  # Qwen3.5's 4 KV heads: SP mode at P = 2


def capacity_tokens(model, device, reserve_gib: float) -> int:
    """Tokens of the largest pool that fits in 90% of free memory less ``reserve_gib``."""
    runtime = model.torch_cp
    per_page = pool_bytes_per_page(runtime, PAGE)
    if device.type != "cuda":
        return 0
    free_cuda(device)
    free, _ = torch.cuda.mem_get_info(device)
    pages = int(0.9 * free - reserve_gib * 2**30) // per_page - 1
    pool = runtime.new_pool(pages, PAGE)  # shows that it is allocatable
    del pool
    return pages * PAGE


class Decoder:
    """One engine (pool and captured buckets) sized for the largest fitting shape."""

    def __init__(self, model, num_pages: int, max_batch: int, max_context: int, graphs: bool,
                 compile: bool = False):
        self.engine = torch_cp.Engine(model, num_pages, PAGE, max_rows=max_batch,
                                      cuda_graphs=graphs, compile=compile and graphs,
                                      max_pages_per_row=-(-(max_context + 64) // PAGE))
        self.replayed = False  # whether the last step replayed a CUDA graph

    def step_fn(self, batch: int, context: int):
        """A decode step of ``batch`` rows at ``context`` tokens (the pool holds zeros: the
        kernels read the same bytes whatever the values)."""
        e = self.engine
        for row in range(batch):
            assert e.allocator.reserve(row, context + 1)
            if e.state is not None:  # a hybrid model's linear-attention state slot
                e.allocator.take_state_slot(row)
        tables = [e.allocator.table_tensor(row) for row in range(batch)]
        slots = [e.allocator.state_slot(row) for row in range(batch)] if e.state else None
        ids, rows = [1] * batch, list(range(batch))
        following = [Row(row, context, 1, samples=True) for row in range(batch)]

        def step() -> LaunchedStep:
            planned = e.launcher.plan(following, tables, slots)
            self.replayed = planned.plan.bucket is not None
            launched = LaunchedStep(following, rows, e.launcher.launch(planned, ids, rows))
            launched.send_ids_home(greedy_tokens(launched.logits))
            return launched

        def release():
            for row in range(batch):
                e.allocator.release(row)

        return step, release


def time_steps(step, device, iters: int, overlap: bool) -> float:
    """ms per step; ``overlap``: each step is planned and launched before the host waits for
    the previous one's tokens (``Engine(overlap_planning=True)``), else the host waits for
    each step's own tokens before planning the next."""
    for _ in range(3):
        step().host_ids()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    previous = None
    for _ in range(iters):
        launched = step()
        (previous if overlap and previous is not None else launched).host_ids()
        previous = launched
    previous.host_ids()
    return (time.perf_counter() - start) * 1e3 / iters


def nccl_ms_per_step(step, device, iters: int = 5) -> float | None:
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            step()
        torch.cuda.synchronize(device)
    us = sum(e.self_device_time_total for e in prof.key_averages()
             if "nccl" in e.key.lower())
    return us / 1e3 / iters


def run_p(name: str, p: int, mesh, args, device, results: Results, rank: int) -> list[dict]:
    dtype = torch.float32 if args.smoke else torch.bfloat16
    start = time.perf_counter()
    model = models.build(name, device, dtype, smoke=args.smoke)
    if rank == 0:
        print(f"{name}: built in {time.perf_counter() - start:.0f} s", flush=True)
    mode = SETUPS[name]
    if p > 1:
        torch_cp.patch_model(model, context_parallel=True, mesh=mesh, mode=mode,
                             backend=args.backend, page_size=PAGE)
    else:
        torch_cp.patch_model(model, backend=args.backend, page_size=PAGE)
    # Captured buckets, activations and logits need memory beside the pool.
    capacity = capacity_tokens(model, device, reserve_gib=args.reserve_gib)
    need = {(c, b): b * -(-(c + 1) // PAGE) for c in args.contexts for b in args.batches}
    fits = {k: v for k, v in need.items() if v * PAGE <= capacity or device.type != "cuda"}
    records = []
    base = dict(model=name, mode=mode if p > 1 else "-", P=p, compiled=args.compile,
                capacity_tokens=capacity, weight_bytes=models.weight_bytes_read(model))
    if fits:
        start = time.perf_counter()
        decoder = Decoder(model, max(fits.values()), max(b for _, b in fits),
                          max(c for c, _ in fits), graphs=device.type == "cuda",
                          compile=args.compile)
        if rank == 0:
            print(f"{name}: engine and capture in {time.perf_counter() - start:.0f} s",
                  flush=True)
        base["kv_bytes_per_rank_per_token"] = decoder.engine.kv_bytes / (
            (decoder.engine.allocator.num_pages + 1) * PAGE)
        base["state_bytes_per_rank"] = decoder.engine.state_bytes
    for (context, batch) in need:
        record = dict(base, context=context, batch=batch)
        if (context, batch) not in fits:
            record["skipped"] = (f"does not fit: {need[context, batch] * PAGE} tokens of KV, "
                                 f"capacity {capacity}")
        else:
            step, release = decoder.step_fn(batch, context)
            record["step_ms"] = time_steps(step, device, args.iters, overlap=False)
            record["step_ms_overlap"] = time_steps(step, device, args.iters, overlap=True)
            record["replayed"] = decoder.replayed
            if p > 1:
                nccl = nccl_ms_per_step(step, device)
                record["exchange_ms"] = nccl
                record["exchange_share"] = nccl / record["step_ms"] if nccl is not None else None
            release()
        if rank == 0:
            records.append(results.add(**record))
    del model
    free_cuda(device)
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--models", default="qwen3,mla")
    parser.add_argument("--contexts", default=None,
                        help="comma-separated (default 32768,131072; --smoke: 256,1024)")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--reserve-gib", type=float, default=6.0)
    parser.add_argument("--backend", default=None)
    parser.add_argument("--compile", action="store_true",
                        help="capture compiled decoder layers (Engine(compile=True))")
    parser.add_argument("--smoke", action="store_true", help="tiny models on the CPU")
    args = parser.parse_args()
    args.contexts = [int(c) for c in (args.contexts or (
        "256,1024" if args.smoke else "32768,131072")).split(",")]
    args.batches = [int(b) for b in args.batches.split(",")]
    device, world, rank = torchrun_setup(args.smoke)
    args.backend = args.backend or ("flashinfer" if device.type == "cuda" else "torch")
    results = appending_results(args.out, rank, device)
    rows = []
    for name in args.models.split(","):
        start = time.perf_counter()
        mesh = None
        if world > 1:
            mesh = torch_cp.init_mesh(tp=world if SETUPS[name] == "tp" else 1,
                                      sp=world if SETUPS[name] == "sp" else 1,
                                      device_type=device.type)
        rows += run_p(name, world, mesh, args, device, results, rank)
        if rank == 0:
            print(f"{name} at P = {world}: {time.perf_counter() - start:.0f} s", flush=True)
        dist.barrier()
    if rank == 0:
        print(table(rows, ["model", "mode", "P", "context", "batch", "step_ms",
                           "step_ms_overlap", "exchange_ms",
                           "exchange_share", "capacity_tokens", "skipped"]))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
