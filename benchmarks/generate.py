"""End-to-end generation: torch_cp against the Hugging Face ways of generating, in one run.

Models (random bf16 weights, built on the GPU; see ``benchmarks.models``): Qwen3-8B's shape, an
MLA model of similar size (DeepSeek-V3 attention, kv_lora_rank 512, rope 64, dense MLPs), the MoE
models ``qwen3_moe`` and ``glm_flash``, and ``qwen3_5`` (Qwen3.5-9B's text model: gated DeltaNet
and full attention; torch_cp runs its linear attention with flash-linear-attention's kernels
beside FlashInfer, as Hugging Face does when fla is installed). For each prompt length and batch
size, exactly ``--new-tokens`` greedy tokens (no EOS) from:

- ``torch_cp``: ``torch_cp.Engine(..., cuda_graphs=True)`` over a patched model (P = 1,
  FlashInfer), the engine ``torch_cp.generate`` builds; one engine (one capture) per block;
  a warm-up call of the same prompts with 2 new tokens before each timed call;
  ``torch_cp_overlap``: the same with ``overlap_planning=True`` (the next decode step planned
  and launched, fed this step's tokens on the device, while this one runs; a step's time is
  stamped when its tokens reach the host); ``torch_cp_compiled``: with ``compile=True`` as
  well (the captured step runs compiled decoder layers, ``graphs.compiled_layers``);
- ``hf_static``: ``model.generate`` with the static cache, compiled by transformers' default
  CompileConfig (a warm-up call per shape first, which includes the compile);
- ``hf_dynamic``: ``model.generate`` with the dynamic cache, eager;
- ``generate_batch``: transformers' continuous batching (a short warm-up call first);
- ``compiled_loop``: a static-cache decode loop under
  ``torch.compile(mode="reduce-overhead", fullgraph=True)`` (warm-up run per shape first).

Each decode step is set against its memory roofline: (weight bytes + KV bytes read + a hybrid's
linear-attention state, read and written) / the copy bandwidth measured in the same run.
``--plan`` orders the runs (``model:prompt:systems;...``); ``--budget-s`` skips what would not
finish, and says so in the JSON (a compiled peer compiles once per new shape: about 50 s for the
first and 85 s for the dynamic-shape recompile on an H200).

    python -m benchmarks.generate --out benchmarks/results/generate.json
    python -m benchmarks.generate --smoke --plan "qwen3:16:torch_cp,hf_static" --batches 1,3 \
        --new-tokens 6                                # CPU, tiny models, torch backend
    python -m benchmarks.generate --plan "qwen3_5:512:torch_cp_compiled,hf_static" \
        --batches 1,32,64 --new-tokens 64 --budget-s 540   # Qwen3.5 (one H200; then 4096)
"""

from __future__ import annotations

import argparse
import importlib.metadata
import inspect
import time
import traceback

import torch

import torch_cp
from benchmarks import models, peers
from benchmarks.common import (
    DECODE_KERNEL_HELP,
    KERNEL_HELP,
    LINEARS_HELP,
    Budget,
    Results,
    apply_decode_kernel,
    apply_inductor_settings,
    apply_kernel_settings,
    apply_linears,
    copy_bandwidth,
    free_cuda,
    run_header,
    sync,
    table,
)
from benchmarks.peers import Timing

SYSTEMS = ("torch_cp", "torch_cp_overlap", "torch_cp_compiled", "hf_dynamic", "generate_batch",
           "hf_static",
           "compiled_loop")
PAGE = 16
# Seconds a system needs at least before it is started (the first compiled call compiles).
MIN_SECONDS = dict(torch_cp=10, torch_cp_overlap=10, torch_cp_compiled=40, hf_dynamic=10,
                   generate_batch=20,
                   hf_static=90, compiled_loop=90)


