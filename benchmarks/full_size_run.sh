#!/usr/bin/env bash
# Full size on one GPU (issue #10 item 5): a random 60-block, full-width Qwen-Image pipeline
# folder, a 1024² CFG/SDE trajectory with L1 capture through the production backend and a LoRA
# adapter, its replay, its training recompute (backward, gradient checkpointing) diffed against
# it, and the peer probe matrix at full width.
#
#   $ bash benchmarks/full_size_run.sh [WORK_DIR=/dev/shm/drifttool-full] [STEPS=10]
#
# Every command prints its wall time; the diffs print their verdicts and first drifts.
set -uo pipefail
WORK=${1:-/dev/shm/drifttool-full}
STEPS=${2:-10}
mkdir -p "$WORK"
t() { local s=$(date +%s.%N); "$@"; local rc=$?; printf '[%6.1f s, rc %d] %s\n' "$(echo "$(date +%s.%N) - $s" | bc)" $rc "$*"; return 0; }
[ -d "$WORK/qwen" ] || t python3 benchmarks/make_random_checkpoint.py --layers 60 --out "$WORK/qwen" --lora "$WORK/lora.safetensors"
RUN=(--checkpoint "$WORK/qwen" --device cuda --mode auto --height 1024 --width 1024 --steps "$STEPS" --samples 0)
t drifttool run "${RUN[@]}" --capture L1 --lora "$WORK/lora.safetensors" -o "$WORK/rollout" --overwrite
t drifttool run "${RUN[@]}" --capture L0 --lora "$WORK/lora.safetensors" -o "$WORK/rollout-L0" --overwrite
t drifttool replay "$WORK/rollout" --device cuda -o "$WORK/replay" --overwrite
t drifttool diff "$WORK/rollout" "$WORK/replay"
t drifttool recompute "$WORK/rollout" --device cuda --grad --gradient-checkpointing -o "$WORK/train" --overwrite
t drifttool diff "$WORK/rollout" "$WORK/train"
