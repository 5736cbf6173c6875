"""Serving: a shared long prefix with prefix caching on and off, and a Poisson stream of requests.

    python -m benchmarks.serving --scenario prefix --out benchmarks/results/serving.json
    python -m benchmarks.serving --scenario poisson --out benchmarks/results/serving.json
    torchrun --standalone --nproc-per-node 2 -m benchmarks.serving --scenario prefix ...

- ``prefix``: ``--requests`` (32) requests sharing a ``--prefix`` (16k) token prefix with distinct
  ``--suffix`` (256) token suffixes, ``--new-tokens`` each: the first alone (it prefills the
  prefix: ``first_ttft_s``), then the others at once when its first token is out; their time to
  first token (median, p99, last) and the total, ``prefix_caching`` off then on (one engine
  each, the cache empty at the start). A cached page is shared once its KV is written (requests
  submitted with the first wait for that, with caching on: the scheduler's
  ``_waits_for_prefix``), so the first's time is measured alone. Under torchrun with
  2 ranks: SP mode, P = 2.
- ``poisson``: requests arriving as a Poisson process (``--rate`` per second, prompts of
  ``--prompt`` tokens), each submitted when its arrival time has passed, between steps of
  ``Engine.step``: tokens/s, and the p50 / p99 of time to first token and of the time between
  a request's tokens.

Model: Qwen3-8B's shape (random bf16 weights) with FlashInfer, CUDA graphs, compiled layers and
steps launched ahead (the fastest engine; ``--no-compile``, ``--no-overlap-planning`` turn them
off; run 50 had neither); ``--smoke``: the tiny model on the CPU with the torch backend and tiny
sizes.
"""

from __future__ import annotations

import argparse
import datetime
import os
import random
import time

import torch
import torch.distributed as dist

import torch_cp
from benchmarks import models
from benchmarks.common import appending_results, table
from torch_cp.engine.memory import pool_fit_problems

PAGE = 16


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _settings(args, device) -> dict:
    """The engine's speed settings, as ``Engine`` takes them and each record reports them."""
    cuda = device.type == "cuda"
    return dict(cuda_graphs=cuda, compile=cuda and args.compile,
                overlap_planning=args.overlap_planning)


def _engine(model, args, device, prefix_caching: bool, pages: int):
    return torch_cp.Engine(model, pages, PAGE, max_tokens_per_step=args.tokens_per_step,
                           max_rows=args.max_rows, prefix_caching=prefix_caching,
                           **_settings(args, device))


def _warm_up(engine, args, device) -> None:
    """Decode steps after a prefill that shares no page with the measured prompts (ids 1); with
    compiled layers two full chunks and a short one before them: a fresh chunk, chunks after a
    context and a second length, so every prefill shape they meet has compiled
    (``Engine(compile=True)``: once for the first length, once more for the others)."""
    compiled = _settings(args, device)["compile"]
    tokens = 2 * args.tokens_per_step + PAGE + 1 if compiled else PAGE + 1
    serve(engine, [(0.0, [1] * tokens)], 2, device)


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def serve(engine, arrivals: list[tuple[float, list[int]]], new_tokens: int, device) -> dict:
    """Submit each (arrival second, prompt) once its time has passed, step until all end:
    per request its first token's and every later token's times."""
    start = time.perf_counter()
    pending = sorted(arrivals, key=lambda a: a[0])
    submitted, times = {}, {}
    while pending or engine.has_unfinished():
        now = time.perf_counter() - start
        while pending and pending[0][0] <= now:
            at, prompt = pending.pop(0)
            submitted[engine.submit(prompt, new_tokens)] = at
        if not engine.has_unfinished():
            time.sleep(max(0.0, pending[0][0] - now))
            continue
        outputs = engine.step()
        now = time.perf_counter() - start
        for out in outputs:  # only this call's requests (one submitted before still runs)
            if out.token_ids and out.request_id in submitted:
                times.setdefault(out.request_id, []).append(now)
    _sync(device)
    total = time.perf_counter() - start
    ttft = [times[r][0] - at for r, at in submitted.items() if r in times]
    gaps = [b - a for r in times for a, b in zip(times[r], times[r][1:])]
    tokens = sum(len(t) for t in times.values())
    return dict(total_s=total, tokens_per_s=tokens / total, ttft_p50_s=_percentile(ttft, 0.5),
                ttft_p99_s=_percentile(ttft, 0.99), ttft_last_s=max(ttft, default=None),
                itl_p50_s=_percentile(gaps, 0.5), itl_p99_s=_percentile(gaps, 0.99),
                requests=len(submitted), tokens=tokens)


