"""scripts/mutants.py stays applicable: every planted bug's original text is in its file exactly
once, and the tests it runs exist. Code that moves on would otherwise leave a mutant "not
applied", its bug no longer tested (five had, found by helper 57)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("mutants", ROOT / "scripts" / "mutants.py")
mutants = sys.modules.setdefault("mutants", importlib.util.module_from_spec(spec))
spec.loader.exec_module(mutants)  # registered first: its dataclasses look themselves up


@pytest.mark.parametrize("mutant", mutants.MUTANTS, ids=[m.name for m in mutants.MUTANTS])
def test_each_mutant_applies_once_and_names_tests_that_exist(mutant):
    source = (ROOT / mutant.path).read_text()
    assert source.count(mutant.old) == 1, f"{mutant.old!r} is not once in {mutant.path}"
    assert mutant.new != mutant.old
    for test in mutant.tests + ((mutant.gpu_only,) if mutant.gpu_only else ()):
        assert (ROOT / test.partition("::")[0]).is_file(), test
