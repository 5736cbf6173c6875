"""FlashInfer's paged GQA decode kernels as a captured step runs them, side by side.

    python -m benchmarks.decode_kernels --out benchmarks/results/decode_kernels.json

torch_cp's captured decode steps plan FlashInfer's tensor-core decode with ``use_cuda_graph=True``,
whose planner always splits the KV (so a merge kernel always follows) and caps the work items at
two CTAs an SM. This times, replayed from a CUDA graph with the wrapper's fixed buffers, one
layer's decode (output and LSE, as torch_cp asks for) with each variant FlashInfer offers:

- ``fa2``: the tensor-core path as torch_cp plans it today;
- ``fa2_no_split``: the same with ``disable_split_kv=True`` (no merge, one CTA per row and head);
  ``--splits N,...`` adds ``fa2_split:N``, the KV split in pieces of N pages
  (``fixed_split_size``, the split vLLM pins for batch invariance);
- ``fa3``: the tensor-core path on FlashInfer's SM90 (FA3) prefill kernel;
- ``cuda_cores``: the CUDA-core decode kernel (GQA groups FlashInfer's dispatch takes);
- ``triton``: torch_cp's chunked Triton kernels (``torch_cp/attention/triton_decode.py``), with
  the work items a captured step of these rows gets; ``--triton B:W:P[:S],...`` adds a variant
  per tile (context tokens a tile, warps, programs an SM, pipeline stages), for tuning.

``--layouts NHD,HND`` and ``--pages 16,64`` time FlashInfer's variants over other pool layouts
and page sizes too (torch_cp's pool is NHD with the user's page; the Triton kernels read NHD
only).

Each variant's output is checked against ``fa2``'s (bf16 atol 2e-2: the same attention summed in
another order). KV bytes over the time set against the copy bandwidth of the same run. A KV that
fits the 50 MB L2 replays from it; inside a step the layers between evict it. ``--layers L``
times L layers' KV in turn (each its own tensor) and reports the time a layer.
"""

from __future__ import annotations

import argparse
import itertools

import torch

from benchmarks.common import (
    Results,
    copy_bandwidth,
    graph_time_ms,
    run_header,
    table,
    triton_tile,
)

PAGE = 16
DTYPE = torch.bfloat16
SHAPES = {"gqa": dict(q_heads=32, kv_heads=8, head_dim=128),   # Qwen3-8B layer
          "gqa8": dict(q_heads=32, kv_heads=4, head_dim=128)}  # Qwen3-30B-A3B layer
# rows x context; "+L": the last row L tokens (a long request among short ones)
SIZES = ("1x512", "1x4096", "32x512", "64x512", "32x4096", "64x4096", "32x512+32768")
VARIANTS = ("fa2", "fa2_no_split", "fa3", "cuda_cores", "triton")


