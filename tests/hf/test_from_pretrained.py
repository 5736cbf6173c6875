"""torch_cp.from_pretrained over gloo ranks: each reads only its own TP shards from the files.

Checkpoints (tests/helpers/saved_checkpoints.py) are written with ``save_pretrained``: a tiny Qwen3
(tied embeddings, one KV head, q/k/v and o_proj biases; one file) and a tiny DeepSeek-V3 (MLA, MoE
experts stored per expert as Hugging Face checkpoints hold them; several files and an index). At
P = 2 and 4 (TP mode, and SP x TP with ``mode="auto"``), every rank's greedy tokens and logits
equal the unpatched model loaded whole by transformers, and its parameters equal, bit for bit,
those ``patch_model`` cuts from that whole model (which also gives bit-equal logits).

Peak memory, measured in fresh spawned processes at P = 2 on a 59 MB Qwen3 (4 layers, hidden
512, MLP 2048, vocabulary 256, so the replicated embeddings are small), checkpointed in files of
at most 4 MB as large checkpoints are (70 GB in 5 GB files):

- what is measured: the process's peak resident memory over the load (``VmHWM`` in
  /proc/self/status, reset by writing 5 to /proc/self/clear_refs just before) minus its resident
  memory just before. Resident memory counts the parameters the process holds and also the
  checkpoint's page-cache pages it has mapped (safetensors reads through a memory map). Those
  pages are shared between the ranks of a host and reclaimable, but counting them keeps the
  measure conservative; the loader releases each file's map once read, so at most about a file
  is ever mapped.
- before measuring, each process loads a tiny checkpoint of the same family once, so the
  imports and caches a first load makes are in the baseline, not in the measure.
- a TP rank (rank 1) measures ``torch_cp.from_pretrained(path, mesh)`` at tp = 2.
- loading the whole model (rank 0, another fresh process): transformers' ``from_pretrained``
  of the same checkpoint, then every parameter read once. transformers maps the file without
  reading it (a ``from_pretrained`` alone costs ~4 MB), so its whole model becomes resident only
  as it is used; on a GPU the whole model is copied to the device at once.
- asserted: the rank's peak is below 0.7x the whole load's and below 0.7x the model's
  parameter bytes. Observed: 0.56x of both (the rank holds 30 of the 59 MB); with the rank
  loading the whole model and then sharding it (planted), 1.06x.
"""

from __future__ import annotations

import functools
import json
import sys
from dataclasses import dataclass

import pytest
import torch
import transformers
from driver import NEW_TOKENS, PROMPTS, TOL, greedy, hf_greedy
from mla_models import LOGIT_TOL
from multirank import ranks_by_world
from saved_checkpoints import save_checkpoints

import torch_cp

PAGE_SIZE = 8
RATIO = 0.7


@dataclass(frozen=True)
class Case:
    checkpoint: str  # a name saved_checkpoints writes
    sp: int
    tp: int
    mode: str
    placed_mode: str  # the mode the placement must record
    partners: int

    @property
    def world(self) -> int:
        return self.sp * self.tp

    @property
    def id(self) -> str:
        return f"{self.checkpoint}-sp{self.sp}xtp{self.tp}-{self.mode}-P{self.partners}"


CASES = [
    Case("qwen3", 1, 2, "tp", "tp", 2),
    Case("deepseek_v3", 1, 2, "tp", "tp", 2),
    Case("qwen3", 1, 4, "tp", "tp", 4),
    Case("deepseek_v3", 1, 4, "tp", "tp", 4),
    Case("qwen3", 2, 2, "auto", "sp", 2),  # SP mode over TP-sharded ranks
    Case("qwen3_next", 1, 2, "tp", "tp", 2),  # hybrid: linear heads and conv channels split
    Case("qwen3_5", 1, 2, "tp", "tp", 2),  # the text model of a multimodal checkpoint
]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    return save_checkpoints(tmp_path_factory.mktemp("checkpoints"), big=True)


