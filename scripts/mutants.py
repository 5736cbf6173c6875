"""A mutation run: plant single-point bugs one at a time, run the CPU tests that concern each,
report which survive.

    python scripts/mutants.py                 # every mutant; results in mutants.json
    python scripts/mutants.py --only merge    # the mutants whose name contains "merge"
    python scripts/mutants.py --list

Each mutant replaces one exact snippet of one file (it must occur exactly once) and names the
test paths that should catch it; the file is restored whatever happens. The suite is too slow
for a generic tool that mutates every line (mutmut would run thousands of mutants through a
10-minute suite on 2 cores), so the list is curated: the bugs a refactor brings (an index off by
one, a wrong axis, a check dropped, a stream shared), over every part. Results and survivors
are recorded in docs/testing.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]
    gpu_only: str = ""  # the GPU test that kills it, when no CPU test can


T = "tests/"
PLACE = (T + "core/test_placement.py",)
POOL = (T + "kv/test_pool.py",)
MERGE = (T + "attention/test_merge.py", T + "attention/test_merge_helpers.py")
PLACED = (T + "attention/test_placed_attention.py",)
ENGINE = (T + "engine/test_engine.py",)
SCHED = (T + "engine/test_engine.py", T + "engine/test_admission.py",
         T + "engine/test_overlap.py")
GQA = (T + "models/test_patch_gqa.py",)
TP = (T + "hf/test_tp_kv_heads.py", T + "hf/test_patch_multirank.py")
MLA = (T + "models/test_patch_mla.py",)

MUTANTS = [
    # placement
    Mutant("placement-owner", "torch_cp/placement.py", "return position % self.size",
           "return (position + 1) % self.size", PLACE),
    Mutant("placement-local-slot", "torch_cp/placement.py", "return offset // self.size",
           "return offset % self.size", PLACE),
    Mutant("placement-local-length", "torch_cp/placement.py",
           "torch.clamp(length - r + self.size - 1, min=0) // self.size",
           "torch.clamp(length - r + self.size, min=0) // self.size", PLACE),
    Mutant("placement-write-owner", "torch_cp/placement.py",
           "own = self.owner(offsets) == self.rank", "own = self.owner(offsets) != self.rank",
           PLACE),
    # pools
    Mutant("pool-gqa-value-slot", "torch_cp/kv/pool.py",
           "cache[page_ids, 1, slots] = v_nhd.to(cache.dtype)",
           "cache[page_ids, 1, slots] = k_nhd.to(cache.dtype)", POOL),
    Mutant("pool-mla-order", "torch_cp/kv/pool.py",
           "index_copy_(0, write_index, new.to(cache.dtype))",
           "index_copy_(0, write_index.flip(0), new.to(cache.dtype))", POOL),
    Mutant("rotate-half-sign", "torch_cp/kv/rotate_kernel.py",
           "turned = tl.where(d < half, -y_partner, y_partner)",
           "turned = tl.where(d < half, y_partner, -y_partner)", (T + "kv/test_rotate_kernel.py",)),
    Mutant("rotate-key-norm-weight", "torch_cp/kv/rotate_kernel.py",
           "x, x_partner = _normed(k_ptr + token * k_sn + kh * D, k_w_ptr,",
           "x, x_partner = _normed(k_ptr + token * k_sn + kh * D, q_w_ptr,",
           (T + "kv/test_rotate_kernel.py",)),
    # plan
    Mutant("plan-decode-attends-own-token", "torch_cp/plan.py",
           "attend = c_t + q_t if is_decode else c_t", "attend = c_t", PLACE),
    Mutant("plan-positions", "torch_cp/plan.py", "torch.where(real, c_t[row_of] + step, 0)",
           "torch.where(real, c_t[row_of] + step + 1, 0)", PLACE),
    Mutant("plan-write-index", "torch_cp/plan.py", "write_index = physical_pages * local_page",
           "write_index = physical_pages * page_size", PLACE + POOL),
    Mutant("plan-padding-writes-page-0", "torch_cp/plan.py",
           "// page_size],\n                        sink_page)",
           "// page_size],\n                        0)",
           PLACE + POOL),
    # merge (partners) and the own-token merge
    Mutant("merge-base-e", "torch_cp/attention/partial.py", "weight = torch.exp2(lse - top)",
           "weight = torch.exp(lse - top)", MERGE),
    # Not "drop the -inf guard on the max": the merge's later guards make that one equivalent.
    Mutant("merge-empty-total", "torch_cp/attention/partial.py",
           "safe_total = torch.where(total > 0, total, torch.ones_like(total))",
           "safe_total = total", MERGE),
    Mutant("merge-kernel-lse-clamp", "torch_cp/attention/merge.py",
           "return lse.float().clamp_min(EMPTY_LSE)", "return lse.float()", MERGE),
    Mutant("own-token-merge-dropped", "torch_cp/attention/module.py",
           "partial = self.merge_own(partial, Partial(*own_partial(q, k, v, self.handle)))",
           "partial = Partial(*own_partial(q, k, v, self.handle))", PLACED),
    Mutant("own-tokens-not-causal", "torch_cp/attention/torch_ref.py",
           "(index[None, :] <= index[:, None])", "(index[None, :] < index[:, None])", MERGE),
    Mutant("torch-ref-natural-lse", "torch_cp/attention/torch_ref.py",
           "(lse / LN2).reshape(n, h)", "lse.reshape(n, h)", MERGE),
    # exchange
    Mutant("exchange-gather-heads-order", "torch_cp/attention/exchange.py",
           "self._all_gather(q_nhd).permute(1, 0, 2, 3).reshape",
           "self._all_gather(q_nhd).reshape", PLACED),
    Mutant("exchange-return-lse-layout", "torch_cp/attention/exchange.py",
           "lse = partial.lse.view(n, p, ph // p).permute(1, 0, 2)",
           "lse = partial.lse.view(p, n, ph // p)", PLACED),
    # allocator
    Mutant("allocator-release-loses-pages", "torch_cp/kv/allocator.py",
           "self._give_back(self._tables.pop(request_id, []))",
           "self._tables.pop(request_id, [])", (T + "kv/test_allocator.py",) + ENGINE),
    Mutant("allocator-overcommit", "torch_cp/kv/allocator.py",
           "if missing > self.free_pages:", "if missing > self.free_pages + 1:",
           (T + "kv/test_allocator.py",)),
    # scheduler
    Mutant("scheduler-forgets-promises", "torch_cp/engine/scheduler.py",
           "available = a.free_pages - self._promised_pages()",
           "available = a.free_pages", SCHED),
    Mutant("scheduler-chunk-samples", "torch_cp/engine/scheduler.py",
           "samples=end == len(request.tokens)", "samples=True", SCHED),
    Mutant("scheduler-one-token-too-many", "torch_cp/engine/scheduler.py",
           "elif len(request.generated) >= request.max_new_tokens:",
           "elif len(request.generated) > request.max_new_tokens:", SCHED),
    # sampling
    Mutant("sampling-shared-stream", "torch_cp/engine/sampling.py",
           "manual_seed((self.seed * _SEED_STRIDE + request_index) % 2**63)",
           "manual_seed((self.seed * _SEED_STRIDE) % 2**63)", (T + "engine/test_sampling.py",)),
    Mutant("sampling-top-p-boundary", "torch_cp/engine/sampling.py",
           "drop_sorted = before >= top_p", "drop_sorted = before > top_p",
           (T + "engine/test_sampling.py",)),
    # TP sharding
    Mutant("tp-bias-on-every-rank", "torch_cp/tp.py",
           "out = compat.sum_over(gemv.linear(x, self.weight), self.group)\n"
           "        return out if self.bias is None else out + self.bias",
           "return compat.sum_over(gemv.linear(x, self.weight, self.bias), self.group)", TP),
    Mutant("tp-experts-gate-up", "torch_cp/tp.py", "gate_up = torch.cat([mine, inter + mine])",
           "gate_up = torch.cat([mine, mine])", TP),
    Mutant("tp-one-kv-head-per-rank", "models/gqa.py",
           "kv_cols = slice(kv.start * d, kv.stop * d)",
           "kv_cols = slice(kv.start * d, (kv.start + 1) * d)", TP),
    Mutant("partner-groups-transposed", "torch_cp/mesh.py",
           "grid.view(sp, tp // replicas, replicas).reshape(-1, replicas)",
           "grid.view(sp, replicas, tp // replicas).transpose(1, 2).reshape(-1, replicas)",
           (T + "core/test_partner_groups.py",)),
    Mutant("kv-head-split-unchecked", "torch_cp/mesh.py",
           "if num_kv_heads % tp != 0 and tp % num_kv_heads != 0:",
           "if False:", (T + "hf/test_validate.py", T + "core/test_config_errors.py")),
    # model families
    Mutant("gqa-k-norm", "models/gqa.py", "attn.q_norm(q_nhd), attn.k_norm(k_nhd)",
           "attn.q_norm(q_nhd), attn.q_norm(k_nhd)", GQA),
    Mutant("mla-rope-sin", "models/mla.py", "kpe.unsqueeze(1), cos_nd, sin_nd",
           "kpe.unsqueeze(1), cos_nd, cos_nd", MLA),
    # graphs
    Mutant("graphs-bucket-tie-break", "graphs/buckets.py", "key=lambda b: (b.tokens, b.rows)",
           "key=lambda b: (b.rows, b.tokens)", (T + "graphs/test_graphs.py",)),
    Mutant("graphs-static-indices", "graphs/static_plan.py",
           "buffer[: new.shape[0]].copy_(new, non_blocking=True)", "pass",
           (T + "graphs/test_graphs.py",)),
    # the Hugging Face bridge and validation
    Mutant("validate-partners", "torch_cp/hf/validate.py",
           'partners, who = (tp // kv_heads, "TP', 'partners, who = (tp, "TP',
           (T + "hf/test_validate.py", T + "core/test_config_errors.py")),
    Mutant("cache-placement-check", "torch_cp/hf/cache.py",
           "if plan.placement != self.runtime.placement:", "if False:",
           (T + "hf/test_cache_checks.py",)),
    Mutant("forward-unpack-order", "torch_cp/hf/forward.py",
           "index_copy(0, index, out_nd[: index.shape[0]])",
           "index_copy(0, index.flip(0), out_nd[: index.shape[0]])", GQA),
    Mutant("generate-mask-columns", "torch_cp/hf/generate_cache.py",
           "attention_mask[:, -s:]", "attention_mask[:, :s]", (T + "hf/test_hf_generate.py",)),
]


def run(mutant: Mutant, timeout: int) -> dict:
    path = ROOT / mutant.path
    original = path.read_text()
    if original.count(mutant.old) != 1:
        return dict(name=mutant.name, status="not applied",
                    detail=f"snippet found {original.count(mutant.old)} times")
    tests = [t for t in mutant.tests if (ROOT / t).exists()]
    start = time.time()
    try:
        path.write_text(original.replace(mutant.old, mutant.new))
        done = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
                               *tests], cwd=ROOT, capture_output=True, text=True,
                              timeout=timeout, env={**os.environ, "TORCH_CP_MUTANTS": "1"})
        status = "killed" if done.returncode != 0 else "survived"
        tail = done.stdout.strip().splitlines()[-1:] if done.stdout else []
    except subprocess.TimeoutExpired:
        status, tail = "killed (timeout)", []
    finally:
        path.write_text(original)
    return dict(name=mutant.name, status=status, seconds=round(time.time() - start, 1),
                tests=tests, summary=tail[0] if tail else "", gpu_only=mutant.gpu_only)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="run the mutants whose name contains this")
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--timeout", type=int, default=600)
    parser.add_argument("--out", default=str(ROOT / "mutants.json"))
    args = parser.parse_args()
    chosen = [m for m in MUTANTS if args.only in m.name]
    if args.list:
        for m in chosen:
            print(f"{m.name:34s} {m.path}")
        return 0
    results = []
    for m in chosen:
        results.append(run(m, args.timeout))
        r = results[-1]
        print(f"{r['status']:16s} {r['name']:34s} {r.get('seconds', 0):7.1f} s", flush=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    killed = sum(r["status"].startswith("killed") for r in results)
    print(f"{killed} of {len(results)} killed; survivors: "
          f"{[r['name'] for r in results if not r['status'].startswith('killed')]}")
    return 0 if killed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
