"""Where torch_cp's engine makes the host wait for the GPU: one call of ``Engine.run`` (a
prefill of ``--batch`` prompts, then ``--new-tokens`` decode steps) under
``torch.cuda.set_sync_debug_mode("warn")``, every synchronizing call counted by its call site
(the innermost frame of torch_cp, its graphs or model families, else of transformers).

A host sync inside a prefill drains the launch queue: the GPU then idles while the host
launches the next kernels. A step needs one, where it reads its sampled tokens (launched ahead,
it overlaps the next step); the rest are what to remove.

    python -m benchmarks.sync_points --model qwen3_moe --layers 4 --batch 32 --prompt 512
    python -m benchmarks.sync_points --model qwen3_moe --layers 4 --graphs   # captured, compiled
"""

from __future__ import annotations

import argparse
import traceback
import warnings
from collections import Counter

import torch

import torch_cp
from benchmarks import models
from benchmarks.common import Results, run_header

PAGE = 16
OURS = ("/torch_cp/", "/graphs/", "/models/")


def call_site(stack: list[traceback.FrameSummary]) -> str:
    """The innermost frame of torch_cp (else of transformers, else the innermost) as
    ``file:line function``."""
    for marks in (OURS, ("/transformers/",)):
        for frame in reversed(stack):
            if any(m in frame.filename for m in marks) and "/benchmarks/" not in frame.filename:
                return f"{frame.filename.rsplit('/', 2)[-2]}/{frame.filename.rsplit('/', 1)[-1]}" \
                       f":{frame.lineno} {frame.name}"
    frame = stack[-1]
    return f"{frame.filename}:{frame.lineno} {frame.name}"


def syncs_of(fn) -> Counter:
    """Call sites of every synchronizing CUDA call ``fn()`` makes, counted."""
    sites: Counter = Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchronizing" in str(message):
            sites[call_site(traceback.extract_stack()[:-1])] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sites


@torch.inference_mode()
def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3_moe",
                   choices=["qwen3", "mla", "qwen3_moe", "glm_flash", "qwen3_5"])
    p.add_argument("--layers", type=int, default=4, help="decoder layers (the model's widths)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=4)
    p.add_argument("--graphs", action="store_true", help="cuda_graphs=True, compile=True")
    p.add_argument("--overlap-planning", action="store_true")
    p.add_argument("--out")
    args = p.parse_args(argv)
    device = torch.device("cuda")
    model = models.build(args.model, device, torch.bfloat16, layers=args.layers)
    torch_cp.patch_model(model, backend="flashinfer", page_size=PAGE)
    per_row = -(-(args.prompt + args.new_tokens) // PAGE)
    engine = torch_cp.Engine(model, args.batch * per_row, PAGE, max_rows=args.batch,
                             max_tokens_per_step=args.batch * args.prompt,
                             cuda_graphs=args.graphs, compile=args.graphs,
                             overlap_planning=args.overlap_planning, max_pages_per_row=per_row)
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, model.config.vocab_size, (args.batch, args.prompt),
                            generator=gen).tolist()

    def call():
        return engine.run(prompts, args.new_tokens, eos_token_ids=(), progress=False)

    call()  # warm-up: lazy initialisation, capture and compilation
    torch.cuda.synchronize()
    steps = engine.steps
    sites = syncs_of(call)
    steps = engine.steps - steps
    results = Results(args.out, dict(run_header(device), **{k: v for k, v in vars(args).items()
                                                            if k != "out"}))
    results.data.update(steps=steps, syncs=sum(sites.values()),
                        sites=[dict(site=s, count=n) for s, n in sites.most_common()])
    print(f"{args.model}, {args.layers} layers, {args.batch} x {args.prompt} + "
          f"{args.new_tokens}, graphs {args.graphs}: {sum(sites.values())} syncs in {steps} steps")
    for site, n in sites.most_common():
        print(f"{n:6d}  {site}")
    results.save()
    return results.data


if __name__ == "__main__":
    main()