def _status(*keys: str) -> list[int]:
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return [int(fields[k].split()[0]) * 1024 for k in keys]


def _peak_of(load) -> tuple[object, int]:
    """(load(), the peak resident bytes it added): see the module docstring."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    (before,) = _status("VmRSS")
    out = load()
    (peak,) = _status("VmHWM")
    return out, peak - before


@torch.no_grad()
def _whole(path: str):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    for p in model.parameters():
        p.sum()  # transformers maps the file; reading makes the whole model resident
    return model


def _measure_memory(rank: int, mesh, paths: dict[str, str]) -> dict:
    if rank == 0:
        _whole(paths["qwen3"])
        model, peak = _peak_of(lambda: _whole(paths["big"]))
        for name in ("qwen3", "big"):  # rank 1's loads: every rank of the mesh makes them
            torch_cp.from_pretrained(paths[name], mesh=mesh)
        return dict(whole=peak, bytes=sum(p.nbytes for p in model.parameters()))
    torch_cp.from_pretrained(paths["qwen3"], mesh=mesh)
    _, peak = _peak_of(lambda: torch_cp.from_pretrained(paths["big"], mesh=mesh))
    return dict(sharded=peak)


def _params(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _run_cases(rank: int, world: int, cases: list[Case], paths: dict[str, str]) -> dict:
    results = {}
    if world == 2:  # first, while the process is fresh
        mesh = torch_cp.init_mesh(tp=2, device_type="cpu")
        results["memory"] = _measure_memory(rank, mesh, paths)
    for case in cases:
        mesh = torch_cp.init_mesh(tp=case.tp, sp=case.sp, device_type="cpu")
        path = paths[case.checkpoint]
        model = torch_cp.from_pretrained(path, mesh=mesh, mode=case.mode, context_parallel=True,
                                         dtype=torch.float32, page_size=PAGE_SIZE)
        out = greedy(model, PROMPTS, NEW_TOKENS)
        whole = torch_cp.patch_model(transformers.AutoModelForCausalLM.from_pretrained(path),
                                     mesh=mesh, mode=case.mode, context_parallel=True,
                                     page_size=PAGE_SIZE)
        mine, cut = _params(model), _params(whole)
        placement = model.torch_cp.placement
        results[case.id] = dict(
            tokens=out.tokens, logits=out.last_logits,
            whole_logits=greedy(whole, PROMPTS, NEW_TOKENS).last_logits,
            differ=sorted(k for k in mine.keys() | cut.keys()
                          if k not in mine or k not in cut or not torch.equal(mine[k], cut[k])),
            bytes=sum(p.nbytes for p in mine.values()),
            tied=model.lm_head.weight is model.model.embed_tokens.weight,
            mode=placement.mode, partners=placement.size, dtype=model.dtype)
    if world == 2:
        results["refusals"] = _refusals(rank, paths)
    return results


def _refusals(rank: int, paths: dict[str, str]) -> dict[str, str]:
    """What each rank raises when the ranks load with another page size, another checkpoint,
    or a path only rank 0 has (each refused before any weight is read)."""
    mesh = torch_cp.init_mesh(tp=2, device_type="cpu")
    out = {}
    for key, path, page_size in [
            ("page_size", paths["qwen3"], PAGE_SIZE * (1 + rank)),
            ("checkpoint", paths["qwen3_next" if rank else "qwen3"], PAGE_SIZE),
            ("missing", paths["qwen3"] + ("-missing" if rank else ""), PAGE_SIZE)]:
        try:
            torch_cp.from_pretrained(path, mesh=mesh, context_parallel=True, page_size=page_size,
                                     dtype=torch.float32)
            out[key] = "ran"
        except ValueError as e:
            out[key] = str(e)
    out["read fails"] = _read_failing_on_rank_1(rank, mesh, paths["qwen3"])
    return out


def _read_failing_on_rank_1(rank: int, mesh, path: str) -> str:
    """What each rank raises when rank 1 alone fails reading a tensor, after the ranks agreed
    (rank 0 went on to its first collective and waited there for ever)."""
    from torch_cp.hf import load

    read_into = load.read_into
    if rank == 1:
        def failing(*args, **kwargs):
            raise OSError(5, "Input/output error (rank 1 alone, in this test)")
        load.read_into = failing
    try:
        torch_cp.from_pretrained(path, mesh=mesh, context_parallel=True, page_size=PAGE_SIZE,
                                 dtype=torch.float32)
        return "ran"
    except (OSError, RuntimeError) as e:
        return f"{type(e).__name__}: {e}"
    finally:
        load.read_into = read_into


@pytest.fixture(scope="module")
def ranks(checkpoints):
    """world size -> each rank's results (spawned once per size)."""
    return ranks_by_world(functools.partial(_run_cases, paths=checkpoints), CASES)


