"""The command line of ``python -m torch_cp`` (``__main__.py``) and its checks, made before
anything is loaded: every problem named at once."""

from __future__ import annotations

import argparse
import os

from torch_cp.attention.select import BACKEND_NAMES
from torch_cp.engine import SamplingParams
from torch_cp.engine.engine import DEFAULT_TOKENS_PER_STEP

MODES = ("auto", "tp", "sp")
DTYPES = ("float32", "bfloat16", "float16")
NUMBERS = {"max_new_tokens": int, "tp": int, "sp": int, "page_size": int, "temperature": float,
           "top_k": int, "top_p": float, "seed": int, "max_tokens_per_step": int}


class UsageError(ValueError):
    """A command line argparse refuses (exit code 2, as argparse's own)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(message)


def parse_args(argv=None) -> argparse.Namespace:
    p = _Parser(prog="python -m torch_cp", description="Generate with a patched model, on one "
                "process or under torchrun.")
    p.add_argument("--model", help="local checkpoint folder (default: the tiny random Qwen3)")
    p.add_argument("--prompt", action="append", help="a prompt (repeatable): text when the "
                   "checkpoint has a tokenizer, else space-separated token ids")
    p.add_argument("--max-new-tokens", default=16, help="per prompt (default: 16)")
    p.add_argument("--context-parallel", action="store_true",
                   help="stripe the KV cache over the partners (P > 1)")
    p.add_argument("--mode", default="auto",
                   help="partners: TP ranks sharing a KV head, or the SP ranks (auto, tp, sp; "
                   "auto: sp when --sp > 1, else tp)")
    p.add_argument("--tp", default=1,
                   help="tensor-parallel ranks (default: 1; tp x sp = the torchrun world)")
    p.add_argument("--sp", default=1,
                   help="sequence-parallel ranks, each holding the whole model (default: 1)")
    p.add_argument("--backend", default="torch",
                   help=f"attention backend ({', '.join(BACKEND_NAMES)}; default: torch)")
    p.add_argument("--page-size", default=16,
                   help="tokens a logical page holds, a multiple of P (default: 16)")
    p.add_argument("--temperature", default=0.0,
                   help="sampling temperature (default: 0, greedy)")
    p.add_argument("--top-k", help="sample among the k most likely tokens")
    p.add_argument("--top-p", help="sample within this probability mass")
    p.add_argument("--seed", default=0, help="the sampling seed (default: 0)")
    p.add_argument("--max-tokens-per-step", default=DEFAULT_TOKENS_PER_STEP,
                   help=f"a step's token budget; longer prompts prefill in chunks (default: "
                        f"{DEFAULT_TOKENS_PER_STEP})")
    p.add_argument("--dtype", default=None,
                   help=f"model dtype ({', '.join(DTYPES)}; default: float32 for the tiny model "
                   "and for a checkpoint on the CPU, bfloat16 for a checkpoint on CUDA)")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="replay decode steps from captured CUDA graphs (CUDA)")
    p.add_argument("--compile", action="store_true",
                   help="compile the decoder layers, in the captured steps and the eager "
                   "prefill steps (with --cuda-graphs)")
    p.add_argument("--overlap-planning", action="store_true",
                   help="plan each decode step while the previous one runs")
    p.add_argument("--json", metavar="PATH", help="rank 0 writes P, mode, world, the KV bytes "
                   "per rank and every request's prompt, tokens and text to PATH")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return _numbers(p.parse_args(argv))


def _numbers(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` with its numbers converted here, not by argparse's ``type=``, which stops at the
    first bad value: one that is no number is None, named in ``args.unparsed`` (with argparse's
    words), which ``argument_problems`` names with the rest."""
    args.unparsed = []
    for dest, kind in NUMBERS.items():
        value = getattr(args, dest)
        if isinstance(value, str):
            try:
                value = kind(value)
            except ValueError:
                args.unparsed.append(f"argument --{dest.replace('_', '-')}: invalid "
                                     f"{kind.__name__} value: {value!r}")
                value = None
            setattr(args, dest, value)
    return args


def model_path_problems(path: str | None) -> list[str]:
    if path is None:
        return []
    if not os.path.exists(path):
        return [f"--model {path}: no such folder (a local checkpoint folder is expected)"]
    if not os.path.isdir(path):
        return [f"--model {path}: not a folder (a local checkpoint folder is expected)"]
    if not os.path.isfile(os.path.join(path, "config.json")):
        return [f"--model {path}: no config.json in it (not a checkpoint folder)"]
    return []


def argument_problems(args, cuda: bool) -> list[str]:
    """What is wrong with the command line, found before anything is loaded (a number that is
    none, None in ``args``, named once: ``args.unparsed``)."""
    def below_one(value) -> bool:
        return value is not None and value < 1

    problems = list(getattr(args, "unparsed", [])) + model_path_problems(args.model)
    if below_one(args.page_size):
        problems.append(f"--page-size must be >= 1, got {args.page_size}")
    if below_one(args.max_new_tokens):
        problems.append(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.cuda_graphs and not cuda:
        problems.append("--cuda-graphs needs CUDA")
    if args.compile and not args.cuda_graphs:
        problems.append("--compile compiles the captured step: it needs --cuda-graphs")
    if below_one(args.tp) or below_one(args.sp):
        problems.append(f"--tp and --sp must be >= 1, got {args.tp} and {args.sp}")
    # Checked here, not by argparse's choices, which stop at the first bad one.
    for flag, value, allowed in (("--backend", args.backend, BACKEND_NAMES),
                                 ("--mode", args.mode, MODES), ("--dtype", args.dtype, DTYPES)):
        if value is not None and value not in allowed:
            problems.append(f"{flag} must be one of {', '.join(allowed)}, got {value!r}")
    if args.mode in ("tp", "sp") and not args.context_parallel:
        problems.append(f"--mode {args.mode} picks the context-parallel partners: it needs "
                        f"--context-parallel")
    sp = args.sp or 1
    sp_partners = args.context_parallel and (args.mode == "sp"
                                             or (args.mode == "auto" and sp > 1))
    if sp_partners and sp > 1 and args.page_size and args.page_size % sp:  # TP: from the model
        problems.append(f"--page-size {args.page_size} must be a multiple of the {sp} SP "
                        f"partners (each holds an equal share of every page's slots)")
    if below_one(args.max_tokens_per_step):
        problems.append(f"--max-tokens-per-step must be >= 1, got {args.max_tokens_per_step}")
    try:  # in place of a number named as unparsed, the default
        SamplingParams(0.0 if args.temperature is None else args.temperature, args.top_k,
                       args.top_p, args.seed or 0)
    except ValueError as e:  # --temperature, --top-k, --top-p
        problems.append(str(e))
    folder = os.path.dirname(os.path.abspath(args.json)) if args.json else None
    json_problem = folder and (f"the folder {folder} does not exist" if not os.path.isdir(folder)
                               else "a folder, not a file" if os.path.isdir(args.json)
                               else f"the folder {folder} is not writable"
                               if not os.access(folder, os.W_OK) else None)
    return problems + ([f"--json {args.json}: {json_problem}"] if json_problem else [])
