#!/usr/bin/env bash
# Full size on one GPU: a random 60-block, full-width Qwen-Image pipeline
# folder, a 1024² CFG/SDE trajectory with L1 capture through the production backend and a LoRA
# adapter, its replay, and its training recompute (backward of the LoRA, gradient checkpointing)
# diffed against it.
#
#   $ bash benchmarks/full_size_run.sh [WORK_DIR=/dev/shm/drifttool-full]
#   environment: STEPS=10 LAYERS=60 SIZE=1024 DEVICE=cuda
#
# Every command prints its wall time; the diffs print their verdicts and first drifts.
set -uo pipefail
WORK=${1:-/dev/shm/drifttool-full}
STEPS=${STEPS:-10} LAYERS=${LAYERS:-60} SIZE=${SIZE:-1024} DEVICE=${DEVICE:-cuda}
mkdir -p "$WORK"
t() {
  local s; s=$(date +%s.%N); "$@"; local rc=$?
  python3 -c "import sys, time; print(f'[{time.time() - float(sys.argv[1]):6.1f} s, rc {sys.argv[2]}]', *sys.argv[3:])" "$s" "$rc" "$@"
}
[ -d "$WORK/qwen" ] || t python3 benchmarks/make_random_checkpoint.py --layers "$LAYERS" --out "$WORK/qwen" \
  --lora "$WORK/lora.safetensors" --device "$DEVICE"
RUN=(--checkpoint "$WORK/qwen" --device "$DEVICE" --mode auto --height "$SIZE" --width "$SIZE" --steps "$STEPS" --samples 0)
t drifttool run "${RUN[@]}" --capture L1 --lora "$WORK/lora.safetensors" -o "$WORK/rollout" --overwrite
t drifttool replay "$WORK/rollout" --device "$DEVICE" -o "$WORK/replay" --overwrite
t drifttool diff "$WORK/rollout" "$WORK/replay"
t drifttool recompute "$WORK/rollout" --device "$DEVICE" --grad --gradient-checkpointing -o "$WORK/train" --overwrite
t drifttool diff "$WORK/rollout" "$WORK/train"
