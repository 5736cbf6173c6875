"""Capacity: how many requests fit, and how fast they decode, with context parallelism on and off.

Without context parallelism, TP ranks that share a KV head each hold a full copy of its KV: at
long context the pool fills and the batch stays small. With P partners striping it, the same
memory holds P times the tokens. Each configuration is its own torchrun job (a fresh process, so
no job inherits another's memory); each appends its records to ``--out``:

    for cp in off on; do for m in mla gqa; do
      torchrun --standalone --nproc-per-node 2 -m benchmarks.capacity --setup tp --model $m \\
          --context-parallel $cp --out benchmarks/results/capacity.json; done; done
    torchrun --standalone --nproc-per-node 1 -m benchmarks.capacity --setup sp --model qwen3 \\
        --out benchmarks/results/capacity.json
    torchrun --standalone --nproc-per-node 2 -m benchmarks.capacity --setup sp --model qwen3 \\
        --out benchmarks/results/capacity.json

- ``--setup tp`` (two GPUs, tp = 2): the 8B MLA model (one latent head: without context
  parallelism both ranks hold the whole latent) and ``gqa``, Qwen3-8B's shape with one KV head
  (no Qwen or GLM checkpoint has fewer KV heads than two GPUs; GLM-4-9B's two are fewer than
  tp = 4). Per context (32k and 128k by default): the pool that fits in 90% of the memory left
  after the model, the largest batch it holds (each request ``context + 64`` tokens, at most
  ``--max-batch``), and that batch's decode step (CUDA-graph replay, greedy token back on the
  host): tokens/s per GPU.
- ``--setup sp``: Qwen3-8B replicated over SP ranks (P = world). The longest context one request
  can hold, and one decode step of a single request at the longest context the job holds.

``--smoke`` runs tiny models on the CPU (gloo, torch backend, eager steps, 1 MiB of pool a rank).
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator

import torch
import torch.distributed as dist

import torch_cp
from benchmarks import models
from benchmarks.common import appending_results, free_cuda, table, torchrun_setup
from benchmarks.long_context import PAGE, Decoder, capacity_tokens, time_steps
from torch_cp.engine.memory import pool_bytes_per_page

NEW = 64  # tokens a request generates beyond its context: its pages are reserved at admission
SMOKE_BYTES = 2**20  # --smoke: the memory a rank has for its pool


def build(name: str, device, smoke: bool):
    dtype = torch.float32 if smoke else torch.bfloat16
    if name == "gqa":  # Qwen3-8B's shape, one KV head
        config = models.config_for("qwen3", smoke)
        config.num_key_value_heads = 1
        torch.manual_seed(0)
        with torch.device(device):
            model = models.AutoModelForCausalLM.from_config(config, dtype=dtype)
        return model.eval()
    return models.build(name, device, dtype, smoke=smoke)


def pool_tokens(model, device, args) -> int:
    """Tokens of the largest pool every rank's memory holds (``--smoke``: in ``SMOKE_BYTES``):
    the ranks' least, so that all size their batch and their buckets alike (one rank's larger
    batch would leave its collectives unmatched)."""
    if args.smoke:
        tokens = SMOKE_BYTES // pool_bytes_per_page(model.torch_cp, PAGE) * PAGE
    else:
        tokens = capacity_tokens(model, device, args.reserve_gib)
    least = torch.tensor([tokens], device=device)
    dist.all_reduce(least, op=dist.ReduceOp.MIN)
    return int(least.item())


def decode(model, device, args, batch: int, context: int) -> dict:
    """One engine sized for ``batch`` requests at ``context``; its step time and tokens/s."""
    pages = batch * -(-(context + NEW) // PAGE)
    decoder = Decoder(model, pages, batch, context, graphs=device.type == "cuda",
                      compile=args.compile)
    step, release = decoder.step_fn(batch, context)
    ms = time_steps(step, device, args.iters, overlap=True)
    release()
    del decoder
    free_cuda(device)
    return dict(step_ms=ms, tokens_per_s=batch * 1e3 / ms)


def run_tp(args, device, world: int) -> Iterator[dict]:
    mesh = torch_cp.init_mesh(tp=world, device_type=device.type)
    model = build(args.model, device, args.smoke)
    torch_cp.patch_model(model, context_parallel=args.context_parallel, mesh=mesh, mode="tp",
                         backend=args.backend, page_size=PAGE)
    capacity = pool_tokens(model, device, args)
    for context in args.contexts:
        batch = min(args.max_batch, capacity // (context + NEW))
        record = dict(setup="tp", model=args.model, context_parallel=args.context_parallel,
                      P=model.torch_cp.placement.size, world=world, context=context,
                      capacity_tokens=capacity, batch=batch)
        if batch < 1:
            record["skipped"] = f"one request of {context + NEW} tokens does not fit"
        else:
            record.update(decode(model, device, args, batch, context))
            record["tokens_per_s_per_gpu"] = record["tokens_per_s"] / world
        yield record


def run_sp(args, device, world: int) -> Iterator[dict]:
    mesh = torch_cp.init_mesh(sp=world, device_type=device.type) if world > 1 else None
    model = build(args.model, device, args.smoke)
    torch_cp.patch_model(model, context_parallel=world > 1, mesh=mesh,
                         mode="sp" if world > 1 else "auto", backend=args.backend,
                         page_size=PAGE)
    capacity = pool_tokens(model, device, args)
    context = (capacity - NEW) // PAGE * PAGE  # the longest request the pool holds
    record = dict(setup="sp", model=args.model, P=world, world=world, capacity_tokens=capacity,
                  context=context, batch=1)
    record.update(decode(model, device, args, 1, context) if context > 0 else
                  dict(skipped="no request fits"))
    yield record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--setup", choices=("tp", "sp"), required=True)
    parser.add_argument("--model", default="mla", help="tp: mla or gqa; sp: qwen3")
    parser.add_argument("--context-parallel", choices=("on", "off"), default="on")
    parser.add_argument("--contexts", default=None,
                        help="comma-separated (default 32768,131072; --smoke: 64,256)")
    parser.add_argument("--max-batch", type=int, default=64)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--reserve-gib", type=float, default=6.0)
    parser.add_argument("--backend", default=None)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="tiny models on the CPU")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    args.context_parallel = args.context_parallel == "on"
    args.contexts = [int(c) for c in (args.contexts or (
        "64,256" if args.smoke else "32768,131072")).split(",")]
    device, world, rank = torchrun_setup(args.smoke)
    args.backend = args.backend or ("flashinfer" if device.type == "cuda" else "torch")
    results = appending_results(args.out, rank, device)
    records = []
    for record in (run_tp if args.setup == "tp" else run_sp)(args, device, world):
        records.append(results.add(**record))  # on disk before the next context's run
    if rank == 0:
        print(table(records, ["setup", "model", "context_parallel", "P", "context",
                              "capacity_tokens", "batch", "step_ms", "tokens_per_s_per_gpu",
                              "skipped"]))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
