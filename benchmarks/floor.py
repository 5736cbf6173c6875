"""The weight reads of a one-token decode step alone: what a step of one kernel per linear
costs before anything else runs.

One CUDA graph holds, for each of the model's layers (each with its own weights, of the model's
shapes), only the kernels that read weights, in the step's order and each fed by the one before:
the q/k/v, o (and the router's) one-token linears (``torch_cp.gemv``), then the experts (the
fused pair kernels over ``top_k`` distinct experts, ``torch_cp.graphs.fused_experts``, and the
sum of a token's pairs: two torch kernels here, in the engine's compiled layers one with the
residual add) or the dense MLP's gate/up and down; last the LM head (cuBLAS, as in the engine).
No norm, RoPE, pool write, attention, routing choice or SiLU. The dependent launch on and off,
as in the engine. Its time against the copy time of the same bytes shows what the linears alone
cost at batch 1; a whole step (``benchmarks.generate``) minus it, what all else costs.

    python -m benchmarks.floor --models qwen3_moe,qwen3 --out benchmarks/results/floor.json
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from torch.nn import functional as F

from benchmarks.common import (
    Results,
    captured,
    copy_bandwidth,
    kernel_times,
    run_header,
    table,
    time_ms,
)
from benchmarks.models import config_for
from torch_cp import gemv, pdl
from torch_cp.graphs.fused_experts import fused_experts


@dataclass(frozen=True)
class Shape:
    """The weight shapes of one decoder layer and the LM head, from a transformers config."""

    hidden: int
    qkv: int  # q, k and v projections' rows together
    attn: int  # o's input features
    inter: int  # the dense MLP's, or one expert's, intermediate size
    experts: int  # 0 for a dense MLP
    top_k: int
    layers: int
    vocab: int

    @classmethod
    def of(cls, config) -> Shape:
        head = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        experts = getattr(config, "num_experts", 0) or 0
        return cls(hidden=config.hidden_size,
                   qkv=(config.num_attention_heads + 2 * config.num_key_value_heads) * head,
                   attn=config.num_attention_heads * head,
                   inter=config.moe_intermediate_size if experts else config.intermediate_size,
                   experts=experts, top_k=getattr(config, "num_experts_per_tok", 0) if experts
                   else 0, layers=config.num_hidden_layers, vocab=config.vocab_size)

    def bytes_read(self, element_size: int = 2) -> int:
        """Weight bytes one step reads: each layer's linears (of the experts, ``top_k``), the LM
        head."""
        layer = self.qkv * self.hidden + self.hidden * self.attn
        if self.experts:
            layer += self.experts * self.hidden + self.top_k * 3 * self.inter * self.hidden
        else:
            layer += 3 * self.inter * self.hidden
        return (self.layers * layer + self.vocab * self.hidden) * element_size


class Chain:
    """The layers' weights, drawn once (N(0, 1 / in features)), and the step of linears alone
    over them. Of each layer's experts only the ``top_k`` it reads are held (each expert's weights
    contiguous, as in transformers' [E, 2I, H] and [E, H, I] tensors)."""

    def __init__(self, shape: Shape, device: torch.device, dtype: torch.dtype = torch.bfloat16):
        self.shape = s = shape
        g = torch.Generator(device).manual_seed(0)

        def w(*dims):
            return (torch.randn(*dims, generator=g, device=device, dtype=torch.float32)
                    / dims[-1] ** 0.5).to(dtype)

        self.layers = []
        for _ in range(s.layers):
            layer = dict(qkv=w(s.qkv, s.hidden), o=w(s.hidden, s.attn))
            if s.experts:
                layer.update(router=w(s.experts, s.hidden), experts=SimpleNamespace(
                    gate_up_proj=w(s.top_k, 2 * s.inter, s.hidden),
                    down_proj=w(s.top_k, s.hidden, s.inter)))
            else:
                layer.update(gate_up=w(2 * s.inter, s.hidden), down=w(s.hidden, s.inter))
            self.layers.append(layer)
        self.lm_head = w(s.vocab, s.hidden)
        self.x = torch.randn(s.hidden, generator=g, device=device).to(dtype)
        self.ids_tk = torch.arange(s.top_k, device=device)[None]
        self.weights_tk = torch.ones(1, s.top_k, device=device)

    def step(self, linear=gemv.one_token, experts=fused_experts) -> torch.Tensor:
        """The logits [1, vocab]: each layer's linears in turn, each fed by the last (o by the
        first ``attn`` of q/k/v's outputs, down by the first ``inter`` of gate/up's), the
        experts and the dense MLP's output the next layer's input."""
        x = self.x
        for layer in self.layers:
            h = linear(linear(x, layer["qkv"])[:self.shape.attn], layer["o"])
            if self.shape.experts:
                linear(h, layer["router"])  # the router's read; its choice is not modelled
                x = experts(layer["experts"], h[None], self.ids_tk, self.weights_tk)[0]
            else:
                x = linear(linear(h, layer["gate_up"])[:self.shape.inter], layer["down"])
        return F.linear(x[None], self.lm_head)


def reference_experts(experts, x_td, ids_tk, weights_tk) -> torch.Tensor:
    """The experts in plain torch (float32): SiLU(gate) * up, down, weighted, summed."""
    out = torch.zeros(x_td.shape, dtype=torch.float32, device=x_td.device)
    for t in range(x_td.shape[0]):
        for e, wt in zip(ids_tk[t].tolist(), weights_tk[t].tolist()):
            gate, up = (experts.gate_up_proj[e].float() @ x_td[t].float()).chunk(2)
            out[t] += wt * (experts.down_proj[e].float() @ (F.silu(gate) * up))
    return out.to(x_td.dtype)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="qwen3_moe,qwen3",
                        help="benchmarks.models names with GQA attention: qwen3, qwen3_moe")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    bandwidth = copy_bandwidth(device)
    results = Results(args.out, dict(run_header(device), bandwidth=bandwidth))
    print(f"copy bandwidth {bandwidth / 1e12:.3f} TB/s")
    rows = []
    with torch.inference_mode():
        for name in args.models.split(","):
            shape = Shape.of(config_for(name, smoke=False))
            chain = Chain(shape, device)
            roof_ms = shape.bytes_read() / bandwidth * 1e3
            for on in (True, False):
                pdl.ENABLED = on
                graph = captured(chain.step, device)
                ms = time_ms(graph.replay, device, iters=args.iters, warmup=3)
                kernels = kernel_times(graph.replay, device)
                per_kernel = {k: dict(ms=v[0], calls=v[1]) for k, v in
                              sorted(kernels.items(), key=lambda kv: -kv[1][0])}
                rows.append(results.add(model=name, pdl=on, ms=ms, roofline_ms=roof_ms,
                                        x_roof=ms / roof_ms, weights_gb=shape.bytes_read() / 1e9,
                                        kernels=sum(v[1] for v in kernels.values()),
                                        per_kernel=per_kernel))
                del graph
            del chain
            torch.cuda.empty_cache()
    pdl.ENABLED = True
    print(table(rows, ["model", "pdl", "ms", "roofline_ms", "x_roof", "weights_gb", "kernels"]))


if __name__ == "__main__":
    main()
