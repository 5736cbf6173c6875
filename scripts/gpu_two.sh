#!/usr/bin/env bash
# The two-GPU work the open issues wait for, in three parts, each meant to fit one 600 s call of
# the project's lent nvidia-h200-x2 machine (docs/gpu-runs.md's queue). Every command runs under
# `timeout` within what is left of the part's budget, so a slow one cannot lose the others'
# results. At the end the part's results are merged into $OUT/partN.json (file name -> its JSON)
# and its logs' tails, after rc.txt (each command's exit code and seconds), into
# $OUT/partN.log, and the single files removed: the lent machine sends back about eight files.
#   scripts/gpu_two.sh 1   # correctness over NCCL: nccl_checks case by case, test_nccl_gpu.py
#   scripts/gpu_two.sh 2   # capacity (issue 19) and the shared-prefix serving run at P = 2 (17)
#   scripts/gpu_two.sh 3   # long context at P = 1 and 2: Qwen3.5 (15), compiled (19)
# Run from the repository root after `source .device/env.sh` on the GPU machine (never replace
# PYTHONPATH afterwards: env.sh puts FlashInfer, transformers 5.23 and fla there).
set -uo pipefail
PART="${1:?usage: $0 1|2|3}"
OUT="${OUT:-gpu-logs}"
BUDGET="${BUDGET:-580}"
mkdir -p "$OUT"
: > "$OUT/rc.txt"
T0=$(date +%s)
TR="torchrun --standalone --nproc-per-node"

# run NAME LIMIT CMD...: CMD under timeout min(LIMIT, what is left); skipped under 30 s left.
run() {
  local name=$1 limit=$2; shift 2
  local left=$(( BUDGET - ($(date +%s) - T0) ))
  if [ "$left" -lt 30 ]; then echo "$name skipped (budget)" >> "$OUT/rc.txt"; return; fi
  [ "$limit" -gt "$left" ] && limit=$left
  local start=$(date +%s)
  timeout --kill-after 15 "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "$name rc $? $(( $(date +%s) - start ))s" >> "$OUT/rc.txt"
}

case "$PART" in
  1)
    for only in qwen3-kv mla- qwen3_moe- glm4_moe- glm4_moe_lite- deepseek_v3-; do
      run "nccl_$only" 150 $TR 2 tests/helpers/nccl_checks.py --only "$only" \
        --out "$OUT/nccl_$only.json"
    done
    run test_nccl 300 python -m pytest -m gpu -q -rA tests/project/test_nccl_gpu.py ;;
  2)
    for cp in off on; do for m in mla gqa; do
      run "capacity_tp_${m}_$cp" 120 $TR 2 -m benchmarks.capacity --setup tp --model "$m" \
        --context-parallel "$cp" --out "$OUT/capacity.json"
    done; done
    for p in 1 2; do
      run "capacity_sp_p$p" 120 $TR "$p" -m benchmarks.capacity --setup sp --model qwen3 \
        --out "$OUT/capacity.json"
    done
    run serving_p2 200 $TR 2 -m benchmarks.serving --scenario prefix \
      --out "$OUT/serving_p2.json" ;;
  3)
    for p in 1 2; do
      run "long_qwen3_5_p$p" 150 $TR "$p" -m benchmarks.long_context --models qwen3_5 \
        --out "$OUT/long_context_qwen3_5.json"
    done
    for p in 1 2; do
      run "long_compiled_p$p" 200 $TR "$p" -m benchmarks.long_context --compile \
        --out "$OUT/long_context_compiled.json"
    done ;;
  *) echo "PART must be 1, 2 or 3" >&2; exit 2 ;;
esac
python - "$OUT" "$PART" <<'PY'
import json, pathlib, sys
out, part = pathlib.Path(sys.argv[1]), sys.argv[2]
merged, logs = {}, [(out / "rc.txt").read_text()]
for path in sorted(p for p in out.glob("*.json") if not p.name.startswith("part")):
    try:
        merged[path.name] = json.loads(path.read_text())
    except ValueError as e:  # cut by a timeout
        merged[path.name] = f"unreadable: {e}"
    path.unlink()
for path in sorted(p for p in out.glob("*.log") if not p.name.startswith("part")):
    logs.append(f"==== {path.name}\n" + "\n".join(path.read_text().splitlines()[-80:]) + "\n")
    path.unlink()
(out / f"part{part}.json").write_text(json.dumps(merged, indent=1))
(out / f"part{part}.log").write_text("".join(logs))
PY
cat "$OUT/rc.txt"
