"""MoE experts under CUDA graphs: which of transformers' experts implementations (and torch_cp's
``"torch_cp_fused"``, graphs/fused_experts.py, where Triton is installed) can be captured
(eager and compiled, fp32 and bf16), how exact each is in bf16, how fast each runs one MoE block
at decode batch sizes, and whether partitioning whole experts over two TP ranks (expert
parallel) beats splitting every expert's channels (what ``torch_cp.tp`` does).

Blocks: the sparse MoE block of Qwen3-30B-A3B (128 experts, top 8, 768 channels, hidden 2048) and
of GLM-4.7-Flash (``glm4_moe_lite``: 64 experts, top 4, 1536 channels, one shared expert, hidden
2048), random bf16 weights on the GPU. Times are of the block replayed from a CUDA graph (the way
a captured decode step runs it). The roofline of a block: the bytes of the experts its tokens
route to (and the router and shared expert) over the copy bandwidth measured in the same run.

TP against EP at tp = 2 is measured on one GPU as the work of each rank: TP, the block with half
of every expert's channels; EP, the block with the experts of one rank (ids of the other rank's
experts sent to transformers' expert-parallel sentinel, weight 0), slower rank of the two. Both
finish with the same all-reduce of [tokens, hidden], so that is left out of both.

    python -m benchmarks.experts --out benchmarks/results/experts.json
    python -m benchmarks.experts --smoke          # CPU, tiny blocks, the capture checks skipped
"""

from __future__ import annotations

import argparse
import copy
import traceback

import torch
from transformers import AutoConfig

from benchmarks.common import Results, copy_bandwidth, graph_time_ms, run_header, table, time_ms
from benchmarks.models import expert_bytes

try:  # registers torch_cp's fused decode-sized experts ("torch_cp_fused"; needs Triton)
    from torch_cp.graphs import fused_experts
except ImportError:
    fused_experts = None

IMPLEMENTATIONS = ("eager", "grouped_mm", "batched_mm") + (
    (fused_experts.NAME,) if fused_experts is not None else ())
SHAPES = {
    "qwen3_30b_a3b": ("qwen3_moe", dict(hidden_size=2048, moe_intermediate_size=768,
                                        num_experts=128, num_experts_per_tok=8,
                                        norm_topk_prob=True)),
    "glm47_flash": ("glm4_moe_lite", dict(hidden_size=2048, moe_intermediate_size=1536,
                                          n_routed_experts=64, num_experts_per_tok=4,
                                          n_shared_experts=1, n_group=1, topk_group=1)),
}
SMOKE = dict(hidden_size=64, moe_intermediate_size=32)


def moe_block(shape: str, device, dtype, smoke: bool = False) -> torch.nn.Module:
    """One sparse MoE block of ``shape`` (the model's own class), random weights."""
    model_type, fields = SHAPES[shape]
    config = AutoConfig.for_model(model_type, **{**fields, **(SMOKE if smoke else {})})
    from transformers import AutoModelForCausalLM

    config.num_hidden_layers = 2
    config.first_k_dense_replace = 1
    config.mlp_layer_types = ["dense", "sparse"]
    config.vocab_size = 128
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    block = copy.deepcopy(model.model.layers[1].mlp).to_empty(device=device)
    torch.manual_seed(0)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.02)
    for b in block.buffers():  # glm's router bias: zeros, as initialised
        b.zero_()
    return block.to(dtype).eval()


def set_implementation(block: torch.nn.Module, name: str) -> None:
    block.experts.config._experts_implementation = name


def experts_of(block):
    return block.experts


