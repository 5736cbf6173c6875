"""Context parallelism over NCCL, one GPU a rank, launched with torchrun:

    torchrun --standalone --nproc-per-node 2 tests/helpers/nccl_checks.py --out /tmp/nccl.json

``tests/project/test_nccl_gpu.py`` launches it and asserts on the JSON. For every case (model, kv
heads, tp, sp, mode) that fits the world size, and for the reference backend in fp32 and
FlashInfer in bf16, every rank generates greedily:

- at P = 1 on its own GPU (no mesh): the expected tokens and the pool's bytes;
- at P = world over NCCL, eagerly and with CUDA graphs (collectives captured in the graphs; the
  MoE experts switched to a capturable implementation): the tokens, the pool's bytes for the
  same pages, and the collectives it recorded; each again with
  decode steps launched during the previous one, fed its tokens (rank 0's, broadcast over
  NCCL) on the device (``overlap_planning``);
- for the MoE families, with CUDA graphs, compiled layers and steps launched ahead: the tokens
  (``"compiled"``; fp32 too may split at a near-tie there, as compiled kernels sum in another
  order);
- with CUDA graphs over the mesh, the NaN-padding check of ``tests/graphs/test_graphs_gpu.py``.

A check that does not run for a case is named in the case's ``"skipped"`` ({check: why}):
``"graphs"`` (with its overlap run) and ``"nan_padding"`` without CUDA, ``"nan_padding"`` where
the harness's model (one KV head) does not fit the case.

Where bf16 tokens differ from P = 1, the unpatched model's logit gap between the two tokens at the
first difference is recorded (a near-tie is the only acceptable cause). On a machine without CUDA
it runs the fp32 cases over gloo on the CPU, eagerly (a dry run of this script).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist

import torch_cp

NEW_TOKENS = 24
PROMPT_LENGTHS = (3, 17, 40, 70)


@dataclass(frozen=True)
class Case:
    model: str  # "qwen3" (tiny, head_dim 128), "mla" (DeepSeek-V3 attention, 512/64), or MOE
    kv_heads: int
    tp: int
    sp: int
    mode: str

    @property
    def name(self) -> str:
        return f"{self.model}-kv{self.kv_heads}-tp{self.tp}-sp{self.sp}-{self.mode}"


MOE = ("qwen3_moe", "glm4_moe", "glm4_moe_lite", "deepseek_v3")  # graphs with compiled layers
CASES = {
    2: [Case("qwen3", 1, 2, 1, "tp"), Case("qwen3", 2, 1, 2, "sp"), Case("mla", 1, 2, 1, "tp"),
        *(Case(m, 1, 2, 1, "tp") for m in MOE)],
    4: [Case("qwen3", 1, 4, 1, "tp"), Case("qwen3", 2, 4, 1, "tp"), Case("qwen3", 1, 2, 2, "sp"),
        Case("qwen3", 1, 2, 2, "tp"), Case("mla", 1, 4, 1, "tp")],
}


def build(case: Case, dtype: torch.dtype, device):
    from gpu_models import MODELS, qwen3

    model = qwen3(dtype, case.kv_heads) if case.model == "qwen3" else MODELS[case.model](dtype)
    return model.to(device)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(1, 300, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def run_engine(model, cuda_graphs: bool, num_pages: int = 64, overlap: bool = False,
               compile: bool = False):
    """(tokens, pool bytes, recorded collectives, replayed steps, steps launched ahead, fed
    the previous step's tokens on the device) of greedy generation. Compiled, nothing is
    recorded: Dynamo guards on the record list's length, so recording would recompile every
    step."""
    records = []
    model.torch_cp.exchange.records = None if compile else records
    engine = torch_cp.Engine(model, num_pages, 16, cuda_graphs=cuda_graphs, max_rows=8,
                             max_pages_per_row=8, overlap_planning=overlap, compile=compile)
    results = engine.run(prompts(), NEW_TOKENS)
    errors = [r.error for r in results if not r.ok]
    assert not errors, errors
    model.torch_cp.exchange.records = None
    return dict(tokens=[list(r.token_ids) for r in results], kv_bytes=engine.kv_bytes,
                records=[f"{r.op}{list(r.shape)}:{r.dtype}" for r in records],
                replayed=engine.replayed_steps, launched_ahead=engine.launched_ahead_steps)


def near_tie_gaps(case: Case, dtype, device, expected, got) -> list[tuple | None]:
    """Per prompt: None where the streams agree, else (|logit a - logit b|, max(|a|, |b|),
    flip) of the unpatched model at the first position where they differ (the last item: whether
    one expert choice at a router near-tie, made the other way, gives ``got``'s token,
    ``router_flip_explains``)."""
    from router_ties import router_flip_explains

    model = build(case, dtype, device)
    gaps = []
    for prompt, want, have in zip(prompts(), expected, got):
        if want == have:
            gaps.append(None)
            continue
        d = next(i for i, (x, y) in enumerate(zip(want, have)) if x != y)
        ids = torch.tensor([prompt + want[:d]], device=device)
        with torch.inference_mode():
            logits = model(ids).logits[0, -1]
        a, b = logits[want[d]].float().item(), logits[have[d]].float().item()
        gaps.append((abs(a - b), max(abs(a), abs(b)), router_flip_explains(model, ids, have[d])))
    return gaps


def nan_padding(case: Case, backend: str, dtype, mesh) -> str:
    from graph_harness import Harness, check_replay_and_padding

    atol = 1e-4 if dtype == torch.float32 else 0.25  # as in tests/graphs/test_graphs_gpu.py
    h = Harness(backend, dtype, model=case.model, mesh=mesh, mode=case.mode)
    check_replay_and_padding(h, atol)
    return "ok"


def skipped_checks(case: Case, cuda: bool) -> dict[str, str]:
    """The checks that do not run for ``case``, each with why."""
    skipped = {}
    if not cuda:
        skipped["graphs"] = "no CUDA: captured graphs (and their overlap run) need it"
        skipped["nan_padding"] = "no CUDA: the NaN-padding check replays captured graphs"
    elif not (case.kv_heads == 1 or case.mode == "sp"):
        skipped["nan_padding"] = (f"the padding harness's model has 1 KV head, so in TP mode "
                                  f"not this case's placement over {case.kv_heads} KV heads")
    return skipped


def run_case(case: Case, backend: str, dtype, device, cuda: bool) -> dict:
    out = {"skipped": skipped_checks(case, cuda)}
    single = torch_cp.patch_model(build(case, dtype, device), backend=backend)
    out["p1"] = run_engine(single, cuda_graphs=False)
    del single
    mesh = torch_cp.init_mesh(tp=case.tp, sp=case.sp, device_type=device.type)
    for graphs in (False, True):
        if graphs and "graphs" in out["skipped"]:
            continue
        model = torch_cp.patch_model(build(case, dtype, device), context_parallel=True,
                                     mesh=mesh, mode=case.mode, backend=backend)
        out["P"] = model.torch_cp.placement.size
        key = "graphs" if graphs else "eager"
        out[key] = run_engine(model, cuda_graphs=graphs)
        out[f"{key}_overlap"] = run_engine(model, cuda_graphs=graphs, overlap=True)
        if dtype != torch.float32:
            out[key]["gaps"] = near_tie_gaps(case, dtype, device, out["p1"]["tokens"],
                                             out[key]["tokens"])
        if graphs and case.model in MOE:  # and with compiled layers, launching ahead
            out["compiled"] = run_engine(model, cuda_graphs=True, overlap=True, compile=True)
            out["compiled"]["gaps"] = near_tie_gaps(case, dtype, device, out["p1"]["tokens"],
                                                    out["compiled"]["tokens"])
        del model
    if "nan_padding" not in out["skipped"]:
        out["nan_padding"] = nan_padding(case, backend, dtype, mesh)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--only", help="run only cases whose name contains this")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{int(os.environ['LOCAL_RANK'])}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    # A rank that fails between collectives leaves its partners waiting: fail in minutes.
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=180))
    world, rank = dist.get_world_size(), dist.get_rank()
    backends = [("torch", torch.float32)]
    if cuda:
        backends.append(("flashinfer", torch.bfloat16))
    mine = {}
    for case in CASES.get(world, []):
        if args.only and args.only not in case.name:
            continue
        for backend, dtype in backends:
            key = f"{case.name}/{backend}"
            try:
                mine[key] = run_case(case, backend, dtype, device, cuda)
            except Exception:
                mine[key] = {"error": traceback.format_exc()}
            dist.barrier()
    gathered = [None] * world
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"world": world, "backend": dist.get_backend(), "ranks": gathered}, f,
                      indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
