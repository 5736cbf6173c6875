"""The benchmark scripts run end to end on the CPU (``--smoke``: tiny models, the torch backend)
and write the JSON their tables are made from, so they do not rot between GPU sessions. Their
numbers are meaningless here; only GPU runs are reported (BENCHMARKS.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}

pytestmark = pytest.mark.slow


def run(args: list[str], timeout: int = 300, returncode: int = 0
        ) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, *args], cwd=ROOT, env=ENV, capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == returncode, done.stdout[-3000:] + done.stderr[-5000:]
    return done


def records(path: Path) -> list[dict]:
    data = json.loads(path.read_text())
    assert data["versions"]["torch"] and data["command"]
    return data["records"]


def test_attention_benchmark(tmp_path):
    run(["-m", "benchmarks.attention", "--smoke", "--out", str(tmp_path / "a.json")])
    rows = records(tmp_path / "a.json")
    assert rows and all("error" not in r for r in rows)


def test_generate_benchmark_with_every_torch_cp_system_and_a_peer(tmp_path):
    run(["-m", "benchmarks.generate", "--smoke", "--plan",
         "qwen3:16:torch_cp,torch_cp_overlap,hf_dynamic;mla:16:torch_cp;qwen3_5:16:torch_cp",
         "--batches", "1,2",
         "--new-tokens", "4", "--repeats", "2", "--out", str(tmp_path / "g.json")])
    rows = records(tmp_path / "g.json")
    assert {(r["model"], r["system"]) for r in rows} == {
        ("qwen3", "torch_cp"), ("qwen3", "torch_cp_overlap"), ("qwen3", "hf_dynamic"),
        ("mla", "torch_cp"), ("qwen3_5", "torch_cp")}
    assert all(r.get("tokens_per_s") for r in rows), [r for r in rows if "error" in r]
    for r in rows:  # --repeats 2: the faster of two timed calls, where the system repeats
        assert (len(r["walls_s"]) == 2 and r["wall_s"] == min(r["walls_s"])
                if r["system"].startswith("torch_cp") else "walls_s" not in r)


def test_long_context_benchmark_at_one_and_two_ranks(tmp_path):
    out = tmp_path / "l.json"
    for p in (1, 2):
        run(["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={p}",
             "-m", "benchmarks.long_context", "--smoke", "--iters", "2", "--models",
             "qwen3,mla,qwen3_5", "--out", str(out)])
    rows = records(out)
    assert {(r["model"], r["P"]) for r in rows} == {(m, p) for m in ("qwen3", "mla", "qwen3_5")
                                                    for p in (1, 2)}
    assert all(r.get("step_ms") for r in rows)
    half = {(r["model"], r["P"]): r["kv_bytes_per_rank_per_token"] for r in rows}
    assert all(half[m, 2] * 2 == half[m, 1] for m in ("qwen3", "mla", "qwen3_5"))
    state = {(r["model"], r["P"]): r["state_bytes_per_rank"] for r in rows}
    assert state["qwen3_5", 2] == state["qwen3_5", 1] > 0  # SP mode: the whole state each


def test_prefill_profile_sets_torch_cp_beside_hugging_face(tmp_path):
    out = tmp_path / "p.json"
    run(["-m", "benchmarks.prefill_profile", "--smoke", "--model", "mla", "--batch", "2",
         "--prompt", "16", "--iters", "1", "--out", str(out)])
    data = json.loads(out.read_text())
    for name in ("torch_cp", "hugging_face"):
        assert data[name]["ms"] > 0 and data[name]["by_kind"]["gemm"] > 0, data[name]
    assert data["torch_cp"]["steps_per_call"] == 1, "the whole prefill in one step"
    assert data["same_first_tokens"] == 2, "fp32: both prefills give the same first tokens"


def test_capacity_benchmark_doubles_what_fits_with_context_parallelism(tmp_path):
    """TP = 2 over one KV head, context parallelism off then on (its own job each), and SP at
    one and two ranks: the pool the same memory holds doubles, and with it the batch at a
    context and the longest single request."""
    out = tmp_path / "c.json"
    jobs = [(2, ["--setup", "tp", "--model", "gqa", "--context-parallel", cp]) for cp in
            ("off", "on")] + [(n, ["--setup", "sp", "--model", "qwen3"]) for n in (1, 2)]
    for n, flags in jobs:
        run(["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
             "-m", "benchmarks.capacity", "--smoke", "--iters", "2", "--contexts", "256",
             *flags, "--out", str(out)])
    tp = {r["context_parallel"]: r for r in records(out) if r["setup"] == "tp"}
    sp = {r["P"]: r for r in records(out) if r["setup"] == "sp"}
    assert tp[True]["capacity_tokens"] == 2 * tp[False]["capacity_tokens"]
    assert tp[True]["batch"] >= 2 * tp[False]["batch"] - 1 and tp[True]["tokens_per_s_per_gpu"]
    assert sp[2]["capacity_tokens"] == 2 * sp[1]["capacity_tokens"]
    assert sp[2]["context"] > sp[1]["context"] and sp[2]["step_ms"]


def test_serving_benchmark_reuses_a_shared_prefix_and_serves_a_poisson_stream(tmp_path):
    out = tmp_path / "s.json"
    for scenario in ("prefix", "poisson"):
        run(["-m", "benchmarks.serving", "--smoke", "--scenario", scenario, "--out", str(out)])
    rows = {(r["scenario"], r.get("prefix_caching")): r for r in records(out)}
    off, on = rows["prefix", False], rows["prefix", True]
    assert off["reused_tokens"] == 0 < on["reused_tokens"]
    assert on["tokens"] == off["tokens"] and rows["poisson", None]["ttft_p99_s"] is not None


def test_serving_benchmark_names_the_requests_a_pool_cannot_hold():
    """Without caching every request holds its own prefix: a pool past the free memory (one
    H100 holds about 11 of the default 32 requests at 16k) ends before the prompts are built,
    naming ``--requests``."""
    done = run(["-m", "benchmarks.serving", "--smoke", "--scenario", "prefix", "--requests",
                "100000", "--prefix", "100000000"], returncode=1)
    assert "fewer with --requests (now 100000)" in done.stderr, done.stderr[-3000:]


def test_few_tokens_benchmark_checks_its_kernel_against_the_linear(tmp_path):
    """``benchmarks.few_tokens --smoke``: the kernel in Triton's interpreter, each tile's output
    checked against ``F.linear`` in float32 (the script raises on a mismatch), at 3 and 32 rows."""
    out = tmp_path / "few.json"
    run(["-m", "benchmarks.few_tokens", "--smoke", "--out", str(out)])
    rows = records(out)
    assert sorted(r["tokens"] for r in rows) == [3, 32] and all(r["kernel"] == "triton"
                                                               for r in rows)


def test_sync_points_counts_each_synchronizing_call_by_its_torch_cp_call_site(monkeypatch):
    """``benchmarks.sync_points`` (GPU only: CUDA's sync debug mode) names each host sync by the
    innermost frame of torch_cp. Here the mode is a no-op and the warning CUDA would give is
    planted in a callee of a torch_cp function (``values.positive_int`` calls ``as_int``); other
    warnings are not counted."""
    import inspect
    import warnings

    import torch

    from benchmarks import sync_points
    from torch_cp import values

    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", lambda mode: None)
    real = values.as_int

    def syncing(value):
        warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)
        return real(value)
    monkeypatch.setattr(values, "as_int", syncing)

    def call():
        for _ in range(3):
            values.positive_int(2)
        warnings.warn("another warning", UserWarning, stacklevel=1)
    line = next(i for i, text in enumerate(inspect.getsourcelines(values.positive_int)[0])
                if "as_int(" in text) + values.positive_int.__code__.co_firstlineno
    assert sync_points.syncs_of(call) == {f"torch_cp/values.py:{line} positive_int": 3}
