"""A linear of a few tokens (y = x W^T, x of 2-64 rows) in one Triton kernel against cuBLAS, at
the decode shapes of Qwen3-8B and Qwen3-30B-A3B, replayed from CUDA graphs with each weight cycled
through copies that keep it out of L2, against the copy roofline of the weight's bytes.

At 32 rows cuBLAS reads Qwen3-8B's q/k/v and o at about 3.1 TB/s of the H200's 4.27 and its down
projection with a split-K sum after it (run 105's profile: the GEMMs 1.17x their weights' time).
Here each program multiplies every row by ``bn`` rows of the weight (tensor cores, float32 sums)
over the whole input, so a weight is read as hundreds of independent strips, as the one-token
kernel (``torch_cp.gemv``) does for one row; the rows of x are re-read from L2 by each program.

    python -m benchmarks.few_tokens --out benchmarks/results/few_tokens.json
    TRITON_INTERPRET=1 python -m benchmarks.few_tokens --smoke   # CPU, a tiny grid
"""

from __future__ import annotations

import argparse
import itertools
import math

import torch
import triton
import triton.language as tl
from torch.nn import functional as F

from benchmarks.common import Results, copy_bandwidth, graph_time_ms, run_header, table
from benchmarks.gemv import SHAPES as ONE_TOKEN_SHAPES
from benchmarks.gemv import cycled

# the one-token sweep's weights (name: out features N, in features K) but the router's
SHAPES = {name: shape for name, shape in ONE_TOKEN_SHAPES.items() if name != "a3b_router"}


@triton.jit
def _few_tokens(x_ptr, w_ptr, out_ptr, M, N, K, x_sm, w_sn, out_sm,
                BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    m = tl.arange(0, BM)
    n_ok = n < N
    m_ok = m < M
    acc = tl.zeros([BM, BN], tl.float32)
    for k0 in range(0, K, BK):
        k = k0 + tl.arange(0, BK)
        x = tl.load(x_ptr + m[:, None] * x_sm + k[None, :], mask=m_ok[:, None], other=0.0)
        w = tl.load(w_ptr + n.to(tl.int64)[:, None] * w_sn + k[None, :], mask=n_ok[:, None],
                    other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
    tl.store(out_ptr + m[:, None] * out_sm + n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def few_tokens(x: torch.Tensor, w: torch.Tensor, bn: int, bk: int, warps: int, stages: int
               ) -> torch.Tensor:
    """``F.linear(x, w)`` for x [M, K] (M <= 64) by the kernel at one tile."""
    m, k = x.shape
    n = w.shape[0]
    assert k % bk == 0 and m <= 64
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _few_tokens[(triton.cdiv(n, bn),)](x, w, out, m, n, k, x.stride(0), w.stride(0),
                                       out.stride(0), BM=max(16, triton.next_power_of_2(m)),
                                       BN=bn, BK=bk, num_warps=warps, num_stages=stages)
    return out


def sweep(args, device: torch.device, results: Results, bandwidth: float | None) -> list[dict]:
    ints = lambda s: [int(v) for v in s.split(",")]  # noqa: E731
    dtype = torch.float32 if args.smoke else torch.bfloat16
    summary = []
    for name, tokens in itertools.product(args.shapes.split(","), ints(args.tokens)):
        n, k = (64, 128) if args.smoke else SHAPES[name]
        nbytes = n * k * 2
        copies = max(2, min(8, math.ceil(160e6 / nbytes)))
        weights = [torch.randn(n, k, device=device, dtype=dtype) / k ** 0.5
                   for _ in range(1 if args.smoke else copies)]
        x = torch.randn(tokens, k, device=device, dtype=dtype)
        want = F.linear(x.float(), weights[0].float())
        case = dict(shape=name, n=n, k=k, tokens=tokens)
        if bandwidth:
            case["roofline_us"] = nbytes / bandwidth * 1e6
        rows = []
        if not args.smoke:
            us = graph_time_ms(cycled(lambda w, x=x: F.linear(x, w), weights), device, iters=200,
                               per_graph=4 * copies) * 1e3
            rows.append(results.add(kernel="cublas", us=us, **case))
        for bn, bk, warps, stages in itertools.product(ints(args.bn), ints(args.bk),
                                                       ints(args.warps), ints(args.stages)):
            if k % bk:
                continue
            try:
                got = few_tokens(x, weights[0], bn, bk, warps, stages).float()
                torch.testing.assert_close(got, want, atol=1e-2 * want.abs().max().item(),
                                           rtol=0)
                us = None if args.smoke else graph_time_ms(
                    cycled(lambda w, x=x, t=(bn, bk, warps, stages): few_tokens(x, w, *t),
                           weights), device, iters=200, per_graph=4 * copies) * 1e3
            except Exception as error:  # a tile out of resources: noted, the sweep goes on
                if isinstance(error, AssertionError):
                    raise
                print(f"{name} x{tokens} {bn}/{bk}/{warps}/{stages}: {type(error).__name__}")
                continue
            rows.append(results.add(kernel="triton", bn=bn, bk=bk, warps=warps, stages=stages,
                                    us=us, **case))
        if args.smoke:
            summary.append(dict(case, tiles=len(rows)))
            continue
        rows.sort(key=lambda r: r["us"])
        for r in rows:
            r["x_roof"] = r["us"] / case["roofline_us"]
        best = [r for r in rows if r["kernel"] == "triton"][:args.top]
        cublas = next(r for r in rows if r["kernel"] == "cublas")
        print(f"\n{name} x {tokens} ({n} x {k}, {nbytes / 1e6:.1f} MB, "
              f"roofline {case['roofline_us']:.2f} us)")
        print(table([cublas] + best, ["kernel", "bn", "bk", "warps", "stages", "us", "x_roof"]))
        summary.append(dict(case, cublas_us=cublas["us"],
                            triton_us=best[0]["us"] if best else None,
                            tile=best[0] and {f: best[0][f] for f in ("bn", "bk", "warps",
                                                                      "stages")}))
        del weights
    return summary


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--tokens", default="8,16,32,64")
    parser.add_argument("--bn", default="16,32,64")
    parser.add_argument("--bk", default="64,128,256")
    parser.add_argument("--warps", default="2,4")
    parser.add_argument("--stages", default="3,4,5")
    parser.add_argument("--top", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="CPU, Triton's interpreter")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.smoke:
        args.shapes, args.tokens, args.bn, args.bk = "qwen3_8b_o", "3,32", "16", "64"
        args.warps, args.stages = "4", "3"
    device = torch.device("cpu" if args.smoke else "cuda")
    bandwidth = None if args.smoke else copy_bandwidth(device)
    results = Results(args.out, dict(run_header(device), bandwidth=bandwidth))
    if bandwidth:
        print(f"copy bandwidth {bandwidth / 1e12:.3f} TB/s")
    summary = sweep(args, device, results, bandwidth)
    if not args.smoke:
        print("\nsummary")
        print(table(summary, ["shape", "tokens", "roofline_us", "cublas_us", "triton_us"]))
    results.data["summary"] = summary
    results.save()
    return results.data


if __name__ == "__main__":
    main()
