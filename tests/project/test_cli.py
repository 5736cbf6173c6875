"""The command line, `python -m torch_cp` (and its console script): the default tiny model on one
process and under torchrun with 2 gloo ranks (same tokens, half the KV bytes a rank), and a saved
checkpoint."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

import torch_cp
from torch_cp.__main__ import DEFAULT_PROMPTS
from torch_cp.tiny import tiny_qwen3, tiny_tokenizer

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")


def run(cmd: list[str], timeout: int = 240) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=timeout)
    assert done.returncode == 0, f"{cmd} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def parse(out: str) -> tuple[list[list[int]], list[int]]:
    tokens = [[int(t) for t in m.split(",")] for m in re.findall(r"^request \d+ .*: \[(.*)\]$",
                                                                out, re.M)]
    kv = [int(b) for b in re.findall(r"^KV bytes rank \d+: (\d+)$", out, re.M)]
    return tokens, kv


@pytest.fixture(scope="module")
def expected():
    model = torch_cp.patch_model(tiny_qwen3())
    results = torch_cp.generate(model, [list(p) for p in DEFAULT_PROMPTS], 16, progress=False)
    return [list(r.token_ids) for r in results]


@pytest.fixture(scope="module")
def single_process():
    return parse(run([sys.executable, "-m", "torch_cp", "--no-progress"]))


def test_default_tiny_model(single_process, expected):
    tokens, kv = single_process
    assert tokens == expected
    assert len(kv) == 1 and kv[0] > 0


def test_torchrun_two_ranks_context_parallel(single_process, expected):
    out = run([TORCHRUN, "--standalone", "--nproc-per-node", "2", "-m", "torch_cp",
               "--context-parallel", "--tp", "2", "--overlap-planning", "--no-progress"])
    tokens, kv = parse(out)
    assert "P = 2 (tp mode)" in out
    assert tokens == expected
    assert kv == [single_process[1][0] // 2] * 2 and single_process[1][0] % 2 == 0


def test_a_saved_checkpoint_with_its_tokenizer(tmp_path):
    model, tok = tiny_qwen3(), tiny_tokenizer()
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    out = run([sys.executable, "-m", "torch_cp", "--model", str(tmp_path),
               "--prompt", "Hello", "--max-new-tokens", "6", "--page-size", "8", "--no-progress"])
    tokens, kv = parse(out)
    want = torch_cp.generate(torch_cp.patch_model(tiny_qwen3()), ["Hello"], 6, tokenizer=tok,
                             progress=False)[0]
    assert tokens == [list(want.token_ids)]
    assert f"  text: {want.text!r}" in out
    assert len(kv) == 1


def test_the_cli_leaves_torch_cp_generate_the_function():
    import inspect

    import torch_cp.__main__  # noqa: F401

    assert inspect.isfunction(torch_cp.generate)
    model = torch_cp.patch_model(tiny_qwen3())
    result = torch_cp.generate(model, [[1, 2, 3]], 2, progress=False)
    assert len(result) == 1 and len(result[0].token_ids) == 2


def test_the_console_script_runs_the_cli():
    script = os.path.join(os.path.dirname(sys.executable), "torch-cp-generate")
    tokens, kv = parse(run([script, "--no-progress", "--max-new-tokens", "2"]))
    assert len(tokens) == len(DEFAULT_PROMPTS) and all(len(t) == 2 for t in tokens)
    assert len(kv) == 1


def test_a_bad_configuration_is_one_clear_line():
    done = subprocess.run([sys.executable, "-m", "torch_cp", "--compile", "--page-size",
                           "0", "--no-progress"], capture_output=True, text=True, env=ENV,
                          timeout=120)
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    assert "--page-size must be >= 1, got 0" in done.stderr
    assert "--compile compiles the captured step: it needs --cuda-graphs" in done.stderr
