#!/usr/bin/env bash
# Launch `python -m torch_cp` on NPROC ranks of this host with torchrun.
#   scripts/torchrun_generate.sh 2 --context-parallel --tp 2           # TP mode, P = 2
#   scripts/torchrun_generate.sh 4 --context-parallel --mode sp --sp 4 # SP mode, P = 4
#   scripts/torchrun_generate.sh 2 --model /path/to/ckpt --prompt "Hi" --context-parallel --tp 2
# gloo on CPU, NCCL when CUDA is available (one GPU a rank, by LOCAL_RANK).
set -euo pipefail
NPROC="${1:?usage: $0 NPROC [python -m torch_cp arguments...]}"
shift
exec torchrun --standalone --nproc-per-node "$NPROC" -m torch_cp "$@"
