"""Weights prefetched into L2 during a decode layer's small kernels, against reading them cold.

A stand-in for a batch-1 attention phase, replayed from one CUDA graph over 48 layers of distinct
weights (so nothing stays in L2 from the layer before): the one-token q/k/v linear, ``--small``
elementwise kernels that read almost nothing (norms, RoPE, the pool write, the decode and its
merge in a real layer), then the output projection. The variants differ only in
a prefetch kernel before the small kernels: none, per-line or bulk prefetches of o's weight,
the same with the next layer's q/k/v as well, or the bulk prefetch on a side stream.

Prefetches do not hold a warp, so the hope was a kernel that ends in microseconds while the bytes
arrive during the small kernels. Run 108 (one H200, BENCHMARKS.md) measured otherwise: a bulk
prefetch of Qwen3-30B-A3B's o (16.8 MB) held the stream 10.9 us, per-line prefetches 3.3 us, and
neither made the output projection faster, on the stream or beside it; so the library has none.

    python -m benchmarks.l2_prefetch --out benchmarks/results/l2_prefetch.json
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from benchmarks.common import Results, copy_bandwidth, graph_time_ms, run_header, table
from torch_cp import gemv

CHUNK = 1 << 16  # bytes a bulk prefetch asks for
LINE = 128  # bytes an L2 line holds
LINES = 1024  # lines a program of the line kernel asks for


@triton.jit
def _bulk(addr_ptr, nbytes_ptr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(1)
    base = tl.load(addr_ptr + t)
    nbytes = tl.load(nbytes_ptr + t)
    start = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64) * CHUNK
    # Chunks past the end ask again for the last one (a duplicate prefetch costs nothing).
    start = tl.minimum(start, ((nbytes - 1) // CHUNK) * CHUNK)
    size = tl.minimum(nbytes - start, CHUNK).to(tl.int32)
    tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0;",
                              "=r,l,r", [base + start, size], dtype=tl.int32, is_pure=False,
                              pack=1)


@triton.jit
def _lines(addr_ptr, nbytes_ptr, LINE: tl.constexpr, LINES: tl.constexpr):
    t = tl.program_id(1)
    base = tl.load(addr_ptr + t)
    nbytes = tl.load(nbytes_ptr + t)
    offset = (tl.program_id(0) * LINES + tl.arange(0, LINES)).to(tl.int64) * LINE
    offset = tl.minimum(offset, nbytes - 1)
    tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0;", "=r,l",
                              [base + offset], dtype=tl.int32, is_pure=False, pack=1)


class Prefetch:
    """A fixed set of tensors to pull into L2 with ``launch()``: their addresses are read once
    here, so the tensors must keep their storage (weights do)."""

    def __init__(self, tensors: list[torch.Tensor], bulk: bool | None = None):
        assert tensors and all(t.is_cuda and t.is_contiguous() for t in tensors)
        device = tensors[0].device
        self.nbytes = [t.numel() * t.element_size() for t in tensors]
        addrs = [t.data_ptr() for t in tensors]
        if bulk is None:
            bulk = (torch.cuda.get_device_capability(device)[0] >= 9
                    and all(a % 16 == 0 and n % 16 == 0 for a, n in zip(addrs, self.nbytes)))
        self.bulk = bulk
        self.addr = torch.tensor(addrs, dtype=torch.int64, device=device)
        self.size = torch.tensor(self.nbytes, dtype=torch.int64, device=device)
        unit = CHUNK * 32 if bulk else LINE * LINES
        self.grid = (triton.cdiv(max(self.nbytes), unit), len(tensors))

    def launch(self) -> None:
        if self.bulk:
            _bulk[self.grid](self.addr, self.size, CHUNK=CHUNK, BLOCK=32, num_warps=1)
        else:
            _lines[self.grid](self.addr, self.size, LINE=LINE, LINES=LINES, num_warps=4)

SHAPES = {  # name: (hidden, q/k/v rows, o's input features)
    "a3b": (2048, 5120, 4096),  # Qwen3-30B-A3B
    "qwen3_8b": (4096, 6144, 4096),
}
VARIANTS = ("base", "lines", "bulk", "bulk_next", "side", "small_only", "prefetch_only")


def layer_weights(hidden, qkv_rows, o_in, layers, device):
    def weight(n, k):
        return torch.randn(n, k, device=device, dtype=torch.bfloat16) * k ** -0.5
    return [(weight(qkv_rows, hidden), weight(hidden, o_in)) for _ in range(layers)]


def step_fn(variant, weights, small, device):
    hidden, o_in = weights[0][1].shape
    x = torch.randn(1, hidden, device=device, dtype=torch.bfloat16)
    attn = torch.randn(1, o_in, device=device, dtype=torch.bfloat16)
    scratch = torch.randn(1, 4096, device=device, dtype=torch.bfloat16)
    nxt = weights[1:] + weights[:1]
    bulk = variant != "lines"
    prefetches = [Prefetch([o] + ([q_next] if variant == "bulk_next" else []), bulk=bulk)
                  for (_, o), (q_next, _) in zip(weights, nxt)]
    side = torch.cuda.Stream(device)

    def step():
        cur = torch.cuda.current_stream(device)
        for (qkv, o), pf in zip(weights, prefetches):
            if variant not in ("small_only", "prefetch_only"):
                gemv.one_token(x, qkv)
            if variant in ("lines", "bulk", "bulk_next", "prefetch_only"):
                pf.launch()
            elif variant == "side":
                side.wait_stream(cur)
                with torch.cuda.stream(side):
                    pf.launch()
            if variant != "prefetch_only":
                for _ in range(small):
                    scratch.mul_(1.0001)
            if variant not in ("small_only", "prefetch_only"):
                gemv.one_token(attn, o)
        if variant == "side":
            cur.wait_stream(side)

    return step


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--small", default="4,8", help="small kernels between the linears")
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--out")
    args = ap.parse_args()
    device = torch.device("cuda")
    res = Results(args.out, run_header(device))
    res.data["copy_bandwidth_tb_s"] = copy_bandwidth(device) / 1e12
    rows = []
    for shape in args.shapes.split(","):
        hidden, qkv_rows, o_in = SHAPES[shape]
        weights = layer_weights(hidden, qkv_rows, o_in, args.layers, device)
        o_bytes = hidden * o_in * 2
        for small in map(int, args.small.split(",")):
            for variant in VARIANTS:
                ms = graph_time_ms(step_fn(variant, weights, small, device), device,
                                   iters=20, per_graph=1)
                rows.append(res.add(shape=shape, small=small, variant=variant,
                                    us_per_layer=1e3 * ms / args.layers,
                                    o_mb=o_bytes / 1e6,
                                    o_copy_us=1e6 * o_bytes / (res.data["copy_bandwidth_tb_s"]
                                                               * 1e12)))
        del weights
        torch.cuda.empty_cache()
    print(table(rows, ["shape", "small", "variant", "us_per_layer", "o_copy_us"]))


if __name__ == "__main__":
    main()
