"""The package's layering, checked on its import statements: the core (placement, plan, kv,
attention) imports neither the engine nor the Hugging Face bridge, model families do not import
the cache adapter, graphs/ reaches neither the model registry nor the Hugging Face bridge (which
installs its experts and routers), and no module grows past the
size one concept needs."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"torch_cp": ROOT / "torch_cp", "torch_cp.models": ROOT / "models",
            "torch_cp.graphs": ROOT / "graphs"}
MAX_LINES = 300


def modules() -> dict[str, Path]:
    found = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            name = ".".join((package, *parts))
            if package == "torch_cp" and parts[:1] in (("models",), ("graphs",)):
                continue
            found[name] = path
    return found


def imports(path: Path) -> set[str]:
    """Every ``torch_cp...`` module a file imports, at any depth (lazy imports included)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m.startswith("torch_cp")}


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


RULES = [  # (importer, imported, why)
    ("torch_cp.attention", "torch_cp.engine", "attention must not know the engine"),
    ("torch_cp.engine", "torch_cp.attention", "the engine reaches kernels through the backend"),
    ("torch_cp.attention", "torch_cp.hf", "attention must not know Hugging Face"),
    ("torch_cp.kv", "torch_cp.engine", "pools must not know the engine"),
    ("torch_cp.state", "torch_cp.engine", "the state pool must not know the engine"),
    ("torch_cp.state", "torch_cp.hf", "the state kernels must not know Hugging Face"),
    ("torch_cp.plan", "torch_cp.engine", "the plan must not know the engine"),
    ("torch_cp.models", "torch_cp.hf", "families get (pool, plan), not the cache adapter"),
    ("torch_cp.graphs", "torch_cp.models", "graphs/ must not reach the model registry"),
    ("torch_cp.graphs", "torch_cp.hf", "hf/ installs graphs/' experts and routers, not back"),
]


@pytest.mark.parametrize("importer,imported,why", RULES, ids=[f"{a}->{b}" for a, b, _ in RULES])
def test_no_import_against_the_layering(importer, imported, why):
    bad = [f"{name} imports {m}" for name, path in modules().items() if _under(name, importer)
           for m in sorted(imports(path)) if _under(m, imported)]
    assert not bad, f"{why}: " + "; ".join(bad)


def test_graphs_and_models_are_imported_only_through_torch_cp():
    """The folders graphs/ and models/ are the packages torch_cp.graphs and torch_cp.models.
    Imported by their folder names too, a module runs twice as two objects: the second
    registered "torch_cp_fused" with transformers again, so a test's monkeypatch of
    torch_cp.graphs.fused_experts no longer reached the experts a model ran (CI at 698c68b,
    through benchmarks/floor.py)."""
    def bare(name: str) -> bool:
        return name.split(".")[0] in ("graphs", "models")

    bad = []
    for folder in ("torch_cp", "graphs", "models", "benchmarks", "tests", "scripts"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = ([node.module] if isinstance(node, ast.ImportFrom) and node.level == 0
                         else [a.name for a in node.names] if isinstance(node, ast.Import)
                         else [])
                bad += [f"{path.relative_to(ROOT)} imports {n}" for n in names if n and bare(n)]
    assert not bad, "; ".join(bad)


def test_modules_stay_small():
    long = {name: n for name, path in modules().items()
            if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_generate_is_always_the_function():
    import inspect

    import torch_cp
    import torch_cp.__main__  # noqa: F401  (the CLI; it must not replace the function)

    assert inspect.isfunction(torch_cp.generate)
