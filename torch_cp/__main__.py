"""Command line: generate with a patched model, on one process or under torchrun.

    python -m torch_cp                                  # the tiny random Qwen3, P = 1
    torchrun --nproc-per-node 2 -m torch_cp --context-parallel --tp 2
    python -m torch_cp --model /path/to/checkpoint --prompt "Hello" --max-new-tokens 32

A checkpoint loads with ``torch_cp.from_pretrained`` (each TP rank reads only its own shards).
Prints each request's tokens and text (token ids alone when the checkpoint has no usable
tokenizer), P, and the bytes each rank holds of the KV cache (and of a hybrid model's
linear-attention state); ``--json PATH`` writes them too. Under torchrun the mesh is (sp, tp)
over all ranks: gloo on CPU, NCCL on GPUs. A configuration problem is one line on rank 0 (the
other ranks exit with the same code, silently); the console script ``torch-cp-generate`` runs the
same ``cli``.
"""

from __future__ import annotations

import json
import os
import sys
import warnings

import torch

from torch_cp.agreement import OtherRankFailed
from torch_cp.cli_args import UsageError, argument_problems, model_path_problems, parse_args
from torch_cp.engine import EngineWarning, SamplingParams
from torch_cp.engine.checks import checked
from torch_cp.engine.generation import batch_rows, engine_for, never_fit_hints

DEFAULT_PROMPTS = ("The capital of France is", "Hello")  # the tiny model's, through its tokenizer
# For a checkpoint without a usable tokenizer: ids under 128, within any tiny test vocabulary.
DEFAULT_TOKEN_PROMPTS = ([1, 5, 9, 13, 17, 21, 25, 29, 33, 37, 41, 45, 49, 53, 57, 61, 65, 69, 73],
                         [100, 3, 50, 7, 99])
TINY_NOTE = ("the default model is a tiny Qwen3 with random weights: its tokens and text are "
             "meaningless (pass --model PATH for a real checkpoint)")


def _first_line(error: Exception) -> str:
    return next((line for line in str(error).splitlines() if line.strip()), type(error).__name__)


def load_model(args, device: torch.device, mesh):
    """The patched model on ``device``. A checkpoint loads through ``torch_cp.from_pretrained``:
    each TP rank reads only its own shards. ValueError for a checkpoint that cannot load."""
    patch = dict(context_parallel=args.context_parallel, mesh=mesh, mode=args.mode,
                 backend=args.backend, page_size=args.page_size)
    default = "bfloat16" if device.type == "cuda" else "float32"
    dtype = getattr(torch, args.dtype or (default if args.model else "float32"))
    if args.model is None:
        from torch_cp.hf import patch_model
        from torch_cp.tiny import tiny_qwen3

        return patch_model(tiny_qwen3(dtype=dtype).to(device), **patch)
    from transformers import AutoConfig

    from torch_cp.hf import from_pretrained
    from torch_cp.models import SUPPORTED_MODEL_TYPES

    try:
        config = AutoConfig.from_pretrained(args.model)
    except Exception as e:  # any kind: a field of the wrong type raises huggingface_hub's own
        raise ValueError(f"--model {args.model}: cannot read its config.json: "
                         f"{_first_line(e)}") from None
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"--model {args.model}: model_type {config.model_type!r} is not "
                         f"supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    try:
        model = from_pretrained(args.model, dtype=dtype, device=device, **patch)
    except OSError as e:  # unreadable files
        raise ValueError(f"--model {args.model}: cannot load its weights: "
                         f"{_first_line(e)}") from None
    return model


def tokenizer_of(args):
    """The tiny model's tokenizer, or the checkpoint's (``load_tokenizer``)."""
    if args.model is None:
        from torch_cp.tiny import tiny_tokenizer

        return tiny_tokenizer()
    return load_tokenizer(args.model)


