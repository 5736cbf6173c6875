#!/usr/bin/env bash
# The one-GPU test suite in three parts, each meant to fit one 600 s call of the project's lent
# GPU machine (docs/gpu-runs.md: the whole suite took 446 s in run 58 and more since Dynamo is
# reset before each GPU test). Logs, with per-test durations, go to $OUT (default: ./gpu-logs).
#   scripts/gpu_suite.sh 1    # attention/, engine/, kv/
#   scripts/gpu_suite.sh 2    # graphs/ (the router, the fused experts, whole-step replay)
#   scripts/gpu_suite.sh 3    # models/, state/, project/ (the NCCL test skips on one GPU)
# Run from the repository root after `source .device/env.sh` on the GPU machine; never replace
# PYTHONPATH afterwards (env.sh puts FlashInfer, transformers 5.23 and fla there: run 63).
set -uo pipefail
PART="${1:?usage: $0 1|2|3}"
OUT="${OUT:-gpu-logs}"
mkdir -p "$OUT"
case "$PART" in
  1) DIRS=(tests/attention tests/engine tests/kv) ;;
  2) DIRS=(tests/graphs) ;;
  3) DIRS=(tests/models tests/state tests/project) ;;
  *) echo "PART must be 1, 2 or 3" >&2; exit 2 ;;
esac
timeout 570 python -m pytest -m gpu -v -rA -p no:cacheprovider --durations=30 "${DIRS[@]}" \
  > "$OUT/gpu_suite_$PART.log" 2>&1
status=$?
tail -40 "$OUT/gpu_suite_$PART.log"
exit $status
