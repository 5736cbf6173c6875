"""Tiles for torch_cp's fused decode-sized experts (graphs/fused_experts.py): each kernel's rows,
channels and warps per program, swept one kernel at a time (the other at its default), replayed
from a CUDA graph at one and eight tokens of the Qwen3-30B-A3B and GLM-4.7-Flash blocks, against
the copy roofline of the routed experts' weights. Prints the fastest tiles of each kernel.

    python -m benchmarks.experts_tiles --out benchmarks/results/experts_tiles.json
"""

from __future__ import annotations

import argparse
import itertools

import torch

from benchmarks.common import Results, copy_bandwidth, graph_time_ms, run_header, table
from benchmarks.experts import SHAPES, moe_block, route
from torch_cp.graphs import fused_experts as fe

ROWS, COLS, WARPS = (8, 16, 32), (128, 256, 512), (4, 8)


def sweep(shape: str, tokens: int, bandwidth: float, results: Results) -> list[dict]:
    device = torch.device("cuda")
    block = moe_block(shape, device, torch.bfloat16)
    experts = block.experts
    x = torch.randn(tokens, experts.hidden_dim, device=device, dtype=torch.bfloat16)
    with torch.inference_mode():
        _, weights, ids = route(block, x)
    per_expert = (experts.gate_up_proj[0].numel() + experts.down_proj[0].numel()) * 2
    roof = ids.unique().numel() * per_expert / bandwidth * 1e3
    want = fe.fused_experts(experts, x, ids, weights).float()
    rows = []
    for kernel in ("gate_up", "down"):
        for r, c, w in itertools.product(ROWS, COLS, WARPS):
            tiles = {f"{kernel}_tiles": fe.Tiles(rows=r, cols=c, warps=w)}
            got = fe.fused_experts(experts, x, ids, weights, **tiles).float()
            torch.testing.assert_close(got, want, atol=2e-2 * want.abs().max().item(), rtol=0)
            ms = graph_time_ms(lambda t=tiles: fe.fused_experts(experts, x, ids, weights, **t),
                               device, iters=100)
            rows.append(results.add(shape=shape, tokens=tokens, kernel=kernel, rows=r, cols=c,
                                    warps=w, ms=ms, roofline_ms=roof))
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out")
    p.add_argument("--tokens", default="1,8")
    args = p.parse_args(argv)
    results = Results(args.out, header=run_header(torch.device("cuda")))
    bandwidth = copy_bandwidth(torch.device("cuda"))
    rows = []
    with torch.inference_mode():
        for shape in SHAPES:
            for tokens in (int(t) for t in args.tokens.split(",")):
                rows += sweep(shape, tokens, bandwidth, results)
    best = []
    for _, group in itertools.groupby(rows, lambda r: (r["shape"], r["tokens"], r["kernel"])):
        best.append(min(group, key=lambda r: r["ms"]))
    print(table(best, ["shape", "tokens", "kernel", "rows", "cols", "warps", "ms",
                       "roofline_ms"]))
    defaults = [r for r in rows if (r["rows"], r["cols"], r["warps"]) == (32, 128, 4)]
    print("defaults (32, 128, 4):")
    print(table(defaults, ["shape", "tokens", "kernel", "ms", "roofline_ms"]))
    results.save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
