"""A one-token linear (y = W x) in Triton against cuBLAS, at the decode shapes of Qwen3-8B and
Qwen3-30B-A3B, replayed from CUDA graphs with each weight cycled through copies that keep it
out of L2, against the copy roofline of the weight's bytes.

cuBLAS reads the weights of a batch-1 step at 63-78 % of the copy bandwidth where they are
small or K is long (Qwen3-8B's o and down: run 59's profile), and a step is mostly those reads.
Here each program reduces a ``rows x K / split`` strip, so a weight becomes hundreds of
independent loads in flight; a split's partial sums go to a float32 scratch and the last program
of a row block to finish (an atomic ticket) sums them in a fixed order, so the result is
deterministic and the linear stays one kernel. The sweep's rows beside cuBLAS: "torch_cp",
``torch_cp.gemv.one_token`` at its own tile (split 1, which won every shape of run 102).

    python -m benchmarks.gemv --out benchmarks/results/gemv.json
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
from torch_cp import gemv

SHAPES = {  # name: (out features N, in features K)
    "qwen3_8b_qkv": (6144, 4096), "qwen3_8b_o": (4096, 4096),
    "qwen3_8b_gate_up": (24576, 4096), "qwen3_8b_down": (4096, 12288),
    "a3b_qkv": (5120, 2048), "a3b_o": (2048, 4096), "a3b_router": (128, 2048),
}


@triton.jit
def _gemv(x_ptr, w_ptr, out_ptr, part_ptr, ticket_ptr, N, K, split, w_sn,
          BN: tl.constexpr, BK: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    n = pid_n * BN + tl.arange(0, BN)
    n_ok = n < N
    k_len = K // split
    acc = tl.zeros([BN], tl.float32)
    for k0 in range(pid_k * k_len, (pid_k + 1) * k_len, BK):
        k = k0 + tl.arange(0, BK)
        w = tl.load(w_ptr + n.to(tl.int64)[:, None] * w_sn + k[None, :], mask=n_ok[:, None],
                    other=0.0)
        x = tl.load(x_ptr + k)
        acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], 1)
    if split == 1:
        tl.store(out_ptr + n, acc.to(out_ptr.dtype.element_ty), mask=n_ok)
    else:
        tl.store(part_ptr + pid_k * N + n, acc, mask=n_ok)
        tl.debug_barrier()
        ticket = tl.atomic_add(ticket_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if ticket == split - 1:
            total = tl.zeros([BN], tl.float32)
            for s in range(0, split):
                total += tl.load(part_ptr + s * N + n, mask=n_ok, other=0.0, cache_modifier=".cg")
            tl.store(out_ptr + n, total.to(out_ptr.dtype.element_ty), mask=n_ok)
            tl.store(ticket_ptr + pid_n, 0)


class Gemv:
    """One tile's launcher with its scratch: ``(x [K], w [N, K]) -> [N]``."""

    def __init__(self, n: int, k: int, bn: int, bk: int, split: int, warps: int, stages: int,
                 device: torch.device):
        assert k % (split * bk) == 0
        self.n, self.k, self.bn, self.bk, self.split = n, k, bn, bk, split
        self.warps, self.stages = warps, stages
        self.part = torch.empty(split, n, dtype=torch.float32, device=device)
        self.tickets = torch.zeros(triton.cdiv(n, bn), dtype=torch.int32, device=device)

    def __call__(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        out = torch.empty(self.n, dtype=x.dtype, device=x.device)
        grid = (triton.cdiv(self.n, self.bn), self.split)
        tile = dict(BN=self.bn, BK=self.bk, num_warps=self.warps, num_stages=self.stages)
        _gemv[grid](x, w, out, self.part, self.tickets, self.n, self.k, self.split, w.stride(0),
                    **tile)
        return out


def cycled(fn, weights):
    """``fn(w)`` over the copies in turn, one a call (captured calls take the next copy)."""
    state = {"i": 0}

    def call():
        w = weights[state["i"] % len(weights)]
        state["i"] += 1
        return fn(w)
    return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--bn", default="8,16,32")
    parser.add_argument("--bk", default="256,512,1024")
    parser.add_argument("--splits", default="1,2,4,8,16")
    parser.add_argument("--warps", default="4,8")
    parser.add_argument("--stages", default="1,3")
    parser.add_argument("--top", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    ints = lambda s: [int(v) for v in s.split(",")]  # noqa: E731
    device = torch.device("cuda")
    bandwidth = copy_bandwidth(device)
    results = Results(args.out, dict(run_header(device), bandwidth=bandwidth))
    print(f"copy bandwidth {bandwidth / 1e12:.3f} TB/s")
    summary = []
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        nbytes = n * k * 2
        copies = max(2, min(8, math.ceil(160e6 / nbytes)))
        weights = [torch.randn(n, k, device=device, dtype=torch.bfloat16) / k ** 0.5
                   for _ in range(copies)]
        x = torch.randn(k, device=device, dtype=torch.bfloat16)
        want = F.linear(x.float(), weights[0].float())
        roof_us = nbytes / bandwidth * 1e6
        case = dict(shape=name, n=n, k=k, roofline_us=roof_us)
        rows = []
        for label, fn in (("cublas_linear", lambda w, x=x: F.linear(x[None], w)),
                          ("cublas_mv", lambda w, x=x: torch.mv(w, x)),
                          ("torch_cp", lambda w, x=x: gemv.one_token(x, w))):
            us = graph_time_ms(cycled(fn, weights), device, iters=200, per_graph=4 * copies) * 1e3
            rows.append(results.add(kernel=label, us=us, **case))
        grid = itertools.product(ints(args.bn), ints(args.bk), ints(args.splits),
                                 ints(args.warps), ints(args.stages))
        for bn, bk, split, warps, stages in grid:
            if k % (split * bk):
                continue
            g = Gemv(n, k, bn, bk, split, warps, stages, device)
            try:
                got = g(x, weights[0]).float()
                torch.testing.assert_close(got, want, atol=1e-2 * want.abs().max().item(),
                                           rtol=0)
                us = graph_time_ms(cycled(lambda w, g=g, x=x: g(x, w), weights), device, iters=200,
                                   per_graph=4 * copies) * 1e3
            except Exception as error:  # a tile out of resources: noted, the sweep goes on
                print(f"{name} {bn}/{bk}/{split}/{warps}/{stages}: {type(error).__name__}")
                continue
            rows.append(results.add(kernel="triton", bn=bn, bk=bk, split=split, warps=warps,
                                    stages=stages, us=us, **case))
        rows.sort(key=lambda r: r["us"])
        for r in rows:
            r["x_roof"] = r["us"] / roof_us
        best = [r for r in rows if r["kernel"].startswith("triton")][:args.top]
        cublas = [r for r in rows if not r["kernel"].startswith("triton")]
        print(f"\n{name} ({n} x {k}, {nbytes / 1e6:.1f} MB, roofline {roof_us:.2f} us)")
        print(table(cublas + best, ["kernel", "bn", "bk", "split", "warps", "stages", "us",
                                    "x_roof"]))
        summary.append(dict(shape=name, roofline_us=roof_us,
                            cublas_us=min(r["us"] for r in cublas if r["kernel"] != "torch_cp"),
                            torch_cp_us=next(r["us"] for r in cublas
                                             if r["kernel"] == "torch_cp"),
                            triton_us=best[0]["us"] if best else None,
                            tile=best[0] and {f: best[0][f] for f in
                                              ("bn", "bk", "split", "warps", "stages")}))
        del weights
    print("\nsummary")
    print(table(summary, ["shape", "roofline_us", "cublas_us", "torch_cp_us", "triton_us"]))
    results.data["summary"] = summary
    results.save()


if __name__ == "__main__":
    main()
