"""Every private PyTorch and transformers hook torch_cp relies on, in one place.

Each is an attribute or signature a release may change without notice;
``tests/project/test_compat.py`` checks them against the installed versions and fails loudly,
naming the hook, when one moves.

- ``nn.Module._compiled_call_impl`` and ``_call_impl``: what ``nn.Module.compile()`` sets (the
  compiled ``_call_impl``) and ``__call__`` then runs; set per decoder layer for regional
  compilation.
- ``torch._dynamo.config`` ``allow_unspec_int_on_nn_module`` and ``recompile_limit``: the layer
  index traced as a symbol, and room for the graphs a capture compiles.
- ``torch._inductor.config.triton.enable_pdl``: Inductor's kernels launched as dependent launches
  (``torch_cp/pdl.py``), set around the compiled layers' compilation when torch_cp's are;
  ``TritonKernel._handle_pdl_before_access`` and ``Scheduler.previous_node``, which decide
  where such a kernel waits (made to wait before every access).
- ``torch.distributed._functional_collectives``: traceable collectives (``all_gather_tensor`` was
  renamed ``all_gather_single`` in torch 2.13; the GPU machine's 2.11 has only the old name).
- ``GenerationMixin._prepare_cache_for_generation``: where ``model.generate`` builds its cache;
  a patched model overrides it to build a paged one. ``PreTrainedModel.use_kernels`` (5.25): the
  kernels hub's layers, turned off before patching.
- transformers' torch gated delta rules (``torch_chunk_gated_delta_rule``,
  ``torch_recurrent_gated_delta_rule`` in ``modeling_qwen3_5``), wrapped by a decorator that
  dispatches to flash-linear-attention when it is installed (from 5.25 inside the ``kernels``
  hub's module, which holds it in its ``forward``'s closure): the reference kernels are the
  wrapped functions (``__wrapped__``). ``ACT2FN`` names the activations.
- ``config._experts_implementation``: which experts forward a ``@use_experts_implementation``
  MoE block runs (``graphs/experts.py`` reads it, and sets it where ``set_experts_implementation``
  does not reach). ``transformers.integrations.moe._grouped_linear``: the grouped GEMM of its
  ``grouped_mm`` experts (``torch._grouped_mm``, or its fallback where that cannot run), which
  ``graphs/sorted_experts.py`` runs with its own combine; ``_default_apply_gate``, the gate
  ``@use_experts_implementation`` gives a class that defines none (the fused kernels compute
  only that one).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import types
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

# Imported here, not where it is called: Dynamo (torch 2.11) cannot trace an import statement
# whose package is transformers' lazy module ("Bad import result", run 79).
from transformers.integrations import moe as transformers_moe

all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
all_to_all_single = funcol.all_to_all_single
all_reduce = funcol.all_reduce
wait_tensor = funcol.wait_tensor
# The classic all-gather into one tensor, renamed like funcol's in torch 2.13 (2.11 has the old).
gather_into_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _eager_gloo(group) -> bool:
    """Over gloo outside tracing, the classic collectives: torch 2.13's functional collectives
    over gloo crashed a spawned CPU rank in two of about six CI runs (heap corruption at CI stop
    26, then a segfault inside an all-gather's ``wait_tensor`` in a fresh-clone run)."""
    return not torch.compiler.is_compiling() and dist.get_backend(group) == "gloo"


def gather_dim0(x: torch.Tensor, group) -> torch.Tensor:
    """[X, ...] -> [P * X, ...], rank p's ``x`` at rows ``[p * X, (p + 1) * X)``."""
    if _eager_gloo(group):
        out = x.new_empty((dist.get_world_size(group) * x.shape[0], *x.shape[1:]))
        gather_into_tensor(out, x, group=group)
        return out
    return wait_tensor(all_gather(x, 0, group))


def all_to_all_dim0(x: torch.Tensor, group) -> torch.Tensor:
    """[P * X, ...] -> [P * X, ...]: chunk p goes to rank p, and chunk p holds rank p's."""
    if _eager_gloo(group):
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out
    return wait_tensor(all_to_all_single(x, None, None, group))


def sum_over(t: torch.Tensor, group) -> torch.Tensor:
    """``t`` summed over ``group`` (out of place)."""
    if _eager_gloo(group):
        out = t.clone()
        dist.all_reduce(out, group=group)
        return out
    return wait_tensor(all_reduce(t, "sum", group))


COMPILED_CALL = "_compiled_call_impl"
PREPARE_CACHE = "_prepare_cache_for_generation"
PREPARE_CACHE_PARAMS = ("generation_config", "model_kwargs", "generation_mode", "batch_size",
                        "max_cache_length")
DYNAMO_OPTIONS = ("allow_unspec_int_on_nn_module", "recompile_limit")
INDUCTOR_PDL = "triton.enable_pdl"
INDUCTOR_PDL_ACCESS = "_handle_pdl_before_access"  # TritonKernel's; reads scheduler.previous_node


def compile_call(module: nn.Module) -> Callable:
    """What ``nn.Module.compile(fullgraph=True)`` makes: ``module._call_impl`` compiled."""
    return torch.compile(module._call_impl, fullgraph=True)


def compiled_call(module: nn.Module) -> Callable | None:
    """What ``module(...)`` runs instead of its forward when compiled (None: eager)."""
    return getattr(module, COMPILED_CALL, None)


def set_compiled_call(module: nn.Module, compiled: Callable | None) -> None:
    """Make ``module(...)`` run ``compiled`` (``None``: eager again), as ``nn.Module.compile``
    does, without making a new ``torch.compile`` wrapper each time."""
    setattr(module, COMPILED_CALL, compiled)


@contextlib.contextmanager
def dynamo_layer_options(recompile_limit: int) -> Iterator[None]:
    """Dynamo traces int attributes of modules (the layer index) as symbols, and may compile up
    to ``recompile_limit`` graphs per code object, within the block."""
    with torch._dynamo.config.patch(allow_unspec_int_on_nn_module=True,
                                    recompile_limit=recompile_limit):
        yield


@contextlib.contextmanager
def inductor_pdl(on: bool) -> Iterator[None]:
    """Inductor's own Triton kernels take the dependent launch (``triton.enable_pdl``, read as
    it generates code) within the block, where ``on``, each waiting before its first access;
    else nothing changes.

    Inductor waits before an access only where the node generated just before wrote (or, for
    a store, touched) that buffer: a kernel could load, before its wait, what a kernel still
    running wrote (an output of a custom op whose results Inductor splits into nodes of their
    own), or end without waiting at all (one that only stores), and let its successor start
    before the kernel two back has ended. With no previous node Inductor waits before every
    access, as torch_cp's own kernels do (``torch_cp/pdl.py``): so each access is generated
    with none."""
    if not on:
        yield
        return
    from torch._inductor.codegen.triton import TritonKernel

    original = TritonKernel.__dict__.get(INDUCTOR_PDL_ACCESS)
    if original is None:  # a torch that moved it: Inductor's own rule, said once
        _warn_once("torch_cp: Inductor's kernels take the dependent launch with their own "
                   f"waits (no TritonKernel.{INDUCTOR_PDL_ACCESS} to make them wait first)")
    install = original is not None and not getattr(original, "_torch_cp_wait_first", False)
    if install:  # not where an enclosing block did
        setattr(TritonKernel, INDUCTOR_PDL_ACCESS, _wait_first(original))
    try:
        with torch._inductor.config.patch({INDUCTOR_PDL: True}), _pdl_cache_tag():
            yield
    finally:
        current = TritonKernel.__dict__.get(INDUCTOR_PDL_ACCESS)
        if install and getattr(current, "_torch_cp_wait_first", False):
            setattr(TritonKernel, INDUCTOR_PDL_ACCESS, original)


def _wait_first(original: Callable) -> Callable:
    """``original`` (``TritonKernel._handle_pdl_before_access``) called with no previous node."""
    from torch._inductor.virtualized import V

    def wait_first(self, *args, **kwargs):
        scheduler = getattr(V.graph, "scheduler", None)
        if scheduler is None:
            return original(self, *args, **kwargs)
        previous, scheduler.previous_node = scheduler.previous_node, None
        try:
            return original(self, *args, **kwargs)
        finally:
            scheduler.previous_node = previous

    wait_first._torch_cp_wait_first = True
    return wait_first


def _pdl_cache_tag() -> contextlib.AbstractContextManager:
    """Inductor's caches key on its config, not on the patched method: a tag of their own keeps
    kernels generated under Inductor's own waits from being reused."""
    import torch.compiler.config as compiler_config

    if not hasattr(compiler_config, "cache_key_tag"):
        return contextlib.nullcontext()
    return compiler_config.patch(
        cache_key_tag=f"{compiler_config.cache_key_tag}+torch_cp-pdl-wait-first")


@functools.cache
def _warn_once(message: str) -> None:
    logging.getLogger("torch_cp").warning(message)


def hub_kernels_off(model: nn.Module) -> bool:
    """Turn transformers' kernels-hub layers off (``use_kernels``, which ``from_pretrained`` turns
    on by default from 5.25): the model runs its torch layers, and a later change of kernels mode
    (``model.train()`` / ``eval()``) no longer re-kernelizes it, which would drop every forward
    torch_cp installs on a layer class the hub decorates. Returns whether they were on."""
    if not getattr(model, "use_kernels", False):
        return False
    model.use_kernels = False  # kernelizes with an empty mapping: no hub access
    return True


def override_prepare_cache(model: nn.Module, prepare: Callable) -> None:
    """Make ``model.generate`` build its cache with ``prepare(self, *PREPARE_CACHE_PARAMS)``."""
    setattr(model, PREPARE_CACHE, types.MethodType(prepare, model))


def restore_prepare_cache(model: nn.Module) -> None:
    model.__dict__.pop(PREPARE_CACHE, None)


def prepare_cache_default(model: nn.Module, *args) -> None:
    """The class's own ``_prepare_cache_for_generation`` (what the override falls back to)."""
    getattr(type(model), PREPARE_CACHE)(model, *args)


def cache_kwarg(model: nn.Module) -> str:
    """The forward's name for the cache: ``cache`` from transformers 5.2x, ``past_key_values``
    before (later releases drop the old name)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def experts_implementation(experts: nn.Module) -> str | None:
    """The experts implementation a transformers MoE ``experts`` module dispatches to."""
    return experts.config._experts_implementation


def set_experts_implementation(model: nn.Module, experts: list[nn.Module], name: str) -> None:
    """Switch ``model``'s MoE experts to ``name``, also in sub-configs the public setter skips."""
    model.set_experts_implementation(name)
    for e in experts:
        e.config._experts_implementation = name


def grouped_linear(x_sd: torch.Tensor, weight_eod: torch.Tensor, offsets: torch.Tensor
                   ) -> torch.Tensor:
    """[S, O]: rows of ``x_sd`` [S, D], sorted by expert and ending at ``offsets`` [E] (int32,
    cumulative), each times its expert's ``weight_eod`` [E, O, D] transposed."""
    return transformers_moe._grouped_linear(x_sd, weight_eod, offsets)


def has_default_gate(experts: nn.Module) -> bool:
    """Whether a transformers experts module gates with the default ``act_fn(gate) * up`` over
    the halves of its gate/up output, not a gate of its class's own."""
    return getattr(type(experts), "_apply_gate", None) is transformers_moe._default_apply_gate


def torch_gated_delta_rules() -> tuple[Callable, Callable]:
    """transformers' torch (chunked, recurrent) gated delta rules, never flash-linear-attention's
    kernels that their module-level names dispatch to when it is installed."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    return tuple(unwrapped(getattr(m, name), name) for name in (
        "torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"))


def unwrapped(fn: Callable, name: str) -> Callable:
    """The function ``name`` under transformers' wrappers: ``functools.wraps``' (``__wrapped__``)
    and, from transformers 5.25 (which brings the ``kernels`` package), the hub's module that
    calls it (``kernels``' ``Func``: an ``nn.Module`` whose ``forward`` holds it in its closure)."""
    for _ in range(8):
        if getattr(fn, "__wrapped__", None) is not None:
            fn = fn.__wrapped__
        elif isinstance(fn, torch.nn.Module):
            cells = getattr(type(fn).forward, "__closure__", None) or ()
            held = [c.cell_contents for c in cells
                    if getattr(c.cell_contents, "__name__", None) == name]
            if len(held) != 1:
                break
            fn = held[0]
        else:
            return fn
    raise RuntimeError(f"transformers' {name} is wrapped in a way torch_cp does not know "
                       f"({type(fn).__name__}): torch_cp.compat needs updating")


def activation(name: str) -> Callable:
    """transformers' activation function called ``name``."""
    from transformers.activations import ACT2FN

    return ACT2FN[name]