def load_tokenizer(path: str):
    """The checkpoint's tokenizer, or None when it has none or one that encodes text to nothing
    (transformers builds an empty one from a folder without tokenizer files)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except ImportError as e:  # a tokenizer that exists but needs sentencepiece, tiktoken, ...
        raise ValueError(f"--model {path}: its tokenizer needs a library that is not "
                         f"installed: {_first_line(e)}") from None
    except Exception:  # noqa: BLE001 (read before the model: a config field of the wrong type
        # raises huggingface_hub's own error, named when the model loads)
        return None
    try:
        usable = len(tokenizer) > 1 and bool(tokenizer("Hello", add_special_tokens=False)
                                             ["input_ids"])
    except (ValueError, TypeError, KeyError):
        usable = False
    return tokenizer if usable else None


def prompts_of(args, tokenizer) -> list[list[int]]:
    from torch_cp.engine.requests import normalize_prompts

    if tokenizer is None:
        if not args.prompt:
            return [list(p) for p in DEFAULT_TOKEN_PROMPTS]
        ids = [_token_ids(p) for p in args.prompt]
        bad = [p for p, i in zip(args.prompt, ids) if i is None]
        if bad:  # every one named (helper 87: the first, one run at a time)
            raise ValueError("; ".join(f"--prompt {p!r}" for p in bad) + ": without a "
                             "tokenizer a prompt is token ids (space- or comma-separated)")
        return ids
    texts = args.prompt or (DEFAULT_PROMPTS if args.model is None
                            else ["The capital of France is"])
    return normalize_prompts(list(texts), tokenizer)


def _token_ids(prompt: str) -> list[int] | None:
    try:
        return [int(t) for t in prompt.replace(",", " ").split()]
    except ValueError:
        return None


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))


def main(argv=None) -> int:
    args = parse_args(argv)
    problems = argument_problems(args, torch.cuda.is_available())
    tokenizer = prompts = None
    if not model_path_problems(args.model):  # the prompts, named before the model loads
        tokenizer = tokenizer_of(args)
        prompts = checked(problems, prompts_of, args, tokenizer)
    if problems:  # a number that is none: argparse's usage error, with the rest
        raise (UsageError if args.unparsed else ValueError)("; ".join(problems))
    import torch.distributed as dist

    from torch_cp.engine.requests import eos_ids
    from torch_cp.mesh import init_mesh

    world = int(os.environ.get("WORLD_SIZE", 1))
    cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    mesh = None
    if world > 1 or args.tp * args.sp > 1:
        mesh = init_mesh(tp=args.tp, sp=args.sp, device_type=device.type)
    rank = _rank()
    model = load_model(args, device, mesh)
    if args.model is None and rank == 0:
        print(TINY_NOTE)
    if tokenizer is None and rank == 0:
        print(f"torch_cp: warning: {args.model} has no usable tokenizer (no tokenizer files, or "
              f"one that encodes text to nothing): prompts are token ids, output token ids only",
              file=sys.stderr)
    news = [args.max_new_tokens] * len(prompts)
    runtime = model.torch_cp
    eng, cap = engine_for(model, prompts, news, args.page_size,
                          max_tokens_per_step=args.max_tokens_per_step,
                          max_rows=batch_rows(prompts), cuda_graphs=args.cuda_graphs,
                          compile=args.compile,
                          overlap_planning=args.overlap_planning, progress=not args.no_progress)
    sampling = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)
    results = never_fit_hints(
        eng.run_tokens(prompts, news, sampling, eos_ids(model, None, tokenizer),
                       progress=not args.no_progress, tokenizer=tokenizer),
        prompts, news, args.page_size, cap)
    kv, state = [eng.kv_bytes], [eng.state_bytes]  # state: hybrid models' linear attention
    if dist.is_initialized():
        kv, state = [None] * dist.get_world_size(), [None] * dist.get_world_size()
        dist.all_gather_object(kv, eng.kv_bytes)
        dist.all_gather_object(state, eng.state_bytes)
    if rank == 0:
        p = runtime.placement
        texts = [r.text if r.ok else None for r in results]  # None without a tokenizer
        print(f"P = {p.size} ({p.mode} mode)" if p.size > 1 else "P = 1 (no context parallelism)")
        for r, text in zip(results, texts):
            line = f"request {r.index} ({len(prompts[r.index])} prompt tokens, {r.finish_reason}): "
            print(line + (f"error: {r.error}" if r.error else str(list(r.token_ids))))
            if text is not None:
                print(f"  prompt: {tokenizer.decode(prompts[r.index])!r}")
                print(f"  text: {text!r}")
        print(f"KV cache: {eng.allocator.num_pages} pages of {args.page_size} tokens, "
              f"{eng.steps} steps")
        for i, (b, sb) in enumerate(zip(kv, state)):
            print(f"KV bytes rank {i}: {b}" + (f", linear-attention state bytes: {sb}" if sb
                                               else ""))
        if args.json:
            write_json(args.json, p, len(kv), kv, state, prompts, results, texts)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0 if all(r.ok for r in results) else 1


def write_json(path: str, placement, world: int, kv: list[int], state: list[int], prompts,
               results, texts) -> None:
    """The run as JSON: P, mode (None at P = 1), world, KV and linear-attention state bytes per
    rank (state: 0 unless the model is hybrid), every request (``error``: why it ended with
    ``finish_reason`` "error", else None)."""
    record = {"P": placement.size, "mode": placement.mode if placement.size > 1 else None,
              "world": world, "kv_bytes_per_rank": kv, "state_bytes_per_rank": state,
              "results": [{"index": r.index, "prompt_ids": list(prompts[r.index]),
                           "token_ids": list(r.token_ids), "finish_reason": r.finish_reason,
                           "error": r.error, "text": text} for r, text in zip(results, texts)]}
    with open(path, "w") as f:
        json.dump(record, f, indent=1)


def one_line(error: Exception) -> str:
    """``error``'s message on one line (patch_model lists its problems on lines of their own)."""
    lines = [line.strip().removeprefix("- ") for line in str(error).splitlines() if line.strip()]
    out = ""
    for line in lines:  # a line ending in ":" introduces the next (a rank's list, under torchrun)
        out += ("" if not out else " " if out.endswith(":") else "; ") + line
    return out


def _show_engine_warnings(show):
    """``warnings.showwarning`` printing the engine's warnings as ``torch_cp: warning: ...``: the
    line they name is the caller's outside torch_cp, here runpy's (helper 109)."""
    def shown(message, category, filename, lineno, file=None, line=None):
        if not issubclass(category, EngineWarning):
            return show(message, category, filename, lineno, file, line)
        print(f"torch_cp: warning: {message}", file=file or sys.stderr)
    return shown


def cli(argv=None) -> None:
    """The console script and ``python -m torch_cp``. A configuration problem (ValueError; out
    of device memory; under torchrun, a load that failed on another rank) is one line on rank
    0, not a traceback; every rank exits with its code (2 for a usage error, else 1). Any other
    exception is a bug and keeps its traceback."""
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _show_engine_warnings(warnings.showwarning)
            code = main(argv)
    except (ValueError, torch.OutOfMemoryError, OtherRankFailed) as error:
        if _rank() == 0:
            print(f"torch_cp: error: {one_line(error)}", file=sys.stderr)
        code = 2 if isinstance(error, UsageError) else 1
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    sys.exit(code)


if __name__ == "__main__":
    cli()
