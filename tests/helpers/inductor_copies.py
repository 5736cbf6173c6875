"""Every Triton kernel of torch_cp as Inductor copies it into the code it generates, and the
global names that copy leaves undefined (``tests/core/test_kernels_in_inductor.py``).

Run as a script in a process without ``TRITON_INTERPRET`` (whose kernels are not the
``JITFunction`` objects Inductor copies): prints ``{kernel: [undefined names]}`` as JSON.
"""

from __future__ import annotations

import builtins
import dis
import importlib
import json
import types

MODULES = ["torch_cp.gemv", "torch_cp.pdl", "torch_cp.attention.triton_decode",
           "torch_cp.kv.write_kernel", "torch_cp.kv.rotate_kernel", "torch_cp.state.conv_kernel",
           "torch_cp.state.decode_kernel",
           "torch_cp.graphs.grouped_experts", "torch_cp.graphs.fused_experts",
           "torch_cp.graphs.fused_router"]


def undefined_names(source: str) -> list[str]:
    """Global names that functions of ``source`` (a module) load and it does not define."""
    module = compile(source, "<inductor>", "exec")
    defined = {i.argval for i in dis.get_instructions(module)
               if i.opname in ("STORE_NAME", "IMPORT_NAME", "IMPORT_FROM")} | set(dir(builtins))
    functions = [c for c in module.co_consts if isinstance(c, types.CodeType)]
    loaded = {i.argval for code in functions for i in dis.get_instructions(code)
              if i.opname == "LOAD_GLOBAL"}
    return sorted(loaded - defined)


def undefined_by_kernel() -> dict[str, list[str]]:
    """Each kernel defined in ``MODULES``: what Inductor's copy of it (under Inductor's Triton
    imports) leaves undefined."""
    import triton
    from torch._inductor.codegen.triton import TritonKernel
    from torch._inductor.codegen.wrapper import (
        user_defined_triton_kernel_transitive_closure_source_code as inductor_copy,
    )

    found = {}
    for name in MODULES:
        module = importlib.import_module(name)
        for attr, value in vars(module).items():
            if isinstance(value, triton.JITFunction) and value.fn.__module__ == name:
                source = (TritonKernel.gen_common_triton_imports() + "\n@triton.jit\n"
                          + inductor_copy(value))
                found[f"{name}.{attr}"] = undefined_names(source)
    return found


if __name__ == "__main__":
    print(json.dumps(undefined_by_kernel()))