def decode_variant(name: str, shape: dict, lens: list[int], q: torch.Tensor,
                   workspace: torch.Tensor, layout: str = "NHD", page: int = PAGE):
    """A planned graph-ready wrapper for ``name`` over rows of ``lens`` tokens, and the call
    that runs it on a layer's KV (``triton:B:W:P[:S]``: the Triton kernels at that tile)."""
    device = q.device
    batch = len(lens)
    pages = [-(-n // page) for n in lens]
    i32 = dict(dtype=torch.int32, device=device)
    order = torch.randperm(sum(pages), generator=torch.Generator().manual_seed(0)).to(**i32)
    indptr = torch.tensor([0] + pages, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    if name.startswith("triton"):
        from torch_cp.attention import triton_decode

        block, warps, per_sm, stages = variant_tile(name)
        table = torch.zeros(batch, max(pages), **i32)  # padded with page 0, never read
        for row, (a, b) in enumerate(zip(indptr.tolist(), indptr[1:].tolist())):
            table[row, : b - a] = order[a:b]
        rows = torch.arange(batch, device=device)
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        spare = triton_decode.spare_items(batch, shape["kv_heads"], sms, per_sm)
        scale = shape["head_dim"] ** -0.5
        row_lens = torch.tensor(lens, **i32)
        return lambda kv: triton_decode.decode(q, kv, table, row_lens, rows, scale, spare,
                                               block, warps, stages)
    import flashinfer

    last = torch.tensor([n - (p - 1) * page for n, p in zip(lens, pages)], dtype=torch.int32)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        workspace, layout, use_cuda_graph=True, use_tensor_cores=name != "cuda_cores",
        paged_kv_indptr_buffer=torch.zeros(batch + 1, **i32),
        paged_kv_indices_buffer=torch.zeros(sum(pages), **i32),
        paged_kv_last_page_len_buffer=torch.zeros(batch, **i32),
        **({"backend": "fa3"} if name == "fa3" else {}))
    extra = ({"disable_split_kv": True} if name == "fa2_no_split" else
             {"fixed_split_size": int(name.partition(":")[2])} if name.startswith("fa2_split:")
             else {})
    wrapper.plan(indptr, order, last, shape["q_heads"], shape["kv_heads"], shape["head_dim"],
                 page, q_data_type=DTYPE, kv_data_type=DTYPE, **extra)
    return lambda kv: wrapper.run(q, kv, return_lse=True)


def variant_tile(name: str) -> tuple:
    """``"triton"``: the module's tile (None each); ``"triton:B:W:P[:S]"``: that tile."""
    return (None,) * 4 if name == "triton" else triton_tile(name.partition(":")[2])


def row_lengths(case: str) -> list[int]:
    """``"BxC"``: B rows of C tokens; ``"BxC+L"``: the last of them L tokens instead (a long
    request among short ones)."""
    size, _, longest = case.partition("+")
    batch, ctx = map(int, size.split("x"))
    return [ctx] * (batch - 1) + [int(longest) if longest else ctx]


def run_case(shape: dict, lens: list[int], copy_bw: float, device, variants=VARIANTS,
             layers: int = 1, layout: str = "NHD", page: int = PAGE) -> dict:
    pages = sum(-(-n // page) for n in lens)
    heads_tokens = ((page, shape["kv_heads"]) if layout == "NHD"
                    else (shape["kv_heads"], page))
    kvs = [torch.empty(pages, 2, *heads_tokens, shape["head_dim"], dtype=DTYPE,
                       device=device).normal_() for _ in range(layers)]
    q = torch.randn(len(lens), shape["q_heads"], shape["head_dim"], dtype=DTYPE, device=device)
    kv_bytes = sum(lens) * 2 * shape["kv_heads"] * shape["head_dim"] * DTYPE.itemsize
    rec = dict(batch=len(lens), ctx=lens[0], longest=max(lens), kv_bytes=kv_bytes,
               roofline_us=kv_bytes / copy_bw * 1e6, layout=layout, page=page, variants={})
    if (layout, page) != ("NHD", PAGE):
        variants = [name for name in variants if not name.startswith("triton")]
    want = None
    for name in variants:
        workspace = torch.zeros(256 << 20, dtype=torch.uint8, device=device)
        try:
            layer = decode_variant(name, shape, lens, q, workspace, layout, page)
            out, lse = layer(kvs[0])
            if want is None:
                want = (out.clone(), lse.clone())
            err = (out.float() - want[0].float()).abs().max().item()
            lse_err = (lse - want[1]).abs().max().item()
            us = graph_time_ms(lambda layer=layer: [layer(kv) for kv in kvs], device) * 1e3 / layers
            rec["variants"][name] = dict(us=us, max_err=err, lse_err=lse_err,
                                         ok=err <= 2e-2 and lse_err <= 1e-3)
        except Exception as error:  # noqa: BLE001  (a variant FlashInfer refuses here)
            rec["variants"][name] = dict(error=f"{type(error).__name__}: {str(error)[:200]}")
    return rec


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="JSON results path")
    ap.add_argument("--shapes", default="gqa,gqa8")
    ap.add_argument("--sizes", default=None,
                    help="rows x context cases, e.g. '1x512,32x512,32x512+32768'")
    ap.add_argument("--triton", default="",
                    help="more Triton tiles, 'block:warps:programs_per_sm[:stages],...'")
    ap.add_argument("--splits", default="",
                    help="more FlashInfer variants: the KV split fixed at N pages, 'N,...'")
    ap.add_argument("--layouts", default="NHD", help="pool layouts, 'NHD,HND'")
    ap.add_argument("--pages", default=str(PAGE), help="page sizes in tokens, '16,64'")
    ap.add_argument("--layers", type=int, default=1,
                    help="layers' KV timed in turn (4 puts 32 x 512 of Qwen3-30B-A3B past L2)")
    args = ap.parse_args(argv)
    tiles = tuple(f"triton:{t}" for t in args.triton.split(",") if t)
    for name in tiles:
        variant_tile(name)  # a malformed tile exits before any timing
    variants = VARIANTS + tuple(f"fa2_split:{int(n)}" for n in args.splits.split(",") if n) + tiles
    device = torch.device("cuda")
    torch.manual_seed(0)
    results = Results(args.out, run_header(device))
    copy_bw = copy_bandwidth(device)
    results.data["copy_tb_s"] = copy_bw / 1e12
    results.data["layers"] = args.layers
    rows = []
    for shape_name in args.shapes.split(","):
        for case, layout, page in itertools.product(
                args.sizes.split(",") if args.sizes else SIZES, args.layouts.split(","),
                [int(p) for p in args.pages.split(",")]):
            rec = results.add(shape=shape_name, case=case,
                              **run_case(SHAPES[shape_name], row_lengths(case), copy_bw, device,
                                         variants, args.layers, layout, page))
            row = {"shape": shape_name, "rows x context": case, "layout": layout, "page": page,
                   "roofline us": rec["roofline_us"]}
            for name, v in rec["variants"].items():
                row[f"{name} us"] = v.get("us")
                row[f"{name} ok"] = v.get("ok", v.get("error", "")[:20])
            rows.append(row)
            print(row, flush=True)
    print(f"\ncopy bandwidth {copy_bw / 1e12:.2f} TB/s")
    print(table(rows, list(dict.fromkeys(c for row in rows for c in row))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
