"""The command line, `python -m torch_cp` (and its console script): the default tiny model with its
byte tokenizer on one process and under torchrun with 2 gloo ranks (same tokens, half the KV bytes
a rank), --json, a saved checkpoint with and without tokenizer files, and configuration errors
as one line on rank 0 only."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest

import torch_cp
from torch_cp.__main__ import DEFAULT_PROMPTS, TINY_NOTE, cli, load_tokenizer, prompts_of
from torch_cp.cli_args import argument_problems, model_path_problems, parse_args
from torch_cp.tiny import tiny_qwen3, tiny_tokenizer

pytestmark = pytest.mark.slow  # runs the CLI in subprocesses, under torchrun too

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
BIN = os.path.dirname(sys.executable)
TORCHRUN = os.path.join(BIN, "torchrun")
SCRIPT = os.path.join(BIN, "torch-cp-generate")


def spawn(cmd: list[str], timeout: int = 240) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=timeout)


def run(cmd: list[str], timeout: int = 240) -> str:
    done = spawn(cmd, timeout)
    assert done.returncode == 0, f"{cmd} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def parse(out: str) -> tuple[list[list[int]], list[int]]:
    tokens = [[int(t) for t in m.split(",")] for m in re.findall(r"^request \d+ .*: \[(.*)\]$",
                                                                out, re.M)]
    kv = [int(b) for b in re.findall(r"^KV bytes rank \d+: (\d+)$", out, re.M)]
    return tokens, kv


def assert_one_clean_line(done: subprocess.CompletedProcess, *fragments: str,
                          torchrun: bool = False) -> None:
    """Exit code 1, one error line naming every fragment, no traceback of ours (torchrun's
    launcher prints its own when a rank fails)."""
    assert done.returncode == 1, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("torch_cp: error: ")]
    assert len(lines) == 1, done.stderr
    assert all(f in lines[0] for f in fragments), lines[0]
    assert "torch_cp/__main__.py" not in done.stderr and "ValueError" not in done.stderr
    assert torchrun or "Traceback" not in done.stderr, done.stderr


@pytest.fixture(scope="module")
def expected():
    model = torch_cp.patch_model(tiny_qwen3())
    return torch_cp.generate(model, list(DEFAULT_PROMPTS), 16, tokenizer=tiny_tokenizer(),
                             progress=False)


@pytest.fixture(scope="module")
def single_process(tmp_path_factory):
    path = tmp_path_factory.mktemp("json") / "run.json"
    out = run([sys.executable, "-m", "torch_cp", "--no-progress", "--json", str(path)])
    return out, json.loads(path.read_text())


def test_default_tiny_model(single_process, expected):
    out, record = single_process
    tokens, kv = parse(out)
    assert tokens == [list(r.token_ids) for r in expected]
    assert len(kv) == 1 and kv[0] > 0
    assert out.splitlines()[0] == TINY_NOTE and "P = 1 (no context parallelism)" in out
    for prompt, r in zip(DEFAULT_PROMPTS, expected):
        assert f"  prompt: {prompt!r}\n  text: {r.text!r}\n" in out


def test_json_holds_the_run(single_process, expected):
    out, record = single_process
    tok = tiny_tokenizer()
    assert {k: record[k] for k in ("P", "mode", "world", "kv_bytes_per_rank")} == {
        "P": 1, "mode": None, "world": 1, "kv_bytes_per_rank": parse(out)[1]}
    assert record["results"] == [
        {"index": i, "prompt_ids": tok(p, add_special_tokens=False)["input_ids"],
         "token_ids": list(r.token_ids), "finish_reason": r.finish_reason, "error": None,
         "text": r.text}
        for i, (p, r) in enumerate(zip(DEFAULT_PROMPTS, expected))]


def test_torchrun_two_ranks_context_parallel(single_process, expected, tmp_path):
    # the README's command as pasted (mode "auto": TP mode, since sp = 1)
    out = run([TORCHRUN, "--standalone", "--nproc-per-node", "2", "-m", "torch_cp",
               "--context-parallel", "--tp", "2", "--overlap-planning", "--no-progress",
               "--json", str(tmp_path / "run.json")])
    tokens, kv = parse(out)
    assert "P = 2 (tp mode)" in out and out.count(TINY_NOTE) == 1
    assert tokens == [list(r.token_ids) for r in expected]
    one = single_process[1]["kv_bytes_per_rank"][0]
    assert kv == [one // 2] * 2 and one % 2 == 0
    record = json.loads((tmp_path / "run.json").read_text())
    assert (record["P"], record["mode"], record["world"]) == (2, "tp", 2)
    assert record["kv_bytes_per_rank"] == kv
    assert [r["text"] for r in record["results"]] == [r.text for r in expected]


def test_under_torchrun_an_error_is_one_line_from_rank_0():
    # page size 3 is no multiple of P = 2: patch_model refuses it after the mesh is up
    done = spawn([TORCHRUN, "--standalone", "--nproc-per-node", "2", "-m", "torch_cp",
                  "--context-parallel", "--tp", "2", "--page-size", "3", "--no-progress"])
    assert_one_clean_line(done, "page_size 3 is not a multiple of P = 2", torchrun=True)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """The tiny model saved twice: with its tokenizer, and without tokenizer files."""
    with_tok, bare = tmp_path_factory.mktemp("with_tokenizer"), tmp_path_factory.mktemp("bare")
    for folder in (with_tok, bare):
        tiny_qwen3().save_pretrained(folder)
    tiny_tokenizer().save_pretrained(with_tok)
    return with_tok, bare


def test_a_saved_checkpoint_with_its_tokenizer(checkpoints):
    out = run([sys.executable, "-m", "torch_cp", "--model", str(checkpoints[0]),
               "--prompt", "Hello", "--max-new-tokens", "6", "--page-size", "8", "--no-progress"])
    tokens, kv = parse(out)
    want = torch_cp.generate(torch_cp.patch_model(tiny_qwen3()), ["Hello"], 6,
                             tokenizer=tiny_tokenizer(), progress=False)[0]
    assert tokens == [list(want.token_ids)]
    assert f"  text: {want.text!r}" in out
    assert len(kv) == 1 and TINY_NOTE not in out


def test_without_tokenizer_files_prompts_are_token_ids(checkpoints):
    assert load_tokenizer(str(checkpoints[1])) is None  # transformers' empty one is refused
    done = spawn([sys.executable, "-m", "torch_cp", "--model", str(checkpoints[1]),
                  "--prompt", "1 2 3", "--prompt", "7,8", "--max-new-tokens", "4",
                  "--no-progress"])
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("has no usable tokenizer") == 1
    want = torch_cp.generate(torch_cp.patch_model(tiny_qwen3()), [[1, 2, 3], [7, 8]], 4,
                             progress=False)
    assert parse(done.stdout)[0] == [list(r.token_ids) for r in want]
    assert "text:" not in done.stdout


def test_without_a_tokenizer_a_text_prompt_is_refused():
    args = SimpleNamespace(prompt=["1 2", "Hello", "3, 4", "3.5"], model="ckpt")
    with pytest.raises(ValueError, match="--prompt 'Hello'; --prompt '3.5': without a tokenizer"):
        prompts_of(args, None)  # every one named (helper 87)
    assert prompts_of(SimpleNamespace(prompt=["1 2", "3, 4"], model="ckpt"), None) == [
        [1, 2], [3, 4]]


def test_the_cli_leaves_torch_cp_generate_the_function():
    import inspect

    import torch_cp.__main__  # noqa: F401

    assert inspect.isfunction(torch_cp.generate)
    model = torch_cp.patch_model(tiny_qwen3())
    result = torch_cp.generate(model, [[1, 2, 3]], 2, progress=False)
    assert len(result) == 1 and len(result[0].token_ids) == 2


def test_a_bad_configuration_is_one_clear_line():
    done = spawn([sys.executable, "-m", "torch_cp", "--model", "/nonexistent/ckpt", "--compile",
                  "--page-size", "0", "--no-progress", "--temperature", "-1", "--top-p", "1.5",
                  "--max-tokens-per-step", "0"])
    assert_one_clean_line(done, "--model /nonexistent/ckpt: no such folder",
                          "--page-size must be >= 1, got 0",
                          "--compile compiles the captured step: it needs --cuda-graphs",
                          "--max-tokens-per-step must be >= 1, got 0",
                          "temperature must be finite and >= 0, got -1.0",
                          "top_p must be in (0, 1] or None, got 1.5")


def test_the_backend_and_the_sp_page_size_are_named_with_the_rest():
    args = parse_args(["--backend", "foo", "--top-k", "0", "--context-parallel", "--sp", "2",
                       "--page-size", "5"])
    assert argument_problems(args, cuda=False) == [
        "--backend must be one of auto, torch, flashinfer, got 'foo'",
        "--page-size 5 must be a multiple of the 2 SP partners (each holds an equal share of "
        "every page's slots)",
        "invalid sampling parameters: top_k must be a positive int or None, got 0"]
    # --mode without --context-parallel did nothing, silently (helper 69)
    assert argument_problems(parse_args(["--sp", "2", "--mode", "sp"]), cuda=False) == [
        "--mode sp picks the context-parallel partners: it needs --context-parallel"]
    # every bad choice named together (argparse's choices stopped at the first)
    assert argument_problems(parse_args(["--mode", "both", "--dtype", "int8", "--backend",
                                         "foo"]), cuda=False) == [
        "--backend must be one of auto, torch, flashinfer, got 'foo'",
        "--mode must be one of auto, tp, sp, got 'both'",
        "--dtype must be one of float32, bfloat16, float16, got 'int8'"]


def test_the_console_script_runs_the_cli_one_line_errors_and_all(tmp_path):
    assert os.path.isfile(SCRIPT), "pip install -e . installs the console script"
    done = spawn([SCRIPT, "--model", str(tmp_path), "--no-progress"])
    assert_one_clean_line(done, f"--model {tmp_path}: no config.json in it")


def test_a_model_path_is_checked_before_anything_loads(tmp_path):
    (tmp_path / "file").write_text("")
    assert model_path_problems(str(tmp_path / "file")) == [
        f"--model {tmp_path / 'file'}: not a folder (a local checkpoint folder is expected)"]
    assert model_path_problems(str(tmp_path / "missing"))[0].endswith("no such folder "
                                                                      "(a local checkpoint "
                                                                      "folder is expected)")


def test_a_json_path_that_cannot_be_written_is_refused_before_the_run(capsys, tmp_path):
    for path, problem in ((tmp_path, "a folder, not a file"),):
        with pytest.raises(SystemExit) as exit_:
            cli(["--json", str(path)])
        assert exit_.value.code == 1
        assert capsys.readouterr().err == f"torch_cp: error: --json {path}: {problem}\n"


def test_the_engines_warnings_are_one_line_that_names_no_file(capsys):
    """They name their caller outside torch_cp, which for the CLI was runpy's frozen module
    (``<frozen runpy>:88: IgnoredSettingWarning: ...``, helper 109)."""
    with pytest.raises(SystemExit) as exit_:
        cli(["--top-k", "5", "--max-new-tokens", "2", "--no-progress"])
    assert exit_.value.code == 0
    err = capsys.readouterr().err
    assert "torch_cp: warning: top_k=5 is ignored at temperature 0" in err
    assert "runpy" not in err and "IgnoredSettingWarning" not in err


def test_a_config_field_of_the_wrong_type_is_one_line(capsys, tmp_path):
    """transformers refuses it with huggingface_hub's own error, not a ValueError (helper 87:
    a traceback)."""
    tiny_qwen3().config.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"num_hidden_layers": "two"}))
    with pytest.raises(SystemExit) as exit_:
        cli(["--model", str(tmp_path), "--no-progress"])
    assert exit_.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith(f"torch_cp: error: --model {tmp_path}: cannot read its config.json: ")
    assert err.count("\n") == 1 and "num_hidden_layers" in err


@pytest.mark.parametrize("rank,printed", [("0", True), ("1", False)])
def test_errors_are_printed_by_rank_0_only(monkeypatch, capsys, rank, printed):
    monkeypatch.setenv("RANK", rank)
    with pytest.raises(SystemExit) as exit_:
        cli(["--model", "/nonexistent", "--json", "/nonexistent/run.json"])
    assert exit_.value.code == 1
    err = capsys.readouterr().err
    assert (err == "torch_cp: error: --model /nonexistent: no such folder (a local checkpoint "
            "folder is expected); --json /nonexistent/run.json: the folder /nonexistent does "
            "not exist\n") if printed else err == ""


@pytest.mark.parametrize("error", ["out of memory", "another rank failed"])
def test_the_weights_out_of_memory_or_failing_on_another_rank_is_one_line(monkeypatch, capsys,
                                                                          tmp_path, error):
    """Loading out of device memory, or (under torchrun) a load that failed on another rank
    (``agreement.together``): what the user must change, not a bug's traceback."""
    import torch

    from torch_cp.agreement import OtherRankFailed

    raised = (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
              if error == "out of memory" else OtherRankFailed(
                  "from_pretrained failed on rank 1, so it stops on every rank (rank 1: OSError: "
                  "[Errno 5] Input/output error)"))

    def load(*args, **kwargs):
        raise raised
    monkeypatch.setattr("torch_cp.hf.load._load", load)
    tiny_qwen3().save_pretrained(tmp_path)
    capsys.readouterr()  # save_pretrained's progress bar
    with pytest.raises(SystemExit) as exit_:
        cli(["--model", str(tmp_path), "--no-progress"])
    assert exit_.value.code == 1
    assert capsys.readouterr().err == f"torch_cp: error: {raised}\n"


