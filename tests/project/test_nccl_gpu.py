"""Context parallelism over NCCL on 2 (and 4) GPUs, launched with torchrun (tests/nccl_checks.py):
greedy tokens equal P = 1 on one GPU, eager and with captured collectives, for TP- and SP-mode GQA
and TP-mode MLA; every partner records the same collectives; each rank's pool holds 1/P of the
bytes; NaN padding stays out of real rows in captured buckets; planning each decode step during
the previous one changes no token and no collective. The 4-rank cases also run on the CPU over
gloo (fp32, eager), so the script is known to work before 4 GPUs are lent.

Every check of a case either ran or is listed in the case's ``"skipped"`` with why (on the CPU:
the captured graphs and the NaN-padding check); what was skipped is reported as a warning, so a
run says what it did not check."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from gpu_models import near_tie

needs_flashinfer = pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None,
                                      reason="needs FlashInfer")
HELPERS = Path(__file__).resolve().parents[1] / "helpers"
NEW_TOKENS = 24
CHECKS = ("eager", "graphs", "nan_padding")  # what nccl_checks.py runs for a case, or skips


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
    check(report, required=("eager", "graphs"))


@pytest.mark.slow
def test_the_four_rank_cases_on_cpu(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    report = launch(4, tmp_path / "report.json", env)
    assert report["backend"] == "gloo"
    assert len(report["ranks"][0]) == 5, "tp 4 over 1 and 2 KV heads, tp 2 x sp 2 (both), MLA"
    skipped = check(report, required=("eager",))  # warns what it did not check
    assert sorted(skipped) == sorted((key, name) for key in report["ranks"][0]
                                     for name in ("graphs", "nan_padding")), skipped


def ran_or_skipped(key: str, per_rank: list[dict], required: tuple[str, ...]) -> dict[str, str]:
    """Each of ``CHECKS`` ran for case ``key`` or is skipped with a reason, the same on every
    rank; the ``required`` ones ran. Returns the skipped checks with why."""
    skipped = per_rank[0].get("skipped")
    assert isinstance(skipped, dict), f"{key}: no list of skipped checks"
    assert all(r.get("skipped") == skipped for r in per_rank), f"{key}: ranks skip differently"
    for name in CHECKS:
        ran = [name in r for r in per_rank]
        assert all(ran) or not any(ran), f"{key}: {name} ran on some ranks only"
        if ran[0]:
            assert name not in skipped, f"{key}: {name} both ran and was skipped"
        else:
            assert name in skipped, f"{key}: {name} neither ran nor was listed as skipped"
            assert isinstance(skipped[name], str) and skipped[name].strip(), \
                f"{key}: {name} skipped without a reason"
    assert set(skipped) <= set(CHECKS), f"{key}: unknown checks skipped: {sorted(skipped)}"
    missing = [name for name in required if name in skipped]
    assert not missing, f"{key}: {missing} must run here but were skipped: {skipped}"
    return skipped


def check(report: dict, required: tuple[str, ...]) -> list[tuple[str, str]]:
    """Assert on every case of ``report``; warn about (and return as (case, check)) what was
    skipped."""
    ranks = report["ranks"]
    cases = ranks[0].keys()
    assert cases and all(r.keys() == cases for r in ranks)
    not_checked = {}
    for key in cases:
        per_rank = [r[key] for r in ranks]
        errors = [r["error"] for r in per_rank if "error" in r]
        assert not errors, f"{key}:\n" + "\n".join(errors)
        first = per_rank[0]
        p = first["P"]
        assert p > 1, key
        skipped = ran_or_skipped(key, per_rank, required)
        for name, why in skipped.items():
            not_checked.setdefault((name, why), []).append(key)
        modes = [mode for mode in ("eager", "graphs") if mode not in skipped]
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
                assert all(near_tie(gap, magnitude) or router_tie
                           for gap, magnitude, router_tie in gaps), \
                    f"{key} {mode}: splits at {gaps}"
        if "graphs" in modes:
            assert first["graphs"]["replayed"] >= NEW_TOKENS - 2, f"{key}: decode replays graphs"
        if "compiled" in first:  # MoE: graphs, compiled layers, launching ahead
            runs = [r["compiled"] for r in per_rank]
            assert all(run["tokens"] == runs[0]["tokens"] for run in runs), f"{key} compiled"
            assert runs[0]["replayed"] >= NEW_TOKENS - 2 and runs[0]["launched_ahead"] > 0
            splits = [g for g in runs[0]["gaps"] if g is not None]
            assert all(near_tie(gap, magnitude) or router_tie
                       for gap, magnitude, router_tie in splits), f"{key} compiled: {splits}"
        kv_heads, tp = (int(part[2:]) for part in key.split("-")[1:3])
        for r in per_rank:
            # share of P = 1's heads this rank holds: the MLA latent is one head on every rank
            held = 1 if key.startswith("mla") else max(1, kv_heads // tp) / kv_heads
            assert r["eager"]["kv_bytes"] * p == r["p1"]["kv_bytes"] * held, key
        if "nan_padding" not in skipped:
            assert all(r["nan_padding"] == "ok" for r in per_rank), key
    for (name, why), keys in not_checked.items():
        warnings.warn(f"not checked over {report['backend']}: {name} ({why}) for "
                      f"{', '.join(keys)}", stacklevel=2)
    return [(key, name) for (name, _), keys in not_checked.items() for key in keys]


# check() itself, on made-up reports (no process is launched).

def made_up_report(skipped: dict[str, str], world: int = 2) -> dict:
    """What nccl_checks.py writes for one fp32 TP-mode case at P = 2, eager only."""
    run = dict(tokens=[[1, 2, 3]], kv_bytes=100, records=["all_gather[2]:torch.float32"],
               replayed=0, launched_ahead=3)
    case = dict(skipped=dict(skipped), P=2, p1=dict(run, kv_bytes=200), eager=dict(run),
                eager_overlap=dict(run))
    return {"world": world, "backend": "gloo",
            "ranks": [{"qwen3-kv1-tp2-sp1-tp/torch": json.loads(json.dumps(case))}
                      for _ in range(world)]}


CPU_SKIPS = {"graphs": "no CUDA", "nan_padding": "no CUDA"}


def test_check_reports_what_was_skipped_and_why():
    with pytest.warns(UserWarning) as said:
        skipped = check(made_up_report(CPU_SKIPS), required=("eager",))
    assert sorted(skipped) == [("qwen3-kv1-tp2-sp1-tp/torch", "graphs"),
                               ("qwen3-kv1-tp2-sp1-tp/torch", "nan_padding")]
    messages = sorted(str(w.message) for w in said)
    assert len(messages) == 2 and all("(no CUDA)" in m for m in messages), messages


@pytest.mark.parametrize("skipped,required,problem", [
    ({"graphs": "no CUDA"}, ("eager",), "nan_padding neither ran nor was listed as skipped"),
    ({}, ("eager",), "graphs neither ran nor was listed as skipped"),
    ({"graphs": "no CUDA", "nan_padding": " "}, ("eager",), "nan_padding skipped without a reason"),
    (CPU_SKIPS, ("eager", "graphs"), "must run here but were skipped"),
    ({**CPU_SKIPS, "eager": "no time"}, ("eager",), "must run here but were skipped"),
    ({**CPU_SKIPS, "p1": "why"}, (), "unknown checks skipped"),
])
def test_check_fails_a_check_neither_run_nor_skipped_with_a_reason(skipped, required, problem):
    report = made_up_report(skipped)
    if "eager" in skipped:
        del report["ranks"][0]["qwen3-kv1-tp2-sp1-tp/torch"]["eager"]
        del report["ranks"][1]["qwen3-kv1-tp2-sp1-tp/torch"]["eager"]
    with pytest.raises(AssertionError, match=problem):
        check(report, required=required)


def test_check_fails_when_ranks_skip_differently_or_a_skipped_check_ran():
    report = made_up_report(CPU_SKIPS)
    report["ranks"][1]["qwen3-kv1-tp2-sp1-tp/torch"]["skipped"].pop("nan_padding")
    with pytest.raises(AssertionError, match="ranks skip differently"):
        check(report, required=("eager",))
    report = made_up_report(CPU_SKIPS)
    for rank in report["ranks"]:
        rank["qwen3-kv1-tp2-sp1-tp/torch"]["nan_padding"] = "ok"
    with pytest.raises(AssertionError, match="nan_padding both ran and was skipped"):
        check(report, required=("eager",))


def test_the_script_names_what_it_skips_on_each_machine():
    """On the CPU every case skips the captured graphs and the NaN-padding check; on GPUs only
    the NaN-padding check of the TP-mode case over 2 KV heads (its harness has 1 KV head)."""
    import nccl_checks

    for case in [c for cases in nccl_checks.CASES.values() for c in cases]:
        on_cpu = nccl_checks.skipped_checks(case, cuda=False)
        assert sorted(on_cpu) == ["graphs", "nan_padding"] and all(on_cpu.values()), case
        on_gpu = nccl_checks.skipped_checks(case, cuda=True)
        expect = ["nan_padding"] if (case.kv_heads, case.mode) == (2, "tp") else []
        assert sorted(on_gpu) == expect and all(on_gpu.values()), case
