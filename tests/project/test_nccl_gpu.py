"""Context parallelism over NCCL on 2 (and 4) GPUs, launched with torchrun (tests/nccl_checks.py):
greedy tokens equal P = 1 on one GPU, eager and with captured collectives, for TP- and SP-mode GQA
and TP-mode MLA; every partner records the same collectives; each rank's pool holds 1/P of the
bytes; NaN padding stays out of real rows in captured buckets; planning each decode step during
the previous one changes no token and no collective. The 4-rank cases also run on the CPU over
gloo (fp32, eager), so the script is known to work before 4 GPUs are lent."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gpu_models import near_tie

needs_flashinfer = pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None,
                                      reason="needs FlashInfer")
HELPERS = Path(__file__).resolve().parents[1] / "helpers"
NEW_TOKENS = 24


def launch(world: int, out: Path, env: dict | None = None) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={world}", str(HELPERS / "nccl_checks.py"), "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, env=env)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module", params=[2, 4], ids=["2gpu", "4gpu"])
def report(request, tmp_path_factory):
    world = request.param
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs, found {torch.cuda.device_count()}")
    return launch(world, tmp_path_factory.mktemp("nccl") / "report.json")


@pytest.mark.gpu
@needs_flashinfer
def test_every_case_matches_one_gpu(report):
    assert report["backend"] == "nccl"
    check(report, modes=("eager", "graphs"))


@pytest.mark.slow
def test_the_four_rank_cases_on_cpu(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    report = launch(4, tmp_path / "report.json", env)
    assert report["backend"] == "gloo"
    assert len(report["ranks"][0]) == 5, "tp 4 over 1 and 2 KV heads, tp 2 x sp 2 (both), MLA"
    check(report, modes=("eager",))


def check(report: dict, modes: tuple[str, ...]) -> None:
    ranks = report["ranks"]
    cases = ranks[0].keys()
    assert cases and all(r.keys() == cases for r in ranks)
    for key in cases:
        per_rank = [r[key] for r in ranks]
        errors = [r["error"] for r in per_rank if "error" in r]
        assert not errors, f"{key}:\n" + "\n".join(errors)
        first = per_rank[0]
        p = first["P"]
        assert p > 1, key
        for mode in modes:
            runs = [r[mode] for r in per_rank]
            assert all(run["tokens"] == runs[0]["tokens"] for run in runs), f"{key} {mode}"
            assert runs[0]["records"] and all(
                run["records"] == runs[0]["records"] for run in runs), f"{key} {mode} lockstep"
            ahead = [r[f"{mode}_overlap"] for r in per_rank]
            assert all(a["tokens"] == run["tokens"] for a, run in zip(ahead, runs)), \
                f"{key} {mode}: planning ahead changed tokens"
            assert ahead[0]["launched_ahead"] > 0 and all(
                a["records"] == ahead[0]["records"] for a in ahead), f"{key} {mode} ahead"
            want, got = first["p1"]["tokens"], runs[0]["tokens"]
            if key.endswith("/torch"):  # fp32: exactly P = 1's tokens
                assert got == want, f"{key} {mode}"
            else:
                gaps = [g for g in runs[0]["gaps"] if g is not None]
                assert all(near_tie(*g) for g in gaps), f"{key} {mode}: splits at {gaps}"
        if "graphs" in modes:
            assert first["graphs"]["replayed"] >= NEW_TOKENS - 2, f"{key}: decode replays graphs"
        kv_heads, tp = (int(part[2:]) for part in key.split("-")[1:3])
        for r in per_rank:
            # share of P = 1's heads this rank holds: the MLA latent is one head on every rank
            held = 1 if key.startswith("mla") else max(1, kv_heads // tp) / kv_heads
            assert r["eager"]["kv_bytes"] * p == r["p1"]["kv_bytes"] * held, key
        if "nan_padding" in first:
            assert all(r["nan_padding"] == "ok" for r in per_rank), key
