"""A decode step's linears: cuBLAS (``F.linear``) beside torch_cp's skinny kernel
(graphs/skinny_linear.py) at its picked tiles and, with ``--sweep``, at every tile of a space,
replayed from a CUDA graph, against the copy roofline of the weight.

    python -m benchmarks.linears --out benchmarks/results/linears.json

Each case cycles through enough copies of its weight (each its own tensor) that no copy is
still in the 50 MB L2 when it is read again, as inside a step, and reports the time a copy.
Every tile's output is checked against ``F.linear``'s (bf16: within 2**-7 of the largest output,
the two summing in another order and each rounding once).
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F

from benchmarks.common import Results, copy_bandwidth, graph_time_ms, run_header, table
from torch_cp.graphs import skinny_linear as sl

# name: (out features, in features), bf16, of the models the benchmarks build
SHAPES = {
    "a3b_qkv": (5120, 2048), "a3b_o": (2048, 4096), "a3b_router": (128, 2048),
    "a3b_lm_head": (151936, 2048),
    "8b_qkv": (6144, 4096), "8b_o": (4096, 4096), "8b_gate_up": (24576, 4096),
    "8b_down": (4096, 12288),
}
SPACE = dict(rows=(16, 32, 64), cols=(128, 256), split=(1, 2, 4), warps=(4,), stages=(3, 4, 5))
L2_BYTES = 200 << 20  # cycle at least this many weight bytes


def run_case(name: str, tokens: int, bandwidth: float, results: Results, sweep: bool
             ) -> list[dict]:
    device = torch.device("cuda")
    n_out, k_len = SHAPES[name]
    weight_bytes = n_out * k_len * 2
    copies = max(1, -(-L2_BYTES // weight_bytes))
    weights = [torch.randn(n_out, k_len, device=device, dtype=torch.bfloat16) / k_len ** 0.5
               for _ in range(copies)]
    x = torch.randn(tokens, k_len, device=device, dtype=torch.bfloat16)
    want = F.linear(x, weights[0]).float()
    case = dict(shape=name, tokens=tokens, roofline_us=weight_bytes / bandwidth * 1e6)

    def timed(call) -> float:
        return graph_time_ms(lambda: [call(w) for w in weights], device, iters=20,
                             per_graph=2) * 1e3 / copies

    rows = [results.add(kernel="F.linear", us=timed(lambda w: F.linear(x, w)), **case)]
    picked = sl.pick_tiles(tokens, n_out, k_len, torch.cuda.get_device_properties(
        device).multi_processor_count)
    space = itertools.product(*SPACE.values()) if sweep else []
    for tiles in [picked] + [sl.SkinnyTiles(*t) for t in space]:
        if k_len % (tiles.cols * tiles.split):
            continue
        got = sl.linear(x, weights[0], tiles=tiles).float()
        torch.testing.assert_close(got, want, atol=2 ** -7 * want.abs().max().item(), rtol=0)
        rows.append(results.add(kernel="skinny" + (" (picked)" if tiles is picked else ""),
                                tiles=str(tiles), us=timed(
                                    lambda w, t=tiles: sl.linear(x, w, tiles=t)), **case))
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--tokens", default="1,8,32,64")
    p.add_argument("--sweep", action="store_true", help="every tile of SPACE too")
    args = p.parse_args(argv)
    device = torch.device("cuda")
    results = Results(args.out, header=run_header(device))
    bandwidth = copy_bandwidth(device)
    best = []
    with torch.inference_mode():
        for name in args.shapes.split(","):
            for tokens in map(int, args.tokens.split(",")):
                rows = run_case(name, tokens, bandwidth, results, args.sweep)
                best += [r for r in rows if r["kernel"] != "skinny"]
                swept = [r for r in rows if r["kernel"] == "skinny"]
                if swept:
                    best.append(dict(min(swept, key=lambda r: r["us"]), kernel="skinny (best)"))
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    print(table(best, ["shape", "tokens", "kernel", "us", "roofline_us", "tiles"]))
    results.save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