@pytest.fixture(scope="module")
def unpatched(checkpoints):
    """checkpoint name -> (greedy tokens, last logits, state-dict bytes) of the model
    transformers loads whole."""
    memo = {}

    def reference(name: str):
        if name not in memo:
            model = transformers.AutoModelForCausalLM.from_pretrained(checkpoints[name]).eval()
            memo[name] = (*hf_greedy(model), sum(p.nbytes for p in model.state_dict().values()))
        return memo[name]
    return reference


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_every_rank_loads_its_shards_and_generates_the_unpatched_tokens(ranks, unpatched, case):
    tokens, logits, whole_bytes = unpatched(case.checkpoint)
    tol = LOGIT_TOL if case.checkpoint == "deepseek_v3" else TOL
    for rank, results in enumerate(ranks(case.world)):
        got = results[case.id]
        where = f"rank {rank}"
        assert (got["mode"], got["partners"]) == (case.placed_mode, case.partners), where
        assert got["differ"] == [], f"{where}: differ from patch_model's shards"
        assert got["bytes"] < whole_bytes, f"{where} holds the whole model"
        assert got["tied"] == (case.checkpoint == "qwen3"), where
        assert got["dtype"] == torch.float32, where
        assert got["tokens"] == tokens, where
        torch.testing.assert_close(got["logits"], logits, **tol,
                                   msg=lambda m, where=where: f"{where}: {m}")
        assert torch.equal(got["logits"], got["whole_logits"]), where


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_a_tp_rank_peaks_at_about_its_shard(ranks):
    whole, sharded = ranks(2)[0]["memory"], ranks(2)[1]["memory"]
    measured = json.dumps({k: f"{v / 2**20:.1f} MB" for k, v in (whole | sharded).items()})
    assert sharded["sharded"] < RATIO * whole["whole"], measured
    assert sharded["sharded"] < RATIO * whole["bytes"], measured


@pytest.mark.slow
def test_ranks_that_load_differently_all_refuse(ranks):
    """Ranks loading with other settings or checkpoints went on to hang or die in their
    collectives, and a rank without the checkpoint, or failing to read it, left the others
    waiting: now every rank raises, naming what differs or rank 1's problem."""
    for rank, results in enumerate(ranks(2)):
        got = results["refusals"]
        for key, named in [("page_size", "page_size"), ("checkpoint", "config")]:
            assert got[key] == (f"the ranks called from_pretrained with different {named}: every "
                                f"rank must pass the same arguments"), f"rank {rank}: {key}"
        assert got["missing"].startswith(("rank 1: " if rank == 0 else "") + "cannot load "), (
            f"rank {rank}: {got['missing']}")
        assert "-missing':\n  - not a directory with a config.json" in got["missing"]
    own = "OSError: [Errno 5] Input/output error (rank 1 alone, in this test)"
    assert ranks(2)[1]["refusals"]["read fails"] == own
    assert ranks(2)[0]["refusals"]["read fails"] == (
        f"OtherRankFailed: from_pretrained failed on rank 1, so it stops on every rank (rank 1: "
        f"{own})")
