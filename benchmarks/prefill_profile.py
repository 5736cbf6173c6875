"""Where a prefill goes: torch_cp's engine against the unpatched Hugging Face forward.

    python -m benchmarks.prefill_profile --model qwen3 --batch 16 --prompt 4096
    python -m benchmarks.prefill_profile --model qwen3 --batch 16 --prompt 4096 --compile
    python -m benchmarks.prefill_profile --smoke     # CPU, tiny model, torch backend

The same ``--batch`` prompts of ``--prompt`` random tokens, prefilled twice: by
``torch_cp.Engine.run(prompts, 1)`` over the patched model (one step of ``batch * prompt``
tokens: the prompts and the first token) and by the unpatched model's own forward
(``logits_to_keep=1``, a fresh ``DynamicCache``: what ``model.generate`` runs first). Each is timed
(milliseconds, best of ``--iters`` after a warm-up) and profiled once: its kernels (operators on
the CPU) summed by name and by kind (GEMM, attention, other), so the two can be set side by side.
``--compile``: the engine of ``torch_cp.generate(..., cuda_graphs=True, compile=True)``, whose
prefill steps run through the compiled decoder layers (the warm-up call compiles them).
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict

import torch
from transformers import DynamicCache

import torch_cp
from benchmarks import models
from benchmarks.common import kernel_times, run_header, sync
from torch_cp.compat import cache_kwarg

PAGE = 16
GEMM_MARKS = ("gemm", "nvjet", "cutlass", "xmma", "cublas", "aten::mm", "aten::addmm",
              "aten::matmul", "aten::bmm", "aten::linear")
ATTENTION_MARKS = ("flash", "prefill", "attention", "fmha", "mla", "aten::_scaled_dot_product",
                   "merge", "context_partial", "own_partial")


def kind_of(kernel: str) -> str:
    name = kernel.lower()
    if any(mark in name for mark in ATTENTION_MARKS):
        return "attention"
    if any(mark in name for mark in GEMM_MARKS):
        return "gemm"
    return "other"


def profiled(fn, device: torch.device, top: int) -> dict:
    """One call of ``fn`` under torch.profiler: milliseconds by kind and the ``top`` kernels."""
    times = kernel_times(fn, device)
    by_kind: dict[str, float] = defaultdict(float)
    for name, (ms, _) in times.items():
        by_kind[kind_of(name)] += ms
    ranked = sorted(times.items(), key=lambda kv: -kv[1][0])[:top]
    return dict(kernel_ms=sum(ms for ms, _ in times.values()), by_kind=dict(by_kind),
                top=[dict(kernel=k[:120], ms=ms, calls=calls) for k, (ms, calls) in ranked])


def best_ms(fn, device: torch.device, iters: int) -> float:
    fn()  # warm-up: lazy initialisation, kernel selection
    times = []
    for _ in range(iters):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return min(times)


@torch.inference_mode()
def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3", choices=["qwen3", "mla", "qwen3_moe", "glm_flash"])
    p.add_argument("--batch", type=int, help="prompts (default 16; --smoke: 2)")
    p.add_argument("--prompt", type=int, help="tokens a prompt (default 4096; --smoke: 24)")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--compile", action="store_true", help="compiled layers (CUDA graphs engine)")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny model, torch backend")
    p.add_argument("--noise-floor", action="store_true",
                   help="also Hugging Face's first tokens with eager attention against its sdpa "
                        "ones: how far bf16 rounding alone moves them in this random model")
    p.add_argument("--out")
    args = p.parse_args(argv)
    args.batch = args.batch or (2 if args.smoke else 16)
    args.prompt = args.prompt or (24 if args.smoke else 4096)
    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    model = models.build(args.model, device, dtype, args.smoke)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.prompt), generator=gen)
    prompts = ids.tolist()
    ids = ids.to(device)

    cache = cache_kwarg(model)

    def hf_prefill():
        return model(input_ids=ids, use_cache=True, logits_to_keep=1,
                     **{cache: DynamicCache(config=model.config)}).logits

    hf = dict(ms=best_ms(hf_prefill, device, args.iters), **profiled(hf_prefill, device, args.top))
    last_hf = hf_prefill()[:, -1].float()
    first_hf = last_hf.argmax(-1).tolist()
    floor = None
    if args.noise_floor:
        model.set_attn_implementation("eager")
        floor = sum(a == b for a, b in zip(hf_prefill()[:, -1].argmax(-1).tolist(), first_hf))
        model.set_attn_implementation("sdpa")

    torch_cp.patch_model(model, backend="torch" if args.smoke else "flashinfer", page_size=PAGE)
    per_row = -(-(args.prompt + 1) // PAGE)
    compiled = dict(cuda_graphs=True, compile=True, max_pages_per_row=per_row) if args.compile \
        else {}
    engine = torch_cp.Engine(model, args.batch * per_row, PAGE, max_rows=args.batch,
                             max_tokens_per_step=args.batch * args.prompt, **compiled)

    def torch_cp_prefill():
        return engine.run(prompts, 1, eos_token_ids=(), progress=False)

    steps_before = engine.steps
    ours = dict(ms=best_ms(torch_cp_prefill, device, args.iters),
                **profiled(torch_cp_prefill, device, args.top))
    ours["steps_per_call"] = (engine.steps - steps_before) / (args.iters + 2)
    first_ours = [r.token_ids[0] for r in torch_cp_prefill()]
    torch_cp.unpatch_model(model)
    out = dict(run_header(device), model=args.model, batch=args.batch, prompt=args.prompt,
               compile=args.compile,
               tokens=args.batch * args.prompt, torch_cp=ours, hugging_face=hf,
               same_first_tokens=sum(a == b for a, b in zip(first_ours, first_hf)),
               # Where the first tokens differ: Hugging Face's logit of its token less its logit
               # of ours, over its largest logit (a near-tie is a few bf16 ulps: <= 2**-5).
               split_gaps=[round((row[a] - row[b]).item() / row[a].abs().item(), 5)
                           for row, a, b in zip(last_hf, first_hf, first_ours) if a != b],
               same_first_tokens_hf_eager_attention=floor)
    for name, r in (("torch_cp", ours), ("hugging_face", hf)):
        kinds = ", ".join(f"{k} {v:.1f}" for k, v in sorted(r["by_kind"].items()))
        print(f"{name}: {r['ms']:.1f} ms ({out['tokens'] / r['ms']:.0f} tokens/ms); "
              f"profiled ms by kind: {kinds}")
        for k in r["top"]:
            print(f"  {k['ms']:9.2f} ms {k['calls']:5d}x  {k['kernel']}")
    print(f"same first token in {out['same_first_tokens']} of {args.batch} rows; where not, "
          f"Hugging Face's relative logit gap: {out['split_gaps']}")
    if floor is not None:
        print(f"Hugging Face with eager attention: the same first token in {floor} rows")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