def test_every_ranks_list_of_problems_reads_as_one_line():
    from torch_cp.__main__ import one_line

    error = ValueError("rank 0: cannot load 'ckpt':\n  - a\n  - b | rank 1: cannot load "
                       "'ckpt':\n  - c")
    assert one_line(error) == "rank 0: cannot load 'ckpt': a; b | rank 1: cannot load 'ckpt': c"


def test_a_usage_error_is_one_line_with_argparses_code(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli(["--tp", "two"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.startswith("torch_cp: error: argument --tp: invalid int")


def test_every_number_that_is_none_is_named_with_the_rest(capsys):
    """argparse's ``type=`` stopped at the first (helper 116)."""
    argv = ["--max-new-tokens", "1.5", "--page-size", "x", "--temperature", "abc", "--tp", "y",
            "--mode", "xx", "--top-k", "0"]
    assert argument_problems(parse_args(argv), cuda=False) == [
        "argument --max-new-tokens: invalid int value: '1.5'",
        "argument --tp: invalid int value: 'y'", "argument --page-size: invalid int value: 'x'",
        "argument --temperature: invalid float value: 'abc'",
        "--mode must be one of auto, tp, sp, got 'xx'",
        "invalid sampling parameters: top_k must be a positive int or None, got 0"]
    with pytest.raises(SystemExit) as exit_:
        cli(argv)
    assert exit_.value.code == 2  # argparse's, for a usage error
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'abc'" in err and "--mode must be" in err


def test_prompts_are_checked_before_the_model_loads(checkpoints, monkeypatch, capsys):
    """Without a tokenizer a text prompt was refused after the whole checkpoint loaded, and
    alone (helper 116)."""
    def load(*args, **kwargs):
        raise AssertionError("the model was loaded")
    monkeypatch.setattr("torch_cp.hf.from_pretrained", load)
    for extra, named in ((["--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0; "),
                         ([], "")):
        with pytest.raises(SystemExit) as exit_:
            cli(["--model", str(checkpoints[1]), "--prompt", "hello", "--no-progress", *extra])
        assert exit_.value.code == 1
        assert capsys.readouterr().err == (f"torch_cp: error: {named}--prompt 'hello': without a "
                                           f"tokenizer a prompt is token ids (space- or "
                                           f"comma-separated)\n")


def test_a_tokenizer_that_needs_a_missing_library_is_named(checkpoints, monkeypatch, capsys):
    """Read as "no tokenizer" (any error was), the run went on with token-id prompts and a
    warning that there were no tokenizer files (helper 118)."""
    import transformers

    def needs(*args, **kwargs):
        raise ImportError("this tokenizer requires the SentencePiece library")
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", needs)
    with pytest.raises(SystemExit) as exit_:
        cli(["--model", str(checkpoints[0]), "--no-progress"])
    assert exit_.value.code == 1
    assert capsys.readouterr().err == (
        f"torch_cp: error: --model {checkpoints[0]}: its tokenizer needs a library that is not "
        f"installed: this tokenizer requires the SentencePiece library\n")


def test_a_hybrid_checkpoint_reports_its_state_bytes(tmp_path):
    """A Qwen3.5 checkpoint: the unpatched model's tokens, and the linear-attention state bytes
    beside the KV bytes (in the JSON too): for the one prompt's slot, as ``generate`` sizes its
    state pool (the CLI took a slot for each of 64 rows: helper 115)."""
    import copy

    import torch
    from driver import tiny_model

    import torch_cp
    from torch_cp.engine.memory import state_pool_bytes

    model = tiny_model("qwen3_5_text")
    model.save_pretrained(tmp_path / "ckpt")
    path = tmp_path / "run.json"
    out = run([sys.executable, "-m", "torch_cp", "--model", str(tmp_path / "ckpt"), "--prompt",
               "1 2 3 4 5", "--max-new-tokens", "5", "--page-size", "4", "--no-progress",
               "--json", str(path)])
    want = model.generate(torch.tensor([[1, 2, 3, 4, 5]]), max_new_tokens=5, do_sample=False)
    assert parse(out)[0] == [want[0, 5:].tolist()]
    record = json.loads(path.read_text())
    state = record["state_bytes_per_rank"]
    assert state[0] == state_pool_bytes(torch_cp.patch_model(copy.deepcopy(model)).torch_cp, 1)
    assert state[0] > 0 and f"KV bytes rank 0: {record['kv_bytes_per_rank'][0]}, " \
        f"linear-attention state bytes: {state[0]}" in out


def test_a_request_that_can_never_fit_says_what_memory_holds(capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_:
        cli(["--max-new-tokens", str(10**12), "--no-progress", "--json", str(tmp_path / "r")])
    assert exit_.value.code == 1  # a request failed
    out = capsys.readouterr().out
    refusals = [line for line in out.splitlines() if line.startswith("request ")]
    assert len(refusals) == len(DEFAULT_PROMPTS)
    assert all("error: " in line and "can never fit: free memory holds a pool of at most"
               in line for line in refusals), out
    record = json.loads((tmp_path / "r").read_text())  # the JSON says why too (helper 87)
    assert [r["finish_reason"] for r in record["results"]] == ["error"] * len(DEFAULT_PROMPTS)
    assert all(r["error"] in out for r in record["results"])
