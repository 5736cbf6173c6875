"""Where a decode step's time goes: host phases, the captured graph on the GPU, its kernels.

    python -m benchmarks.step_profile --model qwen3 --batch 1 --context 512 [--compile]

Builds the benchmarked model (``benchmarks.models``), an engine with CUDA graphs, one batch of
rows at ``--context`` tokens (pool of zeros), and then times the phases of
``CUDAGraphRunner.prepare`` + ``launch`` on the host (prepare, and inside it the plan, the load
into the static plan and the backend plan; launch; the wait for the replay; the token to the
host); the replay alone back to back (GPU time of the graph); and lists the graph's kernels by
CUDA time (torch.profiler). Last, ``engine.run`` with ``overlap_planning`` under the profiler:
how long the GPU idles per decode step and which host CUDA calls wait.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import torch_cp
from benchmarks import models
from benchmarks.common import (
    DECODE_KERNEL_HELP,
    KERNEL_HELP,
    LINEARS_HELP,
    apply_decode_kernel,
    apply_inductor_settings,
    apply_kernel_settings,
    apply_linears,
    kernel_times,
    run_header,
    sync,
    time_ms,
)

PAGE = 16


class _Timed:
    """Accumulates the milliseconds spent in ``fn`` while installed on ``owner.name``."""

    def __init__(self, owner, name: str):
        self.owner, self.name, self.fn, self.ms = owner, name, getattr(owner, name), 0.0

    def __enter__(self):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return self.fn(*args, **kwargs)
            finally:
                self.ms += (time.perf_counter() - start) * 1e3
        setattr(self.owner, self.name, timed)
        return self

    def __exit__(self, *exc):
        setattr(self.owner, self.name, self.fn)


def phases(runner, ids, q_lens, ctx_lens, tables, rows, state_slots, iters: int
           ) -> dict[str, float]:
    """Mean milliseconds of each host phase of ``runner.prepare`` + ``runner.launch``, the
    wait for the replay and the token's trip to the host (``state_slots``: a hybrid model's
    slot of each row, else None)."""
    bucket = runner.bucket_for(q_lens, max(len(t) for t in tables))
    static = runner.captured[bucket].static
    total = dict.fromkeys(("prepare", "launch", "wait", "token"), 0.0)
    with _Timed(runner, "_plan") as plan, _Timed(static, "load") as load, \
            _Timed(runner.cache, "begin_step") as backend_plan:
        for _ in range(iters):
            t = [time.perf_counter()]
            prepared = runner.prepare(q_lens, ctx_lens, tables, state_slots)
            t.append(time.perf_counter())
            logits = runner.launch(prepared, ids, rows)
            t.append(time.perf_counter())
            torch.cuda.synchronize()
            t.append(time.perf_counter())
            logits.argmax(-1).tolist()
            t.append(time.perf_counter())
            for name, a, b in zip(total, t, t[1:]):
                total[name] += (b - a) * 1e3 / iters
    return dict(plan=plan.ms / iters, static_load=load.ms / iters,
                backend_plan=backend_plan.ms / iters, **total)


def kernels(graph, device, steps: int = 3, top: int = 20) -> tuple[list[dict], float, int]:
    def replays():
        for _ in range(steps):
            graph.replay()

    rows = [dict(kernel=name[:90], ms_per_step=ms / steps, calls_per_step=calls / steps)
            for name, (ms, calls) in kernel_times(replays, device).items()]
    rows.sort(key=lambda r: -r["ms_per_step"])
    total = sum(r["ms_per_step"] for r in rows)
    calls = int(sum(r["calls_per_step"] for r in rows))
    return rows[:top], total, calls


def engine_gaps(engine, device, ids: list[int], context: int, new_tokens: int = 48,
                trace: str | None = None) -> dict:
    """``engine.run`` with ``overlap_planning`` under torch.profiler: per decode step, the GPU's
    idle time (no kernel or copy running) and the host's CUDA runtime calls (ms per step; a
    ``cudaEventSynchronize`` is the host waiting for a step's tokens, a
    ``cudaStreamSynchronize`` a copy or call that waits for the whole stream). The profiler
    slows the host several times over (``cudaGraphLaunch`` 2.7 ms a step under it, run 24), so
    the idle time is an upper bound; which calls wait is the finding."""
    from torch.profiler import DeviceType, ProfilerActivity, profile

    for row in range(len(ids)):
        engine.allocator.release(row)
    engine.overlap_planning = True
    prompts = [[i] * (context - new_tokens) for i in ids]  # the pool holds `context` tokens a row
    engine.run(prompts, 8, eos_token_ids=())
    walls = []
    for tokens in (8, new_tokens):  # unprofiled: the decode step of engine.run, by difference
        sync(device)
        start = time.perf_counter()
        engine.run(prompts, tokens, eos_token_ids=())
        walls.append(time.perf_counter() - start)
    run_step_ms = (walls[1] - walls[0]) * 1e3 / (new_tokens - 8)
    steps_before, ahead_before = engine.steps, engine.launched_ahead_steps
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        results = engine.run(prompts, new_tokens, eos_token_ids=())
        torch.cuda.synchronize(device)
    assert all(r.ok for r in results), [r.error for r in results]
    if trace:
        prof.export_chrome_trace(trace)
    kernels_on_gpu = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                            if e.device_type == DeviceType.CUDA)
    spans = [(start, end) for start, end, _ in kernels_on_gpu]
    # The decode steps: the last 3/4 of the GPU's activity (the prefill comes first).
    first, last = spans[0][0], max(end for _, end in spans)
    window = first + (last - first) // 4
    idle, cursor, gaps, named = 0, window, [], []
    last_end, before = 0, ""  # the kernel that ended last so far
    for start, end, name in kernels_on_gpu:
        if end > window:
            if start > cursor:
                idle += start - cursor
                gaps.append(start - cursor)
                named.append((round(start - cursor, 1), before[:60], name[:60]))
            cursor = max(cursor, end)
        if end > last_end:
            last_end, before = end, name
    decode_steps = (new_tokens - 1) * 3 / 4
    steps = engine.steps - steps_before
    waits = {e.key: round(e.cpu_time_total / 1e3 / steps, 4) for e in prof.key_averages()
             if e.key.startswith("cuda") and e.cpu_time_total / 1e3 / steps > 0.02}
    return dict(new_tokens=new_tokens, run_step_ms=run_step_ms,
                launched_ahead=engine.launched_ahead_steps - ahead_before,
                gpu_idle_us_per_step=idle / decode_steps,
                gaps_over_50us_per_step=sum(g > 50 for g in gaps) / decode_steps,
                largest_gaps_us=sorted(gaps)[-5:], host_waits_ms_per_step=waits,
                largest_gaps_between=sorted(named)[-12:])


@torch.inference_mode()
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--out")
    p.add_argument("--trace", help="write the engine run's chrome trace here")
    p.add_argument("--tokens", choices=("same", "distinct"), default="same",
                   help="the rows' input tokens: one id for all (a MoE step routes every row to "
                        "the same experts) or a different id a row (routing spread as in serving)")
    p.add_argument("--decode-kernel", help=DECODE_KERNEL_HELP)
    p.add_argument("--linears", choices=("gemv", "cublas"), help=LINEARS_HELP)
    p.add_argument("--kernel", default="", help=KERNEL_HELP)
    p.add_argument("--inductor", default="",
                   help="torch._inductor.config settings, 'name=value,...' (with --compile)")
    args = p.parse_args()
    inductor = apply_inductor_settings(args.inductor)
    kernel = apply_kernel_settings(args.kernel)
    device = torch.device("cuda")
    model = models.build(args.model, device, torch.bfloat16)
    decode_kernel = apply_decode_kernel(args.decode_kernel)
    linears = apply_linears(args.linears)
    torch_cp.patch_model(model, backend="flashinfer", page_size=PAGE)
    width = -(-(args.context + 1) // PAGE)
    start = time.perf_counter()
    engine = torch_cp.Engine(model, args.batch * width, PAGE, max_rows=args.batch,
                             cuda_graphs=True, max_pages_per_row=width, compile=args.compile)
    setup_s = time.perf_counter() - start
    hybrid = engine.state is not None
    for row in range(args.batch):
        assert engine.allocator.reserve(row, args.context + 1)
        if hybrid:  # its state slot, as the scheduler gives one at admission
            engine.allocator.take_state_slot(row)
    tables = [engine.allocator.table_tensor(r) for r in range(args.batch)]
    rows = list(range(args.batch))
    ids = [1 if args.tokens == "same" else 1 + 7919 * r % 30000 for r in range(args.batch)]
    step = dict(ids=ids, q_lens=[1] * args.batch, ctx_lens=[args.context] * args.batch,
                tables=tables, rows=rows,
                state_slots=[engine.allocator.state_slot(r) for r in rows] if hybrid else None)
    runner = engine.runner
    phases(runner, **step, iters=3)
    host = phases(runner, **step, iters=args.iters)
    bucket = runner.bucket_for(step["q_lens"], width)
    graph = runner.captured[bucket].graph
    replay_ms = time_ms(graph.replay, device, iters=args.iters)
    top, kernel_ms, calls = kernels(graph, device)
    step_ms = sum(host[k] for k in ("prepare", "launch", "wait", "token"))
    try:  # the measures above stand on their own
        gaps = engine_gaps(engine, device, ids, args.context, trace=args.trace)
    except Exception as error:  # noqa: BLE001
        gaps = dict(error=repr(error))
    out = dict(run_header(device), model=args.model, batch=args.batch, context=args.context,
               compiled=args.compile, tokens=args.tokens,
               decode_kernel=decode_kernel, linears=linears, inductor=inductor, kernel=kernel,
               setup_s=setup_s,
               host_phases_ms=host,
               step_ms=step_ms, replay_only_ms=replay_ms, kernel_ms=kernel_ms,
               kernels_per_step=calls, engine_overlap=gaps, top_kernels=top)
    print(json.dumps({k: v for k, v in out.items() if k != "top_kernels"}, indent=1))
    for r in top:
        print(f"{r['ms_per_step']:8.3f} ms {r['calls_per_step']:6.0f}x  {r['kernel']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
