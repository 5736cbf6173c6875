"""Tiles for torch_cp's fused decode-sized experts (graphs/fused_experts.py): each kernel's rows,
channels and warps per program, swept one kernel at a time (the other at its default), replayed
from a CUDA graph at one and eight tokens of the Qwen3-30B-A3B and GLM-4.7-Flash blocks, against
the copy roofline of the routed experts' weights. Prints the fastest tiles of each kernel.
With ``--grouped``, the same for ``grouped_experts``' kernels (graphs/grouped_experts.py) at 32
and 64 tokens, beside ``grouped_mm``, the implementation they replace there. ``--routing hot``
gives every token the same input (so the same experts, each with all the tokens: the worst case
for a kernel that walks an expert's pairs in one program).

    python -m benchmarks.experts_tiles --out benchmarks/results/experts_tiles.json
    python -m benchmarks.experts_tiles --grouped --out benchmarks/results/grouped_tiles.json

``--space pairs=16;rows=32,64;cols=64,128;warps=4;stages=2,3,4`` narrows or widens the grouped
sweep (``stages``: Triton's pipeline depth; left out, the default tiles'); ``--shapes`` picks
blocks.
"""

from __future__ import annotations

import argparse
import itertools

import torch
from transformers.integrations import moe

from benchmarks.common import Results, copy_bandwidth, graph_time_ms, run_header, table
from benchmarks.experts import SHAPES, moe_block, route
from benchmarks.models import expert_bytes
from torch_cp.graphs import fused_experts as fe
from torch_cp.graphs import grouped_experts as ge

ROWS, COLS, WARPS = (8, 16, 32), (128, 256, 512, 1024), (4, 8)  # 1024: run 102's gemv tile
GROUPED_PAIRS, GROUPED_ROWS = (16, 32), (32, 64, 128)
GROUPED_COLS, GROUPED_WARPS = (64, 128), (4, 8)
GROUPED_SPACE = dict(pairs=GROUPED_PAIRS, rows=GROUPED_ROWS, cols=GROUPED_COLS,
                     warps=GROUPED_WARPS, stages=(ge.DOWN_TILES.stages,))


def grouped_space(text: str) -> dict:
    """``"rows=32,64;stages=2,3"`` over ``GROUPED_SPACE``: the values to sweep of each field."""
    space = dict(GROUPED_SPACE)
    for part in filter(None, text.split(";")):
        name, _, values = part.partition("=")
        if name not in space:
            raise ValueError(f"--space: {name!r} is not one of {sorted(space)}")
        space[name] = tuple(int(v) for v in values.split(","))
    return space


def sweep(shape: str, tokens: int, bandwidth: float, results: Results, grouped: bool,
          routing: str, defaults_only: bool = False, space: dict | None = None) -> list[dict]:
    device = torch.device("cuda")
    block = moe_block(shape, device, torch.bfloat16)
    experts = block.experts
    x = torch.randn(1 if routing == "hot" else tokens, experts.hidden_dim, device=device,
                    dtype=torch.bfloat16).expand(tokens, -1).contiguous()
    with torch.inference_mode():
        _, weights, ids = route(block, x)
    roof = ids.unique().numel() * expert_bytes(experts) / bandwidth * 1e3
    call, tile = (ge.grouped_experts, ge.GroupedTiles) if grouped else (fe.fused_experts, fe.Tiles)
    want = moe.batched_mm_experts_forward(experts, x, ids, weights).float()
    case = dict(shape=shape, tokens=tokens, routing=routing, roofline_ms=roof)
    rows = []
    if grouped:
        ms = graph_time_ms(lambda: moe.grouped_mm_experts_forward(experts, x, ids, weights),
                           device, iters=100)
        rows.append(results.add(kernel="grouped_mm", ms=ms, **case))
    space = (itertools.product(*(space or GROUPED_SPACE).values()) if grouped
             else itertools.product([None], ROWS, COLS, WARPS, [None]))
    for (m, r, c, w, st), kernel in itertools.product([] if defaults_only else list(space),
                                                      ("gate_up", "down")):
        # (a kernel at other pairs than the other's takes a second align: counted in its time)
        tiles = {f"{kernel}_tiles": tile(m, r, c, w, st) if grouped else tile(r, c, w)}
        got = call(experts, x, ids, weights, **tiles).float()
        torch.testing.assert_close(got, want, atol=2e-2 * want.abs().max().item(), rtol=0)
        ms = graph_time_ms(lambda t=tiles: call(experts, x, ids, weights, **t), device, iters=100)
        rows.append(results.add(kernel=kernel, pairs=m, rows=r, cols=c, warps=w, stages=st,
                                ms=ms, **case))
    ms = graph_time_ms(lambda: call(experts, x, ids, weights), device, iters=100)
    rows.append(results.add(kernel="both at their defaults", ms=ms, **case))
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out")
    p.add_argument("--tokens", default=None, help="default 1,8 (32,64 with --grouped)")
    p.add_argument("--grouped", action="store_true")
    p.add_argument("--routing", choices=("spread", "hot"), default="spread")
    p.add_argument("--defaults-only", action="store_true", help="no sweep: the default tiles")
    p.add_argument("--space", default="", help="grouped sweep, e.g. 'rows=32,64;stages=2,3'")
    p.add_argument("--shapes", default=",".join(SHAPES))
    args = p.parse_args(argv)
    if args.space and not args.grouped:
        raise SystemExit("--space sweeps the grouped kernels: give --grouped too")
    try:
        space = grouped_space(args.space)
    except ValueError as error:
        raise SystemExit(str(error)) from None
    args.tokens = args.tokens or ("32,64" if args.grouped else "1,8")
    results = Results(args.out, header=run_header(torch.device("cuda")))
    bandwidth = copy_bandwidth(torch.device("cuda"))
    rows = []
    with torch.inference_mode():
        for shape in args.shapes.split(","):
            for tokens in (int(t) for t in args.tokens.split(",")):
                rows += sweep(shape, tokens, bandwidth, results, args.grouped, args.routing,
                              args.defaults_only, space)
    best = []
    rows.sort(key=lambda r: (r["shape"], r["tokens"], r["kernel"]))
    for _, group in itertools.groupby(rows, lambda r: (r["shape"], r["tokens"], r["kernel"])):
        best.append(min(group, key=lambda r: r["ms"]))
    print(table(best, ["shape", "tokens", "kernel", "pairs", "rows", "cols", "warps", "stages",
                       "ms", "roofline_ms"]))
    module = ge if args.grouped else fe
    for kernel in () if args.defaults_only else ("gate_up", "down"):
        t = getattr(module, f"{kernel.upper()}_TILES")
        defaults = [r for r in rows if r["kernel"] == kernel
                    and (r["pairs"], r["rows"], r["cols"], r["warps"], r["stages"])
                    == (getattr(t, "pairs", None), t.rows, t.cols, t.warps,
                        getattr(t, "stages", None))]
        print(f"{kernel} at its default tiles {t}:")
        print(table(defaults, ["shape", "tokens", "ms", "roofline_ms"]))
    results.save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
