"""KV-cache sizing: bytes per rank from the pool geometry (what context parallelism saves), a
hybrid model's linear-attention state per rank (and the state pool an ``Engine`` allocates),
and the pages a batch of requests needs."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from torch_cp.agreement import across_ranks
from torch_cp.engine.checks import positive_ints
from torch_cp.placement import page_size_problems
from torch_cp.state import LinearGeometry, StatePool
from torch_cp.values import as_int, positive_int


def _config_and_dtype(model_or_config) -> tuple[object, torch.dtype]:
    """The text config of an unpatched model or config, and the dtype its caches take (the
    model's, else the config's, else float32)."""
    config = getattr(model_or_config, "config", model_or_config)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    dtype = getattr(model_or_config, "dtype", None)
    if not isinstance(dtype, torch.dtype):
        dtype = getattr(config, "dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.removeprefix("torch."))
    return config, dtype


def _per_slot_elements(model_or_config) -> tuple[int, int, torch.dtype]:
    """(layers, cache elements of one token slot of one layer, dtype) of one unplaced rank."""
    runtime = getattr(model_or_config, "torch_cp", None)
    if runtime is not None:
        g = runtime.geometry
        per_slot = 2 * g.kv_heads * g.head_dim if g.kind == "gqa" else g.kv_lora_rank + g.rope_dim
        return runtime.num_layers, per_slot, runtime.dtype
    config, dtype = _config_and_dtype(model_or_config)
    if getattr(config, "kv_lora_rank", None):
        per_slot = config.kv_lora_rank + config.qk_rope_head_dim
    else:
        head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads)
        per_slot = 2 * config.num_key_value_heads * head_dim
    layer_types = getattr(config, "layer_types", None)
    layers = (sum(t != "linear_attention" for t in layer_types) if layer_types
              else config.num_hidden_layers)
    return layers, per_slot, dtype


def kv_bytes_per_rank(model_or_config, tokens: int, partners: int = 1, page_size: int = 16) -> int:
    """Bytes of paged KV one rank holds for ``tokens`` tokens of context when ``partners`` ranks
    stripe every page between them (P = ``partners``).

    Args:
        model_or_config: a patched model (its per-rank geometry, layers and pool dtype), or an
            unpatched model / config (all KV heads on one rank).
        tokens: context length of one sequence; it occupies ``ceil(tokens / page_size)`` pages.
        partners: P; ``page_size`` must be a multiple of it.
        page_size: logical page size in tokens.
    Returns:
        ``layers * pages * (page_size // P) * bytes per token slot``.
    """
    problems = []
    if as_int(tokens) is None or tokens < 0:
        problems.append(f"tokens must be an int >= 0, got {tokens!r}")
    if positive_int(partners) is None:
        problems.append(f"partners must be an int >= 1, got {partners!r}")
    else:
        problems += page_size_problems(page_size, partners)
    if problems:
        raise ValueError("; ".join(problems))
    tokens, partners = as_int(tokens), as_int(partners)
    layers, per_slot, dtype = _per_slot_elements(model_or_config)
    pages = -(-tokens // page_size)
    element = torch.empty((), dtype=dtype).element_size()
    return layers * pages * (page_size // partners) * per_slot * element


def state_bytes_per_rank(model_or_config, requests: int = 1, tp: int = 1) -> int:
    """Bytes of linear-attention state one rank holds for ``requests`` running requests of a
    hybrid model (Qwen3.5, Qwen3-Next); 0 for a model without linear attention. The state is not
    striped, so P does not divide it: TP splits its heads, SP partners each hold it whole.

    Args:
        model_or_config: a patched model (its per-rank share), or an unpatched model / config
            (split over ``tp`` ranks; the conv state in the model's dtype, else the config's,
            else float32).
        requests: state slots: running requests (one each), plus an ``Engine``'s
            ``state_checkpoints`` when it caches prefixes. ``Engine.state_bytes`` is its whole
            state pool: a slot for each of its ``max_rows`` (64 by default) and checkpoints,
            a sink slot for padding rows and a zero slot fresh rows start from.
        tp: the TP ranks an unpatched model's linear heads split over (a patched model knows).
    """
    if as_int(requests) is None or requests < 0 or positive_int(tp) is None:
        raise ValueError(f"need requests an int >= 0 and tp an int >= 1, got {requests!r} and "
                         f"{tp!r}")
    runtime = getattr(model_or_config, "torch_cp", None)
    if runtime is not None:
        return 0 if runtime.linear is None else requests * runtime.linear.slot_bytes(
            runtime.dtype)
    config, dtype = _config_and_dtype(model_or_config)
    if not any(t == "linear_attention" for t in getattr(config, "layer_types", None) or ()):
        return 0
    return requests * LinearGeometry.from_config(config, tp).slot_bytes(dtype)


# An Engine's most rows of a captured step, and a hybrid model's running requests (each holds a
# state slot) when max_rows is None.
DEFAULT_GRAPH_ROWS = 64


def state_slot_counts(hybrid: bool, max_rows: int | None, prefix_caching: bool,
                      state_checkpoints: int | None) -> tuple[int, int]:
    """(slots of running requests, checkpoint slots) of an ``Engine``'s state pool: a hybrid
    model's running requests hold one each (``max_rows`` of them), and prefix caching keeps as
    many state checkpoints unless ``state_checkpoints`` says."""
    running = (max_rows or DEFAULT_GRAPH_ROWS) if hybrid else 0
    return running, (state_checkpoints or running) if prefix_caching else 0


def state_pool_bytes(runtime, max_rows: int | None = None, prefix_caching: bool = False,
                     state_checkpoints: int | None = None) -> int:
    """Bytes of the state pool an ``Engine`` with these arguments allocates on this rank (0 for
    a model without linear attention): what a default KV pool leaves free for it."""
    if runtime.linear is None:
        return 0
    slots = sum(state_slot_counts(True, max_rows, prefix_caching, state_checkpoints))
    return StatePool.bytes_for(runtime.linear, slots, runtime.dtype)


def lifetime_pages(prompt, max_new_tokens: int, page_size: int) -> int:
    """Pages a request holds at most (its last generated token is never cached)."""
    return -(-max(len(prompt) + max_new_tokens - 1, 1) // page_size)


def pool_bytes_per_page(runtime, page_size: int) -> int:
    """Bytes one logical page of ``runtime``'s pool takes on this rank, every layer."""
    return runtime.new_pool(1, page_size, "meta").bytes // 2  # one page plus the sink page


# Share of free host memory a default pool may take on CPU (activations, logits and the rest of
# the process need the remainder); on CUDA 90% of the device's free memory.
HOST_MEMORY_SHARE = 0.5
DEVICE_MEMORY_SHARE = 0.9


def free_host_bytes() -> int | None:
    """Host memory free for a new allocation: Linux's MemAvailable (page cache counts as free),
    else the POSIX free physical pages; ``None`` where neither is known."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def memory_cap_pages(runtime, page_size: int, reserved_bytes: int = 0) -> int | None:
    """Most pages a default pool takes: a share of the free memory of the pool's device
    (``DEVICE_MEMORY_SHARE`` of a GPU's, ``HOST_MEMORY_SHARE`` of the host's) less
    ``reserved_bytes`` (what the engine allocates beside it: a hybrid model's state pool);
    ``None`` when the free memory is unknown."""
    free = _free_bytes(runtime)
    if free is None:
        return _agreed(None, runtime)
    share = DEVICE_MEMORY_SHARE if torch.device(runtime.device).type == "cuda" else \
        HOST_MEMORY_SHARE
    budget = int(share * free) - reserved_bytes
    # logical pages: the pool allocates its sink page beside them
    return _agreed(max(1, budget // pool_bytes_per_page(runtime, page_size) - 1), runtime)


def pool_fit_problems(runtime, page_size: int, num_pages: int, reserved_bytes: int = 0,
                      default: bool = False) -> list[str]:
    """Why a pool of ``num_pages`` and ``reserved_bytes`` beside it (a hybrid model's state
    pool) cannot fit in the free memory of this rank's device, before any of it is allocated
    (``default``: the smallest pool that sizing by the requests can make, one page).
    No collective: callers gather every rank's problems (``torch_cp.agreement``), so a pool
    that fits on one rank only is refused on every rank, naming the rank it does not fit."""
    free = _free_bytes(runtime)
    per_page = pool_bytes_per_page(runtime, page_size)
    # logical pages: the pool allocates its sink page beside them (helper 88)
    fits = None if free is None else max(0, (free - reserved_bytes) // per_page - 1)
    if fits is None or num_pages <= fits:
        return []
    beside = (f" beside {reserved_bytes / 2**30:.1f} GiB of state pool" if reserved_bytes
              else "")
    what = (f"the default pool's first page (page_size {page_size}) needs" if default
            else f"num_pages {num_pages} need")
    return [f"{what} {num_pages * per_page / 2**30:.1f} GiB of pool on each rank{beside}; the "
            f"free memory holds at most {fits} pages"]


def engine_fit_problems(runtime, page_size, num_pages, max_rows, prefix_caching,
                        state_checkpoints, default: bool = False) -> list[str]:
    """``pool_fit_problems`` of an ``Engine``'s pools: its KV pool beside its state pool (a
    hybrid model's), each where its own arguments are valid: the state pool alone where the KV
    pool's are not, so that it is named beside them."""
    state = (state_pool_bytes(runtime, max_rows, prefix_caching, state_checkpoints)
             if positive_ints(max_rows, state_checkpoints, none=True) else 0)
    if positive_ints(num_pages) and not runtime.placement.page_size_problems(page_size):
        return pool_fit_problems(runtime, page_size, num_pages, state, default)
    free = _free_bytes(runtime)
    if free is None or state <= free:
        return []
    return [f"the state pool needs {state / 2**30:.1f} GiB on each rank (a state slot for "
            f"each of max_rows and state_checkpoints); the free memory holds "
            f"{free / 2**30:.1f} GiB"]


def _free_bytes(runtime) -> int | None:
    """Free memory of the pool's device on this rank: the GPU's, or the host's (None where it is
    not known). On a GPU the blocks torch's caching allocator holds unused count as free (it
    gives them back to allocate a pool): a pool the size of one just dropped fits again."""
    device = torch.device(runtime.device)
    if device.type != "cuda":
        return free_host_bytes()
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return torch.cuda.mem_get_info(device)[0] + cached


def _agreed(cap: int | None, runtime) -> int | None:
    """The smallest cap of every rank: ranks see different free memory, and pools of different
    sizes would split their schedulers."""
    if not across_ranks(runtime.spans_ranks):
        return cap
    unknown = 2**62
    device = runtime.device if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor([unknown if cap is None else cap], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return None if int(t) == unknown else int(t)


def default_num_pages(prompts, news, page_size: int, cap: int | None) -> int:
    """Pages for every request's whole lifetime, at most ``cap`` (``memory_cap_pages``). A
    request whose lifetime alone exceeds ``cap`` can never fit and adds nothing: a huge
    ``max_new_tokens`` gets its error result without sizing the pool."""
    lifetimes = [lifetime_pages(p, n, page_size) for p, n in zip(prompts, news)]
    need = max(1, sum(n for n in lifetimes if cap is None or n <= cap))
    return need if cap is None else min(need, cap)
