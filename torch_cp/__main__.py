"""Command line: generate with a patched model, on one process or under torchrun.

    python -m torch_cp                                  # the tiny random Qwen3, P = 1
    torchrun --nproc-per-node 2 -m torch_cp --context-parallel --tp 2
    python -m torch_cp --model /path/to/checkpoint --prompt "Hello" --max-new-tokens 32

Prints each request's tokens (and text when the checkpoint has a tokenizer) and the KV-cache bytes
each rank holds. Under torchrun the mesh is (sp, tp) over all ranks: gloo on CPU, NCCL on GPUs.
The console script ``torch-cp-generate`` runs the same ``main``.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from torch_cp.engine import SamplingParams
from torch_cp.engine.engine import DEFAULT_TOKENS_PER_STEP
from torch_cp.engine.generation import engine_for

DEFAULT_PROMPTS = ([1, 5, 9, 13, 17, 21, 25, 29, 33, 37, 41, 45, 49, 53, 57, 61, 65, 69, 73],
                   [200, 3, 150, 7, 99])


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m torch_cp", description=__doc__.split(
        "\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="local checkpoint folder (default: the tiny random Qwen3)")
    p.add_argument("--prompt", action="append", help="a prompt (repeatable): text when the "
                   "checkpoint has a tokenizer, else space-separated token ids")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--context-parallel", action="store_true",
                   help="stripe the KV cache over the partners (P > 1)")
    p.add_argument("--mode", choices=("tp", "sp"), default="tp")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--sp", type=int, default=1)
    p.add_argument("--backend", default="torch", help="attention backend (torch, flashinfer)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int)
    p.add_argument("--top-p", type=float)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-tokens-per-step", type=int, default=DEFAULT_TOKENS_PER_STEP)
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="model dtype (default: float32 for the tiny model, bfloat16 on CUDA)")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="replay decode steps from captured CUDA graphs (CUDA)")
    p.add_argument("--compile", action="store_true",
                   help="capture the steps with compiled decoder layers (with --cuda-graphs)")
    p.add_argument("--overlap-planning", action="store_true",
                   help="plan each decode step while the previous one runs")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def load_model(args, device: torch.device):
    """(model, tokenizer or None) on ``device``."""
    default = "bfloat16" if device.type == "cuda" else "float32"
    dtype = getattr(torch, args.dtype or (default if args.model else "float32"))
    if args.model is None:
        from torch_cp.tiny import tiny_qwen3

        return tiny_qwen3(dtype=dtype).to(device), None
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(device).eval()
    try:
        tokenizer = AutoTokenizer.from_pretrained(args.model)
    except (OSError, ValueError, TypeError):
        tokenizer = None
    return model, tokenizer


def prompts_of(args, tokenizer) -> list[list[int]]:
    if not args.prompt:
        if args.model is not None and tokenizer is not None:
            return [tokenizer("The capital of France is", add_special_tokens=False)["input_ids"]]
        return [list(p) for p in DEFAULT_PROMPTS]
    if tokenizer is not None:
        return [tokenizer(p, add_special_tokens=False)["input_ids"] for p in args.prompt]
    try:
        return [[int(t) for t in p.replace(",", " ").split()] for p in args.prompt]
    except ValueError as e:
        raise SystemExit(f"--prompt must be token ids without a tokenizer: {e}") from None


def argument_problems(args, cuda: bool) -> list[str]:
    """What is wrong with the command line, found before anything is loaded."""
    problems = []
    if args.page_size < 1:
        problems.append(f"--page-size must be >= 1, got {args.page_size}")
    if args.max_new_tokens < 1:
        problems.append(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.cuda_graphs and not cuda:
        problems.append("--cuda-graphs needs CUDA")
    if args.compile and not args.cuda_graphs:
        problems.append("--compile compiles the captured step: it needs --cuda-graphs")
    if args.tp < 1 or args.sp < 1:
        problems.append(f"--tp and --sp must be >= 1, got {args.tp} and {args.sp}")
    return problems


def main(argv=None) -> int:
    args = parse_args(argv)
    problems = argument_problems(args, torch.cuda.is_available())
    if problems:
        raise ValueError("; ".join(problems))
    import torch.distributed as dist

    from torch_cp.engine.requests import eos_ids
    from torch_cp.hf import patch_model
    from torch_cp.mesh import init_mesh

    world = int(os.environ.get("WORLD_SIZE", 1))
    cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    mesh = None
    if world > 1 or args.tp * args.sp > 1:
        mesh = init_mesh(tp=args.tp, sp=args.sp, device_type="cuda" if cuda else "cpu")
    rank = dist.get_rank() if dist.is_initialized() else 0
    model, tokenizer = load_model(args, device)
    model = patch_model(model, context_parallel=args.context_parallel, mesh=mesh, mode=args.mode,
                        backend=args.backend, page_size=args.page_size)
    prompts = prompts_of(args, tokenizer)
    news = [args.max_new_tokens] * len(prompts)
    runtime = model.torch_cp
    eng = engine_for(model, prompts, news, args.page_size,
                            max_tokens_per_step=args.max_tokens_per_step,
                            cuda_graphs=args.cuda_graphs, compile=args.compile,
                            overlap_planning=args.overlap_planning)
    sampling = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)
    results = eng.run(prompts, news, sampling, eos_ids(model, None, tokenizer),
                      progress=not args.no_progress)
    kv = [eng.kv_bytes]
    if dist.is_initialized():
        kv = [None] * dist.get_world_size()
        dist.all_gather_object(kv, eng.kv_bytes)
    if rank == 0:
        p = runtime.placement
        print(f"P = {p.size} ({p.mode} mode)" if p.size > 1 else "P = 1 (no context parallelism)")
        for r in results:
            line = f"request {r.index} ({len(prompts[r.index])} prompt tokens, {r.finish_reason}): "
            print(line + (f"error: {r.error}" if r.error else str(list(r.token_ids))))
            if tokenizer is not None and r.ok:
                print(f"  text: {tokenizer.decode(list(r.token_ids), skip_special_tokens=True)!r}")
        print(f"KV cache: {eng.allocator.num_pages} pages of {args.page_size} tokens, "
              f"{eng.steps} steps")
        for i, b in enumerate(kv):
            print(f"KV bytes rank {i}: {b}")
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0 if all(r.ok for r in results) else 1


def cli() -> None:
    """The console script and ``python -m torch_cp``: a configuration problem is one line, not a
    traceback."""
    try:
        sys.exit(main())
    except ValueError as error:
        sys.exit(f"python -m torch_cp: {error}")


if __name__ == "__main__":
    cli()
