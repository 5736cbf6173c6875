#!/usr/bin/env bash
# The one-kernel q/k norms, RoPE and pool write (torch_cp/kv/rotate_kernel.py; on by default since
# runs 140-142), on one GPU: its GPU tests (the kernel against transformers' modules; captured
# and compiled engines' tokens with it against without), then batch-1 decode steps of Qwen3-8B
# and Qwen3-30B-A3B with it off and on, alternating twice, then Qwen3-8B with it beside Hugging
# Face. Logs and JSON go to $OUT (default: ./gpu-logs). The whole takes more than one 600 s call
# (on an H100 the tests about 250 s, each decode call about 60 s): split it with TESTS=0,
# MODELS, RUNS and PEERS=0. Run from the repository root after `source .device/env.sh`.
set -uo pipefail
OUT="${OUT:-gpu-logs}"
mkdir -p "$OUT"
ON="--kernel torch_cp.kv.pool.ROTATE_IN_ONE_KERNEL=True"
OFF="--kernel torch_cp.kv.pool.ROTATE_IN_ONE_KERNEL=False"
# A shorter call where less device time is left: e.g. MODELS=qwen3 RUNS="off1 on1" PEERS=0.
MODELS="${MODELS:-qwen3 qwen3_moe}"
RUNS="${RUNS:-off1 on1 off2 on2}"
PEERS="${PEERS:-1}"
TESTS="${TESTS:-1}"

if [ "$TESTS" = 1 ]; then
  timeout -k 5 300 python -m pytest -m gpu -v -rA -p no:cacheprovider \
    tests/kv/test_rotate_kernel.py tests/kv/test_write_kernel.py > "$OUT/rotate_tests.log" 2>&1
  echo "tests rc $?" >> "$OUT/rotate_tests.log"
  tail -3 "$OUT/rotate_tests.log"
fi

for model in $MODELS; do
  for run in $RUNS; do
    mode=${run%?}
    opt="$OFF"; [ "$mode" = on ] && opt="$ON"
    out="$OUT/gen_${model}_b1_${run}.json"
    # shellcheck disable=SC2086
    timeout -k 5 90 python -m benchmarks.generate --plan "$model:512:torch_cp_compiled" \
      --batches 1 --new-tokens 128 --repeats 3 $opt --out "$out" >> "$OUT/rotate_gen.log" 2>&1
    python - "$out" "$model" "$mode" <<'EOF'
import json, sys
path, model, mode = sys.argv[1:]
try:
    run = json.load(open(path))
except OSError:
    print(model, mode, "no result (see rotate_gen.log)")
    sys.exit()
r = run["records"][0]
print(model, mode, f"{r['step_ms']:.3f} ms a step, {r['step_over_roofline']:.3f}x the roofline,",
      "first tokens", r["first_tokens"][:6], f"copy {run['copy_tb_s']:.2f} TB/s")
EOF
  done
done

[ "$PEERS" = 1 ] || exit 0
# shellcheck disable=SC2086
timeout -k 5 200 python -m benchmarks.generate --plan "qwen3:512:torch_cp_compiled,hf_static" \
  --batches 1 --new-tokens 128 --repeats 3 $ON --out "$OUT/gen_qwen3_peers_on.json" \
  > "$OUT/rotate_peers.log" 2>&1
tail -8 "$OUT/rotate_peers.log"