def capture_check(block, x: torch.Tensor, want: torch.Tensor, compiled: bool) -> str:
    """"ok (max error e)" or why the capture failed."""
    fn = torch.compile(block, fullgraph=True) if compiled else block
    try:
        stream = torch.cuda.Stream(x.device)
        stream.wait_stream(torch.cuda.current_stream(x.device))
        with torch.cuda.stream(stream), torch.inference_mode():
            for _ in range(2):
                fn(x)
        torch.cuda.current_stream(x.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(graph, stream=stream):
            out = fn(x)
        graph.replay()
        torch.cuda.synchronize(x.device)
        return f"ok (max error {(out.float() - want).abs().max().item():.3g})"
    except Exception as e:  # what the capture says is the result
        torch.cuda.synchronize(x.device)
        return f"fails: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
    finally:
        torch._dynamo.reset()


def touched_bytes(block, x: torch.Tensor) -> int:
    """Bytes a forward of ``x`` must read: the experts its tokens route to, the rest whole."""
    with torch.inference_mode():
        _, _, ids = route(block, x)
    experts = experts_of(block)
    rest = sum(p.numel() * p.element_size() for n, p in block.named_parameters()
               if not n.startswith("experts."))
    return int(ids.unique().numel()) * expert_bytes(experts) + rest


def route(block, x):
    """The router's (logits, weights, ids) for ``x`` [1, N, hidden], as the block computes them."""
    return block.gate(x.view(-1, x.shape[-1]))


class ExpertParallelHalf(torch.nn.Module):
    """The work of EP rank ``rank`` of 2: its half of the experts, every token routed as the
    whole block routes it, ids of the other rank's experts sent to the EP sentinel."""

    def __init__(self, block, rank: int):
        super().__init__()
        self.block = copy.deepcopy(block)
        experts = self.block.experts
        local = experts.num_experts // 2
        keep = slice(rank * local, (rank + 1) * local)
        experts.gate_up_proj = torch.nn.Parameter(experts.gate_up_proj[keep].clone())
        experts.down_proj = torch.nn.Parameter(experts.down_proj[keep].clone())
        experts.num_experts = local
        experts._is_expert_parallel = True
        self.first, self.local = rank * local, local

    def forward(self, x):
        _, weights, ids = route(self.block, x)
        local_ids = ids - self.first
        outside = (local_ids < 0) | (local_ids >= self.local)
        local_ids = local_ids.masked_fill(outside, self.local)
        weights = weights.masked_fill(outside, 0.0)
        out = self.block.experts(x.view(-1, x.shape[-1]), local_ids, weights).view(x.shape)
        shared = getattr(self.block, "shared_experts", None)
        return out if shared is None else out + shared(x) * 0.5  # half the shared expert's work


def tensor_parallel_half(block) -> torch.nn.Module:
    """The work of a TP rank of 2: every expert's (and the shared expert's) channels halved."""
    from torch_cp.tp import _shard_dense, _shard_experts

    half = copy.deepcopy(block)
    _shard_experts(half.experts, 0, 2)
    if getattr(half, "shared_experts", None) is not None:
        _shard_dense(half.shared_experts, 0, 2)
    return half


def measure(shape: str, batches: list[int], device, bandwidth: float | None, smoke: bool,
            results: Results) -> list[dict]:
    cuda = device.type == "cuda"
    timer = graph_time_ms if cuda else time_ms
    rows = []
    block32 = moe_block(shape, device, torch.float32, smoke)
    block16 = copy.deepcopy(block32).to(torch.bfloat16)
    for batch in batches:
        x32 = torch.randn(1, batch, block32.experts.hidden_dim, device=device,
                          generator=torch.Generator(device).manual_seed(batch))
        set_implementation(block32, "eager")
        with torch.inference_mode():
            want = block32(x32).float()
        x16 = x32.to(torch.bfloat16)
        roof = touched_bytes(block16, x16) / bandwidth * 1e3 if cuda else None
        for name in IMPLEMENTATIONS:
            rec = dict(shape=shape, batch=batch, implementation=name, roofline_ms=roof)
            set_implementation(block16, name)
            set_implementation(block32, name)
            with torch.inference_mode():
                got = block16(x16).float()
            rec["bf16_rel_error"] = ((got - want).norm() / want.norm()).item()
            if cuda:
                for dtype, block, x in (("fp32", block32, x32), ("bf16", block16, x16)):
                    for compiled in (False, True):
                        key = f"capture_{dtype}{'_compiled' if compiled else ''}"
                        rec[key] = capture_check(block, x, want, compiled)
            try:
                with torch.inference_mode():
                    rec["ms"] = timer(lambda b=block16, x=x16: b(x), device)
                    if name != "eager":
                        tp = tensor_parallel_half(block16)
                        rec["tp2_rank_ms"] = timer(lambda b=tp, x=x16: b(x), device)
                        ep = [ExpertParallelHalf(block16, r) for r in (0, 1)]
                        rec["ep2_rank_ms"] = max(timer(lambda b=b, x=x16: b(x), device)
                                                 for b in ep)
            except Exception:  # eager cannot be captured: recorded, the rest goes on
                rec["error"] = traceback.format_exc(limit=2)
            rows.append(results.add(**rec))
            print(rec, flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--batches", default="1,32,64")
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    bandwidth = copy_bandwidth(device) if device.type == "cuda" else None
    results = Results(args.out, dict(run_header(device),
                                     copy_bandwidth_gbs=bandwidth and bandwidth / 1e9))
    batches = [int(b) for b in args.batches.split(",")]
    rows = []
    for shape in SHAPES:
        rows += measure(shape, batches, device, bandwidth, args.smoke, results)
    print(table(rows, ["shape", "batch", "implementation", "ms", "roofline_ms", "tp2_rank_ms",
                       "ep2_rank_ms", "bf16_rel_error"]))
    results.save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