def scenario_prefix(model, args, device, p: int) -> list[dict]:
    pages = args.requests * -(-(args.prefix + args.suffix + args.new_tokens) // PAGE)
    # one H100 holds the pool of about 11 of the default 32 requests
    problems = pool_fit_problems(model.torch_cp, PAGE, pages)
    if problems:
        raise SystemExit(f"{'; '.join(problems)}: without prefix caching each request holds its "
                         f"own {args.prefix}-token prefix; ask for fewer with --requests (now "
                         f"{args.requests})")
    rng = random.Random(0)
    vocab = model.config.vocab_size
    prefix = [rng.randrange(3, vocab) for _ in range(args.prefix)]
    prompts = [prefix + [rng.randrange(3, vocab) for _ in range(args.suffix)]
               for _ in range(args.requests)]
    records = []
    for caching in (False, True):
        engine = _engine(model, args, device, caching, pages)
        _warm_up(engine, args, device)
        start = time.perf_counter()
        first = engine.submit(prompts[0], args.new_tokens)
        while not any(o.request_id == first and o.token_ids for o in engine.step()):
            pass
        _sync(device)
        first_ttft = time.perf_counter() - start
        timing = serve(engine, [(0.0, q) for q in prompts[1:]], args.new_tokens, device)
        records.append(dict(scenario="prefix", P=p, prefix_caching=caching,
                            prefix=args.prefix, suffix=args.suffix, first_ttft_s=first_ttft,
                            **_settings(args, device),
                            reused_tokens=engine.reused_tokens, **timing,
                            all_s=first_ttft + timing["total_s"]))
        del engine
    return records


def scenario_poisson(model, args, device, p: int) -> list[dict]:
    rng = random.Random(0)
    vocab = model.config.vocab_size
    at, arrivals = 0.0, []
    for _ in range(args.requests):
        at += rng.expovariate(args.rate)
        arrivals.append((at, [rng.randrange(3, vocab) for _ in range(args.prompt)]))
    pages = args.max_rows * -(-(args.prompt + args.new_tokens) // PAGE)
    engine = _engine(model, args, device, False, pages)
    _warm_up(engine, args, device)
    timing = serve(engine, arrivals, args.new_tokens, device)
    return [dict(scenario="poisson", P=p, rate=args.rate, prompt=args.prompt,
                 **_settings(args, device), **timing)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenario", choices=("prefix", "poisson"), required=True)
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--prefix", type=int, default=None)
    parser.add_argument("--suffix", type=int, default=None)
    parser.add_argument("--prompt", type=int, default=None)
    parser.add_argument("--new-tokens", type=int, default=None)
    parser.add_argument("--rate", type=float, default=None, help="requests per second")
    parser.add_argument("--max-rows", type=int, default=64)
    parser.add_argument("--tokens-per-step", type=int, default=2048)
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                        help="compiled layers (on CUDA, with the CUDA graphs)")
    parser.add_argument("--overlap-planning", action=argparse.BooleanOptionalAction,
                        default=True, help="plan and launch each decode step ahead")
    parser.add_argument("--smoke", action="store_true", help="the tiny model on the CPU")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    small = dict(requests=4, prefix=48, suffix=8, prompt=16, new_tokens=4, rate=50.0)
    large = dict(requests=32, prefix=16384, suffix=256, prompt=512, new_tokens=64, rate=4.0)
    for name, value in (small if args.smoke else large).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.smoke:
        args.tokens_per_step = min(args.tokens_per_step, 32)
    world = int(os.environ.get("WORLD_SIZE", 1))
    if world > 1 and args.scenario == "poisson":
        parser.error("--scenario poisson runs in one process: under torchrun each rank's own "
                     "clock would decide when its requests arrive")
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    mesh = None
    if world > 1:
        dist.init_process_group("nccl" if cuda else "gloo",
                                timeout=datetime.timedelta(seconds=600))
        mesh = torch_cp.init_mesh(sp=world, device_type=device.type)
    model = models.build("qwen3", device, torch.float32 if args.smoke else torch.bfloat16,
                         smoke=args.smoke)
    torch_cp.patch_model(model, context_parallel=world > 1, mesh=mesh, page_size=PAGE,
                         mode="sp" if world > 1 else "auto",
                         backend="flashinfer" if cuda else "torch")
    records = (scenario_prefix if args.scenario == "prefix" else scenario_poisson)(
        model, args, device, world)
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        results = appending_results(args.out, rank, device)
        for record in records:
            results.add(**record)
        print(table(records, ["scenario", "P", "compile", "overlap_planning", "prefix_caching",
                              "requests", "first_ttft_s",
                              "all_s", "total_s",
                              "tokens_per_s", "ttft_p50_s", "ttft_p99_s", "ttft_last_s",
                              "itl_p50_s", "itl_p99_s", "reused_tokens"]))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
