"""Checks of an ``Engine``'s arguments, made before anything is allocated (every problem named)."""

from __future__ import annotations

import torch

from torch_cp.fused_linear import fuse_replaced
from torch_cp.placement import page_size_problems
from torch_cp.runtime import cast_problems


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def positive_ints(*values, none: bool = False) -> bool:
    """Every value a positive int (or None, with ``none``)."""
    return all((none and v is None) or _positive_int(v) for v in values)


def checked(problems: list[str], make, *args):
    """``make(*args)``, or None with its exception's message added to ``problems`` (any
    exception: a tokenizer or chat template may raise anything, and under torchrun a rank that
    raised before the call's gather would leave the others waiting in it)."""
    try:
        return make(*args)
    except ValueError as e:
        problems.append(str(e))
    except Exception as e:  # noqa: BLE001 (named, as a problem, on every rank)
        problems.append(f"{type(e).__name__}: {e}")
    return None


def flag_problems(**flags) -> list[str]:
    """Each of ``flags`` that is not True or False (a string "False" is truthy)."""
    return [f"{name} must be True or False, got {flag!r}" for name, flag in flags.items()
            if not isinstance(flag, bool)]


def changed_model_problems(model, runtime) -> list[str]:
    """What stops an engine made for ``runtime`` (``model.torch_cp`` when it was made) running
    ``model`` now: patched again or unpatched since, or cast or moved after patching. Cheap
    (``submit`` asks it of every request)."""
    if getattr(model, "torch_cp", None) is not runtime:
        return ["the model was unpatched or patched again after this Engine was made for it: "
                "make a new Engine"]
    return cast_problems(model, runtime)


def model_problems(model, runtime) -> list[str]:
    """``changed_model_problems``, after fusing again the linears whose parameters were
    replaced (``fuse_replaced``: a pass over every module), and a model without an LM head to
    give logits (a base model)."""
    if getattr(model, "torch_cp", None) is runtime:
        fuse_replaced(model)
    problems = changed_model_problems(model, runtime)
    if problems:
        return problems
    head = getattr(model, "get_output_embeddings", None)
    if not callable(head) or head() is None:
        problems.append(f"{type(model).__name__} has no LM head, so no logits to sample from: "
                        f"patch and run the model with its head (AutoModelForCausalLM), not "
                        f"its base model")
    return problems


def _bucket_problems(mixed_buckets) -> list[str]:
    """Why ``mixed_buckets`` are not (rows, tokens) shapes with tokens > rows >= 1."""
    try:
        shapes = [tuple(b) for b in mixed_buckets]
    except TypeError:
        return [f"mixed_buckets must be (rows, tokens) pairs, got {mixed_buckets!r}"]
    bad = [s for s in shapes
           if len(s) != 2 or not all(_positive_int(x) for x in s) or not s[0] < s[1]]
    return [f"mixed bucket {s!r} is not (rows, tokens) with ints tokens > rows >= 1" for s in bad]


def engine_problems(num_pages, page_size, partners: int, max_tokens_per_step, max_rows,
                    max_pages_per_row, mixed_buckets, cuda_graphs: bool, compile: bool,
                    device, prefix_caching=False, hybrid: bool = False,
                    state_checkpoints=None, backend=None, overlap_planning=False,
                    progress=False) -> list[str]:
    """Every problem with ``Engine``'s arguments (see its docstring); empty when none.
    ``backend``: the model's attention backend, asked about captured mixed buckets where it
    can refuse their steps (``mixed_bucket_problems``: FlashInfer's MLA planner cap)."""
    problems = []
    if not _positive_int(num_pages):
        problems.append(f"num_pages must be a positive int, got {num_pages!r}")
    problems += page_size_problems(page_size, partners)
    if not _positive_int(max_tokens_per_step):
        problems.append(f"max_tokens_per_step must be a positive int, got {max_tokens_per_step!r}")
    if max_rows is not None and not _positive_int(max_rows):
        problems.append(f"max_rows must be a positive int or None, got {max_rows!r}")
    if max_pages_per_row is not None and not _positive_int(max_pages_per_row):
        problems.append(
            f"max_pages_per_row must be a positive int or None, got {max_pages_per_row!r}")
    buckets = _bucket_problems(mixed_buckets)
    problems += buckets
    if not buckets and mixed_buckets and not cuda_graphs:
        problems.append("mixed_buckets are captured shapes: they need cuda_graphs=True")
    if not buckets and mixed_buckets and hasattr(backend, "mixed_bucket_problems"):
        problems += backend.mixed_bucket_problems([tuple(b) for b in mixed_buckets])
    if cuda_graphs and torch.device(device).type != "cuda":
        problems.append(f"cuda_graphs needs a model on CUDA, not {device}")
    if compile and not cuda_graphs:
        problems.append("compile=True compiles the captured step: it needs cuda_graphs=True")
    problems += flag_problems(cuda_graphs=cuda_graphs, compile=compile,
                              overlap_planning=overlap_planning, prefix_caching=prefix_caching,
                              progress=progress)
    if state_checkpoints is not None:
        if not (hybrid and prefix_caching is True):
            problems.append("state_checkpoints: only a hybrid model (linear attention) with "
                            "prefix_caching=True keeps state checkpoints")
        elif not _positive_int(state_checkpoints):
            problems.append(f"state_checkpoints must be a positive int or None, got "
                            f"{state_checkpoints!r}")
    if hybrid and mixed_buckets and not buckets:
        problems.append("mixed_buckets: a hybrid model's multi-token steps run the chunked "
                        "gated delta rule per row from host lengths, which a CUDA graph cannot "
                        "hold; they run eagerly (compiled with compile=True), so capture "
                        "decode buckets only")
    return problems
