"""Every Triton kernel of torch_cp, as Inductor copies it into the code it generates.

Where compiled code calls a kernel (the one-token linears, the router, the fused experts, the
state kernels), Inductor traces it and writes its source, with the Triton functions and constants
it names, into a module of its own under its Triton imports. A name that the copy leaves
undefined fails only as that kernel compiles on the GPU: the router and the fused experts called
``pdl.wait``, a function named through its module, and every compiled MoE step without the
dependent launch died with ``NameError: 'pdl' is not defined`` (run 114). Here each kernel's
copy is compiled as Python, and every global name its functions load must be defined by the
copy or the imports (``tests/helpers/inductor_copies.py``).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import inductor_copies
import pytest

pytest.importorskip("triton", reason="the kernels are Triton")
ROOT = pathlib.Path(__file__).parents[2]


def test_inductors_copy_of_each_kernel_defines_every_name_it_uses():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, inductor_copies.__file__], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    undefined = json.loads(done.stdout.splitlines()[-1])
    modules = {name.rsplit(".", 1)[0] for name in undefined}
    assert modules == set(inductor_copies.MODULES), modules  # a kernel in each
    assert {k: v for k, v in undefined.items() if v} == {}


def test_every_module_with_kernels_is_checked():
    with_kernels = {p.relative_to(ROOT).with_suffix("") for p in
                    (*ROOT.glob("torch_cp/**/*.py"), *ROOT.glob("graphs/*.py"),
                     *ROOT.glob("models/*.py")) if "@triton.jit" in p.read_text()}
    names = {".".join(("torch_cp", *p.parts) if p.parts[0] in ("graphs", "models") else p.parts)
             for p in with_kernels}
    assert names == set(inductor_copies.MODULES)


def test_a_function_named_through_its_module_is_found():
    """The check itself, on the form that failed in run 114."""
    source = "import triton\n\n\ndef k(PDL):\n    pdl.wait(PDL)\n    tl.store(PDL)\n"
    assert inductor_copies.undefined_names(source) == ["pdl", "tl"]