class TorchCP:
    """One patched model and one engine (CUDA graphs captured once) for every run."""

    def __init__(self, model, max_batch: int, max_len: int, backend: str, cuda_graphs: bool,
                 compile: bool = False, overlap: bool = False):
        torch_cp.patch_model(model, backend=backend, page_size=PAGE)
        per_row = -(-max_len // PAGE)
        kwargs = dict(max_rows=max_batch)
        if overlap:
            kwargs.update(overlap_planning=True)
        params = inspect.signature(torch_cp.Engine).parameters
        self.cuda_graphs = cuda_graphs and "cuda_graphs" in params
        if self.cuda_graphs:
            kwargs.update(cuda_graphs=True, max_pages_per_row=per_row, compile=compile)
        start = time.perf_counter()
        self.engine = torch_cp.Engine(model, max_batch * per_row, PAGE, **kwargs)
        self.setup_s = time.perf_counter() - start
        self.model = model
        self.hybrid = getattr(self.engine, "state", None) is not None

    def warm_up(self, prompts: list[list[int]]) -> float:
        """Seconds of an untimed run of ``prompts`` with the timed run's steps (so its prefill
        step's shapes are compiled and tuned), like the peers' warm-up calls."""
        start = time.perf_counter()
        self.size_steps(prompts)
        self.engine.run(prompts, 2, eos_token_ids=())
        return time.perf_counter() - start

    def size_steps(self, prompts: list[list[int]]) -> None:
        # The whole prefill in one step where it fits 64k tokens (as Hugging Face prefills).
        self.engine.max_tokens_per_step = min(len(prompts) * len(prompts[0]), 65536)

    def run(self, prompts: list[list[int]], new_tokens: int, device) -> Timing:
        batch = len(prompts)
        self.size_steps(prompts)
        stamps: list[tuple[float, set[int]]] = []
        tokens_of = self.engine._tokens

        def timed_tokens(step, *args, **kwargs):
            # Stamped when a step's tokens are on the host; with overlap the next step is
            # already queued on the device, as it is when torch_cp runs untimed.
            out = tokens_of(step, *args, **kwargs)
            stamps.append((time.perf_counter(), {step.rows[b].request for b in step.sampled}))
            return out

        self.engine._tokens = timed_tokens
        peers.reset_peak(device)
        replayed = getattr(self.engine, "replayed_steps", 0)
        try:
            sync(device)
            start = time.perf_counter()
            results = self.engine.run(prompts, new_tokens, eos_token_ids=())
            sync(device)
            wall = time.perf_counter() - start
        finally:
            del self.engine._tokens
        self.generated = [p + list(r.token_ids) for p, r in zip(prompts, results)]
        bad = [r for r in results if len(r.token_ids) != new_tokens]
        if bad:
            raise RuntimeError(f"torch_cp: request {bad[0].index} made {len(bad[0].token_ids)} "
                               f"tokens ({bad[0].finish_reason}, {bad[0].error})")
        # Decode steps are timed from the step that gives the last request its first token: with
        # a prefill in chunks, the earlier requests' decode steps carry the later prompts' chunks.
        seen, first = set(), len(stamps) - 1
        for i, (_, requests) in enumerate(stamps):
            seen |= requests
            if len(seen) >= batch:
                first = i
                break
        times = [t for t, _ in stamps]
        step = ((times[-1] - times[first]) * 1e3 / (len(times) - 1 - first)
                if len(times) - 1 > first else None)
        replays = getattr(self.engine, "replayed_steps", 0) - replayed
        note = f"{len(stamps)} steps, {replays} replayed from CUDA graphs"
        return Timing(wall, times[first] - start, step, batch * new_tokens,
                      peers.peak_gib(device), note, list(results[0].token_ids[:8]))

    def close(self) -> None:
        del self.engine
        torch_cp.unpatch_model(self.model)


def hf_fits(config, batch: int, length: int, device) -> str | None:
    """Why Hugging Face's own cache for this shape cannot fit (None: it may)."""
    if device.type != "cuda":
        return None
    need = (models.hf_cache_bytes_per_token(config, torch.bfloat16) * length
            + models.state_bytes_per_request(config, torch.bfloat16)) * batch
    free, _ = torch.cuda.mem_get_info(device)
    if need > 0.7 * free:
        return (f"Hugging Face's cache would need {need / 2**30:.0f} GiB "
                f"({free / 2**30:.0f} GiB free)")
    return None


def run_system(name: str, state: dict, model, prompts, new_tokens: int, device,
               smoke: bool, repeats: int = 1) -> tuple[Timing, dict]:
    """One system's timed call after its warm-up. torch_cp's and ``hf_static`` time ``repeats``
    calls and keep the fastest (each call's wall time in ``walls_s``)."""
    prompt = len(prompts[0])
    ids = torch.tensor(prompts, device=device)
    extra = {}
    if name.startswith("torch_cp") or name == "hf_static":
        if name == "hf_static":
            def call() -> Timing:
                return peers.hf_generate(model, ids, new_tokens, "static", device,
                                         compile_=not smoke)
            start = time.perf_counter()
            call()
            extra["warmup_s"] = time.perf_counter() - start
        else:
            def call() -> Timing:
                return state[name].run(prompts, new_tokens, device)
            extra["warmup_s"] = state[name].warm_up(prompts)
        timings = [call() for _ in range(repeats)]
        if repeats > 1:
            extra["walls_s"] = [t.wall_s for t in timings]
        return min(timings, key=lambda t: t.wall_s), extra
    if name == "hf_dynamic":
        return peers.hf_generate(model, ids, new_tokens, "dynamic", device), extra
    if name == "generate_batch":
        timing, extra["warmup_s"] = peers.hf_generate_batch(model, prompts, new_tokens, device,
                                                            smoke)
        return timing, extra
    if name == "compiled_loop":
        loop = state.get("loop")
        if loop is None:
            loop = state["loop"] = peers.CompiledLoop(
                model, device, backend="eager" if smoke else "inductor")
        cache = peers.static_cache(model, prompt + new_tokens)
        start = time.perf_counter()
        try:
            loop.run(ids, new_tokens, cache)
        except Exception as error:  # a graph break under fullgraph: say so, run without it
            extra["fullgraph_error"] = f"{type(error).__name__}: {error}"[:500]
            loop = state["loop"] = peers.CompiledLoop(
                model, device, backend="eager" if smoke else "inductor", fullgraph=False)
            loop.run(ids, new_tokens, cache)
        extra["warmup_s"] = time.perf_counter() - start
        return loop.run(ids, new_tokens, cache), extra
    raise ValueError(f"unknown system {name!r}")


DEFAULT_PLAN = ("qwen3:512:torch_cp,torch_cp_overlap,hf_static,compiled_loop,torch_cp_compiled,"
                "hf_dynamic,generate_batch;"
                "qwen3:4096:torch_cp,torch_cp_overlap,hf_dynamic,generate_batch;"
                "mla:512:torch_cp,torch_cp_overlap,hf_dynamic,hf_static,compiled_loop,"
                "generate_batch;"
                "mla:4096:torch_cp,torch_cp_overlap,hf_dynamic")


def parse_plan(text: str) -> list[tuple[str, int, list[str]]]:
    """``"model:prompt:system,system;..."`` -> blocks run in order (a block's systems share one
    prompt length; consecutive blocks of one model share the model)."""
    blocks = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        model, prompt, systems = part.split(":")
        unknown = [s for s in systems.split(",") if s not in SYSTEMS]
        if unknown:
            raise SystemExit(f"unknown systems {unknown}; known: {SYSTEMS}")
        blocks.append((model, int(prompt), systems.split(",")))
    return blocks


def model_info(name: str, model, dtype, build_s: float) -> dict:
    return dict(model=name, build_s=build_s, params=sum(p.numel() for p in model.parameters()),
                weight_bytes_read={},  # per batch size, filled as blocks start
                routed_expert_bytes={},  # the MoE experts' part of it
                kv_bytes_per_token=models.kv_bytes_per_token(model.config, dtype),
                state_bytes_per_request=models.state_bytes_per_request(model.config, dtype))


def run_block(results: Results, budget: Budget, model_name: str, model, info: dict,
              prompt: int, systems: list[str], batches: list[int], args, copy_bw: float,
              device, smoke: bool) -> list[dict]:
    records, state, generated = [], {}, {}
    for batch in batches:  # MoE: the experts a step routes to, measured on the unpatched model
        if batch not in info["weight_bytes_read"]:
            routed = info["routed_expert_bytes"][batch] = models.routed_expert_bytes(model, batch)
            info["weight_bytes_read"][batch] = models.weight_bytes_read(model, batch, routed)
    for system in systems:
        for batch in batches:
            base = dict(model=model_name, system=system, prompt=prompt, batch=batch,
                        new_tokens=args.new_tokens)
            kv_read = info["kv_bytes_per_token"] * batch * (prompt + args.new_tokens / 2)
            weights = info["weight_bytes_read"][batch]
            state_rw = 2 * info["state_bytes_per_request"] * batch  # read and written each step
            base["roofline_ms"] = (weights + kv_read + state_rw) / copy_bw * 1e3
            if not budget.allows(MIN_SECONDS[system]):
                results.add(**base, skipped=f"time budget ({budget.left():.0f} s left)")
                continue
            reason = None if system.startswith("torch_cp") else hf_fits(
                model.config, batch, prompt + args.new_tokens, device)
            if reason:
                results.add(**base, skipped=reason)
                continue
            gen = torch.Generator().manual_seed(batch * 100003 + prompt)
            prompts = torch.randint(0, model.config.vocab_size, (batch, prompt),
                                    generator=gen).tolist()
            try:
                if system.startswith("torch_cp") and system not in state:
                    for other in [k for k in state if k.startswith("torch_cp")]:
                        state.pop(other).close()  # one patched engine at a time
                    state[system] = TorchCP(model, max(batches), prompt + args.new_tokens,
                                            "torch" if smoke else "flashinfer", not smoke,
                                            compile=system == "torch_cp_compiled",
                                            overlap=system != "torch_cp")
                    info[f"{system}_setup_s_{prompt}"] = state[system].setup_s
                    info["torch_cp_cuda_graphs"] = state[system].cuda_graphs
                    info["torch_cp_linear_kernels"] = getattr(
                        model.torch_cp, "linear_kernels", None) if state[system].hybrid else None
                timing, extra = run_system(system, state, model, prompts, args.new_tokens,
                                           device, smoke, args.repeats)
            except Exception as error:
                results.add(**base, error=f"{type(error).__name__}: {error}"[:2000],
                            traceback=traceback.format_exc()[-3000:])
                print(f"{model_name} {system} {prompt}x{batch}: {error}", flush=True)
                free_cuda(device)
                continue
            if system.startswith("torch_cp"):
                generated.setdefault(batch, state[system].generated)
            rec = dict(base, **timing.as_dict(), **extra)
            if timing.step_ms is not None:
                rec["step_over_roofline"] = timing.step_ms / base["roofline_ms"]
            records.append(results.add(**rec))
            print(f"{model_name} {system} prompt {prompt} batch {batch}: "
                  f"{timing.tokens_per_s:.0f} tok/s, step {timing.step_ms} ms, "
                  f"ttft {timing.ttft_s} s ({budget.left():.0f} s left)", flush=True)
            free_cuda(device)
        for key in [k for k in state if k.startswith("torch_cp")]:
            state.pop(key).close()
        state.pop("loop", None)
        for attr in ("_cache", "_compiled_call"):  # what model.generate keeps for reuse
            model.__dict__.pop(attr, None)
        free_cuda(device)
    with_generated_roofline(results, records, model, info, generated, prompt, copy_bw)
    return records


def with_generated_roofline(results: Results, records: list[dict], model, info: dict,
                            generated: dict[int, list[list[int]]], prompt: int,
                            copy_bw: float) -> None:
    """MoE: each record's roofline again with the experts routed by torch_cp's own generated
    tokens (``models.generated_expert_bytes``; the peers make the same tokens up to near-ties),
    beside the one from random tokens."""
    if not models.experts_of(model):
        return
    for batch, sequences in generated.items():
        routed = models.generated_expert_bytes(model, sequences, prompt)
        delta_ms = (routed - info["routed_expert_bytes"][batch]) / copy_bw * 1e3
        for rec in (r for r in records if r["batch"] == batch):
            rec["roofline_generated_ms"] = rec["roofline_ms"] + delta_ms
            if rec.get("step_ms") is not None:
                rec["step_over_roofline_generated"] = rec["step_ms"] / rec["roofline_generated_ms"]
        info.setdefault("generated_expert_bytes", {})[batch] = routed
    results.save()


def fla_version() -> str | None:
    """flash-linear-attention's version (its kernels run a hybrid's linear attention)."""
    for dist in ("fla-core", "flash-linear-attention"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="JSON results path")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny models, torch backend")
    ap.add_argument("--plan", default=DEFAULT_PLAN,
                    help="blocks 'model:prompt:system,...' separated by ';', run in order")
    ap.add_argument("--batches", default="1,32,64")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--budget-s", type=float, default=400.0, help="skip runs past this")
    ap.add_argument("--experts", default=None,
                    help="MoE experts implementation of every system (default: torch_cp's, "
                         "torch_cp_fused in bf16 on CUDA; see benchmarks/models.build)")
    ap.add_argument("--kernel", default="", help=KERNEL_HELP)
    ap.add_argument("--inductor", default="",
                    help="Inductor settings for every compiled system, 'name=value,...' (e.g. "
                         "'max_autotune=True,coordinate_descent_tuning=True'): torch_cp's layers "
                         "and the peers' compiled forwards alike")
    ap.add_argument("--decode-kernel", help=DECODE_KERNEL_HELP)
    ap.add_argument("--linears", choices=("gemv", "cublas"), help=LINEARS_HELP)
    ap.add_argument("--repeats", type=int, default=1,
                    help="timed calls of each torch_cp and hf_static cell, the fastest kept "
                         "(every wall time in walls_s): the run-to-run spread out of a ratio")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        raise SystemExit(f"--repeats must be >= 1, got {args.repeats}")
    inductor = apply_inductor_settings(args.inductor)
    kernel = apply_kernel_settings(args.kernel)
    decode_kernel = apply_decode_kernel(args.decode_kernel)
    linears = apply_linears(args.linears)
    smoke = args.smoke
    device = torch.device("cpu" if smoke else "cuda")
    dtype = torch.float32 if smoke else torch.bfloat16
    budget = Budget(args.budget_s)
    results = Results(args.out, run_header(device))
    results.data["plan"] = args.plan
    results.data["experts"] = args.experts
    results.data["inductor"] = inductor
    results.data["kernel"] = kernel
    results.data["decode_kernel"] = decode_kernel
    results.data["linears"] = linears
    copy_bw = copy_bandwidth(device)
    results.data["copy_tb_s"] = copy_bw / 1e12
    results.data["versions"]["flash-linear-attention"] = fla_version()
    batches = [int(x) for x in args.batches.split(",")]
    records, model, model_name = [], None, None
    for name, prompt, systems in parse_plan(args.plan):
        if name != model_name:
            model = None
            torch._dynamo.reset()  # compiled code holds the previous model's weights
            free_cuda(device)
            start = time.perf_counter()
            model, model_name = models.build(name, device, dtype, smoke, args.experts), name
            sync(device)
            info = model_info(name, model, dtype, time.perf_counter() - start)
            results.data.setdefault("models", {})[name] = info
            with torch.inference_mode():  # lazy CUDA / cuBLAS initialisation, outside timing
                model(input_ids=torch.zeros(1, 8, dtype=torch.long, device=device))
        records += run_block(results, budget, name, model, info, prompt, systems, batches, args,
                             copy_bw, device, smoke)
        results.save()
    print(f"\ncopy bandwidth {copy_bw / 1e12:.2f} TB/s; step = ms per decode step; roofline = "
          f"(weights + KV read + linear-attention state read and written) / copy bandwidth")
    print(table(records, ["model", "system", "prompt", "batch", "tokens_per_s", "step_ms",
                          "roofline_ms", "step_over_roofline", "step_over_roofline_generated",
                          "ttft_s", "peak_gib"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
